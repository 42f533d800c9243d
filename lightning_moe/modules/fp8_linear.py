"""FP8 GEMMs with their backward: the dense linear ``x W^T`` (attention projections, dense FFN, shared experts, head).

Each of the three GEMMs of a layer (forward, dgrad, wgrad) quantizes its two operands along its own reduction
dimension with the recipe's tiling (``fp8.py``); the high-precision operands are kept for backward, as torchao does.

Scales must not depend on the layout either. Where tensor (or expert-tensor) parallelism splits an operand's
features, or data parallelism its tokens, the amax behind a scale is all-reduced (max) over that group: for
tensorwise and delayed scaling whenever the operand is split, for rowwise when the split runs along the quantized
dimension; blockwise tiles never straddle ranks (the split sizes must be multiples of 128). ``split``: which
dimension of the layer the TP group splits, ``"out"`` (column-parallel, N) or ``"in"`` (row-parallel, K).

The weight's two operands (``w`` for the forward, ``w^T`` for dgrad) are quantized once per optimizer step under
``FP8Training(cache_weights=True)`` (``FP8Spec.cached_weight``). Rowwise operands are quantized by one Triton kernel
each on CUDA (``triton_fp8_quant.rowwise_quant``, the same bits) unless their amax is reduced over ranks.

Shapes: M rows (tokens), K input features, N output features.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_moe.modules.fp8 import (BLOCK, AmaxHistory, Tiling, block_amax, formats, fp8_mm, quantize,
                                       tiling)
from lightning_moe.modules.kernels import load
from lightning_moe.modules.wgrad_fusion import sink_for, wgrad_into


def _leaves(x) -> list:
    """The tensors in a nested tuple or list, in order (a cached quantization: values, scales, their inverses)."""
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for item in x for t in _leaves(item)] if isinstance(x, (tuple, list)) else []


@dataclass
class FP8Spec:
    """How one layer's GEMMs run in FP8."""
    recipe: str
    emulate: bool = False
    group: Optional[dist.ProcessGroup] = None  # the TP / ETP group splitting this layer's features, if any
    split: Optional[str] = None  # which features it splits: "out" or "in"
    data_group: Optional[dist.ProcessGroup] = None  # the ranks splitting the tokens (dp x cp; edp for experts)
    history: int = 16  # delayed scaling's amax window
    histories: dict = field(default_factory=dict)  # operand -> AmaxHistory (delayed)
    fp8_format: Optional[str] = None  # Megatron's --fp8-format: "hybrid" (E5M2 gradients) or "e4m3"; None: recipe's
    # the optimizer step whose weights the quantized-weight cache holds (FP8Training sets it before every batch);
    # None: no caching
    step: Optional[int] = None
    weights: dict = field(default_factory=dict)  # operand -> (step, weight's data_ptr, quantized tensors, make)
    # under CUDA graphs (FP8Training): a stale cached weight is rewritten in place (``refresh``), never replaced, so the
    # captured GEMMs, which read it at the address of their capture, see each step's weights
    in_place: bool = False
    fast_accum: str = "fprop"  # which GEMMs use the kernels' fast accumulation (fp8.FAST_ACCUM)
    # Megatron's fp8_wgrad: False runs the weight-gradient GEMMs on the unquantized operands (the activations' dtype,
    # fp32 accumulation) while forward and dgrad stay in FP8
    fp8_wgrad: bool = True
    # the FP8 parameter all-gather's block amaxes of the weights it dequantized (strategy/fp8_param_gather.py)
    presets: Optional[object] = None
    # the experts' input layout: each expert's rows start on a multiple of this (ModelConfig.expert_rows_align); at a
    # multiple of 128 DeepGEMM reads the layout as it is (fp8_deepgemm.rows_aligned)
    rows_align: int = 1
    # FP8Training(defer_expert_wgrad=True): the experts' FP8 wgrad runs once per optimizer step, at the step's last
    # backward, over every micro-batch's held operands (``fp8_grouped_kernels``), writing the fp32 main grads once
    defer_wgrad: bool = False
    # ... over at most this many micro-batches at a time (None: all of the step's), bounding the held operands
    defer_window: Optional[int] = None
    # ... and the (K, C) and (N, C) E4M3 buffers its micro-batches' held operands go into, side by side (kept from step
    # to step: ``fp8_grouped_kernels._held_slots``)
    wgrad_arena: Optional[tuple] = None
    # the experts' GEMMs around an FP8-fused SwiGLU (``fp8_swiglu.Handoff``, "fc1" or "fc2"): fc1 records its rows'
    # experts and takes dh's quantization in backward, fc2 takes a's in forward
    handoff: Optional[tuple] = None
    # the dense linears' ``SharedInput`` (FP8Training): linears reading the same input quantize it once
    inputs: Optional["SharedInput"] = None

    def weight_amax(self, w: torch.Tensor) -> Optional[torch.Tensor]:
        """The amaxes of ``w``'s scale blocks (as an (R, C) grid) that the FP8 parameter all-gather quantized its
        current values with: quantizing with them gives back the gathered bytes. None: none (compute them)."""
        return None if self.presets is None else self.presets.get(w)

    def fast(self, role: str) -> bool:
        """Whether the ``role`` GEMM ("fprop", "dgrad" or "wgrad") accumulates fast."""
        return self.fast_accum == "all" or (self.fast_accum == "fprop" and role == "fprop")

    def cached_weight(self, name: str, w: torch.Tensor, make):
        """``make()``, the quantized weight operand ``name``, made once per optimizer step: the micro-batches of a step
        (and a validation between steps) see the same weights, as Transformer Engine caches FP8 weights; under
        delayed scaling the weight's amax history then advances once per step, at ``make``. Not without a step
        (outside FP8Training). With ``in_place`` a new step's copy is written over the old one's tensors
        (``refresh``)."""
        if self.step is None:
            return make()
        hit = self.weights.get(name)
        if hit is not None and hit[1] == w.data_ptr() and (hit[0] == self.step or self.in_place):
            if hit[0] != self.step:
                self._rewrite(name, hit)
            return hit[2]
        if hit is not None and self.in_place:  # captured GEMMs read the old copy's address, which would be freed
            raise RuntimeError(f"FP8 weight cache ({name}): the weight moved (data_ptr {hit[1]:#x} -> "
                               f"{w.data_ptr():#x}) under CUDA graphs, whose GEMMs read the copy made from it; "
                               "weights must be updated in place while graphs are captured")
        self.weights.pop(name, None)  # the old step's copy goes before the new one is made
        if self.in_place:  # rewritten in place later: never an inference tensor (a sanity check's validation)
            with torch.inference_mode(False), torch.no_grad():  # (inference_mode(False) alone turns grad mode on)
                out = make()
        else:
            out = make()
        self.weights[name] = (self.step, w.data_ptr(), out, make)
        return out

    @torch.no_grad()
    def refresh(self, step: int) -> None:
        """The weights are now those after ``step`` optimizer steps: rewrite every cached quantization made before, in
        place (``in_place``; FP8Training calls this before a step's first batch, outside the graphs that read them)."""
        self.step = step
        for name, hit in list(self.weights.items()):
            if hit[0] != step:
                self._rewrite(name, hit)

    @torch.no_grad()
    def _rewrite(self, name: str, hit: tuple) -> None:
        _, ptr, out, make = hit
        for old, new in zip(_leaves(out), _leaves(make()), strict=True):
            old.copy_(new)
        self.weights[name] = (self.step, ptr, out, make)

    def formats(self) -> tuple[str, str]:
        """(format of inputs and weights, format of gradients)."""
        if self.fp8_format is None:
            return formats(self.recipe)
        return ("e4m3", "e5m2") if self.fp8_format == "hybrid" else ("e4m3", "e4m3")

    def amax(self, name: str, x_RK: torch.Tensor, t: Tiling, rows: Optional[str], cols: Optional[str]
             ) -> Optional[torch.Tensor]:
        """The amax behind operand ``name``'s scales (quantized along its columns), all-reduced over the groups that
        split it where a split would change it: ``rows``/``cols`` name what splits them, ``"tp"`` (``group``),
        ``"data"`` (``data_group``) or None. A scale over the whole tensor changes with any split, one per row with a
        split of the columns, tiles with none (they never straddle ranks). None: the local per-block amax is right."""
        whole = t == Tiling(None, None)
        groups = {"tp": self.group, "data": self.data_group}
        reduce = [groups[k] for k in dict.fromkeys(
            [g for g in ((rows, cols) if whole else (cols,) if t == Tiling(1, None) else ()) if g])
            if groups[k] is not None]
        if self.recipe == "delayed":
            local = x_RK.detach().abs().amax().float().reshape(1)
            for group in reduce:
                dist.all_reduce(local, dist.ReduceOp.MAX, group=group)
            return self.histories.setdefault(name, AmaxHistory(self.history)).amax(local)
        if not reduce:
            return None
        a = block_amax(x_RK, t)
        for group in reduce:
            dist.all_reduce(a, dist.ReduceOp.MAX, group=group)
        return a


class SharedInput:
    """The FP8 quantization of the last input a dense FP8 linear quantized, for the next linears that read the very
    same tensor (the q, k and v projections all read one normed x): one pass over it instead of one per linear. Used
    only where the quantization depends on nothing but the tensor, the recipe and the format (no amax reduced over
    ranks, no delayed history). Keyed as ``fp8_swiglu``'s handoff (storage, shape, strides, version); the entry holds
    the tensor, so that no other tensor can take its memory and match its key while it lives. No parallel state: one
    per ``FP8Training``."""

    def __init__(self):
        self.held: Optional[tuple] = None  # (x, its key, the quantization)

    def get(self, x: torch.Tensor, how: tuple, make):
        from lightning_moe.modules.fp8_swiglu import tensor_key
        key = (tensor_key(x), how)
        if self.held is not None and self.held[1] == key:
            return self.held[2]
        self.held = None  # the old entry goes before the new one is made
        out = make()
        self.held = (x, key, out)
        return out


def _one_pass(x: torch.Tensor, t: Tiling, fmt: str, amax: Optional[torch.Tensor]):
    """``triton_fp8_quant`` where it quantizes ``x`` rowwise in one kernel with ``quantize``'s bits: the rowwise
    recipe's E4M3 per-row scales with no amax from elsewhere (reduced over ranks); else None. One launch instead of
    the amax, scale and cast ops, which left the GPU waiting on the host (docs/PERFORMANCE.md)."""
    from lightning_moe.modules.fp8_grouped_kernels import FUSED_QUANT  # it builds on this module
    if not FUSED_QUANT or amax is not None or t != Tiling(1, None) or fmt != "e4m3":
        return None
    if x.is_cuda and _capability(x.device.index) < (8, 9):  # no E4M3 conversion (emulated FP8 on older GPUs)
        return None
    return load("triton_fp8_quant", x)


@functools.lru_cache(maxsize=None)
def _capability(index: Optional[int]) -> tuple:
    return torch.cuda.get_device_capability(index)


def _quantized(spec: FP8Spec, name: str, x_RK: torch.Tensor, t: Tiling, splits: tuple, fmt: str,
               amax: Optional[torch.Tensor] = None) -> tuple:
    """``quantize``'s (values, scales) of operand ``name``, its amax reduced as the recipe says unless given. Where
    ``_one_pass``'s kernel quantizes it for the GEMM kernel (not emulated), (values, None, dequantization scales):
    ``_scaled_mm`` reads only those, written by the pass (``fp8_mm``), so no reciprocal is launched."""
    amax = spec.amax(name, x_RK, t, *splits) if amax is None else amax
    tq = _one_pass(x_RK, t, fmt, amax)
    if tq is None:
        return quantize(x_RK, fmt, t, amax)
    if spec.emulate:
        return tq.rowwise_quant(x_RK, fmt)
    q, inv = tq.rowwise_quant(x_RK, fmt, inverse=True)
    return q, None, inv


def _quantized_t(spec: FP8Spec, name: str, x_MR: torch.Tensor, t: Tiling, splits: tuple, fmt: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``_quantized`` of ``x_MR^T`` (a wgrad operand, quantized along the tokens M). Where ``_one_pass``'s kernels run
    (an amax reduced over the data ranks too), one kernel quantizes straight into that layout (``colwise_quant_t``,
    the same bits) and the copy, a read and write of the operand, is never made."""
    amax = spec.amax(name, x_MR.t(), t, *splits)  # the values of the copy, in another layout: the same amaxes
    tq = _one_pass(x_MR, t, fmt, None)
    if tq is None:
        return quantize(x_MR.t().contiguous(), fmt, t, amax)
    return tq.colwise_quant_t(x_MR, fmt, amax, inverse=not spec.emulate)  # with the GEMM's dequantization scales


def _mm_t(spec: FP8Spec, names: tuple[str, str], a_MN, b_MK, roles: tuple[str, str], fmts: tuple[str, str],
          splits_a: tuple, splits_b: tuple, out_dtype, gemm: str) -> torch.Tensor:
    """``_mm`` of ``a_MN^T`` and ``b_MK^T``, reduced over M (the wgrad), each operand quantized by ``_quantized_t``."""
    ta, tb = tiling(spec.recipe, roles[0]), tiling(spec.recipe, roles[1])
    a_q = _quantized_t(spec, names[0], a_MN, ta, splits_a, fmts[0])
    b_q = _quantized_t(spec, names[1], b_MK, tb, splits_b, fmts[1])
    # given a_q, fp8_mm reads a only for its device (DeepGEMM's check): the view, not a copy
    return fp8_mm(a_MN.t(), None, ta, tb, fmts[0], fmts[1], out_dtype, spec.emulate, None, None, spec.fast(gemm),
                  b_q=b_q, a_q=a_q)


def _mm(spec: FP8Spec, names: tuple[str, str], a_MK, b_NK, roles: tuple[str, str], fmts: tuple[str, str],
        splits_a: tuple, splits_b: tuple, out_dtype, gemm: str, amax_b: Optional[torch.Tensor] = None,
        weight: Optional[torch.Tensor] = None, shared: Optional[SharedInput] = None) -> torch.Tensor:
    """``amax_b``: the weight's preset amaxes (``FP8Spec.weight_amax``), else reduced as the recipe says. ``weight``:
    ``b`` is made from this weight (``b_NK`` then a function of no arguments that makes it): its quantization is
    cached once per optimizer step (``FP8Spec.cached_weight``), so later micro-batches skip the transpose, the amax
    and the cast. ``shared``: ``a``'s quantization is shared with the linears that read the same tensor, where it
    depends on the tensor alone."""
    ta, tb = tiling(spec.recipe, roles[0]), tiling(spec.recipe, roles[1])
    if shared is None or spec.recipe == "delayed":  # delayed: its history advances inside, once per use
        a_q = _quantized(spec, names[0], a_MK, ta, splits_a, fmts[0])
    else:
        amax_a = spec.amax(names[0], a_MK, ta, *splits_a)  # reduced over ranks, once; None: the tensor alone decides
        quantized_a = functools.partial(_quantized, spec, names[0], a_MK, ta, splits_a, fmts[0], amax_a)
        a_q = quantized_a() if amax_a is not None else \
            shared.get(a_MK, (spec.recipe, fmts[0], ta, spec.emulate), quantized_a)

    def quantized_b():  # with the GEMM's dequantization scales, made once with a cached weight
        b_q = _quantized(spec, names[1], b_NK() if weight is not None else b_NK, tb, splits_b, fmts[1], amax_b)
        return b_q if len(b_q) == 3 or tb.cols is not None else (*b_q, b_q[1].reciprocal())
    b_q = quantized_b() if weight is None else spec.cached_weight(names[1], weight, quantized_b)
    return fp8_mm(a_MK, None, ta, tb, fmts[0], fmts[1], out_dtype, spec.emulate, None, None, spec.fast(gemm),
                  b_q=b_q, a_q=a_q)


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_NK, spec: FP8Spec, sync, both):
        """``both``: ``fp8_linear_both``'s kernels, where they take this linear (one scale per tensor)."""
        ctx.spec, ctx.shape, ctx.both = spec, x.shape, both
        if both is not None:
            from lightning_moe.modules import fp8_linear_both
            return fp8_linear_both.forward(ctx, both, x, w_NK, spec)
        # the parameter itself for the main grad (a saved weight may come back as another tensor: wgrad_fusion.py)
        ctx.sync, ctx.weight = sync, w_NK if sync is not None else None
        x_MK = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x_MK, w_NK)
        fwd, _ = spec.formats()
        col, row = ("tp" if spec.split == s else None for s in ("out", "in"))
        # x: tokens split over data ranks, K over TP (row-parallel); W: N (column) or K (row) over TP
        y = _mm(spec, ("x", "w"), x_MK, lambda: w_NK, ("input", "weight"), (fwd, fwd), ("data", row), (col, row),
                x.dtype, "fprop", spec.weight_amax(w_NK), weight=w_NK, shared=spec.inputs)
        return y.reshape(*x.shape[:-1], w_NK.shape[0])

    @staticmethod
    def backward(ctx, dy):
        if ctx.both is not None:
            from lightning_moe.modules import fp8_linear_both
            return (*fp8_linear_both.backward(ctx, ctx.both, dy), None, None, None)
        x_MK, w_NK = ctx.saved_tensors
        spec = ctx.spec
        fwd, bwd = spec.formats()
        col, row = ("tp" if spec.split == s else None for s in ("out", "in"))
        dy_MN = dy.reshape(-1, dy.shape[-1])
        # dgrad dx = dy W, reduced over N: dy's N split (column), W^T is K x N
        amax_w = spec.weight_amax(w_NK)
        dx = _mm(spec, ("dy", "w_t"), dy_MN, lambda: w_NK.t().contiguous(), ("grad", "weight"), (bwd, fwd),
                 ("data", col), (row, col), x_MK.dtype, "dgrad", None if amax_w is None else amax_w.t(), weight=w_NK)
        if not spec.fp8_wgrad:  # the unquantized operands, accumulated in fp32 (the fused wgrad's GEMM)
            sync, param = ctx.sync, ctx.weight
            ctx.sync = ctx.weight = None
            x_MK = x_MK.to(dy_MN.dtype)
            if sync is not None:  # straight into the fp32 main grad: no fp32 gradient, bf16 rounding or hook's add
                sync.accumulate_wgrad(param, lambda main, first: wgrad_into(main, dy_MN, x_MK, first))
                # never read: it fires the hook
                return dx.reshape(ctx.shape), sync.placeholder(param), None, None, None
            dw = torch.empty(w_NK.shape, dtype=torch.float32, device=w_NK.device)
            wgrad_into(dw, dy_MN, x_MK, True)
            return dx.reshape(ctx.shape), dw.to(w_NK.dtype), None, None, None
        # wgrad dW = dy^T x, reduced over the tokens M (never split); blockwise tiles of 128 tokens: zero rows pad M
        # to a multiple (they add nothing to the product and change no tile's amax)
        pad = (-x_MK.shape[0]) % BLOCK if spec.recipe == "blockwise" else 0
        dy_pad, x_pad = (F.pad(dy_MN, (0, 0, 0, pad)), F.pad(x_MK, (0, 0, 0, pad))) if pad else (dy_MN, x_MK)
        dw = _mm_t(spec, ("dy_t", "x_t"), dy_pad, x_pad, ("grad", "input"), (bwd, fwd), (col, "data"), (row, "data"),
                   w_NK.dtype, "wgrad")
        return dx.reshape(ctx.shape), dw, None, None, None


def fp8_linear(x: torch.Tensor, w_NK: torch.Tensor, spec: FP8Spec) -> torch.Tensor:
    """``x W^T`` in FP8 (forward, dgrad and wgrad); the blockwise recipe in bf16 on the experts' DeepGEMM path where
    it runs (``fp8_deepgemm.linear``)."""
    from lightning_moe.modules import fp8_deepgemm  # it builds on this module
    if spec.recipe == "blockwise" and fp8_deepgemm.linear_runs(spec, x, w_NK):
        return fp8_deepgemm.linear(x, w_NK, spec)
    # fp8_wgrad=False under GradSync's gradient-accumulation fusion: the wgrad's GEMM adds into the main grad (decided
    # here: grad mode is off inside the autograd function's forward)
    sync = None if spec.fp8_wgrad else sink_for(w_NK, x, grouped=False)
    from lightning_moe.modules import fp8_linear_both  # it builds on this module
    both = fp8_linear_both.kernels(spec, x)  # with or without a backward: one weight copy, one history per operand
    return _FP8Linear.apply(x, w_NK, spec, sync, both)
