"""Recompute: selective activation recomputation as a callback (Megatron's ``--recompute-granularity selective
--recompute-modules``).

Two kinds of module, with Megatron's names:

* cheap, memory-heavy pieces whose outputs are rebuilt in backward instead of kept (``saved_tensors.py``):
  ``core_attn`` (attention's output), ``layernorm`` (the two pre-norms' outputs and, with Qwen3's q/k norms, their
  rotated outputs, which attention keeps as q and k: Megatron's ``layernorm`` covers the pre-norms only),
  ``moe_act`` (the experts' SwiGLU activation), ``mla_up_proj`` (MLA's q, k and v from their latents);
* whole modules recomputed with ``torch.utils.checkpoint`` (non-reentrant), keeping only their inputs:
  ``shared_experts``, ``mlp`` (dense FFN), ``moe`` (the MoE layer, its dispatch communication included) and ``full``
  (the block).

The router's statistics are counted in the first pass only and the replay reuses the global aux-loss window the first
pass saw (``modules/replay.py``), so expert-bias updates and losses do not change. Results are bit-identical to no
recomputation on the same kernels.
"""

from __future__ import annotations

from typing import Sequence, Union

import lightning as L
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_moe.callbacks.saved_tensors import policy_of
from lightning_moe.callbacks.wrap_forward import unwrap_forward, wrap_forward
from lightning_moe.modules import replay
from lightning_moe.strategy.pipeline.partition import partition_layers

REBUILT = ("core_attn", "layernorm", "moe_act", "mla_up_proj")
CHECKPOINTED = ("shared_experts", "mlp", "moe", "full")
MODULES = REBUILT + CHECKPOINTED


def _contexts():
    kept = {}  # this invocation's: what its first pass keeps for its replay (FP8 delayed scales)
    return replay.first_pass(kept), replay.replay(kept)


def parse_modules(modules, valid: Sequence[str], what: str) -> list[str]:
    """The chosen module names (a name or a list), each known, without repeats."""
    modules = [modules] if isinstance(modules, str) else list(modules)
    unknown = [m for m in modules if m not in valid]
    if unknown or not modules:
        raise ValueError(f"{what}(modules={modules!r}): unknown module {unknown[0] if unknown else None!r}; valid: "
                         f"{', '.join(valid)}")
    return list(dict.fromkeys(modules))


def parse_layers(layers, what: str):
    """``"all"``, a number N (the first N layers of each pipeline stage), or a list of layer indices."""
    if layers == "all":
        return layers
    if isinstance(layers, int) and not isinstance(layers, bool) and layers >= 0:
        return layers
    if isinstance(layers, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                 for i in layers):
        return sorted(set(layers))
    raise ValueError(f"{what}(layers={layers!r}): use 'all', a number N (the first N layers of each pipeline stage) "
                     "or a list of layer indices")


def selected_layers(pl_module, layers, what: str) -> tuple[list[int], list[int]]:
    """``(every selected global layer index, those on this rank)``: ``layers`` of MoELanguageModel's
    ``model.layers``, with N meaning the first N layers of each (virtual) pipeline stage."""
    model = getattr(pl_module, "model", None)
    if model is None or not hasattr(model, "layers") or not hasattr(model, "chunk_layers"):
        raise TypeError(f"{what} needs a LightningModule whose .model has .layers and .chunk_layers "
                        "(MoELanguageModel's MoETransformer)")
    cfg, ctx = model.cfg, model.ctx
    total = cfg.num_layers
    if isinstance(layers, list):
        bad = [i for i in layers if i >= total]
        if bad:
            raise ValueError(f"{what}(layers={layers}): layer {bad[0]} is out of range; the model has {total} layers "
                             f"(0..{total - 1})")
        chosen = layers
    else:
        stages = partition_layers(total, ctx.pp, ctx.virtual_pipeline_size, ctx.pipeline_first_layers,
                                  ctx.pipeline_last_layers)
        chosen = [i for r in stages for i in (list(r) if layers == "all" else list(r)[:layers])]
    mine = [i for chunk in model.chunk_layers for i in chunk if i in chosen]
    return chosen, mine


def has_module(cfg, name: str, chosen: list[int]) -> bool:
    """Whether the selected layers of the whole model (every pipeline stage) have ``name``."""
    moe = any(cfg.is_moe_layer(i) for i in chosen)
    return {"mla_up_proj": cfg.attention_type == "mla" and bool(chosen), "moe_act": moe, "moe": moe,
            "mlp": any(not cfg.is_moe_layer(i) for i in chosen), "shared_experts": moe and bool(
                cfg.shared_expert_ffn_size)}.get(name, bool(chosen))


def refuse_cuda_graphs(trainer, what: str) -> None:
    if getattr(trainer.strategy, "cuda_graphs", False):
        raise ValueError(f"{what} cannot be combined with MoEFoldStrategy(cuda_graphs=True): the graphs replay each "
                         "block's captured forward and backward whole, so nothing in them can be recomputed or moved; "
                         "use one or the other")


class Recompute(L.Callback):
    """Recompute the chosen ``modules`` in the chosen ``layers`` during backward instead of keeping their activations.

    Args:
        modules: any of ``core_attn``, ``layernorm``, ``moe_act``, ``mla_up_proj``, ``shared_experts``, ``mlp``,
            ``moe``, ``full``. Default: ``moe_act`` and ``layernorm``, the cheap ones.
        layers: ``"all"``, N (the first N layers of each pipeline stage) or a list of global layer indices.

    Logs ``memory/recomputed_gib``: the activations the fine-grained modules kept off the device in the last micro-batch
    (the whole-module ones keep only their inputs).
    """

    def __init__(self, modules: Sequence[str] = ("moe_act", "layernorm"), layers: Union[str, int, Sequence[int]] = "all"):
        self.modules = parse_modules(modules, MODULES, "Recompute")
        self.layers = parse_layers(list(layers) if isinstance(layers, tuple) else layers, "Recompute")
        self._restore: list[tuple[nn.Module, object]] = []

    def on_fit_start(self, trainer, pl_module) -> None:
        refuse_cuda_graphs(trainer, "Recompute")
        chosen, mine = selected_layers(pl_module, self.layers, "Recompute")
        missing = [name for name in self.modules if not has_module(pl_module.model.cfg, name, chosen)]
        if missing:  # decided from the config: the same answer on every rank
            raise ValueError(f"Recompute(modules={self.modules}): the selected layers have no {missing[0]!r} "
                             "(e.g. mla_up_proj needs MLA attention, moe_act and moe MoE layers, mlp dense layers, "
                             "shared_experts shared experts)")
        policy = policy_of(pl_module)
        for block in (pl_module.model.layers[i] for i in mine):
            if "full" in self.modules:  # the whole block: nothing finer to do in it
                self._checkpoint(block)
                continue
            ffn = block.ffn
            for name, module in (("moe", ffn if block.is_moe else None), ("mlp", None if block.is_moe else ffn),
                                 ("shared_experts", getattr(ffn, "shared_experts", None) if block.is_moe else None)):
                if name in self.modules and module is not None:
                    self._checkpoint(module)
            rebuilt = [(name, m) for name, m in self._rebuilt(block) if name in self.modules]
            if "moe" in self.modules and block.is_moe:  # inside the recomputed MoE layer already
                rebuilt = [(name, m) for name, m in rebuilt if name != "moe_act"]
            for name, m in rebuilt:
                policy.mark_recompute(m, name)
            if rebuilt:
                policy.wrap_block(block)

    def _rebuilt(self, block) -> list[tuple[str, nn.Module]]:
        out = [("layernorm", block.attn_norm), ("layernorm", block.ffn_norm),
               ("core_attn", block.attn.core_attn)]
        if getattr(block.attn, "norm_rotate", None) is not None and "core_attn" not in self.modules:
            # the q/k norms' outputs, rotated, are what attention keeps of q and k; a recomputed core_attn keeps
            # them as its inputs already, so rebuilding them as well would free nothing
            out.append(("layernorm", block.attn.norm_rotate))
        if hasattr(block.attn, "up_proj"):
            out.append(("mla_up_proj", block.attn.up_proj))
        if block.is_moe:
            out.append(("moe_act", block.ffn.experts.act))
        return out

    def _checkpoint(self, module: nn.Module) -> None:
        def make(forward):
            def recomputed(*args, **kwargs):
                if not torch.is_grad_enabled():  # evaluation: nothing to keep or rebuild
                    return forward(*args, **kwargs)
                if replay.recorded() or replay.replaying():  # inside a recomputed region already (the shared
                    # experts in the MoE layer): its checkpoint keeps and replays this module too; one of its own
                    # would run its replay as a first pass (FP8 delayed scales pushed again) and recompute it twice
                    return forward(*args, **kwargs)
                return checkpoint(forward, *args, use_reentrant=False, context_fn=_contexts, **kwargs)
            return recomputed

        # innermost: another callback's saved-tensor hooks around the block must stay outside the checkpoint, whose
        # own hooks then apply inside it (hooks nested the other way would hide the checkpoint's)
        self._restore.append((module, wrap_forward(module, make, innermost=True)))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        policy_of(pl_module).stats.clear()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not any(m in REBUILT for m in self.modules):
            return
        stats = policy_of(pl_module).stats
        kept_off = sum(v for k, v in stats.items() if not k.startswith("offload:"))
        # a host tensor: Lightning would copy a Python float to the device, a host sync on CUDA
        pl_module.log("memory/recomputed_gib", torch.tensor(kept_off / 2**30), on_step=True, logger=True)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        for module, wrapper in reversed(self._restore):
            unwrap_forward(module, wrapper)
        self._restore = []
        policy = getattr(pl_module, "_lmoe_saved_tensors", None)
        if policy is not None:
            policy.remove()
            object.__delattr__(pl_module, "_lmoe_saved_tensors")
