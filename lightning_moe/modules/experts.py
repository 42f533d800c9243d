"""Experts: grouped-GEMM SwiGLU over all local experts in two kernel calls, plus the dense SwiGLU MLP.

Shapes: M = rows routed to this rank's experts (sorted by local expert), D = hidden, F = this rank's share of the
expert FFN size (F_full / ETP), L = local experts.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_moe.modules import kernels, wgrad_fusion
from lightning_moe.modules.init import full_normal, shard
from lightning_moe.modules.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from lightning_moe.strategy.parallel_context import ParallelContext

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _aligned(x_MK: torch.Tensor, w_LKN: torch.Tensor) -> bool:
    return (x_MK.shape[-1] * x_MK.element_size()) % 16 == 0 and (w_LKN.shape[-1] * w_LKN.element_size()) % 16 == 0


def grouped_mm(x_MK: torch.Tensor, w_LKN: torch.Tensor, offs_L: torch.Tensor) -> torch.Tensor:
    """``x[rows of group l] @ w[l]``. Rows past ``offs[-1]`` are left undefined (callers mask them).

    ``torch.nn.functional.grouped_mm`` does the work; float64 (gradcheck) and shapes whose strides are not 16-byte
    aligned fall back to a gather-based reference that is slow but loop-free.
    """
    if x_MK.dtype in _GROUPED_MM_DTYPES and _aligned(x_MK, w_LKN):
        y = F.grouped_mm(x_MK, w_LKN, offs=offs_L)
        if y.requires_grad:  # grouped_mm's backward rejects stride-0 grads (e.g. from .sum()) on CPU
            y.register_hook(torch.Tensor.contiguous)
        return y
    rows = torch.arange(x_MK.shape[0], device=x_MK.device)
    group_M = torch.bucketize(rows, offs_L.to(torch.int64), right=True).clamp_(max=w_LKN.shape[0] - 1)
    return torch.bmm(x_MK.unsqueeze(1), w_LKN[group_M]).squeeze(1)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # grouped_mm has no autocast rule: follow autocast (bf16-mixed) by hand, as F.linear would
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class GroupedMM(nn.Module):
    """``grouped_mm`` as a module: the experts' two GEMMs are named places (``experts.fc1``, ``experts.fc2``) where
    callbacks find their inputs (activation offload) and low-precision GEMMs can be swapped in. No parameters.
    ``rows_align``: each expert's rows in the input start on a multiple of this (``ModelConfig.expert_rows_align``),
    which low-precision GEMMs may rely on."""

    def __init__(self, rows_align: int = 1):
        super().__init__()
        self.rows_align = rows_align

    def forward(self, x_MK: torch.Tensor, w_LKN: torch.Tensor, offs_L: torch.Tensor) -> torch.Tensor:
        return self._mm(x_MK, w_LKN, offs_L)

    def _mm(self, x_MK: torch.Tensor, w_LKN: torch.Tensor, offs_L: torch.Tensor) -> torch.Tensor:
        """The GEMM: the place where low-precision GEMMs are swapped in (``FP8Training``). Where GradSync accumulates
        the weight's gradient itself (gradient-accumulation fusion), the wgrad GEMM adds into its main grad."""
        y = wgrad_fusion.grouped_linear(x_MK, w_LKN, offs_L) if _aligned(x_MK, w_LKN) else None
        return grouped_mm(x_MK, w_LKN, offs_L) if y is None else y


def _kernels(t: torch.Tensor, fused: bool):
    """The Triton SwiGLU (``triton_swiglu.py``) when it runs for ``t``; None: the torch code below, the reference."""
    return kernels.load("triton_swiglu", t, fused)


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up``, optionally times a float32 weight per row ``p_M`` (the router probability of the row's
    token copy: Megatron's weighted SwiGLU), keeping only its inputs for backward. Autograd's composition also keeps
    ``silu(gate)``, one more activation of the output's size (96 MiB per layer and micro-batch at the Qwen3 shape);
    backward recomputes it, one elementwise pass (Megatron's fused bias-SwiGLU keeps its input only, too). Without
    the kernels the gradients are the ops autograd would run, in the same order: bit-identical to autograd.

    With weights, the probabilities' gradient is the row sum of the output gradient times the SwiGLU, so the combine
    needs no expert output for it (``ModelConfig.probs_in_experts``)."""

    @staticmethod
    def forward(ctx, h_M2F: torch.Tensor, p_M: Optional[torch.Tensor], fused: bool) -> torch.Tensor:
        if p_M is not None and p_M.shape != h_M2F.shape[:-1]:
            raise ValueError(f"swiglu: {tuple(p_M.shape)} weights for {tuple(h_M2F.shape[:-1])} rows")
        ctx.save_for_backward(h_M2F, p_M)
        ctx.fused = fused
        tk = _kernels(h_M2F, fused)
        if tk is not None:
            return tk.forward(h_M2F, p_M)
        gate_MF, up_MF = h_M2F.chunk(2, dim=-1)
        a_MF = F.silu(gate_MF) * up_MF
        return a_MF if p_M is None else a_MF * p_M.unsqueeze(1).to(a_MF.dtype)

    @staticmethod
    def backward(ctx, g_MF: torch.Tensor):
        h_M2F, p_M = ctx.saved_tensors
        tk = _kernels(h_M2F, ctx.fused)
        if tk is not None:
            g_h, g_p = tk.backward(g_MF, h_M2F, p_M)
            return g_h, (g_p if ctx.needs_input_grad[1] else None), None
        gate_MF, up_MF = h_M2F.chunk(2, dim=-1)
        silu_MF = F.silu(gate_MF)
        g_p = None
        if p_M is not None:
            if ctx.needs_input_grad[1]:
                g_p = (g_MF * (silu_MF * up_MF)).sum(-1, dtype=torch.promote_types(p_M.dtype, torch.float32))
            g_MF = g_MF * p_M.unsqueeze(1).to(g_MF.dtype)
        g_gate = torch.ops.aten.silu_backward(g_MF * up_MF, gate_MF)
        return torch.cat([g_gate, g_MF * silu_MF], dim=-1), g_p, None


def swiglu(h_M2F: torch.Tensor, p_M: Optional[torch.Tensor] = None, fused: bool = True) -> torch.Tensor:
    """``silu(gate) * up`` of ``[gate | up]`` (last dim), each row times ``p_M`` when given, keeping only the inputs
    for backward. ``fused``: the Triton kernels where they run (CUDA)."""
    if not torch.is_grad_enabled() or not (h_M2F.requires_grad or (p_M is not None and p_M.requires_grad)):
        with torch.no_grad():
            return _SwiGLU.forward(_NoCtx(), h_M2F, p_M, fused)
    return _SwiGLU.apply(h_M2F, p_M, fused)


class _NoCtx:
    """An autograd context that keeps nothing (forward without grad)."""

    def save_for_backward(self, *tensors) -> None:
        pass


class SwiGLUActivation(nn.Module):
    """``silu(gate) * up`` of ``[gate | up]`` as a module (``experts.act``), each row weighted by ``p_M`` when
    given: what ``Recompute(["moe_act"])`` recomputes instead of keeping. ``_act`` is where ``FP8Training`` swaps in
    the SwiGLU fused with the FP8 GEMMs' quantization (``fp8_swiglu.py``)."""

    def __init__(self, fused: bool = True):
        super().__init__()
        self.fused = fused

    def forward(self, h_M2F: torch.Tensor, p_M: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self._act(h_M2F, p_M)

    def _act(self, h_M2F: torch.Tensor, p_M: Optional[torch.Tensor]) -> torch.Tensor:
        return swiglu(h_M2F, p_M, self.fused)

    def prepare(self, p_M: Optional[torch.Tensor]) -> None:
        """Told the rows' weights before fc1 runs. Nothing here; where ``FP8Training`` makes this activation in fc1's
        epilogue (``fp8_swiglu``), fc1 needs them."""


class GroupedExperts(nn.Module):
    """``num_local_experts`` SwiGLU experts whose FFN dimension is sharded over ``etp_size`` ranks.

    ``w13`` holds [gate | up] side by side so that the first GEMM is one kernel call; ``w2`` is the down projection.
    Expert ``l`` here is global expert ``expert_offset + l``.
    """

    is_expert = True  # gradients are reduced over the expert-data-parallel group

    def __init__(self, num_local_experts: int, hidden: int, ffn_full: int, expert_offset: int = 0,
                 etp_rank: int = 0, etp_size: int = 1, init_std: float = 0.02, out_std: float = 0.02,
                 fused: bool = True, rows_align: int = 1):
        super().__init__()
        self.num_local_experts, self.hidden, self.expert_offset = num_local_experts, hidden, expert_offset
        self.etp_rank, self.etp_size, self.init_std, self.out_std = etp_rank, etp_size, init_std, out_std
        self.ffn = ffn_full // etp_size
        self.w13 = nn.Parameter(torch.empty(num_local_experts, hidden, 2 * self.ffn))
        self.w2 = nn.Parameter(torch.empty(num_local_experts, self.ffn, hidden))
        for p in (self.w13, self.w2):
            p.is_expert = True
            p.wgrad_fusable = True  # GradSync may accumulate its gradient in the GEMM (wgrad_fusion.py)
        self.fc1, self.act, self.fc2 = GroupedMM(rows_align), SwiGLUActivation(fused), GroupedMM(rows_align)

    @torch.no_grad()
    def reset_parameters_sharded(self, seed: int, name: str) -> None:
        dev, F_ = self.w13.device, self.ffn * self.etp_size
        for l in range(self.num_local_experts):  # init only, once: one full expert at a time bounds memory
            e = self.expert_offset + l
            gate = full_normal((self.hidden, F_), self.init_std, seed, f"{name}.gate.{e}", dev)
            up = full_normal((self.hidden, F_), self.init_std, seed, f"{name}.up.{e}", dev)
            down = full_normal((F_, self.hidden), self.out_std, seed, f"{name}.down.{e}", dev)
            self.w13[l].copy_(torch.cat([shard(gate, 1, self.etp_rank, self.etp_size),
                                         shard(up, 1, self.etp_rank, self.etp_size)], dim=1))
            self.w2[l].copy_(shard(down, 0, self.etp_rank, self.etp_size))

    def forward(self, x_MD: torch.Tensor, tokens_per_expert_L: torch.Tensor, has_tail: bool = False,
                probs_M: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``has_tail``: rows past ``sum(tokens_per_expert)`` exist (dropped or other ranks' copies). grouped_mm
        leaves them undefined in the output AND in the input gradient, so both ends are masked; the middle needs
        no mask because grouped_mm never reads tail rows into a group's result or weight gradient. ``probs_M``: each
        row's router probability, applied after the activation (the dispatcher's ``probs_in_experts``)."""
        dtype = _compute_dtype(x_MD)
        offs_L = tokens_per_expert_L.cumsum(0).to(torch.int32)
        if has_tail:
            valid_M1 = (torch.arange(x_MD.shape[0], device=x_MD.device) < offs_L[-1]).unsqueeze(1)
            x_MD = torch.where(valid_M1, x_MD, 0)
        self.act.prepare(probs_M)
        h_M2F = self.fc1(x_MD.to(dtype), self.w13.to(dtype), offs_L)
        a_MF = self.act(h_M2F) if probs_M is None else self.act(h_M2F, probs_M)
        y_MD = self.fc2(a_MF, self.w2.to(dtype), offs_L)
        return torch.where(valid_M1, y_MD, 0) if has_tail else y_MD

    def extra_repr(self) -> str:
        return f"local_experts={self.num_local_experts}, hidden={self.hidden}, ffn={self.ffn} (etp={self.etp_size})"


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP (dense layers and shared experts), tensor-parallel: [gate | up] column-parallel (each rank
    holds its slice of both), down row-parallel. On one rank it is the plain MLP."""

    def __init__(self, hidden: int, ffn: int, init_std: float = 0.02, out_std: float = 0.02,
                 ctx: Optional[ParallelContext] = None, sequence_parallel: Optional[bool] = None, fused: bool = True):
        super().__init__()
        ctx = ctx or ParallelContext.single()
        self.fused = fused
        self.w13 = ColumnParallelLinear(hidden, 2 * ffn, ctx, init_std, sequence_parallel, part_keys=("gate", "up"))
        self.w2 = RowParallelLinear(ffn, hidden, ctx, out_std, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w13(x), fused=self.fused))
