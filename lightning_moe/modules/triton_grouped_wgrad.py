"""The experts' weight-gradient grouped GEMM, accumulating into the fp32 main grads (``wgrad_fusion.py``).

    main[l] (+)= x[rows of l]^T @ dy[rows of l]        x (M, K), dy (M, N) bf16; main (L, K, N) fp32 (or bf16)

``torch.nn.functional.grouped_mm`` writes a new bf16 tensor that GradSync's hook reads back and adds into the main
grad: 2 + 2 + 4 + 4 bytes per weight element and micro-batch. Here the GEMM's fp32 tile is added to the main grad in
its epilogue (or written, on the first micro-batch of a step): 4 + 4 (or 4) bytes, and no bf16 rounding, as Transformer
Engine's grouped linear does with ``accumulate`` into ``main_grad``. bf16 main grads (bf16 main params) get the fp32
tile rounded once per store, as cuBLAS's bf16-output epilogue does for the dense linears.

One program per (K tile, N tile, expert), experts slowest, so one expert's rows stay in L2 while its tiles run; each
program walks its expert's rows (a reduction of any length, zero for an empty expert). Row offsets come from ``offs``
on the device: no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_moe.modules.kernels import interpreting
from lightning_moe.modules.triton_launch import launch


@triton.jit
def grouped_tile(pid, K, N, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_K: tl.constexpr):
    """An expert's (K, N) output tile of program ``pid``: GROUP_K tiles along K in a row share each N tile while it
    is in L2. Returns the tile's K and N indices."""
    tiles_k, tiles_n = tl.cdiv(K, BLOCK_K), tl.cdiv(N, BLOCK_N)
    width = GROUP_K * tiles_n
    first_k = (pid // width) * GROUP_K
    size = tl.minimum(tiles_k - first_k, GROUP_K)
    return first_k + (pid % width) % size, (pid % width) // size


@triton.jit
def _wgrad_kernel(x_ptr, dy_ptr, out_ptr, offs_ptr, K, N, stride_x, stride_dy, ACC: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_K: tl.constexpr):
    e = tl.program_id(1)
    pk, pn = grouped_tile(tl.program_id(0), K, N, BLOCK_K, BLOCK_N, GROUP_K)
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
        acc += tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _wgrad_segments_kernel(x_ptr, dy_ptr, out_ptr, offs_ptr, xoff_ptr, dyoff_ptr, S, L, K, N, ACC: tl.constexpr,
                           BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                           GROUP_K: tl.constexpr):
    """``_wgrad_kernel`` over S segments (micro-batches held by a deferred wgrad), each in tensors of its own: segment
    s's rows start ``xoff[s]`` (``dyoff[s]``) elements from ``x_ptr`` (``dy_ptr``), contiguous, with its experts' ends
    at ``offs[s, :]``. One fp32 accumulator runs over every segment's rows: the main grad is read and written once."""
    e = tl.program_id(1)
    pk, pn = grouped_tile(tl.program_id(0), K, N, BLOCK_K, BLOCK_N, GROUP_K)
    rk = pk * BLOCK_K + tl.arange(0, BLOCK_K)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for s in range(S):
        start = tl.load(offs_ptr + s * L + e - 1, mask=e > 0, other=0).to(tl.int64)
        end = tl.load(offs_ptr + s * L + e).to(tl.int64)
        # the caching allocator's blocks start on 512 bytes: every offset is a multiple of 16 elements (vector loads)
        xs = x_ptr + tl.multiple_of(tl.load(xoff_ptr + s), 16)
        dys = dy_ptr + tl.multiple_of(tl.load(dyoff_ptr + s), 16)
        for r0 in range(start, end, BLOCK_R):
            rows = r0 + rr
            live = rows < end
            a = tl.load(xs + rows[:, None] * K + rk[None, :], mask=live[:, None] & (rk[None, :] < K), other=0.0)
            b = tl.load(dys + rows[:, None] * N + rn[None, :], mask=live[:, None] & (rn[None, :] < N), other=0.0)
            acc = tl.dot(tl.trans(a), b, acc)
    o_ptrs = out_ptr + e.to(tl.int64) * K * N + rk[:, None].to(tl.int64) * N + rn[None, :]
    o_mask = (rk[:, None] < K) & (rn[None, :] < N)
    if ACC:
        acc += tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


def _config(bk, bn, br, warps, stages, group=8):
    return triton.Config({"BLOCK_K": bk, "BLOCK_N": bn, "BLOCK_R": br, "GROUP_K": group}, num_warps=warps,
                         num_stages=stages)


# Hopper tiles: one large CTA per SM, or two smaller ones whose epilogues (the main grad's read-modify-write) overlap
# the other's GEMM. Every config reduces the rows in the same chunks of 64, so that the tuner's choice leaves the order
# of the sum alone (a run-to-run timing difference must not change the numbers). Only the writing launch is tuned:
# each trial writes the same result, so tuning needs no copy of the main grad (an accumulating trial would have to
# restore it). The accumulating launch takes the writing launch's config for the shape (the first micro-batch of a
# step, which writes, comes first).
DEFAULT = _config(128, 256, 64, 8, 3)
CONFIGS = [DEFAULT, _config(128, 128, 64, 4, 4), _config(256, 128, 64, 8, 3), _config(128, 128, 64, 4, 3),
           _config(64, 256, 64, 4, 3), _config(128, 64, 64, 4, 4)]
_write = triton.autotune(configs=CONFIGS, key=["K", "N"])(_wgrad_kernel)
_write_segments = triton.autotune(configs=CONFIGS, key=["K", "N"])(_wgrad_segments_kernel)


def _tuned_config(K: int, N: int, dtypes: tuple, tuner=_write) -> triton.Config:
    """The writing launch's choice for this shape (the autotuner's cache key: K, N, then the tensors' dtypes), or
    the default where it has not run."""
    found = [(tuple(key[2:]) == dtypes, config) for key, config in getattr(tuner, "cache", {}).items()
             if tuple(key[:2]) == (K, N)]
    return max(found, key=lambda f: f[0])[1] if found else DEFAULT


@torch.no_grad()
def wgrad_into(main_LKN: torch.Tensor, x_MK: torch.Tensor, dy_MN: torch.Tensor, offs_L: torch.Tensor,
               first: bool) -> None:
    """``main[l] = x_l^T dy_l`` (``first``) or ``main[l] += x_l^T dy_l``, accumulated in fp32 and stored in main's
    dtype (fp32 main grads, or bf16 ones under bf16 main params); rows past ``offs[-1]`` are not read."""
    L, K, N = main_LKN.shape
    if not main_LKN.is_contiguous():
        raise ValueError("grouped wgrad: the main grad must be contiguous")
    x_MK, dy_MN = x_MK.contiguous(), dy_MN.contiguous()
    offs = offs_L.to(torch.int32)
    if interpreting():  # small tiles; the interpreter's numpy dot mishandles bf16, and bf16 -> fp32 is exact
        x_MK, dy_MN = x_MK.float(), dy_MN.float()
        grid = (triton.cdiv(K, 16) * triton.cdiv(N, 16), L)
        launch(_wgrad_kernel, grid, x_MK, dy_MN, main_LKN, offs, K, N, x_MK.stride(0), dy_MN.stride(0), ACC=not first,
               BLOCK_K=16, BLOCK_N=16, BLOCK_R=16, GROUP_K=2)
        return
    args = (x_MK, dy_MN, main_LKN, offs, K, N, x_MK.stride(0), dy_MN.stride(0))
    if first:
        grid = lambda meta: (triton.cdiv(K, meta["BLOCK_K"]) * triton.cdiv(N, meta["BLOCK_N"]), L)  # noqa: E731
        _write[grid](*args, ACC=False)
        return
    c = _tuned_config(K, N, tuple(str(t.dtype) for t in (x_MK, dy_MN, main_LKN, offs)))
    grid = (triton.cdiv(K, c.kwargs["BLOCK_K"]) * triton.cdiv(N, c.kwargs["BLOCK_N"]), L)
    launch(_wgrad_kernel, grid, *args, ACC=True, num_warps=c.num_warps, num_stages=c.num_stages, **c.kwargs)


@torch.no_grad()
def wgrad_segments_into(main_LKN: torch.Tensor, segments: list, first: bool) -> None:
    """``main[l] (=|+=) sum over segments of x_l^T dy_l``: ``wgrad_into`` over several micro-batches' (x (M_s, K),
    dy (M_s, N), offs (L,)) in one pass over the main grad, their rows summed in one fp32 accumulator (segment by
    segment, in order), without concatenating them."""
    L, K, N = main_LKN.shape
    if not main_LKN.is_contiguous():
        raise ValueError("grouped wgrad: the main grad must be contiguous")
    interp = interpreting()  # the interpreter's numpy dot mishandles bf16, and bf16 -> fp32 is exact
    xs = [(x.float() if interp else x).contiguous() for x, _, _ in segments]
    dys = [(dy.float() if interp else dy).contiguous() for _, dy, _ in segments]
    if len({t.dtype for t in xs + dys}) != 1:
        raise ValueError("grouped wgrad: every segment's operands must share one dtype")
    # the kernel's hint: every segment on a multiple of 16 elements, as the caching allocator's blocks start (a view
    # at another offset gets a copy of its own)
    size = xs[0].element_size()
    for ts in (xs, dys):
        for i, t in enumerate(ts):
            if t.data_ptr() % (16 * size):
                ts[i] = t.clone()
    offs_SL = torch.stack([o.to(torch.int32) for _, _, o in segments])
    # each segment's tensors as element offsets from the first segment's (int64: another allocation may lie below),
    # copied from pinned memory without a host sync
    S = len(segments)
    off_2S = torch.tensor([(t.data_ptr() - xs[0].data_ptr()) // size for t in xs]
                          + [(t.data_ptr() - dys[0].data_ptr()) // size for t in dys], dtype=torch.int64,
                          pin_memory=main_LKN.is_cuda).to(main_LKN.device, non_blocking=True)
    args = (xs[0], dys[0], main_LKN, offs_SL, off_2S[:S], off_2S[S:], S, L, K, N)
    if interp:
        grid = (triton.cdiv(K, 16) * triton.cdiv(N, 16), L)
        launch(_wgrad_segments_kernel, grid, *args, ACC=not first, BLOCK_K=16, BLOCK_N=16, BLOCK_R=16, GROUP_K=2)
        return
    if first:
        grid = lambda meta: (triton.cdiv(K, meta["BLOCK_K"]) * triton.cdiv(N, meta["BLOCK_N"]), L)  # noqa: E731
        _write_segments[grid](*args, ACC=False)
        return
    c = _tuned_config(K, N, tuple(str(t.dtype) for t in args[:6]), _write_segments)
    grid = (triton.cdiv(K, c.kwargs["BLOCK_K"]) * triton.cdiv(N, c.kwargs["BLOCK_N"]), L)
    launch(_wgrad_segments_kernel, grid, *args, ACC=True, num_warps=c.num_warps, num_stages=c.num_stages, **c.kwargs)
