"""FP8 token dispatch: the dispatch all-to-all sends each token row in E4M3 with its fp32 scale, as DeepEP does.

A row of D values travels as D + 4 bytes (the E4M3 bytes, then the 4 bytes of its scale), padded with zeros to a
multiple of 16 bytes, in one uint8 all-to-all: about half the bytes of bf16. The receiver dequantizes to the input's
dtype. Backward is straight-through: the gradient goes back in the input's precision by the reverse all-to-all (as in
DeepEP, only the dispatch is FP8).

Scales are per row, so the numbers do not depend on the layout: without an EP group the same quantize-dequantize runs
in place of the exchange, and one process is the exact reference of the EP run.

Shapes: N rows sent, M rows received, D hidden, B = ``row_bytes(D)`` per packed row.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from lightning_moe.modules import kernels
from lightning_moe.modules.fp8 import FORMATS, abs_amax, saturate, scale_of
from lightning_moe.strategy import comm

SCALE_BYTES = 4  # one fp32 scale per row
# packed rows are padded to 16 bytes, so that every peer's chunk of the all-to-all starts 16-byte aligned, as NCCL's
# vectorized copies want (rows of D + 4 bytes left the chunks 4-byte aligned)
ROW_ALIGN = 16


def row_bytes(D: int) -> int:
    return -(-(D + SCALE_BYTES) // ROW_ALIGN) * ROW_ALIGN


def _kernels(t: torch.Tensor):
    """The Triton quantization kernels where they run (CUDA), the same bits as the torch code; None: torch (also with
    ``LMOE_FP8_TRITON_QUANT=0``, which keeps every FP8 quantization on torch for comparisons)."""
    from lightning_moe.modules.fp8_grouped_kernels import FUSED_QUANT
    return kernels.load("triton_fp8_quant", t, FUSED_QUANT)


def pack(x_ND: torch.Tensor) -> torch.Tensor:
    """Each row in E4M3 (``scale = 448 / amax``, saturated), then the bytes of its fp32 scale, then zeros to
    ``row_bytes(D)``: (N, B) uint8."""
    tk = _kernels(x_ND)
    if tk is not None:  # one pass over the rows instead of torch's amax, scale, multiply, clamp and cast
        q_ND, scale_N1 = tk.rowwise_quant(x_ND.detach(), "e4m3")
    else:
        dtype, fmax = FORMATS["e4m3"]
        scale_N1 = scale_of(abs_amax(x_ND.detach(), 1), "e4m3")  # an all-zero row (padding) stays zero
        q_ND = saturate(x_ND.detach(), scale_N1, fmax, dtype)
    scale_N4 = scale_N1.reshape(-1).view(torch.uint8).view(-1, SCALE_BYTES)  # flat first: N = 0 has odd strides
    N, D = q_ND.shape
    pad_NP = torch.zeros(N, row_bytes(D) - D - SCALE_BYTES, dtype=torch.uint8, device=q_ND.device)
    return torch.cat([q_ND.view(torch.uint8), scale_N4, pad_NP], dim=1)


def unpack(packed_NB: torch.Tensor, dtype: torch.dtype, D: int) -> torch.Tensor:
    """The rows of ``pack`` (of ``D`` values each) dequantized to ``dtype``."""
    tk = _kernels(packed_NB)
    if tk is not None and D % 4 == 0:  # one pass instead of the upcast, the division and the cast
        return tk.dequant_packed(packed_NB, dtype, D)
    q_ND = packed_NB[:, :D].view(FORMATS["e4m3"][0])
    scale_N1 = packed_NB[:, D:D + SCALE_BYTES].contiguous().view(torch.float32)  # a copy: D need not be 4-aligned
    return (q_ND.float() / scale_N1).to(dtype)


class _FP8AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        packed_NB = pack(x_ND)
        if group is not None:
            recv_MB = packed_NB.new_empty((sum(out_splits), packed_NB.shape[1]))
            dist.all_to_all_single(recv_MB, packed_NB, out_splits, in_splits, group=group)
            packed_NB = recv_MB
        return unpack(packed_NB, x_ND.dtype, x_ND.shape[1])

    @staticmethod
    def backward(ctx, grad_MD):
        # straight-through: quantization is the identity for the gradient, which travels in its own precision
        return comm.all_to_all(grad_MD, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def fp8_all_to_all(x_ND: torch.Tensor, out_splits: Optional[Sequence[int]] = None,
                   in_splits: Optional[Sequence[int]] = None, group=None) -> torch.Tensor:
    """``comm.all_to_all`` with the rows in FP8 on the wire; ``group=None``: the quantize-dequantize alone."""
    if group is not None:
        out_splits, in_splits = list(out_splits), list(in_splits)
    return _FP8AllToAll.apply(x_ND, out_splits, in_splits, group)
