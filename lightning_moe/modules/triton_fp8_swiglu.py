"""The experts' SwiGLU fused with the rowwise FP8 quantization of what it makes (``fp8_swiglu.py`` uses them):

swiglu_quant            a = silu(gate) * up (* p), written, with rowwise_quant_col_amax(a)'s q, scales and
                        per-expert column amaxes: reads h once, where the two kernels read h, then a
swiglu_backward_quant   dh = [d_gate | d_up] (and the row weights' gradient), written, with rowwise_quant_col_amax(dh)'s
                        outputs: reads g and h once, where the two kernels read them, then dh

The values are ``triton_swiglu``'s bits (the same math, one rounding, FMA contraction as there) and the quantization
``triton_fp8_quant.rowwise_quant_col_amax``'s bits of them: the same kernel, making its rows instead of reading them.
The row weights' gradient sums the same terms in another order (within fp32 rounding of ``triton_swiglu``'s).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton

from lightning_moe.modules.fp8 import _TINY, FORMATS
from lightning_moe.modules.triton_fp8_quant import _rowwise_col_amax_kernel
from lightning_moe.modules.triton_launch import launch


def fuses(F: int) -> bool:
    """Whether the fused kernels take an FFN width of F: blocks of at least 128 columns that divide it."""
    return F > 0 and F % 128 == 0


@functools.lru_cache(maxsize=256)
def config(M: int, F: int, backward: bool) -> tuple:
    """(CHUNK, BLOCK_M, BLOCK_K, warps, stages, keep, acc_bf16, maxnreg), from a sweep on one H100 at Mixtral's,
    Qwen3's and OLMoE's shapes (``benchmarks/bench_fp8_swiglu.py``; docs/PERFORMANCE.md):

    - column blocks that divide F (the largest power of two, at most 4096): each lies in the gate or the up half;
    - rows of F (forward) or 2F (backward) values kept in registers from their amax to their quantization, up to
      32,768 values per block (wider: read back, one stage, so that no pipelined load runs ahead of the stores it
      reads); two rows per block up to 2,048 values per row, else one;
    - the column maxes in bf16 (``acc_bf16``, for bf16 rows: half the registers);
    - one warpgroup up to 3,072 values per block, else two, capped at 128 registers (``maxnreg``; two blocks per SM)
      up to 16,384;
    - chunks as ``triton_fp8_quant.fused_config``'s."""
    BLOCK_K = min(F & -F, 4096)
    row = 2 * F if backward else F
    BLOCK_M = 2 if row <= 2048 else 1
    values = BLOCK_M * row
    CHUNK = max(BLOCK_M, min(256, triton.next_power_of_2(triton.cdiv(M, 512))))
    if values > 32768:  # wider rows than measured kept: read back, as fused_config reads its wide rows twice
        return CHUNK, BLOCK_M, BLOCK_K, 16, 1, False, True, None
    warps = 4 if values <= 3072 else 8
    cap = 128 if 3072 < values <= 16384 else None
    return CHUNK, BLOCK_M, BLOCK_K, warps, 3, True, True, cap


def _launch(x, q, s, offs_L, gid_M, amax, h, g, p, gp, source: int, fmt: str, inverse: bool, cfg) -> None:
    M, K = x.shape
    F = h.shape[1] // 2
    CHUNK, BLOCK_M, BLOCK_K, warps, stages, keep, acc_bf16, maxnreg = cfg or config(M, F, source == 2)
    if F % BLOCK_K:
        raise ValueError(f"triton_fp8_swiglu: column blocks of {BLOCK_K} do not divide F = {F}")
    options = {} if maxnreg is None else {"maxnreg": maxnreg}
    launch(_rowwise_col_amax_kernel, (triton.cdiv(M, CHUNK),), x, q, s, offs_L.to(torch.int32).contiguous(),
           gid_M.to(torch.int32).contiguous(), amax.view(torch.int32), M, K, offs_L.numel(), CHUNK,
           FMAX=FORMATS[fmt][1], TINY=_TINY, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, NKB=K // BLOCK_K, STAGES=stages,
           KEEP=bool(keep), INV=inverse, SOURCE=source, h_ptr=h, g_ptr=g, p_ptr=p if p is not None else h,
           gp_ptr=gp if gp is not None else s, HAS_P=p is not None,
           ACC_BF16=bool(acc_bf16) and x.dtype == torch.bfloat16, num_warps=warps,
           enable_fp_fusion=True, **options)  # triton_swiglu's contraction; the quantization has no multiply-add


def _check(h_M2F: torch.Tensor, p_M: Optional[torch.Tensor], offs_L: torch.Tensor) -> tuple[int, int]:
    M, F = h_M2F.shape[0], h_M2F.shape[1] // 2
    if h_M2F.ndim != 2 or h_M2F.shape[1] != 2 * F or not fuses(F):
        raise ValueError(f"triton_fp8_swiglu: h of shape {tuple(h_M2F.shape)}; want (M, 2F) with F a multiple of 128")
    if p_M is not None and p_M.shape != (M,):
        raise ValueError(f"triton_fp8_swiglu: {tuple(p_M.shape)} row weights for {M} rows")
    if offs_L.numel() == 0:
        raise ValueError("triton_fp8_swiglu: no experts (offs_L is empty)")
    return M, F


def swiglu_quant(h_M2F: torch.Tensor, p_M: Optional[torch.Tensor], offs_L: torch.Tensor, gid_M: torch.Tensor,
                 fmt: str = "e4m3", inverse: bool = True, cfg: Optional[tuple] = None) -> tuple:
    """``(a_MF, q_MF, scale_M1, amax_LF)``: ``triton_swiglu.forward(h, p)`` and ``rowwise_quant_col_amax`` of it
    (``inverse``: the dequantization scales), from one read of h. ``gid_M``: each row's expert. ``cfg``: ``config``'s
    tuple, for tests."""
    M, F = _check(h_M2F, p_M, offs_L)
    h_M2F = h_M2F.contiguous()
    dev = h_M2F.device
    a = torch.empty(M, F, device=dev, dtype=h_M2F.dtype)
    q = torch.empty(M, F, device=dev, dtype=FORMATS[fmt][0])
    s = torch.empty(M, 1, device=dev, dtype=torch.float32)
    amax = torch.zeros(offs_L.numel(), F, device=dev, dtype=torch.float32)
    if M:
        _launch(a, q, s, offs_L, gid_M, amax, h_M2F, h_M2F, p_M.contiguous() if p_M is not None else None, None, 1,
                fmt, inverse, cfg)
    return a, q, s, amax


def swiglu_backward_quant(g_MF: torch.Tensor, h_M2F: torch.Tensor, p_M: Optional[torch.Tensor], offs_L: torch.Tensor,
                          gid_M: torch.Tensor, fmt: str = "e4m3", inverse: bool = True,
                          cfg: Optional[tuple] = None) -> tuple:
    """``(dh_M2F, gp_M, q_M2F, scale_M1, amax_L2F)``: ``triton_swiglu.backward(g, h, p)`` (gp None without p) and
    ``rowwise_quant_col_amax`` of dh, from one read of g and h."""
    M, F = _check(h_M2F, p_M, offs_L)
    if g_MF.shape != (M, F):
        raise ValueError(f"triton_fp8_swiglu: gradient {tuple(g_MF.shape)} for h {tuple(h_M2F.shape)}")
    h_M2F = h_M2F.contiguous()
    dev = h_M2F.device
    dh = torch.empty_like(h_M2F)
    q = torch.empty(M, 2 * F, device=dev, dtype=FORMATS[fmt][0])
    s = torch.empty(M, 1, device=dev, dtype=torch.float32)
    gp = torch.empty(M, device=dev, dtype=torch.float32) if p_M is not None else None
    amax = torch.zeros(offs_L.numel(), 2 * F, device=dev, dtype=torch.float32)
    if M:
        _launch(dh, q, s, offs_L, gid_M, amax, h_M2F, g_MF.contiguous(), p_M.contiguous() if p_M is not None else None,
                gp, 2, fmt, inverse, cfg)
    return dh, gp, q, s, amax
