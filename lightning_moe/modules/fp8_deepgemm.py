"""The blockwise recipe's GEMMs on DeepGEMM's FP8 kernels (Hopper, where ``deep_gemm`` imports): the experts' on its
m-grouped kernel; the dense linears' with bf16 inputs as one expert of the same path (``linear``), with fp32 ones on
its dense kernel (``dense_mm``).

DeepGEMM's ``m_grouped_fp8_gemm_nt_contiguous`` multiplies E4M3 operands with DeepSeek-V3's scales (1 x 128 tiles of
A, 128 x 128 blocks of B), promoting the partial sums to fp32 at every 128-wide step of the reduction. On an H100 it
ran at 1.9-2.0x torch's bf16 grouped GEMM at the Qwen3 and Mixtral expert shapes (``benchmarks/probe_deepgemm.py``).

  GEMM     A (K-major)                         B (K-major)                             rows
  forward  x (P, K), 1 x 128 along K           W^T (L, N, K), 128 x 128                 P: each expert's rows start on
  dgrad    dy (P, N), 1 x 128 along N          W (L, K, N), the same blocks            a 128-row boundary (-1 rows
  wgrad    x^T dy per expert on torch's bf16 grouped GEMM, each operand quantized      between experts are skipped)
           over 128-token tiles (128 x 1) and dequantized to bf16

The wgrad GEMM keeps the recipe's quantization but multiplies on bf16 tensor cores: DeepGEMM's k-grouped FP8 kernel
takes the experts' token counts on the host (a host sync per GEMM) and ran at 0.54x bf16 at Qwen3's shape. The
forward keeps that wgrad operand (made in the same pass as its FP8 tiles) rather than its input, so
``Recompute("moe_act")`` frees nothing of fc2's saved input on this path. Under GradSync's gradient-accumulation
fusion the wgrad goes straight into the fp32 main grad, as the bf16 path's does (``wgrad_fusion``).

Where the experts' input is already laid out on 128-row expert boundaries (``ModelConfig.expert_rows_align=128``,
Megatron's ``--moe-router-padding-for-fp8``; ``FP8Spec.rows_align``), the rows are used in place: nothing is scattered
into the padded layout or gathered back out of it (``rows_aligned``). A dense linear's tokens are so whenever their
number is a multiple of 128.

The quantization is the emulation's (``fp8_grouped.py``): the same tiles, amaxes, scales and saturation, so the two
differ in how they accumulate and in the bf16 rounding of the dequantized wgrad operands, as the emulation's own CUDA
path rounds them (``fp8_grouped.on_kernel``). The tiles never straddle ranks, so no amax is reduced. The activation
tiles come from one Triton pass per operand (``triton_fp8_blockwise``), which also writes the wgrad operand; the
weights' blocks, both layouts, once per optimizer step (``FP8Spec.cached_weight``). ``LMOE_DEEPGEMM=0`` turns the path
off (the emulation runs), for comparisons.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from lightning_moe.modules import kernels, wgrad_fusion
from lightning_moe.modules.expert_padding import padded_layout
from lightning_moe.modules.fp8 import BLOCK, FORMATS, Tiling, scale_of
from lightning_moe.modules.fp8_linear import FP8Spec

ENABLED = os.environ.get("LMOE_DEEPGEMM", "1") != "0"
# opt-in: on one H100 the FP8 wgrad (TMA, each 128-token block promoted with its scales) ran at 486 TFLOP/s at the
# Mixtral fc1 shape into fp32 main grads, against 602 for the bf16 GEMM of the dequantized operands
FP8_WGRAD = os.environ.get("LMOE_DEEPGEMM_FP8_WGRAD", "0") == "1"
_IMPORTED: dict[str, Optional[ModuleType]] = {}  # a cache of the imported module, not state


def deep_gemm() -> Optional[ModuleType]:
    """DeepGEMM, if it imports and lays experts out on 128-row boundaries (its SM 9.0 contiguous layout); else None
    (``unavailable()`` says why)."""
    if "deep_gemm" not in _IMPORTED:
        try:
            dg = importlib.import_module("deep_gemm")
        except Exception as e:  # noqa: BLE001 - not installed, or built for another CUDA/torch: the emulation runs
            dg, why = None, f"import deep_gemm failed: {type(e).__name__}: {e}"
        else:
            # DeepGEMM's __init__ skips its kernels when importing them from its module fails (an old CUDA runtime)
            align = getattr(dg, "get_theoretical_mk_alignment_for_contiguous_layout", None)
            align = align() if align is not None and hasattr(dg, "m_grouped_fp8_gemm_nt_contiguous") else None
            why = (f"deep_gemm ({getattr(dg, '__file__', None) or list(getattr(dg, '__path__', []))}) has no FP8 "
                   "grouped GEMMs: built for a CUDA runtime before 12.1, or a partial build" if align is None else
                   None if align == BLOCK else f"its contiguous layout aligns experts to {align} rows, not {BLOCK}")
        _IMPORTED["deep_gemm"] = dg if why is None else None
        _IMPORTED["why"] = why
    return _IMPORTED["deep_gemm"]


def unavailable(device: torch.device) -> Optional[str]:
    """Why DeepGEMM does not run here (None: it does)."""
    if not ENABLED:
        return "LMOE_DEEPGEMM=0"
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return "not an SM 9.0 GPU"
    return None if deep_gemm() is not None else _IMPORTED["why"]


def available(device: torch.device) -> bool:
    return unavailable(device) is None


def eligible(recipe: str, K: int, N: int, device: torch.device) -> bool:
    """Whether a K x N expert GEMM runs on DeepGEMM: the blockwise recipe, 128-multiple dims, SM 9.0, DeepGEMM."""
    return recipe == "blockwise" and K % BLOCK == 0 and N % BLOCK == 0 and available(device)


def runs(spec: FP8Spec, x_MK: torch.Tensor, w_LKN: torch.Tensor) -> bool:
    return spec.formats() == ("e4m3", "e4m3") and eligible(spec.recipe, *w_LKN.shape[1:], x_MK.device)


class Rows(NamedTuple):
    """M routed rows (sorted by expert) in DeepGEMM's contiguous layout of P rows."""
    dest_M: Optional[torch.Tensor]  # each row's place; None: row m is at place m (``rows_aligned``)
    src_P: Optional[torch.Tensor]  # each place's row, -1 for padding (int32); None: as dest_M
    layout_P: torch.Tensor  # each place's expert, -1 for padding (int32): DeepGEMM skips those rows
    poffs_L: torch.Tensor  # the padded cumulative ends


def rows_of(offs_L: torch.Tensor, M: int) -> Rows:
    """On the device, no host sync. Rows past ``offs_L[-1]`` (dropped or foreign) get no place that a GEMM reads."""
    dest_M, poffs_L, gid_M, P = padded_layout(offs_L, M, BLOCK)
    rows_M = torch.arange(M, device=offs_L.device)
    valid_M = rows_M < offs_L[-1].to(torch.int64)
    src_P = torch.full((P,), -1, dtype=torch.int32, device=offs_L.device)
    src_P.index_put_((dest_M,), torch.where(valid_M, rows_M, -1).to(torch.int32))
    layout_P = torch.full((P,), -1, dtype=torch.int32, device=offs_L.device)
    layout_P.index_put_((dest_M,), torch.where(valid_M, gid_M, -1).to(torch.int32))
    return Rows(dest_M, src_P, layout_P, poffs_L)


def rows_aligned(offs_L: torch.Tensor, M: int) -> Rows:
    """Rows whose experts already start on 128-row boundaries (``ModelConfig.expert_rows_align``, Megatron's
    ``--moe-router-padding-for-fp8``): every row keeps its place, so nothing is scattered in or gathered out. P is M
    rounded up to 128 (the places past M are zeros; the output's first M rows are the result). A device-side assert
    guards the alignment (no host sync): a misaligned layout would mix two experts in a 128-row block."""
    torch._assert_async((offs_L % BLOCK == 0).all(), "FP8 experts on DeepGEMM: rows_align=128 was promised, but an "
                        "expert's rows do not start on a 128-row boundary")
    P = -(-M // BLOCK) * BLOCK
    rows_P = torch.arange(P, device=offs_L.device)
    offs = offs_L.to(torch.int64)
    gid_P = torch.bucketize(rows_P, offs, right=True)
    layout_P = torch.where(rows_P < offs[-1], gid_P, -1).to(torch.int32)
    return Rows(None, None, layout_P, offs_L)


def _places(rows: Rows, M: int) -> torch.Tensor:
    """Each place's source row, -1 for none (``tiles_reference``'s ``src_P``)."""
    if rows.src_P is not None:
        return rows.src_P
    p = torch.arange(rows.layout_P.numel(), device=rows.layout_P.device)
    return torch.where(p < M, p, -1).to(torch.int32)


def _unplace(y_PN: torch.Tensor, rows: Rows, M: int) -> torch.Tensor:
    """The M rows' results back from their places."""
    return y_PN[:M] if rows.dest_M is None else y_PN.index_select(0, rows.dest_M)


def tiles_reference(x_MK: torch.Tensor, src_P: torch.Tensor, fmt: str, wgrad: bool, wgrad_dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``x``'s rows at their places (zeros where ``src`` is -1), quantized in 1 x 128 tiles: (q (P, K), the
    dequantization scales (K / 128, P)); and, with ``wgrad``, quantized in 128 x 1 tiles (128 places of a column) and
    dequantized (times the reciprocal scale, as a GEMM applies it), in ``wgrad_dtype``."""
    dtype, fmax = FORMATS[fmt]
    P, K = src_P.numel(), x_MK.shape[1]
    rows = torch.cat([x_MK, x_MK.new_zeros(1, K)])  # -1 reads the zero row (and M = 0 has a row to read)
    x_PK = rows[torch.where(src_P >= 0, src_P.long(), x_MK.shape[0])].float()
    amax = x_PK.abs().reshape(P, K // BLOCK, BLOCK).amax(2, keepdim=True)
    scale = scale_of(amax, fmt)
    q = (x_PK.reshape(P, K // BLOCK, BLOCK) * scale).clamp(-fmax, fmax).to(dtype).reshape(P, K)
    sf = scale.reciprocal().reshape(P, K // BLOCK).t().contiguous()
    if not wgrad:
        return q, sf, None
    cols = x_PK.reshape(P // BLOCK, BLOCK, K)
    scale_c = scale_of(cols.abs().amax(1, keepdim=True), fmt)
    w = ((cols * scale_c).clamp(-fmax, fmax).to(dtype).float() * scale_c.reciprocal()).reshape(P, K).to(wgrad_dtype)
    return q, sf, w


def weight_blocks_reference(w_LKN: torch.Tensor, fmt: str, amax: Optional[torch.Tensor] = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each expert weight in 128 x 128 blocks: (q (L, K, N), q transposed (L, N, K), dequantization scales
    (L, K / 128, N / 128)). ``amax``: the blocks' amaxes as (L * K / 128, N / 128), where given."""
    dtype, fmax = FORMATS[fmt]
    L, K, N = w_LKN.shape
    blocks = w_LKN.float().contiguous().reshape(L, K // BLOCK, BLOCK, N // BLOCK, BLOCK)
    amax = blocks.abs().amax((2, 4), keepdim=True) if amax is None else \
        amax.float().reshape(L, K // BLOCK, 1, N // BLOCK, 1)
    scale = scale_of(amax, fmt)
    q = (blocks * scale).clamp(-fmax, fmax).to(dtype).reshape(L, K, N)
    return q, q.transpose(1, 2).contiguous(), scale.reciprocal().reshape(L, K // BLOCK, N // BLOCK)


def fp8_wgrad(t: torch.Tensor) -> bool:
    """Whether the wgrad runs on FP8 tensor cores (``triton_fp8_wgrad``): with ``LMOE_DEEPGEMM_FP8_WGRAD=1``, on CUDA
    with triton (not the interpreter, whose dot has no FP8). Otherwise, and by default, on the bf16 GEMM of the
    dequantized operands, which is faster: the per-block promotion costs the FP8 kernel half its speed
    (``benchmarks/bench_fp8_wgrad.py``, ``docs/PERFORMANCE.md``)."""
    return (FP8_WGRAD and t.is_cuda and not kernels.interpreting()
            and kernels.load("triton_fp8_wgrad", t) is not None)


def _tiles(x_MK, rows: Rows, fmt: str, wgrad: bool, fp8: Optional[bool] = None):
    """(q, scales, wgrad operand): the operand as bf16 dequantized values (P, K), or with ``fp8`` (default:
    ``fp8_wgrad``) as (E4M3 transposed (K, P), scales (P / 128, K))."""
    tk = kernels.load("triton_fp8_blockwise", x_MK)
    if tk is not None:  # places past the last expert's padded end stay undefined: nothing reads them
        return tk.tiles(x_MK, rows.src_P, rows.poffs_L[-1:], fmt, wgrad, rows.layout_P.numel(),
                        wgrad_fp8=wgrad and (fp8_wgrad(x_MK) if fp8 is None else fp8))
    return tiles_reference(x_MK, _places(rows, x_MK.shape[0]), fmt, wgrad,
                           torch.bfloat16 if x_MK.is_cuda else x_MK.dtype)


def _weights(w_LKN, fmt: str, amax):
    tk = kernels.load("triton_fp8_blockwise", w_LKN)
    return (tk.weight_blocks if tk is not None else weight_blocks_reference)(w_LKN, fmt, amax)


def _m_grouped(dg: ModuleType, a: tuple, b: tuple, d: torch.Tensor, layout_P: torch.Tensor) -> None:
    """DeepGEMM's m-grouped GEMM takes each 128-row block's expert from its first row: blocks of its current
    alignment must not straddle our 128-row expert boundaries (a host read of a setting, no sync)."""
    align = dg.get_mk_alignment_for_contiguous_layout()
    if BLOCK % align:
        raise RuntimeError(f"DeepGEMM's contiguous-layout alignment is {align} rows (set by "
                           f"set_mk_alignment_for_contiguous_layout); the FP8 experts lay experts out on {BLOCK} rows")
    dg.m_grouped_fp8_gemm_nt_contiguous(a, b, d, layout_P, disable_ue8m0_cast=True)


class _DeepGEMMGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_LKN, offs_L, spec: FP8Spec, dg: ModuleType, wgrad: bool, sync, dense_w):
        """``dense_w``: a dense linear's weight (N, K), of which ``w_LKN`` is the (1, K, N) view (``linear``)."""
        L, K, N = w_LKN.shape
        M = x_MK.shape[0]
        fwd, _ = spec.formats()
        aligned = spec.rows_align % BLOCK == 0 or (dense_w is not None and M % BLOCK == 0)
        rows = rows_aligned(offs_L, M) if aligned else rows_of(offs_L, M)
        xq_PK, xs_KP, xw = _tiles(x_MK, rows, fwd, wgrad)
        wq_LKN, wqt_LNK, ws_LKN = spec.cached_weight(
            "blocks", w_LKN, lambda: _weights(w_LKN, fwd, spec.weight_amax(w_LKN)))
        y_PN = xq_PK.new_empty(xq_PK.shape[0], N, dtype=torch.bfloat16)
        # B = W^T (L, N, K) with its scales as (L, N / 128, K / 128): the (L, K / 128, N / 128) grid transposed
        _m_grouped(dg, (xq_PK, xs_KP.t()), (wqt_LNK, ws_LKN.transpose(1, 2)), y_PN, rows.layout_P)
        ctx.fp8_wgrad = isinstance(xw, tuple)
        ctx.save_for_backward(*(xw if ctx.fp8_wgrad else (xw, None)), *rows)
        # the FP8 weight is the step's cached copy, not an activation: kept off the saved-tensor hooks, which would
        # offload (ActivationOffload) a copy of it while the cache keeps it on the device anyway
        ctx.weight = (wq_LKN, ws_LKN)
        ctx.spec, ctx.dg, ctx.dtypes = spec, dg, (x_MK.dtype, w_LKN.dtype)
        # the parameter that takes the main grad (wgrad_fusion); a dense one's tokens pad to this many places
        ctx.param = (dense_w if dense_w is not None else w_LKN) if sync is not None else None
        ctx.w_shape = w_LKN.shape
        ctx.sync, ctx.dense_end = sync, -(-M // BLOCK) * BLOCK if dense_w is not None else None
        return _unplace(y_PN, rows, M).to(x_MK.dtype)

    @staticmethod
    def backward(ctx, dy_MN):
        xw0, xw1, *saved = ctx.saved_tensors
        xw = (xw0, xw1) if ctx.fp8_wgrad else xw0
        rows = Rows(*saved)
        wq_LKN, ws_LKN = ctx.weight
        _, bwd = ctx.spec.formats()
        x_dtype, w_dtype = ctx.dtypes
        want_x, want_w = ctx.needs_input_grad[:2]
        if want_w and xw0 is None:
            raise RuntimeError("FP8 experts on DeepGEMM: the weight gradient is needed, but the forward ran without "
                               "grad enabled and kept no wgrad operand")
        dx = dw = None
        dyq_PN, dys_NP, dyw = _tiles(dy_MN, rows, bwd, wgrad=want_w, fp8=ctx.fp8_wgrad)
        if want_x:
            dx_PK = dyq_PN.new_empty(dyq_PN.shape[0], wq_LKN.shape[1], dtype=torch.bfloat16)
            # B = W (L, K, N): dgrad reduces over N, which W holds contiguous; the same blocks and scales
            _m_grouped(ctx.dg, (dyq_PN, dys_NP.t()), (wq_LKN, ws_LKN), dx_PK, rows.layout_P)
            dx = _unplace(dx_PK, rows, dy_MN.shape[0]).to(x_dtype)
        if want_w and ctx.sync is not None:  # into the fp32 main grad: no bf16 gradient for GradSync to add
            ctx.sync.accumulate_wgrad(ctx.param, lambda main, first: _wgrad_into_main(
                main, xw, dyw, rows.poffs_L, ctx.dense_end, first))
            dw = ctx.sync.placeholder(ctx.param, ctx.w_shape)  # never read: it fires the hook (GradSync drops it)
        elif want_w and ctx.fp8_wgrad:
            dw = torch.empty(ctx.w_shape, dtype=w_dtype, device=dy_MN.device)
            kernels.load("triton_fp8_wgrad", dy_MN).wgrad_into(dw, xw, dyw, rows.poffs_L, True)
        elif want_w:
            dw = F.grouped_mm(xw.t(), dyw, offs=rows.poffs_L.to(torch.int32)).to(w_dtype)
        ctx.weight = ctx.param = None
        return dx, dw, None, None, None, None, None, None


def _wgrad_into_main(main: torch.Tensor, xw, dyw, poffs_L: torch.Tensor, dense_end: Optional[int],
                     first: bool) -> None:
    """The wgrad written (``first``) or added into ``main``: the experts' (L, K, N) = x^T dy per expert, or a dense
    linear's (N, K) = dy^T x over its tokens and their zero padding (``dense_end`` places); from FP8 operands (a tuple,
    ``fp8_wgrad``) or bf16 dequantized ones."""
    if isinstance(xw, tuple):
        tk = kernels.load("triton_fp8_wgrad", main)
        if dense_end is not None:
            tk.wgrad_into(main.unsqueeze(0), dyw, xw, poffs_L, first)
        else:
            tk.wgrad_into(main, xw, dyw, poffs_L, first)
    elif dense_end is not None:
        wgrad_fusion.wgrad_into(main, dyw[:dense_end], xw[:dense_end], first)
    else:
        wgrad_fusion.grouped_wgrad_into(main, xw, dyw, poffs_L, first)


def grouped_mm(x_MK: torch.Tensor, w_LKN: torch.Tensor, offs_L: torch.Tensor, spec: FP8Spec,
               dg: Optional[ModuleType] = None) -> torch.Tensor:
    """``y_g = x_g W_g`` for each expert: forward and dgrad on DeepGEMM (``dg``: it, or a stand-in with its API),
    wgrad on torch's bf16 grouped GEMM with the recipe's quantization."""
    wgrad = torch.is_grad_enabled() and w_LKN.requires_grad  # no wgrad operand in validation or for frozen experts
    return _DeepGEMMGroupedMM.apply(x_MK, w_LKN, offs_L, spec, dg if dg is not None else deep_gemm(), wgrad,
                                    wgrad_fusion.sink_for(w_LKN, x_MK, grouped=True) if wgrad else None, None)


def linear_runs(spec: FP8Spec, x: torch.Tensor, w_NK: torch.Tensor) -> bool:
    """Whether a dense linear runs as one expert of the grouped path (``linear``): the blockwise recipe in E4M3, bf16
    input and weight (the kernel writes bf16), 128-multiple dims, DeepGEMM here, and no FP8 parameter all-gather
    amaxes to reuse (the dense path's ``fp8_mm`` takes those)."""
    return (not spec.emulate and spec.presets is None and x.dtype == w_NK.dtype == torch.bfloat16
            and runs(spec, x, w_NK.t().unsqueeze(0)))


def linear(x: torch.Tensor, w_NK: torch.Tensor, spec: FP8Spec, dg: Optional[ModuleType] = None) -> torch.Tensor:
    """``x W^T`` for a dense blockwise linear, as a single expert of the grouped path: the same Triton quantizers
    (activation tiles and wgrad operand in one pass) and DeepGEMM's grouped kernel, the tokens used in place when
    they are a multiple of 128, and the wgrad (cuBLAS, on the dequantized operands) into the main grad under
    GradSync's fusion."""
    x_MK = x.reshape(-1, x.shape[-1])
    wgrad = torch.is_grad_enabled() and w_NK.requires_grad
    offs_L = torch.full((1,), x_MK.shape[0], dtype=torch.int32, device=x.device)
    y_MN = _DeepGEMMGroupedMM.apply(x_MK, w_NK.t().unsqueeze(0), offs_L, spec,
                                    dg if dg is not None else deep_gemm(), wgrad,
                                    wgrad_fusion.sink_for(w_NK, x_MK, grouped=False) if wgrad else None, w_NK)
    return y_MN.reshape(*x.shape[:-1], w_NK.shape[0])


def dense_runs(a_MK: torch.Tensor, ta: Tiling, tb: Tiling, fmts: tuple[str, str], out_dtype: torch.dtype) -> bool:
    """Whether a dense blockwise GEMM runs on DeepGEMM: 1 x 128 tiles of A with 128 x 128 blocks (forward, dgrad: its
    kernel writes bf16, so only for bf16 outputs) or 1 x 128 tiles (wgrad, along the tokens: fp32) of B, E4M3."""
    shapes = (ta == Tiling(1, BLOCK) and tb == Tiling(BLOCK, BLOCK) and out_dtype == torch.bfloat16) or \
        (ta == Tiling(1, BLOCK) and tb == Tiling(1, BLOCK))
    return fmts == ("e4m3", "e4m3") and shapes and available(a_MK.device)


def dense_mm(qa_MK: torch.Tensor, sa: torch.Tensor, qb_NK: torch.Tensor, sb: torch.Tensor, tb: Tiling,
             out_dtype: torch.dtype, dg: Optional[ModuleType] = None) -> torch.Tensor:
    """``a @ b^T`` of E4M3 operands (row-major, K-major) and their quantization scales per block
    (``fp8.quantize``'s), on DeepGEMM's dense kernel: 1 x 128 by 128 x 128 (it writes bf16), or 1 x 128 by 1 x 128
    (its "1D1D" kernel, which accumulates into fp32)."""
    dg = dg if dg is not None else deep_gemm()
    a, b = (qa_MK, sa.float().reciprocal()), (qb_NK, sb.float().reciprocal())
    shape = (qa_MK.shape[0], qb_NK.shape[0])
    if tb == Tiling(1, BLOCK):
        d = torch.zeros(shape, device=qa_MK.device, dtype=torch.float32)
        dg.fp8_gemm_nt(a, b, d, c=d, recipe=(1, 1, BLOCK), disable_ue8m0_cast=True)
    else:
        d = torch.empty(shape, device=qa_MK.device, dtype=torch.bfloat16)
        dg.fp8_gemm_nt(a, b, d, disable_ue8m0_cast=True)
    return d.to(out_dtype)
