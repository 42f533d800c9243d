"""fc1's FP8 forward GEMM with the SwiGLU and its per-expert FP8 quantization in the epilogue (the delayed recipe's
experts at fine-grained shapes):

    h[m]  = sa[m] * sb[e][None, :] * (x[m] @ w13[e]^T)                     (M, 2F) bf16, kept for backward
    a[m]  = silu(h[m, :F]) * h[m, F:] (* p[m])                              never written
    q, qT = a quantized by expert e's delayed scale, row-major and in the wgrad's padded transposed layout

with ``gluon_fp8_grouped_ws``'s main loop (warp-specialized, persistent, two consumers of 128 x 128 tiles taking turns),
and ``triton_fp8_both.swiglu_both``'s outputs and bits for a. Each tile covers 64 columns of the gate and the same 64
of up (the loader fills the B stage's two halves from the two places of w13), so the SwiGLU of a tile is its own
columns. The h tile goes out through shared memory by TMA (masked stores for an expert's cut last tile), and the
SwiGLU reads it back from there in 32-row chunks: the same bf16 h that ``swiglu_both`` reads from memory.

Why: at Qwen3's shape the separate ``swiglu_both`` pass reads h (0.4 GB) and writes a's two copies, 0.22-0.25 ms of
a 5 ms FP8 block; here the copies leave from the GEMM's epilogue, which one consumer runs while the other's MMAs do.
Measured (``benchmarks/bench_gemm_swiglu.py``, ms): on an H100 the GEMM alone 0.668, with the pass 0.926, fused 0.866
(balanced; uneven 1.039 against 1.002); on an H200 0.647, 0.867 and 0.849 (uneven 0.934 against 0.944). The epilogue
is not hidden under the other consumer's main loop (K = 2,048): its q and transposed qT tiles, its atomic and its
h stores each add a little (a pass at the H200's faster memory costs less). ``LMOE_FP8_FC1_SWIGLU=0`` turns it off.

Shapes: M routed rows (sorted by expert), K = hidden, F the FFN width, L local experts, P padded positions.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
import triton.language as tl

from lightning_moe.modules.fp8 import FORMATS, _TINY
from lightning_moe.modules.gluon_fp8_grouped_ws import (BLOCK_K, NARROW_CONFIG, NARROW_ROWS, _experts, _order,
                                                       _place, narrow)
from lightning_moe.modules.gluon_fp8_wgrad import (MAXNREG, WORKER_REGS, _mainloop, _split_n, barriers, shared_layout,
                                                   sm_count)
from lightning_moe.modules.triton_fp8_grouped_mm import check_operands
from lightning_moe.modules.triton_launch import launch

HALF = 64  # columns of the gate (and of up) per tile: 128 x 128 accumulators
CHUNK = 32  # rows of the SwiGLU per step of the epilogue (16 values a thread per operand)
_BK = gl.constexpr(BLOCK_K)
_HALF = gl.constexpr(HALF)
_CHUNK = gl.constexpr(CHUNK)
_BM = gl.constexpr(128)


def fits(M: int, K: int, F: int, L: int) -> bool:
    """Whether this kernel takes fc1 at this shape: fine-grained experts (``gluon_fp8_grouped_ws.narrow``, where its
    two-consumer config is the default), whole 64-column halves, TMA-aligned rows."""
    return narrow(M, L) and F % HALF == 0 and K % 16 == 0 and F > 0


@gluon.jit
def _max_nan(a, b):
    return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)  # torch's amax keeps NaNs


@gluon.jit
def _load(a_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, F, K, L, TILES, BLOCK_L: gl.constexpr,
          GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """One warp: each live tile's K blocks into the stages, B's two halves from the gate's and up's rows of w13."""
    nk = gl.cdiv(K, _BK)
    it = 0
    ends, cum, live_tiles = _experts(offs_ptr, L, _BM, BLOCK_L, 1)
    for i in range(gl.program_id(0), TILES * gl.cdiv(F, _HALF), gl.num_programs(0)):
        t, pn = _order(i, F, TILES, _HALF, GROUP_M)
        if t < live_tiles:
            e, row0, end = _place(t, ends, cum, _BM, BLOCK_L, 1, 0)
            for kb in range(nk):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
                mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [row0, kb * _BK], ready.index(s), a_bufs.index(s))
                b = b_bufs.index(s)
                tma.async_copy_global_to_shared(b_desc, [e * 2 * F + pn * _HALF, kb * _BK], ready.index(s),
                                                b.slice(0, _HALF))
                tma.async_copy_global_to_shared(b_desc, [e * 2 * F + F + pn * _HALF, kb * _BK], ready.index(s),
                                                b.slice(_HALF, _HALF))
                it += 1


@gluon.jit
def _swiglu_out(g_buf, u_buf, q_buf, qt_buf, q_desc, qt_desc, whole, e, t, row0, end, pn, F, L, H, h_ptr, p_ptr,
                hist_ptr, q_ptr, amax_ptr, inv_m_ptr, inv_l_ptr, FMAX: gl.constexpr, TINY: gl.constexpr,
                HAS_P: gl.constexpr, BLOCK_H: gl.constexpr, WARPS: gl.constexpr):
    """The tile's a from its gate and up halves in shared memory (bf16 h), quantized by expert e's delayed scale
    (``triton_fp8_both._both_kernel``'s formulas and bits), in CHUNK-row steps, into this consumer's q and qT tiles
    in shared memory, then out by TMA (the qT tile is 128 positions of the expert's padded rows: zeros past its
    rows; a cut tile's q rows go by masked stores instead, as its h rows: the rows past its end are the next
    expert's); the dequantization scales (first column tile), the amax (one atomic). Every global load is issued at
    the start (a load's latency, about a microsecond, is a fifth of the tile's main loop). Measured on an H200:
    pointer stores of q and qT, and a scalar atomic (a barrier and a broadcast of its result), cost as much as the
    separate pass."""
    ly: gl.constexpr = gl.BlockedLayout([4, 4], [8, 4], [1, WARPS], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, ly)
    lh: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    hs = gl.arange(0, BLOCK_H, layout=lh)
    used = gl.reduce(gl.load(hist_ptr + hs * L + e, mask=hs < H, other=0.0), 0, _max_nan)  # the history's max
    ps = ()
    if HAS_P:
        for k in gl.static_range(128 // _CHUNK):
            r = row0 + k * _CHUNK + gl.arange(0, _CHUNK, layout=rows_l)
            ps = ps + (gl.load(p_ptr + r, mask=r < end, other=0.0).to(gl.float32), )
    one = gl.full([_CHUNK], 1.0, gl.float32, rows_l)
    s = gl.div_rn(one, _max_nan(gl.zeros([_CHUNK], gl.float32, rows_l) + used, TINY)) * FMAX  # fp8.scale_of's bits
    inv = gl.div_rn(one, s)
    cols = pn * _HALF + gl.arange(0, _HALF, layout=gl.SliceLayout(0, ly))
    c64 = gl.expand_dims(cols.to(gl.int64), 0)
    amax = gl.zeros([_CHUNK], gl.float32, rows_l)
    for k in gl.static_range(128 // _CHUNK):
        r = row0 + k * _CHUNK + gl.arange(0, _CHUNK, layout=rows_l)
        ok = r < end
        ok2 = gl.expand_dims(ok, 1)
        r64 = gl.expand_dims(r.to(gl.int64), 1)
        gate_h = g_buf.slice(k * _CHUNK, _CHUNK).load(ly)
        up_h = u_buf.slice(k * _CHUNK, _CHUNK).load(ly)
        if not whole:
            gl.store(h_ptr + r64 * 2 * F + c64, gate_h, mask=ok2)
            gl.store(h_ptr + r64 * 2 * F + F + c64, up_h, mask=ok2)
        gate = gate_h.to(gl.float32)
        up = up_h.to(gl.float32)
        a = gate * (1 / (1 + gl.exp(-gate))) * up  # triton_swiglu.swiglu_math (tl.sigmoid's formula)
        if HAS_P:
            a = a * gl.expand_dims(ps[k], 1)
        v = gl.where(ok2, a.to(gl.bfloat16).to(gl.float32), 0.0)  # rounded as h's dtype stores it
        c = v * gl.expand_dims(s, 1)
        q = c.to(q_ptr.dtype.element_ty)  # saturating: torch's clamp to +-FMAX (triton_fp8_quant._sat)
        if whole:
            q_buf.slice(k * _CHUNK, _CHUNK).store(q)
        else:
            gl.store(q_ptr + r64 * F + c64, q, mask=ok2)
        qt_buf.slice(k * _CHUNK, _CHUNK, dim=1).permute((1, 0)).store(q)
        if pn == 0:
            gl.store(inv_m_ptr + r, inv, mask=ok)
            if k == 0:
                gl.store(inv_l_ptr + e + gl.zeros([_CHUNK], gl.int32, rows_l), inv,
                         mask=gl.arange(0, _CHUNK, layout=rows_l) == 0)
        amax = _max_nan(amax, gl.reduce(gl.abs(v), 1, _max_nan))
    fence_async_shared()
    tma.async_copy_shared_to_global(qt_desc, [pn * _HALF, t * 128], qt_buf)
    if whole:
        tma.async_copy_shared_to_global(q_desc, [row0, pn * _HALF], q_buf)
    m = gl.zeros([_CHUNK], gl.float32, rows_l) + gl.reduce(amax, 0, _max_nan)
    first = gl.arange(0, _CHUNK, layout=rows_l) == 0  # one lane's atomic: a scalar one waits for its result
    gl.atomic_max(amax_ptr + e + gl.zeros([_CHUNK], gl.int32, rows_l),
                  gl.where(m != m, 0x7FFFFFFF, m.to(gl.int32, bitcast=True)), mask=first, sem="relaxed")


@gluon.jit
def _consume(a_bufs, b_bufs, ready, empty, order, c_smem, c_desc, q_smem, qt_smem, q_desc, qt_desc, sa_ptr, sb_ptr,
             h_ptr, offs_ptr, p_ptr, hist_ptr, q_ptr, amax_ptr, inv_m_ptr, inv_l_ptr, F, K, L, TILES, H,
             FMAX: gl.constexpr, TINY: gl.constexpr, HAS_P: gl.constexpr, BLOCK_L: gl.constexpr,
             BLOCK_H: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, C: gl.constexpr,
             WARPS: gl.constexpr):
    """Consumer C of two (``gluon_fp8_grouped_ws._consume``'s turns): the tile's MMAs, then h out by TMA (masked
    stores for a cut tile) through this consumer's two buffers (gate, up), then a from them."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 128, 32])
    nk = gl.cdiv(K, _BK)
    it = 0
    j = 0
    n = 0
    g_buf, u_buf = c_smem.index(2 * C), c_smem.index(2 * C + 1)
    ends, cum, live_tiles = _experts(offs_ptr, L, _BM, BLOCK_L, WARPS)
    for i in range(gl.program_id(0), TILES * gl.cdiv(F, _HALF), gl.num_programs(0)):
        t, pn = _order(i, F, TILES, _HALF, GROUP_M)
        if t < live_tiles:
            if j % 2 == C:
                e, row0, end = _place(t, ends, cum, _BM, BLOCK_L, WARPS, 0)
                rm = row0 + gl.arange(0, 128, layout=gl.SliceLayout(1, mma))
                jn = gl.arange(0, 128, layout=gl.SliceLayout(0, mma))
                rn = gl.where(jn < _HALF, pn * _HALF + jn, F + pn * _HALF + jn - _HALF)  # gate's columns, then up's
                rows = rm < end
                # the scales before the main loop: their loads' latency under the MMAs
                sa = gl.load(sa_ptr + rm, mask=rows, other=0.0)
                sb = gl.load(sb_ptr + e.to(gl.int64) * 2 * F + rn)
                acc = _mainloop(a_bufs, b_bufs, ready, empty, order, it, nk, n, 128, 128, STAGES, 2, C, mma)
                n += 1
                res = (acc * gl.expand_dims(sa, 1) * gl.expand_dims(sb, 0)).to(gl.bfloat16)
                gate, up = _split_n(res, 2)
                tma.store_wait(0)  # the last tile's stores are done with both buffers
                g_buf.store(gate)
                u_buf.store(up)
                fence_async_shared()
                whole = row0 + 128 <= end
                if whole:  # a whole tile of the expert's rows (a cut one is stored by _swiglu_out: the rows past
                    # its end belong to the next expert)
                    tma.async_copy_shared_to_global(c_desc, [row0, pn * _HALF], g_buf)
                    tma.async_copy_shared_to_global(c_desc, [row0, F + pn * _HALF], u_buf)
                # row tile t's 128 padded positions start at 128 t: an expert's padded rows are its row tiles (the
                # wgrad's alignment is the tile's height)
                _swiglu_out(g_buf, u_buf, q_smem.index(C), qt_smem.index(C), q_desc, qt_desc, whole, e, t, row0, end,
                            pn, F, L, H, h_ptr, p_ptr, hist_ptr, q_ptr, amax_ptr, inv_m_ptr, inv_l_ptr, FMAX, TINY,
                            HAS_P, BLOCK_H, WARPS)
            it += nk
            j += 1
    tma.store_wait(0)


@gluon.jit
def _worker(a_desc, b_desc, a_bufs, b_bufs, ready, empty, order, c_smem, c_desc, q_smem, qt_smem, q_desc, qt_desc,
            sa_ptr, sb_ptr, h_ptr, offs_ptr, p_ptr, hist_ptr, q_ptr, amax_ptr, inv_m_ptr, inv_l_ptr, F, K, L, TILES, H,
            FMAX: gl.constexpr, TINY: gl.constexpr, HAS_P: gl.constexpr, BLOCK_L: gl.constexpr,
            BLOCK_H: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr,
            ROLE: gl.constexpr):
    """The worker partitions (one signature for all): the loader (ROLE 0) or the second consumer (ROLE 1)."""
    if ROLE == 0:
        _load(a_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, F, K, L, TILES, BLOCK_L, GROUP_M, STAGES)
    else:
        _consume(a_bufs, b_bufs, ready, empty, order, c_smem, c_desc, q_smem, qt_smem, q_desc, qt_desc, sa_ptr,
                 sb_ptr, h_ptr, offs_ptr, p_ptr, hist_ptr, q_ptr, amax_ptr, inv_m_ptr, inv_l_ptr, F, K, L, TILES, H,
                 FMAX, TINY, HAS_P, BLOCK_L, BLOCK_H, GROUP_M, STAGES, 1, WARPS)


@gluon.jit
def _kernel(a_desc, sa_ptr, b_desc, sb_ptr, c_desc, q_desc, qt_desc, h_ptr, offs_ptr, p_ptr, hist_ptr, q_ptr,
            amax_ptr, inv_m_ptr, inv_l_ptr, F, K, L, TILES, H, FMAX: gl.constexpr, TINY: gl.constexpr,
            HAS_P: gl.constexpr, BLOCK_L: gl.constexpr, BLOCK_H: gl.constexpr, GROUP_M: gl.constexpr,
            STAGES: gl.constexpr, WORKER_REGS: gl.constexpr, num_warps: gl.constexpr):
    # the B stages hold both halves (128 rows); the NVMMA layout of 128-byte rows does not depend on the row count
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, 2 * _HALF, _BK], b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [4] + c_desc.block_type.shape, c_desc.layout)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    qt_smem = gl.allocate_shared_memory(qt_desc.dtype, [2] + qt_desc.block_type.shape, qt_desc.layout)
    ready, empty, order = barriers(STAGES)
    gl.warp_specialize([
        (_consume, (a_bufs, b_bufs, ready, empty, order, c_smem, c_desc, q_smem, qt_smem, q_desc, qt_desc, sa_ptr,
                    sb_ptr, h_ptr, offs_ptr, p_ptr, hist_ptr, q_ptr, amax_ptr, inv_m_ptr, inv_l_ptr, F, K, L, TILES,
                    H, FMAX, TINY, HAS_P, BLOCK_L, BLOCK_H, GROUP_M, STAGES, 0, num_warps)),
        (_worker, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, order, c_smem, c_desc, q_smem, qt_smem, q_desc,
                   qt_desc, sa_ptr, sb_ptr, h_ptr, offs_ptr, p_ptr, hist_ptr, q_ptr, amax_ptr, inv_m_ptr, inv_l_ptr,
                   F, K, L, TILES, H, FMAX, TINY, HAS_P, BLOCK_L, BLOCK_H, GROUP_M, STAGES, num_warps, 1)),
        (_worker, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, order, c_smem, c_desc, q_smem, qt_smem, q_desc,
                   qt_desc, sa_ptr, sb_ptr, h_ptr, offs_ptr, p_ptr, hist_ptr, q_ptr, amax_ptr, inv_m_ptr, inv_l_ptr,
                   F, K, L, TILES, H, FMAX, TINY, HAS_P, BLOCK_L, BLOCK_H, GROUP_M, STAGES, num_warps, 0)),
    ], [num_warps, 1], [WORKER_REGS, 32])


@torch.no_grad()
def fc1_swiglu(x_MK: torch.Tensor, w_LNK: torch.Tensor, sx_M: torch.Tensor, sw_LN: torch.Tensor,
               offs_L: torch.Tensor, p_M, amax_HL: torch.Tensor, P: int, fmt: str = "e4m3", programs=None) -> tuple:
    """``(h_M2F, q_MF, qT_FP, inv_M, inv_L, amax_L)``: ``gluon_fp8_grouped_ws.grouped_mm(x, w, sx, sw, offs)`` (bf16;
    w (L, 2F, K) holds [gate | up]) and ``triton_fp8_both.swiglu_both(h, p, amax_HL, offs, poffs, gid, P, fmt)``'s
    outputs, from one kernel (see the module's docstring), in the wgrad's 128-row padded layout
    (``expert_padding.fp8_rows_layout(offs, M, 128)``, whose length ``P`` is)."""
    M, K, N, L = check_operands(x_MK, w_LNK, sx_M, sw_LN, offs_L)
    F = N // 2
    if N % 2 or not fits(M, K, F, L):
        raise ValueError(f"gluon_fp8_fc1_swiglu: M={M}, K={K}, 2F={N}, L={L}: want F a multiple of {HALF}, K of 16, "
                         f"at most {NARROW_ROWS} rows per expert on average")
    dev = x_MK.device
    dtype, fmax = FORMATS[fmt]
    h = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    q = torch.empty(M, F, device=dev, dtype=dtype)
    qt = torch.empty(F, P, device=dev, dtype=dtype)
    amax_bits = torch.zeros(L, device=dev, dtype=torch.int32)
    inv_M = torch.empty(M, device=dev, dtype=torch.float32)
    inv_L = torch.ones(L, device=dev, dtype=torch.float32)  # an empty expert's: no tile writes it
    if M == 0 or L == 0:
        return h, q, qt, inv_M, inv_L, amax_bits.view(torch.float32)
    amax_HL = amax_HL.float().reshape(-1, L).contiguous()
    stages = NARROW_CONFIG[3]
    f8 = gl.float8e4nv
    da = TensorDescriptor.from_tensor(x_MK.contiguous(), [128, BLOCK_K], shared_layout((128, BLOCK_K), f8))
    db = TensorDescriptor.from_tensor(w_LNK.contiguous().view(L * N, K), [HALF, BLOCK_K],
                                      shared_layout((HALF, BLOCK_K), f8))
    dc = TensorDescriptor.from_tensor(h, [128, HALF], shared_layout((128, HALF), gl.bfloat16))
    dq = TensorDescriptor.from_tensor(q, [128, HALF], shared_layout((128, HALF), f8))
    dqt = TensorDescriptor.from_tensor(qt, [HALF, 128], shared_layout((HALF, 128), f8))
    tiles = triton.cdiv(M, 128) + L  # a static bound of the experts' row tiles
    if programs is None:
        programs = sm_count(torch.cuda._get_device_index(dev, optional=True))
    p = p_M.reshape(-1).contiguous() if p_M is not None else sx_M
    launch(_kernel, (min(programs, tiles * (F // HALF)),), da, sx_M.float().contiguous(), db,
           sw_LN.float().contiguous(), dc, dq, dqt, h, offs_L.to(torch.int32).contiguous(), p, amax_HL, q, amax_bits,
           inv_M, inv_L, F, K, L, tiles, amax_HL.shape[0], FMAX=fmax, TINY=_TINY, HAS_P=p_M is not None,
           BLOCK_L=max(32, triton.next_power_of_2(L)), BLOCK_H=max(32, triton.next_power_of_2(amax_HL.shape[0])),
           GROUP_M=8, STAGES=stages, WORKER_REGS=WORKER_REGS, num_warps=4, maxnreg=MAXNREG)
    return h, q, qt, inv_M, inv_L, amax_bits.view(torch.float32)
