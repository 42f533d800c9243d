"""FP8Training: the model's GEMMs in FP8, as a callback (Megatron's ``--fp8-recipe``).

It swaps the GEMM of every dense linear (attention projections, dense FFN, shared experts; the head if asked) and of
the experts' grouped GEMMs (forward, dgrad and wgrad) for FP8 ones (``modules/fp8_linear.py``, ``fp8_grouped.py``).
The router stays in fp32 (it is no swap point); main params and the optimizer are untouched. Recipes, with
Megatron's names: ``tensorwise`` (current scaling), ``delayed`` (amax history), ``rowwise``, ``blockwise``
(DeepSeek-V3's 1 x 128 / 128 x 128 scales).

Dense GEMMs run on ``torch._scaled_mm`` for tensorwise and rowwise scales (GPUs of compute capability 8.9+, and the
CPU) and emulated otherwise. The experts' grouped GEMMs run on ``torch._scaled_grouped_mm`` on Hopper (E4M3 operands
with row and column scales: the tensorwise, delayed and rowwise recipes; gradients too with ``fp8_format="e4m3"``),
the blockwise recipe's forward and dgrad on DeepGEMM where it is installed (``modules/fp8_deepgemm.py``, which also
runs the blockwise dense GEMMs), and emulated otherwise (quantized, dequantized, multiplied in fp32). The log says
which path each GEMM took.

Where both of an MoE layer's expert GEMMs quantize on the Triton kernels (the rowwise recipe in E4M3 on an H100, no
ETP, an FFN width that is a multiple of 128), the experts' SwiGLU is fused with their quantization
(``modules/fp8_swiglu.py``): its forward writes a's FP8 copy for fc2 and its backward dh's for fc1, each in the pass
that makes them (``LMOE_FP8_FUSED_SWIGLU=0`` turns it off, for comparisons). There, on one rank, the layer's permutes
also quantize what they gather: the dispatch x's FP8 copy for fc1, the combine's backward dy's for fc2's dgrad
(``modules/triton_fp8_gather.py``; ``LMOE_FP8_FUSED_PERMUTE=0`` turns it off).

``fp8_dispatch=True`` also sends the tokens of the ``alltoall`` dispatcher's dispatch all-to-all in E4M3, one fp32
scale per token (``modules/fp8_dispatch.py``, as DeepEP does): about half the bytes of bf16 on the wire.
``fp8_param_gather=True`` sends the FP8 GEMMs' weights through the distributed optimizer's all-gather in E4M3
(``strategy/fp8_param_gather.py``, Megatron's ``--fp8-param-gather``): half the bytes, the same numbers.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional, Sequence, Union

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning_moe.callbacks.gemm_swap import Gemm, gemms, swap, unswap
from lightning_moe.modules import fp8_deepgemm, fp8_swiglu, wgrad_fusion
from lightning_moe.modules import fp8_grouped_kernels as grouped_kernels
from lightning_moe.modules.dispatchers import AllToAllDispatcher
from lightning_moe.modules.fp8 import FAST_ACCUM, RECIPES
from lightning_moe.modules.fp8_grouped import check_dims, fp8_grouped_mm
from lightning_moe.modules.fp8_linear import FP8Spec, SharedInput, fp8_linear
from lightning_moe.modules.kernels import interpreting
from lightning_moe.modules.moe_layer import MoELayer
from lightning_moe.modules.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from lightning_moe.strategy import fp8_param_gather as fp8_gather
from lightning_moe.strategy.main_params import LOW_PRECISION

# 0: each dense FP8 linear quantizes its input itself, also where several read one tensor (for comparisons)
SHARED_INPUT = os.environ.get("LMOE_FP8_SHARED_INPUT", "1") != "0"


class FP8Training(L.Callback):
    """Train with FP8 GEMMs.

    Args:
        recipe: ``tensorwise``, ``delayed``, ``rowwise`` or ``blockwise``.
        exclude: module names (``fnmatch`` patterns on ``named_modules`` of the LightningModule, e.g.
            ``"*.layers.0.*"``) kept in their own precision.
        include_head: also the output head (off by default, as in Megatron).
        emulate: quantize and dequantize instead of calling FP8 kernels (default: only where no kernel runs).
        amax_history: delayed scaling's window.
        fp8_format: Megatron's ``--fp8-format``: ``"hybrid"`` (E4M3 forward, E5M2 gradients) or ``"e4m3"``
            (everywhere). Default: hybrid for tensorwise and delayed, e4m3 for rowwise and blockwise. Hopper has no
            grouped kernel for E5M2 gradients: the experts' backward GEMMs are emulated under hybrid.
        fp8_dispatch: quantize each token to E4M3 with one fp32 scale (448 / its amax) before the dispatch
            all-to-all of the ``alltoall`` dispatcher, and dequantize on arrival (DeepEP's FP8 dispatch). The
            gradient returns in the activations' precision (straight-through), and the combine all-to-all stays in
            it. Under EP = 1 the same rounding applies where the all-to-all would be, so every layout gives the same
            numbers. Other dispatchers are refused. Independent of ``exclude`` (it applies to every MoE layer).
        cache_weights: quantize each weight once per optimizer step, not once per micro-batch (Transformer
            Engine's FP8 weight cache): the experts' for the FP8 grouped kernels, and the dense linears' for their
            forward and (transposed) dgrad GEMMs. The micro-batches of a step, and a validation between steps, reuse
            them. Costs the FP8 copies (two layouts, 2 bytes per weight element) until the next step. Under the
            delayed recipe a weight's amax history then advances once per step. Under
            ``MoEFoldStrategy(cuda_graphs=True)`` the copies are rewritten in place before each step's first batch,
            outside the graphs, which read them where they were captured.
        fast_accum: which FP8 GEMMs use Hopper's fast accumulation: ``"fprop"`` (default) the forward ones, as
            Transformer Engine does, with the precise (split) accumulator for dgrad and wgrad; ``"all"`` every one,
            as torchao's MoE training does (about 2x faster backward GEMMs at fine-grained expert shapes, fewer
            accumulator bits in the gradients); ``"none"``. Emulated GEMMs accumulate in bf16/fp32 either way.
        fp8_param_gather: all-gather the FP8 GEMMs' weights in E4M3 after each step, with the scales the GEMMs use,
            instead of bf16 (Megatron's ``--fp8-param-gather``): half the all-gather bytes, the same loss bit for bit.
            Needs ``MoEFoldStrategy(distributed_optimizer=True)`` with fp32 main params, and a recipe whose weight
            scales serve both GEMM layouts (``tensorwise``, ``blockwise``). Between steps the model's weights hold
            their FP8 values; the full ones return at the end of training. Layers where no group gathers the weights
            (one rank in their data-parallel group) keep their bf16 path.
        fp8_wgrad: Megatron's ``fp8_wgrad``. False runs every weight-gradient GEMM on the unquantized operands (the
            activations' dtype, fp32 accumulation; the experts' into the fp32 main grads under gradient-accumulation
            fusion) while forward and dgrad stay in FP8: no wgrad quantization passes, bf16 wgrad speed. At
            fine-grained expert shapes on an H100 that is the faster block (Qwen3-30B-A3B's experts, docs/
            PERFORMANCE.md); at coarse ones the FP8 wgrad is. Not for the blockwise recipe, whose wgrad on DeepGEMM
            already runs on bf16 tensor cores from its 128-token tiles.
        defer_expert_wgrad: run the experts' FP8 wgrad once per optimizer step, at its last backward, over the
            quantized wgrad operands that every micro-batch of the step kept, instead of once per micro-batch. Under
            gradient accumulation each micro-batch otherwise reads, adds and writes the fp32 main grads, which bounds
            the wgrad by memory traffic at one sequence per micro-batch (docs/PERFORMANCE.md); deferred, they are
            written once, by GEMMs over all the step's tokens. The same bits. Costs the operands held until the
            step's last backward (1 byte per routed token and feature of both GEMMs' inputs and output gradients,
            per micro-batch). Needs the experts' Triton FP8 wgrad (an SM 9.0 GPU with triton; the rowwise recipe, or
            tensorwise or delayed with ``fp8_format='e4m3'``, whose per-expert scales differ from micro-batch to
            micro-batch as the rowwise ones do) and MoEFoldStrategy's gradient-accumulation fusion (bf16 weights with
            fp32 main grads). Each micro-batch's operands go side by side into buffers kept from step to step (the
            tensorwise and delayed recipes' input copy, made by forward's one-pass quantization, is copied there in
            backward: one copy of its bytes). With bf16 main
            grads (the distributed optimizer's bf16 main params) the sum is rounded to bf16 once per step instead of
            once per micro-batch: not the same bits, closer ones. An int N >= 2 holds at most N micro-batches: the
            backward that fills the window runs them, so the held operands stay bounded under long gradient
            accumulation, at one read, add and write of the main grads per window (the same bits with fp32 main
            grads). With ``fp8_wgrad=False`` (E4M3 gradients: rowwise, or ``fp8_format='e4m3'``) it defers the bf16
            wgrad instead: the held operands are the unquantized bf16 ones (2 bytes per element, the GEMMs' inputs
            kept past their backward), summed over the window in one fp32 accumulator per tile
            (``triton_grouped_wgrad.wgrad_segments_into``: float32 rounding in another order, not the same bits).
            Under ``MoEFoldStrategy(cuda_graphs=True)`` only that bf16 wgrad is deferred, its operands kept by one
            copy of the graphs per micro-batch of the window (``strategy/graph_deferral.py``).
    """

    def __init__(self, recipe: str = "tensorwise", exclude: Sequence[str] = (), include_head: bool = False,
                 emulate: Optional[bool] = None, amax_history: int = 16, fp8_format: Optional[str] = None,
                 fp8_dispatch: bool = False, cache_weights: bool = True, fast_accum: str = "fprop",
                 fp8_param_gather: bool = False, fp8_wgrad: bool = True, defer_expert_wgrad: Union[bool, int] = False):
        if recipe not in RECIPES:
            raise ValueError(f"FP8Training(recipe={recipe!r}): unknown recipe; valid: {', '.join(RECIPES)}")
        if fp8_format not in (None, "hybrid", "e4m3"):
            raise ValueError(f"FP8Training(fp8_format={fp8_format!r}): valid: 'hybrid', 'e4m3' (or None: the recipe's)")
        if fp8_format == "hybrid" and recipe in ("rowwise", "blockwise"):
            raise ValueError(f"FP8Training(recipe={recipe!r}, fp8_format='hybrid'): the {recipe} recipe is E4M3 "
                             "throughout; use fp8_format='e4m3' or the tensorwise or delayed recipe")
        if fast_accum not in FAST_ACCUM:
            raise ValueError(f"FP8Training(fast_accum={fast_accum!r}): valid: {', '.join(map(repr, FAST_ACCUM))}")
        if isinstance(exclude, str):
            exclude = [exclude]
        if amax_history < 1:
            raise ValueError(f"FP8Training(amax_history={amax_history}): must be >= 1")
        if fp8_param_gather and recipe not in fp8_gather.RECIPES:
            raise ValueError(f"FP8Training(recipe={recipe!r}, fp8_param_gather=True): the {recipe} recipe's weight "
                             + ("scales follow an amax history that advances at every use"
                                if recipe == "delayed" else "scales differ between the forward and dgrad layouts")
                             + ", so one FP8 copy cannot serve both GEMMs; use the tensorwise or blockwise recipe, or "
                             "leave fp8_param_gather off")
        if not fp8_wgrad and recipe == "blockwise":
            raise ValueError("FP8Training(recipe='blockwise', fp8_wgrad=False): the blockwise recipe's wgrad on "
                             "DeepGEMM already runs on bf16 tensor cores (from its 128-token tiles); use "
                             "fp8_wgrad=False with the tensorwise, delayed or rowwise recipe, or leave it on")
        window = _defer_window(defer_expert_wgrad)
        e5m2 = FP8Spec(recipe, fp8_format=fp8_format).formats()[1] == "e5m2"  # gradients: emulated backward
        if defer_expert_wgrad and (e5m2 or recipe == "blockwise"):
            raise ValueError(f"FP8Training(recipe={recipe!r}, fp8_wgrad={fp8_wgrad}, fp8_format={fp8_format!r}, "
                             "defer_expert_wgrad=True): only an expert wgrad behind E4M3 gradients can be deferred "
                             "(E5M2 ones run the emulated backward; the blockwise recipe's wgrad is DeepGEMM's): the "
                             "FP8 one on Triton (rowwise, or tensorwise or delayed with fp8_format='e4m3') or, with "
                             "fp8_wgrad=False, the bf16 one; use one of those, or leave defer_expert_wgrad off")
        self.defer_expert_wgrad, self.defer_window = bool(defer_expert_wgrad), window
        self.recipe, self.exclude, self.include_head = recipe, list(exclude), include_head
        self.emulate, self.amax_history, self.fp8_format = emulate, amax_history, fp8_format
        self.fp8_dispatch, self.cache_weights, self.fast_accum = fp8_dispatch, bool(cache_weights), fast_accum
        self.fp8_param_gather, self.fp8_wgrad = bool(fp8_param_gather), bool(fp8_wgrad)
        self._amaxes: Optional[fp8_gather.WeightAmaxes] = None
        self._swapped: list = []
        self._specs: list = []  # specs reading the FP8 parameter all-gather's amaxes
        self._cached: list = []  # the GEMMs' specs, whose weight caches follow trainer.global_step
        self._deferring: list = []  # the experts' specs with a deferred wgrad (and its arenas)
        self._dispatchers: list = []
        self._fused: list = []  # (experts, fc1's spec, fc2's spec) with the FP8-fused SwiGLU
        self._permuting: list = []  # dispatchers whose permutes quantize for their experts (fp8_rows)
        self._inputs = SharedInput()  # the dense linears' last quantized input (fp8_linear.SharedInput)

    def on_fit_start(self, trainer, pl_module) -> None:
        device = trainer.strategy.root_device
        emulate = self.emulate
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9) and not emulate:
            raise ValueError(f"FP8Training: {torch.cuda.get_device_name(device)} has no FP8 tensor cores (compute "
                             "capability 8.9+ needed); pass emulate=True to train with emulated FP8")
        if self.recipe == "delayed" and getattr(trainer.strategy, "cuda_graphs", False):
            # the amax history is a new tensor at every use: a replayed graph would read the one of its capture
            raise ValueError("FP8Training('delayed') with MoEFoldStrategy(cuda_graphs=True): the captured GEMMs cannot "
                             "advance the amax history; use the tensorwise or rowwise recipe, or turn the graphs off")
        if self.defer_expert_wgrad and self.fp8_wgrad and getattr(trainer.strategy, "cuda_graphs", False):
            # its held FP8 operands go into buffers laid out per step, which a replayed graph cannot follow
            raise ValueError("FP8Training(defer_expert_wgrad=...) with MoEFoldStrategy(cuda_graphs=True) holds the "
                             "bf16 wgrad's operands only: pass fp8_wgrad=False (one copy of the graphs per "
                             "micro-batch keeps them), leave defer_expert_wgrad off, or turn the graphs off")
        ctx = getattr(pl_module, "parallel_context", None)
        dispatchers = self._fp8_dispatchers(pl_module) if self.fp8_dispatch else []
        targets = list(gemms(pl_module, self.exclude, self.include_head))
        sharded = self._param_gather_optimizer(trainer) if self.fp8_param_gather else None
        problems = [why for g in targets for why in [self._check(g, device)] if why]
        if problems:
            raise ValueError(f"FP8Training(recipe={self.recipe!r}) cannot run these layers: {problems[0]}"
                             + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                             + "; exclude them (exclude=[...]) or use the tensorwise or rowwise recipe")
        if self.defer_expert_wgrad:
            self._check_defer(trainer, [g for g in targets if g.grouped], device)
        else:
            self._check_strategy_defer(trainer, [g for g in targets if g.grouped], device)
        gathered = []
        self._amaxes = fp8_gather.WeightAmaxes() if sharded is not None else None
        # under CUDA graphs the GEMMs read a cached weight where it was at their capture: it is rewritten there, in
        # place, before each step's first batch (_at_step), not replaced
        graphs = bool(getattr(trainer.strategy, "cuda_graphs", False))
        specs = {}
        for g in targets:
            spec = specs[g.name] = self._spec(g, ctx)
            if not g.grouped and SHARED_INPUT:  # q, k and v read one x: quantized once
                spec.inputs = self._inputs
            spec.defer_wgrad = self.defer_expert_wgrad and g.grouped
            spec.defer_window = self.defer_window if spec.defer_wgrad else None
            if spec.defer_wgrad:
                self._deferring.append(spec)
            swap(g, fp8_linear, fp8_grouped_mm, spec, self._swapped)
            if self.cache_weights:
                spec.in_place = graphs
                self._cached.append(spec)
            if sharded is not None:
                spec.presets = self._amaxes
                self._specs.append(spec)
                gathered.append(fp8_gather.FP8Weight(
                    g.weight, fp8_gather.weight_blocks(tuple(g.weight.shape), self.recipe, g.grouped),
                    spec.group if self.recipe == "tensorwise" and spec.split else None))
        fused_act = self._fuse_swiglu(pl_module, specs, device)
        n_gathered = 0
        if sharded is not None:
            shared = _shared_params(pl_module)  # a weight also used elsewhere (tied) keeps its bf16 values
            n_gathered = sharded.gather_fp8([w for w in gathered if id(w.param) not in shared], self._amaxes)
            # summed over the ranks (pipeline stages hold different layers): the log and the warning say the same
            n_gathered = int(trainer.strategy.reduce(torch.tensor(n_gathered, device=device), reduce_op="sum"))
        for d in dispatchers:
            d.fp8_dispatch = True
        self._dispatchers = dispatchers
        grouped = [g for g in targets if g.grouped]
        dense = "emulated" if emulate else "torch._scaled_mm" if self.recipe != "blockwise" else \
            ("DeepGEMM: bf16 ones as one expert of the grouped path, fp32 ones with forward and dgrad emulated"
             if fp8_deepgemm.available(device) else "emulated")
        on_kernel = sum(not emulate and grouped_kernels.eligible(self.recipe, g.K, g.N, device) for g in grouped)
        e4m3 = not grouped or self._spec(grouped[0], None).formats() == ("e4m3", "e4m3")
        on_dg = sum(not emulate and e4m3 and fp8_deepgemm.eligible(self.recipe, g.K, g.N, device) for g in grouped)
        backward = "" if not on_kernel or e4m3 else \
            " (their backward emulated: no E5M2 grouped kernel; fp8_format='e4m3' runs it on the kernel)"
        unaligned = on_dg and any(self._spec(g, None).rows_align % 128 for g in grouped)
        kernel = f"{on_kernel} on torch._scaled_grouped_mm{backward}" if not on_dg else \
            f"{on_dg} on DeepGEMM (wgrad on bf16 tensor cores with the recipe's quantization; " + \
            ("rows scattered into 128-row expert groups and gathered back at each GEMM: set "
             "ModelConfig.expert_rows_align=128, Megatron's --moe-router-padding-for-fp8, to skip that)"
             if unaligned else "the experts' input used as laid out, expert_rows_align=128)")
        rank_zero_info(f"FP8Training({self.recipe}): {len(targets) - len(grouped)} dense GEMMs ({dense}), "
                       f"{len(grouped)} expert grouped GEMMs ({kernel}, {len(grouped) - on_kernel - on_dg} emulated)"
                       + (f"; FP8 token dispatch in {len(dispatchers)} MoE layers" if self.fp8_dispatch else "")
                       + f"; fast accumulation: {self.fast_accum}"
                       + (f"; SwiGLU fused with the quantization in {fused_act} MoE layers" if fused_act else "")
                       + (f"; x and dy quantized by the permutes in {len(self._permuting)} MoE layers (one rank, "
                          "no masked tail, no autocast cast)" if self._permuting else "")
                       + ("; weight gradients unquantized (fp8_wgrad=False)" if not self.fp8_wgrad else "")
                       + ("; the experts' wgrad once per optimizer step (defer_expert_wgrad)"
                          if self.defer_expert_wgrad and self.defer_window is None else "")
                       + (f"; the experts' wgrad once per {self.defer_window} micro-batches (defer_expert_wgrad)"
                          if self.defer_window is not None else "")
                       + (f"; DeepGEMM unavailable ({fp8_deepgemm.unavailable(device)})"
                          if self.recipe == "blockwise" and not emulate and device.type == "cuda"
                          and fp8_deepgemm.unavailable(device) else "")
                       + (f"; {n_gathered} weights all-gathered in FP8 (summed over the ranks)" if sharded else "")
                       + ("; the weight cache rewritten in place for the CUDA graphs" if self.cache_weights and graphs
                          else ""))
        if sharded is not None and not n_gathered:
            rank_zero_warn("FP8Training(fp8_param_gather=True): no FP8 weight is all-gathered in this layout (each "
                           "data-parallel group of the weights has one rank, or the distributed optimizer does not "
                           "gather them): the option has nothing to do here")

    def _fuse_swiglu(self, pl_module, specs: dict, device: torch.device) -> int:
        """The experts' SwiGLU fused with the FP8 quantization of both its GEMMs where they allow it
        (``fp8_swiglu.attach``): how many experts modules."""
        for name in specs:
            prefix = name[:-len(".fc1")]
            if name.endswith(".fc1") and prefix + ".fc2" in specs:
                experts = pl_module.get_submodule(prefix)
                hand = fp8_swiglu.attach(experts, specs[name], specs[prefix + ".fc2"], device)
                if hand is None:
                    continue
                self._fused.append((experts, specs[name], specs[prefix + ".fc2"]))
                # the layer's permutes quantize x and dy for the same GEMMs where their rows feed the experts as they
                # are (the dispatcher decides at each call: one rank, no masked tail, no FP8 dispatch rounding)
                layer = pl_module.get_submodule(prefix.rpartition(".")[0]) if "." in prefix else None
                if fp8_swiglu.PERMUTE and hand.both is None and isinstance(layer, MoELayer) and \
                        layer.experts is experts:
                    layer.dispatcher.fp8_rows = hand
                    self._permuting.append(layer.dispatcher)
        return len(self._fused)

    def _check_defer(self, trainer, grouped: list, device: torch.device) -> None:
        """ValueError, on every rank, unless every trainable FP8 expert GEMM takes the deferrable wgrad: the Triton FP8
        wgrad into a main grad. A rank without one (a pipeline stage of dense layers) has nothing to defer."""
        trained = [g for g in grouped if g.weight.requires_grad]
        why = None
        if trained and not self.fp8_wgrad:  # the bf16 wgrad: the experts' GEMMs on the FP8 kernels, not emulated
            if not self._on_kernels(trained, device):
                why = ("FP8Training(fp8_wgrad=False, defer_expert_wgrad=True) needs the experts' FP8 kernels (an SM "
                       "9.0 GPU, expert GEMM dims that are multiples of 16, no emulation; here: "
                       f"{device.type}, emulate={self.emulate}, dims {sorted({(g.K, g.N) for g in trained})}); leave "
                       "defer_expert_wgrad off")
        elif trained and not _triton_wgrad_runs(self.recipe, trained, device, self.emulate):
            why = ("FP8Training(defer_expert_wgrad=True) needs the experts' Triton FP8 wgrad: an SM 9.0 GPU with "
                   "triton, expert GEMM dims that are multiples of 16, no emulation, and LMOE_FP8_TRITON_WGRAD and "
                   + ("LMOE_FP8_BOTH" if self.recipe in ("tensorwise", "delayed") else "LMOE_FP8_TRITON_QUANT")
                   + f" not 0 (here: {device.type}"
                   + (f" {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "")
                   + f", emulate={self.emulate}, dims {sorted({(g.K, g.N) for g in trained})}); leave "
                   "defer_expert_wgrad off")
        unfused = [g.name for g in trained if wgrad_fusion.sink_of(g.weight) is None]
        if why is None and unfused:
            why = (f"FP8Training(defer_expert_wgrad=True): {unfused[0]}'s weight gradient is not accumulated into a "
                   "main grad by its GEMM; it needs MoEFoldStrategy's gradient-accumulation fusion (bf16 weights with "
                   "fp32 main grads: precision='bf16-true', the default main params)")
        # the same answer on every rank (pipeline stages hold different layers): no rank may raise alone
        n_trained, n_bad = _sum_over_ranks(trainer, [len(trained), why is not None], device)
        if not n_trained:
            raise ValueError("FP8Training(defer_expert_wgrad=True): no trainable expert GEMM runs in FP8 (none in the "
                             "model, all excluded, or frozen); leave defer_expert_wgrad off")
        if n_bad:
            raise ValueError(why or "FP8Training(defer_expert_wgrad=True) cannot run on another rank (see its error)")

    def _on_kernels(self, grouped: list, device: torch.device) -> bool:
        """Whether every one of these FP8 expert GEMMs runs on the kernels (``fp8_grouped_kernels``), not emulated."""
        return not self.emulate and all(grouped_kernels.eligible(self.recipe, g.K, g.N, device) for g in grouped)

    def _check_strategy_defer(self, trainer, grouped: list, device: torch.device) -> None:
        """ValueError, on every rank, where ``MoEFoldStrategy(defer_expert_wgrad=...)`` is on but a trainable FP8
        expert GEMM would not take it: it defers the bf16 wgrad of ``fp8_wgrad=False`` behind E4M3 gradients on the
        FP8 kernels, not an FP8 wgrad (that is this callback's ``defer_expert_wgrad``)."""
        sync = getattr(trainer.strategy, "_grad_sync", None)
        if not getattr(sync, "expert_deferral", (False, None))[0]:  # a strategy option: the same on every rank
            return
        trained = [g for g in grouped if g.weight.requires_grad]
        why = None
        if trained:
            if self.fp8_wgrad:
                why = "its wgrad is an FP8 GEMM (fp8_wgrad=True)"
            elif FP8Spec(self.recipe, fp8_format=self.fp8_format).formats()[1] == "e5m2":
                why = "its E5M2 gradients run the emulated backward"
            elif not self._on_kernels(trained, device):
                why = "it runs emulated, not on the FP8 kernels"
        n_bad, = _sum_over_ranks(trainer, [why is not None], device)
        if n_bad:
            raise ValueError("MoEFoldStrategy(defer_expert_wgrad=...) does not reach the FP8 experts' wgrad"
                             + (f" ({trained[0].name}: {why})" if why else " on another rank")
                             + "; use FP8Training(defer_expert_wgrad=...) for the FP8 wgrad, or "
                             "fp8_wgrad=False (E4M3 gradients, on an SM 9.0 GPU), or leave the strategy's "
                             "defer_expert_wgrad off")

    def _param_gather_optimizer(self, trainer):
        """The distributed optimizer that gathers the weights; ValueError naming what is missing."""
        strategy = trainer.strategy
        sharded = getattr(strategy, "sharded_optimizer", None)
        if sharded is None or not sharded.grad_sync.shard:
            raise ValueError("FP8Training(fp8_param_gather=True) needs MoEFoldStrategy(distributed_optimizer=True): "
                             "without the distributed optimizer no weight is all-gathered")
        low = any(p.dtype in LOW_PRECISION for bk in sharded.buckets for p in bk.sync.params)
        if not sharded.main_fp32 or not low:  # the same answer on every rank (a rank may own no slot)
            raise ValueError("FP8Training(fp8_param_gather=True) needs bf16 weights with fp32 main params "
                             "(precision='bf16-true' and MoEFoldStrategy's default main params): the model's weights "
                             "hold their FP8 values between steps, the main params the full ones")
        if getattr(strategy, "cuda_graphs", False):
            raise ValueError("FP8Training(fp8_param_gather=True) with MoEFoldStrategy(cuda_graphs=True): the captured "
                             "GEMMs cannot take each step's gathered scales; turn one of them off")
        return sharded

    def _fp8_dispatchers(self, pl_module) -> list:
        """Every MoE layer's dispatcher; ValueError if one is not the all-to-all (the only one with an FP8 path)."""
        layers = [(n, m) for n, m in pl_module.named_modules() if isinstance(m, MoELayer)]
        for name, layer in layers:
            if not isinstance(layer.dispatcher, AllToAllDispatcher):
                raise ValueError(f"FP8Training(fp8_dispatch=True) needs the 'alltoall' dispatcher, but {name} uses "
                                 f"dispatcher={layer.dispatcher.cfg.dispatcher!r}; set dispatcher: alltoall or "
                                 "leave fp8_dispatch off")
        return [layer.dispatcher for _, layer in layers]

    def _spec(self, g: Gemm, ctx) -> FP8Spec:
        """The groups whose ranks split the GEMM's features (TP, ETP) or tokens (DP x CP, EDP): they share scales, as
        Transformer Engine reduces amaxes over its FP8 group."""
        spec = FP8Spec(self.recipe, emulate=bool(self.emulate), history=self.amax_history, fp8_format=self.fp8_format,
                       fast_accum=self.fast_accum, fp8_wgrad=self.fp8_wgrad,
                       rows_align=getattr(g.module, "rows_align", 1) if g.grouped else 1)
        if ctx is None:
            return spec
        if g.grouped:
            if ctx.etp > 1:  # fc1 splits its outputs over ETP, fc2 its inputs
                spec.group, spec.split = ctx.group("etp"), "out" if g.name.endswith("fc1") else "in"
            spec.data_group = ctx.group("edp")
        else:
            if ctx.tp > 1 and isinstance(g.module, (ColumnParallelLinear, RowParallelLinear)):
                spec.group, spec.split = ctx.group("tp"), "out" if isinstance(g.module, ColumnParallelLinear) else "in"
            spec.data_group = ctx.group("dp_cp")
        return spec

    def _check(self, g: Gemm, device: torch.device) -> Optional[str]:
        """Why ``g`` cannot run with the recipe (this rank's shard sizes), or None."""
        why = check_dims(g.name, g.K, g.N, self.recipe)
        if why is None and not g.grouped and device.type == "cuda" and not self.emulate and (g.K % 16 or g.N % 16):
            why = f"{g.name}: {g.K} x {g.N} is not a multiple of 16, which torch._scaled_mm needs"
        return why

    def _at_step(self, trainer, *_) -> None:
        """Before every batch: the weights are those after ``trainer.global_step`` optimizer steps, so a cached
        quantization of another step is stale. Under CUDA graphs it is rewritten now, before the graphs read it,
        from the weights the distributed optimizer's all-gathers bring (waited for first: eagerly each block waits
        for its own before its forward, but the graphs' blocks are replayed without those waits)."""
        if any(spec.in_place and spec.step != trainer.global_step for spec in self._cached):
            sharded = getattr(getattr(trainer, "strategy", None), "sharded_optimizer", None)
            if sharded is not None:
                sharded.wait_all()
        for spec in self._cached:
            if spec.in_place:
                spec.refresh(trainer.global_step)
            else:
                spec.step = trainer.global_step

    on_train_batch_start = on_validation_batch_start = on_test_batch_start = on_predict_batch_start = _at_step

    def _drop_input(self, *_) -> None:
        """The forward is over: the last dense linear's input and its FP8 copy need not outlive it (through the
        backward's peak, or an activation offload's free)."""
        self._inputs.held = None

    on_before_backward = on_train_batch_end = on_validation_batch_end = on_test_batch_end = _drop_input
    on_predict_batch_end = _drop_input

    def teardown(self, trainer, pl_module, stage: str) -> None:
        for spec in self._cached:
            spec.step, spec.weights = None, {}
        self._cached.clear()
        for spec in self._deferring:
            spec.wgrad_arena = None
        self._deferring.clear()
        for spec in self._specs:
            spec.presets = None
        self._specs.clear()
        if self._amaxes is not None:
            self._amaxes.clear()
        unswap(self._swapped)
        for experts, spec1, spec2 in self._fused:
            fp8_swiglu.detach(experts, spec1, spec2)
        self._fused.clear()
        self._inputs.held = None
        for d in self._permuting:
            d.__dict__.pop("fp8_rows", None)
        self._permuting.clear()
        for d in self._dispatchers:
            d.__dict__.pop("fp8_dispatch", None)
        self._dispatchers = []


def _defer_window(defer) -> Optional[int]:
    """``defer_expert_wgrad``'s window: None for True or False (the whole step, or no deferral), else the int N >= 2;
    ValueError for anything else."""
    if isinstance(defer, bool):
        return None
    if not isinstance(defer, int) or defer < 2:
        raise ValueError(f"FP8Training(defer_expert_wgrad={defer!r}): want True (once per optimizer step), False, "
                         "or an int N >= 2 (once per N micro-batches; 1 would run every micro-batch's wgrad on its "
                         "own: leave it False)")
    return defer


def _triton_wgrad_runs(recipe: str, grouped: list, device: torch.device, emulate: Optional[bool]) -> bool:
    """Whether every FP8 expert GEMM's wgrad runs on ``triton_fp8_wgrad`` (the deferrable one), compiled (not
    interpreted), on the FP8 kernels' GPUs: the rowwise recipe's from the Triton quantizers, the tensorwise and
    delayed recipes' from the one-pass kernels (``fp8_grouped_both``; their other path's wgrad is CUTLASS's), each
    switched on (``fp8_grouped_kernels``' and ``fp8_grouped_both``'s environment switches)."""
    from lightning_moe.modules import fp8_grouped_both
    quantizers = fp8_grouped_both.ENABLED if recipe in ("tensorwise", "delayed") else grouped_kernels.FUSED_QUANT
    return (not emulate and device.type == "cuda" and importlib.util.find_spec("triton") is not None
            and quantizers and grouped_kernels.TRITON_WGRAD and not interpreting()
            and all(grouped_kernels.eligible(recipe, g.K, g.N, device) for g in grouped))


def _sum_over_ranks(trainer, values: list, device: torch.device) -> list:
    """``values`` (ints) summed over every rank (as they are where the strategy has no collectives)."""
    reduce = getattr(trainer.strategy, "reduce", None)
    if reduce is None:
        return [int(v) for v in values]
    return [int(v) for v in reduce(torch.tensor([int(v) for v in values], device=device), reduce_op="sum").tolist()]


def _shared_params(pl_module) -> set:
    """Parameters registered in more than one place (tied weights)."""
    seen, shared = set(), set()
    for _, p in pl_module.named_parameters(remove_duplicate=False):
        (shared if id(p) in seen else seen).add(id(p))
    return shared
