"""The fused router: scoring, top-k, gates, per-expert counts and the z-loss and aux-loss partial sums in one Triton
kernel forward and one backward (``triton_router.py``), with the reference's semantics (``router.py``).

``TopKRouter`` asks ``supported`` first: fusion needs ``ModelConfig.router_fusion``, float32 logits where the
kernels run (``kernels.py``: CUDA, or the Triton interpreter), triton importable and at most ``MAX_EXPERTS``
experts. Everything else runs the reference, which is also the CPU path. What the kernel leaves to torch, on purpose:
- the router GEMM (cuBLAS) and the capacity drop (a top-k over tokens, across the kernel's blocks);
- the reductions of the per-block partial sums (tiny, and deterministic unlike float atomics);
- the all-reduce of the counts and the loss formula (``TopKRouter._aux_loss``: communication and scalars).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from lightning_moe.modules import kernels
from lightning_moe.modules.config import ModelConfig


def _tk(logits_TE: torch.Tensor, cfg: ModelConfig):
    """``triton_router`` when its kernels take these logits, else None. float64 (gradcheck) stays on the reference,
    and so do rows wider than the kernel keeps in registers."""
    tk = kernels.load("triton_router", logits_TE, cfg.router_fusion and logits_TE.dtype == torch.float32)
    return tk if tk is not None and cfg.num_experts <= tk.MAX_EXPERTS else None


def supported(cfg: ModelConfig, logits_TE: torch.Tensor) -> bool:
    return _tk(logits_TE, cfg) is not None


@dataclass(frozen=True)
class _Opts:
    topk: int
    score: int  # 0 softmax after top-k, 1 pre_softmax, 2 sigmoid
    groups: int
    group_topk: int
    scale: Optional[float]
    count: bool
    z: bool
    aux: int  # 0 none, 1 softmax scores, 2 normalised sigmoid scores
    aux_topk: bool
    block_t: int


class _FusedRouter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TE, bias_E, o: _Opts, tk):
        probs, experts, tpe, zpart, spart, cpart = tk.router_fwd(
            logits_TE, bias_E, topk=o.topk, score=o.score, groups=o.groups, group_topk=o.group_topk,
            scale=o.scale, count=o.count, z=o.z, aux=o.aux, aux_topk=o.aux_topk, block_t=o.block_t)
        ctx.save_for_backward(logits_TE, experts)
        ctx.o, ctx.tk = o, tk
        ctx.mark_non_differentiable(experts, tpe, cpart)
        ctx.set_materialize_grads(False)  # unused outputs bring None, and the kernel skips their terms
        return probs, experts, tpe, zpart, spart, cpart

    @staticmethod
    def backward(ctx, g_probs, _g_experts, _g_tpe, g_z, g_s, _g_cpart):
        logits_TE, experts_TK = ctx.saved_tensors
        o = ctx.o
        grad = ctx.tk.router_bwd(logits_TE, experts_TK, g_probs, g_z if o.z else None,
                                 g_s if o.aux else None, score=o.score, scale=o.scale, aux=o.aux,
                                 block_t=o.block_t)
        return grad, None, None, None


@dataclass
class FusedScores:
    probs_TK: torch.Tensor  # fp32 gates, before any capacity drop
    experts_TK: torch.Tensor  # int64
    tokens_per_expert_E: torch.Tensor  # fp32 counts of the top-k (dropless)
    z_sum: Optional[torch.Tensor]  # sum over tokens of logsumexp^2, differentiable
    aux_sums: Optional[torch.Tensor]  # aux-loss score column sums: (E,), or (B, E) per sequence; differentiable
    aux_counts: Optional[torch.Tensor]  # the aux-loss routing map's counts, same shape, fp32


def score(logits_TE: torch.Tensor, cfg: ModelConfig, expert_bias_E: Optional[torch.Tensor], z: bool, aux: bool,
          num_sequences: int = 1) -> FusedScores:
    """The fused forward. ``aux``: also the aux-loss partial sums, per sequence for ``seq_aux_loss``."""
    T, E = logits_TE.shape
    tk = _tk(logits_TE, cfg)
    per_seq = aux and cfg.load_balancing == "seq_aux_loss"
    S = T // num_sequences if per_seq else 0
    o = _Opts(topk=cfg.topk, score=2 if cfg.score_function == "sigmoid" else int(cfg.pre_softmax),
              groups=cfg.num_groups or 0, group_topk=cfg.group_topk or 0, scale=cfg.topk_scaling_factor,
              count=True, z=z, aux=(2 if cfg.score_function == "sigmoid" else 1) if aux else 0,
              # the aux loss ranks plain scores: groups or a bias select differently, so it needs its own top-k
              aux_topk=bool(cfg.num_groups) or expert_bias_E is not None,
              block_t=tk.block_tokens(E, S))
    bias = expert_bias_E.float().contiguous() if expert_bias_E is not None else None
    probs, experts, tpe, zpart, spart, cpart = _FusedRouter.apply(logits_TE.contiguous(), bias, o, tk)

    def reduce(part_NE):  # per-block partials -> (E,) or, per sequence, (B, E); blocks never straddle sequences
        return part_NE.view(num_sequences, -1, E).sum(1) if per_seq else part_NE.sum(0)

    return FusedScores(probs, experts, tpe, zpart.sum() if z else None, reduce(spart) if aux else None,
                       reduce(cpart) if aux else None)
