"""NVFP4 GEMMs with their backward, emulated (``nvfp4.py``): the dense linear ``x W^T`` and the experts' grouped GEMM.

NVIDIA's recipe, per GEMM:
  forward  y  = x W^T     x in 1 x 16 blocks along K, W in 16 x 16 blocks (so the same quantized W serves dgrad)
  dgrad    dx = dy W      dy in 1 x 16 blocks along N, rounded stochastically
  wgrad    dW = dy^T x    both along the tokens M, after the same random Hadamard transform over 16-token chunks;
                          dy rounded stochastically
Tokens are padded with zero rows to whole 16-token chunks (they add nothing to any product). Experts get one tensor
scale each, and their chunks never span two experts: each expert's tokens are laid out padded on the device (a
static upper bound, no host sync), as Megatron pads expert row counts for its low-precision kernels.

Shapes: M tokens (rows), K input features, N output features, L local experts, P padded rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from lightning_moe.modules.fp8_grouped import _segment_amax, _wgrad, expert_of_rows, on_kernel
from lightning_moe.modules.expert_padding import padded_layout
from lightning_moe.modules.nvfp4 import BLOCK, apply_along_rows, fake_quantize, random_hadamard


@dataclass
class NVFP4Spec:
    hadamard: Optional[torch.Tensor] = None  # the 16 x 16 random Hadamard transform of the wgrad inputs (None: off)
    stochastic: bool = True  # stochastic rounding of gradients


def _pad_rows(x_MK: torch.Tensor) -> torch.Tensor:
    pad = (-x_MK.shape[0]) % BLOCK
    return F.pad(x_MK, (0, 0, 0, pad)) if pad else x_MK


def _along_tokens(x_MK: torch.Tensor, spec: NVFP4Spec, stochastic: bool, ts=None) -> torch.Tensor:
    """``x`` quantized along its tokens (rows: a wgrad operand), after the Hadamard transform; returned as (K x M)."""
    if spec.hadamard is not None:
        x_MK = apply_along_rows(x_MK, spec.hadamard.to(x_MK.device))
    return fake_quantize(x_MK.float().t().contiguous(), stochastic=stochastic, ts=ts)


class _NVFP4Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_NK, spec: NVFP4Spec):
        x_MK = x.reshape(-1, x.shape[-1])
        wq = fake_quantize(w_NK.float(), square=True)
        ctx.save_for_backward(x_MK, wq)
        ctx.spec, ctx.shape, ctx.w_dtype = spec, x.shape, w_NK.dtype
        y = fake_quantize(x_MK.float()) @ wq.t()
        return y.to(x.dtype).reshape(*x.shape[:-1], w_NK.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x_MK, wq = ctx.saved_tensors
        spec = ctx.spec
        dy_MN = dy.reshape(-1, dy.shape[-1]).float()
        dx = fake_quantize(dy_MN, stochastic=spec.stochastic) @ wq
        dy_p, x_p = _pad_rows(dy_MN), _pad_rows(x_MK.float())
        dw = _along_tokens(dy_p, spec, spec.stochastic) @ _along_tokens(x_p, spec, False).t()
        return dx.to(x_MK.dtype).reshape(ctx.shape), dw.to(ctx.w_dtype), None


def nvfp4_linear(x: torch.Tensor, w_NK: torch.Tensor, spec: NVFP4Spec) -> torch.Tensor:
    return _NVFP4Linear.apply(x, w_NK, spec)


# ------------------------------------------------------------------------------------------------ experts
def _expert_weights(w_LKN: torch.Tensor) -> torch.Tensor:
    """Each expert's weight in 16 x 16 blocks with its own tensor scale (dequantized, (L, K, N))."""
    L, K, N = w_LKN.shape
    ts_L = (448.0 * 6.0) / w_LKN.detach().abs().amax((1, 2)).float().clamp_min(1e-12)
    rows = w_LKN.float().transpose(1, 2).reshape(L * N, K)
    q = fake_quantize(rows, square=True, ts=ts_L.repeat_interleave(N).unsqueeze(1))
    return q.reshape(L, N, K).transpose(1, 2)


def _expert_rows(x_MK: torch.Tensor, offs_L: torch.Tensor, gid_M: torch.Tensor, stochastic: bool) -> torch.Tensor:
    """Rows along K in 1 x 16 blocks, with one tensor scale per expert (over its rows only: tail rows hold anything)."""
    amax_L = _segment_amax(x_MK.detach().abs().amax(1), offs_L)
    ts_L = (448.0 * 6.0) / amax_L.clamp_min(1e-12)
    return fake_quantize(x_MK.float(), stochastic=stochastic, ts=ts_L[gid_M].unsqueeze(1))


def _expert_wgrad(x_MK, dy_MN, offs_L, spec: NVFP4Spec) -> torch.Tensor:
    M = x_MK.shape[0]
    dest, poffs, gid, P = padded_layout(offs_L, M, BLOCK)
    valid_M1 = (torch.arange(M, device=x_MK.device) < offs_L[-1].to(torch.int64)).unsqueeze(1)
    x_MK, dy_MN = torch.where(valid_M1, x_MK, 0), torch.where(valid_M1, dy_MN, 0)  # tail rows: undefined values
    xp = torch.zeros(P, x_MK.shape[1], device=x_MK.device, dtype=torch.float32).index_copy_(0, dest, x_MK.float())
    dyp = torch.zeros(P, dy_MN.shape[1], device=x_MK.device, dtype=torch.float32).index_copy_(0, dest, dy_MN.float())
    pgid = expert_of_rows(P, poffs, x_MK.device)

    def per_expert_ts(a_PX):
        amax_L = _segment_amax(a_PX.abs().amax(1), poffs)
        return ((448.0 * 6.0) / amax_L.clamp_min(1e-12))[pgid].unsqueeze(0)  # per token: a column of the K x P

    if spec.hadamard is not None:  # within 16-row chunks, which never span two experts
        xp, dyp = apply_along_rows(xp, spec.hadamard.to(xp.device)), apply_along_rows(dyp, spec.hadamard.to(xp.device))
    xq = _fake_columns(xp, per_expert_ts(xp), False)
    dyq = _fake_columns(dyp, per_expert_ts(dyp), spec.stochastic)
    return _wgrad(xq, dyq, poffs, pgid)


def _fake_columns(a_PX: torch.Tensor, ts_1P: torch.Tensor, stochastic: bool) -> torch.Tensor:
    """``a`` quantized along its rows (tokens) in 1 x 16 blocks, each token with its expert's tensor scale (a 16-token
    block lies within one expert); back as (P x X)."""
    return fake_quantize(a_PX.t().contiguous(), stochastic=stochastic, ts=ts_1P).t()


class _NVFP4GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_LKN, offs_L, spec: NVFP4Spec):
        from lightning_moe.modules.experts import grouped_mm
        gid = expert_of_rows(x_MK.shape[0], offs_L, x_MK.device)
        wq = _expert_weights(w_LKN)
        ctx.save_for_backward(x_MK, wq, offs_L, gid)
        ctx.spec, ctx.w_dtype = spec, w_LKN.dtype
        return grouped_mm(on_kernel(_expert_rows(x_MK, offs_L, gid, False)), on_kernel(wq), offs_L).to(x_MK.dtype)

    @staticmethod
    def backward(ctx, dy_MN):
        from lightning_moe.modules.experts import grouped_mm
        x_MK, wq, offs_L, gid = ctx.saved_tensors
        spec = ctx.spec
        dx = grouped_mm(on_kernel(_expert_rows(dy_MN, offs_L, gid, spec.stochastic)),
                        on_kernel(wq.transpose(1, 2).contiguous()), offs_L)
        dw = _expert_wgrad(x_MK, dy_MN, offs_L, spec)
        return dx.to(x_MK.dtype), dw.to(ctx.w_dtype), None, None


def nvfp4_grouped_mm(x_MK: torch.Tensor, w_LKN: torch.Tensor, offs_L: torch.Tensor, spec: NVFP4Spec) -> torch.Tensor:
    return _NVFP4GroupedMM.apply(x_MK, w_LKN, offs_L, spec)


def make_hadamard(seed: int, device=None) -> torch.Tensor:
    """The model's random Hadamard transform: random signs from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return random_hadamard(torch.randint(0, 2, (BLOCK,), generator=g) * 2 - 1).to(device)

