"""FP8 for the experts' grouped GEMM ``y_g = x_g W_g`` (forward, dgrad and wgrad), emulated: each GEMM's operands are
quantized and dequantized with the recipe's scales along its reduction dimension, then multiplied by the same grouped
GEMM in float32.

Scales are per expert (tensorwise, delayed), per row (rowwise) or per tile (blockwise), always within one expert, so
that expert parallelism changes none of them; where expert-tensor parallelism splits an operand's features, or the
expert-data-parallel ranks its tokens, the amax is reduced over that group as for dense layers
(``fp8_linear.FP8Spec``). The wgrad GEMM reduces over each expert's tokens: its scales are per expert and feature
(rowwise) or per 128-token tile of an expert (blockwise, whose tiles then depend on the order of the expert's tokens,
which the dispatcher's layout decides).

Shapes: M routed rows (sorted by expert), K input features, N output features, L local experts.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_moe.modules.fp8 import BLOCK, FORMATS, Recomputed, Tiling, abs_amax, saturate, scale_of, tiling
from lightning_moe.modules.fp8_linear import FP8Spec


def _cast(x: torch.Tensor, amax: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``x`` quantized with the (broadcastable) amax of its block, and the scale used."""
    dtype, fmax = FORMATS[fmt]
    scale = scale_of(amax, fmt)
    return saturate(x, scale, fmax, dtype), scale


def _fake(x: torch.Tensor, amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """Quantize-dequantize ``x`` with the (broadcastable) amax of its block."""
    q, scale = _cast(x, amax, fmt)
    return q.float() / scale


def reduce_groups(amax: torch.Tensor, spec: FP8Spec, features: bool, tokens: bool = False) -> torch.Tensor:
    """``amax`` max-reduced in place over the ETP group (``features``: the split runs through these blocks) and the
    expert's data-parallel ranks (``tokens``: they hold other tokens of the same experts)."""
    for reduce, group in ((features, spec.group), (tokens, spec.data_group)):
        if reduce and group is not None:
            dist.all_reduce(amax, dist.ReduceOp.MAX, group=group)
    return amax


def _reduced(amax: torch.Tensor, spec: FP8Spec, name: str, features: bool, tokens: bool = False) -> torch.Tensor:
    """``reduce_groups``, then under delayed scaling the amax to scale by from operand ``name``'s history."""
    reduce_groups(amax, spec, features, tokens)
    if spec.recipe == "delayed":
        return history(spec, name).update(amax)
    return amax


def history(spec: FP8Spec, name: str) -> "_History":
    return spec.histories.setdefault(name, _History(spec.history))


class _History(Recomputed):
    """Delayed scaling for per-expert amaxes: the max over the last ``length`` uses, elementwise; the current amax
    enters after use (``update``; or the kernels scale by the max of the ring and record the amax they find in the
    same pass, ``push`` after: ``ring``). ``past`` is a ring of the last ``length`` amaxes (the first fills it),
    written in place: one copy per use. A recomputation's replay scales as its first pass did (``Recomputed``)."""

    def __init__(self, length: int):
        self.length, self.past, self.pushed = length, None, 0

    def update(self, current: torch.Tensor) -> torch.Tensor:
        return self._used_of(lambda: self._update(current))

    def _update(self, current: torch.Tensor) -> torch.Tensor:
        if self.past is None:  # never an inference tensor: later pushes write it in place, maybe outside
            with torch.inference_mode(False), torch.no_grad():
                self.past = current.unsqueeze(0).repeat(self.length, *([1] * current.ndim))
        used = self.past.amax(0)
        self.push(current)
        return used

    def ring(self) -> Optional[tuple]:
        """``(the ring (H, L), push)`` for the one-pass kernels, or None on first use (``Recomputed._ring_of``)."""
        return self._ring_of(self.past)

    def push(self, current: torch.Tensor) -> None:
        self.past[self.pushed % self.length].copy_(current)
        self.pushed += 1


def _segment_amax(a_MX: torch.Tensor, offs_L: torch.Tensor) -> torch.Tensor:
    """The max of each expert's rows (rows sorted by expert, ``offs_L`` their cumulative ends; 0 for an empty
    expert): a segmented reduction, without the contended atomics of a scatter."""
    bounds = torch.cat([offs_L.new_zeros(1), offs_L]).to(torch.int64)
    return torch.segment_reduce(a_MX, "max", offsets=bounds, axis=0, unsafe=True, initial=0).float()


def rows_amax(x_MK, offs_L, gid_M, t: Tiling, spec: FP8Spec, name: str, split_k: bool) -> torch.Tensor:
    """Activations along their features, (M, 1): one scale per expert (its tokens are spread over the
    expert-data-parallel ranks) or per row. Not blockwise."""
    a_M1 = abs_amax(x_MK.detach(), 1)
    if t == Tiling(None, None):
        amax_L = _segment_amax(a_M1.squeeze(1), offs_L)
        return _reduced(amax_L, spec, name, split_k, tokens=True)[gid_M].unsqueeze(1)
    return _reduced(a_M1, spec, name, split_k)


def _rows_along_k(x_MK, offs_L, gid_M, t: Tiling, fmt: str, spec: FP8Spec, name: str, split_k: bool):
    """Activations along their features: one scale per expert, per row, or per 1 x 128 tile."""
    if t.cols is None:
        return _fake(x_MK, rows_amax(x_MK, offs_L, gid_M, t, spec, name, split_k), fmt)
    M, K = x_MK.shape
    tiles = x_MK.detach().abs().float().reshape(M, K // BLOCK, BLOCK).amax(2, keepdim=True)  # never straddles ranks
    return _fake(x_MK.reshape(M, K // BLOCK, BLOCK), tiles, fmt).reshape(M, K)


def weights_amax(w_LKN, along: str, t: Tiling, spec: FP8Spec, name: str, reduce: bool, split_along: bool):
    """Each expert's weight along K (forward: the GEMM reduces over K) or along N (dgrad): (L, 1, 1) per expert,
    (L, 1, N) or (L, K, 1) per row of the GEMM. Not blockwise."""
    preset = spec.weight_amax(w_LKN)
    if t == Tiling(None, None) and preset is not None:  # the FP8 parameter all-gather's, per expert
        return preset.reshape(w_LKN.shape[0], 1, 1)
    if t == Tiling(None, None):
        return _reduced(abs_amax(w_LKN.detach(), (1, 2)), spec, name, reduce)
    return _reduced(abs_amax(w_LKN.detach(), 1 if along == "K" else 2), spec, name, split_along)


def _weights(w_LKN, along: str, t: Tiling, fmt: str, spec: FP8Spec, name: str, reduce: bool, split_along: bool):
    """Each expert's weight along K (forward: the GEMM reduces over K) or along N (dgrad). Delayed scaling's are
    made once per optimizer step where FP8Training caches weights (``FP8Spec.cached_weight``), as the kernels'."""
    if spec.recipe == "delayed":
        return spec.cached_weight(f"emulated_{name}", w_LKN, lambda: _fake(
            w_LKN, weights_amax(w_LKN, along, t, spec, name, reduce, split_along), fmt))
    if t.cols is None:
        return _fake(w_LKN, weights_amax(w_LKN, along, t, spec, name, reduce, split_along), fmt)
    L, K, N = w_LKN.shape
    if K % BLOCK or N % BLOCK:
        raise ValueError(f"FP8 blockwise: expert weights need dimensions that are multiples of {BLOCK}, got {K} x {N}")
    preset = spec.weight_amax(w_LKN)  # the FP8 parameter all-gather's, as (L * K / 128, N / 128)
    tiles = preset.reshape(L, K // BLOCK, 1, N // BLOCK, 1) if preset is not None else \
        w_LKN.detach().abs().float().reshape(L, K // BLOCK, BLOCK, N // BLOCK, BLOCK).amax((2, 4), keepdim=True)
    return _fake(w_LKN.reshape(L, K // BLOCK, BLOCK, N // BLOCK, BLOCK), tiles, fmt).reshape(L, K, N)


def tokens_amax(x_MK, offs_L, t: Tiling, spec: FP8Spec, name: str, split_k: bool) -> torch.Tensor:
    """An operand of the wgrad GEMM, which reduces over each expert's tokens: amax per expert (L, 1) or per
    (expert, feature) (L, K). Not blockwise."""
    if t == Tiling(None, None):
        amax_L = _segment_amax(abs_amax(x_MK.detach(), 1).squeeze(1), offs_L)
        return _reduced(amax_L, spec, name, split_k, tokens=True).unsqueeze(1)
    return _reduced(_segment_amax(x_MK.detach().abs(), offs_L), spec, name, False, tokens=True)


def _tokens_per_expert(x_MK, offs_L, gid_M, t: Tiling, fmt: str, spec: FP8Spec, name: str, split_k: bool):
    """An operand of the wgrad GEMM, which reduces over each expert's tokens: scales per expert, per (expert,
    feature) or per (128-token tile of an expert, feature)."""
    if t.cols is None:
        return _fake(x_MK, tokens_amax(x_MK, offs_L, t, spec, name, split_k)[gid_M], fmt)
    M, K = x_MK.shape
    L = offs_L.numel()
    starts_L = torch.cat([offs_L.new_zeros(1), offs_L[:-1]]).to(torch.int64)
    tile_M = gid_M * (M // BLOCK + 1) + (torch.arange(M, device=x_MK.device) - starts_L[gid_M]) // BLOCK
    amax_TK = torch.zeros(L * (M // BLOCK + 1), K, device=x_MK.device, dtype=torch.float32).scatter_reduce(
        0, tile_M.unsqueeze(1).expand(M, K), x_MK.detach().abs().float(), "amax", include_self=True)
    return _fake(x_MK, amax_TK[tile_M], fmt)


def on_kernel(t: torch.Tensor) -> torch.Tensor:
    """An emulated operand for the grouped GEMM: bf16 on CUDA, where torch's fp32 grouped GEMM is a slow,
    host-synchronising fallback and the bf16 one accumulates in fp32 (FP8 and FP4 values are exact in bf16; their
    dequantization scales add one bf16 rounding); unchanged elsewhere."""
    return t.to(torch.bfloat16) if t.is_cuda and t.dtype == torch.float32 else t


def _wgrad(x_MK: torch.Tensor, dy_MN: torch.Tensor, offs_L: torch.Tensor, gid_M: torch.Tensor) -> torch.Tensor:
    """``dW_g = x_g^T dy_g`` for every expert: torch's grouped GEMM over the token dimension, or (float64, unaligned)
    a scatter-add of outer products."""
    L = offs_L.numel()
    size = x_MK.element_size()
    if x_MK.dtype in (torch.float32, torch.bfloat16) and (x_MK.shape[1] * size) % 16 == 0 \
            and (dy_MN.shape[1] * size) % 16 == 0:
        return F.grouped_mm(on_kernel(x_MK).t(), on_kernel(dy_MN), offs=offs_L.to(torch.int32))
    out = torch.zeros(L, x_MK.shape[1], dy_MN.shape[1], dtype=x_MK.dtype, device=x_MK.device)
    valid = torch.arange(x_MK.shape[0], device=x_MK.device) < offs_L[-1]
    return out.index_add_(0, gid_M[valid], x_MK[valid].unsqueeze(2) * dy_MN[valid].unsqueeze(1))


def emulated_dgrad(dy_MN, w_LKN, offs_L, gid_M, spec: FP8Spec) -> torch.Tensor:
    """``dx_g = dy_g W_g^T``, reduced over N: dy's N split (column), W along N."""
    from lightning_moe.modules.experts import grouped_mm
    fwd, bwd = spec.formats()
    col, row = spec.split == "out", spec.split == "in"
    dyq = _rows_along_k(dy_MN, offs_L, gid_M, tiling(spec.recipe, "grad"), bwd, spec, "dy", col)
    wq = _weights(w_LKN, "N", tiling(spec.recipe, "weight"), fwd, spec, "w_t", col or row, col)
    return grouped_mm(on_kernel(dyq), on_kernel(wq).transpose(1, 2), offs_L)


def emulated_wgrad(x_MK, dy_MN, offs_L, gid_M, spec: FP8Spec) -> torch.Tensor:
    """``dW_g = x_g^T dy_g``, reduced over the expert's tokens; from the unquantized operands unless
    ``spec.fp8_wgrad``."""
    fwd, bwd = spec.formats()
    valid_M1 = (torch.arange(x_MK.shape[0], device=x_MK.device) < offs_L[-1]).unsqueeze(1)
    x_MK, dy_MN = torch.where(valid_M1, x_MK, 0), torch.where(valid_M1, dy_MN, 0)  # tail rows: undefined values
    if not spec.fp8_wgrad:
        return _wgrad(x_MK, dy_MN, offs_L, gid_M)
    col, row = spec.split == "out", spec.split == "in"
    xq = _tokens_per_expert(x_MK, offs_L, gid_M, tiling(spec.recipe, "input"), fwd, spec, "x_t", row)
    dyq = _tokens_per_expert(dy_MN, offs_L, gid_M, tiling(spec.recipe, "grad"), bwd, spec, "dy_t", col)
    return _wgrad(xq, dyq, offs_L, gid_M)


def expert_of_rows(M: int, offs_L: torch.Tensor, device, int32: bool = False) -> torch.Tensor:
    """Each of M rows' expert (rows past the last end: the last expert), int64 (``int32``: as int32 ``offs_L``, for
    the kernels, without a conversion)."""
    L = offs_L.numel()
    if int32:
        rows_M = torch.arange(M, device=device, dtype=torch.int32)
        return torch.bucketize(rows_M, offs_L.to(torch.int32), right=True, out_int32=True).clamp_(max=L - 1)
    return torch.bucketize(torch.arange(M, device=device), offs_L.to(torch.int64), right=True).clamp_(max=L - 1)


class _FP8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_LKN, offs_L, spec: FP8Spec):
        from lightning_moe.modules.experts import grouped_mm
        M = x_MK.shape[0]
        gid_M = expert_of_rows(M, offs_L, x_MK.device)
        ctx.save_for_backward(x_MK, w_LKN, offs_L, gid_M)
        ctx.spec = spec
        fwd, _ = spec.formats()
        col, row = spec.split == "out", spec.split == "in"
        xq = _rows_along_k(x_MK, offs_L, gid_M, tiling(spec.recipe, "input"), fwd, spec, "x", row)
        wq = _weights(w_LKN, "K", tiling(spec.recipe, "weight"), fwd, spec, "w", col or row, row)
        return grouped_mm(on_kernel(xq), on_kernel(wq), offs_L).to(x_MK.dtype)

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, w_LKN, offs_L, gid_M = ctx.saved_tensors
        dx = emulated_dgrad(dy_MN, w_LKN, offs_L, gid_M, ctx.spec).to(x_MK.dtype)
        dw = emulated_wgrad(x_MK, dy_MN, offs_L, gid_M, ctx.spec).to(w_LKN.dtype)
        return dx, dw, None, None


def fp8_grouped_mm(x_MK: torch.Tensor, w_LKN: torch.Tensor, offs_L: torch.Tensor, spec: FP8Spec
                   ) -> torch.Tensor:
    """The experts' grouped GEMM in FP8: on ``torch._scaled_grouped_mm`` where it runs (``fp8_grouped_kernels``),
    the blockwise recipe on DeepGEMM where it is installed (``fp8_deepgemm``), emulated otherwise or when
    ``spec.emulate``."""
    from lightning_moe.modules import fp8_deepgemm
    from lightning_moe.modules import fp8_grouped_kernels as kernels
    if not spec.emulate and kernels.runs(spec, x_MK, w_LKN):
        return kernels.scaled_grouped_mm(x_MK, w_LKN, offs_L, spec)
    if not spec.emulate and fp8_deepgemm.runs(spec, x_MK, w_LKN):
        return fp8_deepgemm.grouped_mm(x_MK, w_LKN, offs_L, spec)
    return _FP8GroupedMM.apply(x_MK, w_LKN, offs_L, spec)


def check_dims(name: str, K: int, N: int, recipe: str) -> Optional[str]:
    """Why a layer of K inputs and N outputs cannot run in FP8 with ``recipe`` (None: it can)."""
    if recipe == "blockwise" and (K % BLOCK or N % BLOCK):
        return f"{name}: {K} x {N} is not a multiple of the blockwise recipe's {BLOCK} x {BLOCK} tiles"
    return None
