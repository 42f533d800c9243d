"""The experts' weight-gradient grouped GEMM, accumulating into the fp32 main grads (``wgrad_fusion.py``).

    main[l] (+)= x[rows of l]^T @ dy[rows of l]        x (M, K), dy (M, N) bf16; main (L, K, N) fp32

``torch.nn.functional.grouped_mm`` writes a new bf16 tensor that GradSync's hook reads back and adds into the main
grad: 2 + 2 + 4 + 4 bytes per weight element and micro-batch. Here the GEMM's fp32 tile is added to the main grad in
its epilogue (or written, on the first micro-batch of a step): 4 + 4 (or 4) bytes, and no bf16 rounding, as Transformer
Engine's grouped linear does with ``accumulate`` into ``main_grad``.

One program per (K tile, N tile, expert), experts slowest, so one expert's rows stay in L2 while its tiles run; each
program walks its expert's rows (a reduction of any length, zero for an empty expert). Row offsets come from ``offs``
on the device: no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_moe.modules.kernels import interpreting


@triton.jit
def _wgrad_kernel(x_ptr, dy_ptr, out_ptr, offs_ptr, K, N, stride_x, stride_dy, ACC: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_K: tl.constexpr):
    pid, e = tl.program_id(0), tl.program_id(1)
    tiles_k, tiles_n = tl.cdiv(K, BLOCK_K), tl.cdiv(N, BLOCK_N)
    # GROUP_K tiles along K share each dy column tile while it is in L2
    width = GROUP_K * tiles_n
    first_k = (pid // width) * GROUP_K
    size = tl.minimum(tiles_k - first_k, GROUP_K)
    pk = first_k + (pid % width) % size
    pn = (pid % width) // size
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
    end = tl.load(offs_ptr + e).to(tl.int64)
    rk = pk * BLOCK_K + tl.arange(0, BLOCK_K)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, BLOCK_R)
    o_ptrs = out_ptr + e.to(tl.int64) * K * N + rk[:, None].to(tl.int64) * N + rn[None, :]
    o_mask = (rk[:, None] < K) & (rn[None, :] < N)
    if ACC:
        if end == start:  # nothing to add
            return
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + rr
        live = rows < end
        a = tl.load(x_ptr + rows[:, None] * stride_x + rk[None, :], mask=live[:, None] & (rk[None, :] < K), other=0.0)
        b = tl.load(dy_ptr + rows[:, None] * stride_dy + rn[None, :], mask=live[:, None] & (rn[None, :] < N),
                    other=0.0)
        acc = tl.dot(tl.trans(a), b, acc)
    if ACC:
        acc += tl.load(o_ptrs, mask=o_mask, other=0.0)
    tl.store(o_ptrs, acc, mask=o_mask)


def _config(bk, bn, br, warps, stages, group=8):
    return triton.Config({"BLOCK_K": bk, "BLOCK_N": bn, "BLOCK_R": br, "GROUP_K": group}, num_warps=warps,
                         num_stages=stages)


# Hopper tiles: one large CTA per SM, or two smaller ones whose epilogues (the main grad's read-modify-write) overlap
# the other's GEMM; the accumulating launch is tuned on a copy of the output (restore_value), never added twice
_tuned = triton.autotune(
    configs=[_config(128, 256, 64, 8, 3), _config(128, 128, 64, 4, 4), _config(256, 128, 64, 8, 3),
             _config(128, 128, 32, 4, 5), _config(128, 256, 32, 8, 4), _config(128, 128, 64, 4, 3),
             _config(64, 256, 64, 4, 3), _config(128, 64, 64, 4, 4)],
    key=["K", "N", "ACC"], restore_value=["out_ptr"])(_wgrad_kernel)


@torch.no_grad()
def wgrad_into(main_LKN: torch.Tensor, x_MK: torch.Tensor, dy_MN: torch.Tensor, offs_L: torch.Tensor,
               first: bool) -> None:
    """``main[l] = x_l^T dy_l`` (``first``) or ``main[l] += x_l^T dy_l``, accumulated in fp32; rows past
    ``offs[-1]`` are not read."""
    L, K, N = main_LKN.shape
    if not (main_LKN.dtype == torch.float32 and main_LKN.is_contiguous()):
        raise ValueError(f"grouped wgrad: the main grad must be contiguous float32, got {main_LKN.dtype}")
    x_MK, dy_MN = x_MK.contiguous(), dy_MN.contiguous()
    offs = offs_L.to(torch.int32)
    if interpreting():  # small tiles; the interpreter's numpy dot mishandles bf16, and bf16 -> fp32 is exact
        x_MK, dy_MN = x_MK.float(), dy_MN.float()
        grid = (triton.cdiv(K, 16) * triton.cdiv(N, 16), L)
        _wgrad_kernel[grid](x_MK, dy_MN, main_LKN, offs, K, N, x_MK.stride(0), dy_MN.stride(0), ACC=not first,
                            BLOCK_K=16, BLOCK_N=16, BLOCK_R=16, GROUP_K=2)
        return
    grid = lambda meta: (triton.cdiv(K, meta["BLOCK_K"]) * triton.cdiv(N, meta["BLOCK_N"]), L)  # noqa: E731
    _tuned[grid](x_MK, dy_MN, main_LKN, offs, K, N, x_MK.stride(0), dy_MN.stride(0), ACC=not first)
