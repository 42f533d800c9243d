"""The experts' FP8 grouped GEMM on torchao's rowwise MoE kernel (``FP8Training(grouped_kernels="torchao")``).

torchao's ``_to_fp8_rowwise_then_scaled_grouped_mm`` does forward, dgrad and wgrad on ``torch._scaled_grouped_mm``
(SM 9.0) with fast accumulation, quantizing each operand in fused Triton kernels. Its scales are its own, each rounded
down to a power of 2 and computed from this rank's values only (no amax is reduced over ETP or EDP groups): per row of
x and dy, per expert and column (forward) or row (dgrad) of W, per expert and feature over its tokens (wgrad): the
granularity of our rowwise recipe (``fp8_grouped.py``).

It needs every expert's group of rows to be a multiple of 16 rows (``ModelConfig.expert_rows_align=16``: the
dispatcher lays the rows out so, with zero rows between groups; torchao's own padding is not used) and K and N
multiples of 16. torchao is optional: imported on first use.

Shapes: M rows (sorted by expert), K input features, N output features, L local experts.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _kernel():
    """torchao's rowwise grouped GEMM, or None where torchao (or Triton, which its kernels need) is missing."""
    try:
        from torch.utils._triton import has_triton
        from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm
    except ImportError:
        return None
    return _to_fp8_rowwise_then_scaled_grouped_mm if has_triton() else None


def available() -> bool:
    """Whether torchao's rowwise MoE grouped GEMM can be imported here."""
    return _kernel() is not None


def rowwise_grouped_mm(x_MK: torch.Tensor, w_LKN: torch.Tensor, offs_L: torch.Tensor) -> torch.Tensor:
    """``y_g = x_g W_g`` for each expert in FP8 (rowwise scales; forward, dgrad and wgrad) on torchao's kernels.
    ``offs_L``: each expert's cumulative end, every group a multiple of 16 rows; rows past the last are left
    undefined in the output and the input gradient, as ``grouped_mm`` leaves them."""
    kernel = _kernel()
    if kernel is None:
        raise ImportError("FP8 grouped GEMMs on torchao need torchao (and Triton): pip install torchao")
    # torchao reads B column-major, strides (K*N, 1, K); our weights are (L, K, N) row-major, so this is a
    # transposed copy: one read and one write of the weight per call, and in backward its gradient comes back
    # column-major and is copied once more into the row-major .grad. Estimated: 4 passes over Qwen3-30B-A3B's
    # 1.2 GB of bf16 expert weights per layer, ~1.6 ms at an H100's ~3 TB/s, next to ~13 ms of bf16 expert
    # GEMMs at 16k tokens
    w_cm_LKN = w_LKN.transpose(1, 2).contiguous().transpose(1, 2)
    y_MN = kernel(x_MK.contiguous(), w_cm_LKN, offs_L.to(torch.int32), out_dtype=torch.bfloat16,
                  pad_token_groups_for_grouped_mm=False)
    return y_MN.to(x_MK.dtype)
