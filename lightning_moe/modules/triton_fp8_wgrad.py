"""The blockwise recipe's expert weight gradient on FP8 tensor cores, with the experts' token offsets on the device.

    out[l] (+)= sum over l's 128-token blocks t of (aT[:, t] @ bT[:, t]^T) * sa[t][:, None] * sb[t][None, :]

aT (K, P) and bT (N, P) are E4M3, each column of a 128-token block quantized on its own (the recipe's 128 x 1 tiles,
``triton_fp8_blockwise.tiles(..., wgrad_fp8=True)``): K-major operands for Hopper's FP8 MMA, which reduces over the
tokens. Each block's product is promoted to fp32 with its scales, as DeepGEMM's 1D1D kernels do. The experts' token
ranges start on 128-token boundaries (``fp8_deepgemm``'s layouts), read from ``offs`` on the device: no host sync,
where DeepGEMM's k-grouped FP8 kernel takes them as a host list on SM 9.0. ``out`` is written (``first``) or added to
(a main grad over micro-batches, ``wgrad_fusion``).

Opt-in (``LMOE_DEEPGEMM_FP8_WGRAD=1``): it is right on an H100 (``tests/test_gpu_fp8_deepgemm.py``) but not yet fast.
With it, the Mixtral expert block ran at 0.67x bf16, against 1.17x with the bf16 GEMM of the dequantized operands.
The transposed FP8 stores of the tile pass and this kernel's single configuration are the first suspects.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

T = 128  # tokens per scale block


@triton.jit
def _fp8_wgrad_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, out_ptr, offs_ptr, K, N, P, ACC: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, TB: tl.constexpr, GROUP_K: tl.constexpr):
    pid, e = tl.program_id(0), tl.program_id(1)
    tiles_k, tiles_n = tl.cdiv(K, BLOCK_K), tl.cdiv(N, BLOCK_N)
    width = GROUP_K * tiles_n  # GROUP_K tiles along K share each bT tile while it is in L2
    first_k = (pid // width) * GROUP_K
    size = tl.minimum(tiles_k - first_k, GROUP_K)
    pk = first_k + (pid % width) % size
    pn = (pid % width) // size
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
    end = tl.load(offs_ptr + e).to(tl.int64)
    rk = pk * BLOCK_K + tl.arange(0, BLOCK_K)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    o_ptrs = out_ptr + e.to(tl.int64) * K * N + rk[:, None].to(tl.int64) * N + rn[None, :]
    o_mask = (rk[:, None] < K) & (rn[None, :] < N)
    if ACC:
        if end == start:  # nothing to add
            return
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for t0 in range(start, end, TB):
        tok = t0 + tl.arange(0, TB)
        a = tl.load(a_ptr + rk[:, None].to(tl.int64) * P + tok[None, :], mask=rk[:, None] < K, other=0.0)
        b = tl.load(b_ptr + rn[:, None].to(tl.int64) * P + tok[None, :], mask=rn[:, None] < N, other=0.0)
        sa = tl.load(sa_ptr + (t0 // TB) * K + rk, mask=rk < K, other=0.0)
        sb = tl.load(sb_ptr + (t0 // TB) * N + rn, mask=rn < N, other=0.0)
        acc += tl.dot(a, tl.trans(b)) * sa[:, None] * sb[None, :]
    if ACC:
        acc += tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


@torch.no_grad()
def wgrad_into(out_LKN: torch.Tensor, a: tuple, b: tuple, offs_L: torch.Tensor, first: bool) -> None:
    """``out[l] = a_l^T b_l`` (``first``) or ``+=``: ``a = (aT (K, P) E4M3, sa (P / 128, K))``, ``b`` likewise with
    N; ``offs``: the experts' cumulative token ends, multiples of 128."""
    (aT, sa), (bT, sb) = a, b
    L, K, N = out_LKN.shape
    P = aT.shape[1]
    if not out_LKN.is_contiguous() or aT.shape != (K, P) or bT.shape != (N, P) or P % T:
        raise ValueError(f"FP8 wgrad: out {tuple(out_LKN.shape)} (contiguous), aT {tuple(aT.shape)}, bT "
                         f"{tuple(bT.shape)}: want (L, K, N), (K, P), (N, P) with P a multiple of {T}")
    bk, bn = 128, 128
    grid = (triton.cdiv(K, bk) * triton.cdiv(N, bn), L)
    _fp8_wgrad_kernel[grid](aT, sa, bT, sb, out_LKN, offs_L.to(torch.int32), K, N, P, ACC=not first,
                            BLOCK_K=bk, BLOCK_N=bn, TB=T, GROUP_K=8, num_warps=8, num_stages=4)
