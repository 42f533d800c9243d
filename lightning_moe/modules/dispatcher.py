"""The TokenDispatcher interface and the local permute/unpermute steps every dispatcher shares.

A dispatcher moves routed token copies to the experts and back in six steps. Local steps (no communication) are
separate from communication steps so that a schedule can overlap one micro-batch's communication with another's
compute, as Megatron's dispatchers do:

    dispatch_preprocess  local   permute token copies into expert order
    token_dispatch       comm    send them to the ranks that own the experts
    dispatch_postprocess local   sort what arrived by local expert -> (x_MD, tokens_per_local_expert_L)
    ... experts ...
    combine_preprocess   local   inverse of dispatch_postprocess
    token_combine        comm    send expert outputs back
    combine_postprocess  local   unpermute and weight by the router probabilities -> y_TD

Shapes: T tokens, K top-k, D hidden, E experts, L local experts, N = T*K assignments (E*C when padded to
capacity), M rows this rank's experts process.

The base class is the single-rank dispatcher (communication steps are identities). Dropped assignments (capacity)
are sorted behind every kept one (a sentinel expert id E), so there is no data-dependent shape and no host sync on
one rank; their rows are never read back.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from lightning_moe.modules.config import ModelConfig
from lightning_moe.modules.expert_order import expert_order
from lightning_moe.modules.permute import combine_rows, gather_tokens, row_probs
from lightning_moe.modules.router import expert_capacity
from lightning_moe.strategy.parallel_context import ParallelContext


@dataclass
class DispatchState:
    """What the combine steps need from the dispatch steps of one forward call."""
    num_tokens: int
    rows_TK: Optional[torch.Tensor]  # permuted row of each assignment (padded: its capacity slot, or the zero row E*C)
    probs_TK: torch.Tensor
    keep_TK: Optional[torch.Tensor]
    tokens_per_expert_E: torch.Tensor  # rows per global expert in permuted order (kept, or C each when padded)
    extra: dict[str, Any] = field(default_factory=dict)  # dispatcher-specific (split sizes, ...)
    has_tail: bool = False  # the expert input holds rows past the last expert's (dropped / other ranks' copies)
    probs_M: Optional[torch.Tensor] = None  # each expert input row's router probability (float32), for experts that
    #                                         weight their rows (ModelConfig.probs_in_experts)
    probs_applied: bool = False  # the experts did weight them (MoELayer.compute): the combine then only sums


class TokenDispatcher:
    # FP8Training's fp8_swiglu.Handoff for the layer's experts, or None: where the permutes' gathers are the experts'
    # own input and output gradient (``_row_quant``), they quantize them for the experts' FP8 GEMMs
    fp8_rows = None

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext):
        self.cfg, self.ctx = cfg, ctx
        self.num_experts, self.topk = cfg.num_experts, cfg.topk
        if cfg.num_experts % ctx.ep:
            raise ValueError(f"num_experts={cfg.num_experts} is not divisible by expert_parallel_size ep={ctx.ep}")
        if cfg.moe_ffn_hidden_size % ctx.etp:
            raise ValueError(f"moe_ffn_hidden_size={cfg.moe_ffn_hidden_size} is not divisible by "
                             f"expert_tensor_parallel_size etp={ctx.etp}")
        self.num_local_experts = cfg.num_experts // ctx.ep
        self.local_expert_offset = ctx.rank("ep") * self.num_local_experts
        self.pad_to_capacity = cfg.pad_to_capacity
        self.fused = cfg.permute_fusion  # Triton permutes where they run (CUDA); the torch reference elsewhere

    # ------------------------------------------------------------------ local steps
    def dispatch_preprocess(self, x_TD: torch.Tensor, route) -> tuple[torch.Tensor, DispatchState]:
        """Permute token copies into global-expert order (stable: token order within each expert), by count and
        prefix sum (expert_order.py)."""
        T, K, E = x_TD.shape[0], self.topk, self.num_experts
        experts_N = route.experts_TK.reshape(-1)
        if route.keep_TK is not None:
            experts_N = torch.where(route.keep_TK.reshape(-1), experts_N, E)  # dropped -> sentinel, after the rest
        align = self.cfg.expert_rows_align if self.experts_read_preprocess() else 1
        if not self.pad_to_capacity:
            o = expert_order(experts_N, E, div=K, align=align, fused=self.fused)
            st = DispatchState(T, o.rows_N.view(T, K), route.probs_TK, route.keep_TK, o.counts_E,
                               has_tail=route.keep_TK is not None)
            st.extra.update(sizes_E=o.sizes_E, holes=align > 1)
            x_ND = gather_tokens(x_TD, o.src_R, st.rows_TK, route.keep_TK, zero_row=align > 1, fused=self.fused,
                                 quant=self._row_quant(st, x_TD))
            self.weight_rows(st, route.probs_TK, st.rows_TK, route.keep_TK, x_ND.shape[0], o.src_R)
            return x_ND, st
        # pad to capacity: expert e owns rows [e*C, (e+1)*C); empty slots are zero rows, dropped copies read none
        C = -(-expert_capacity(T, E, K, self.cfg.capacity_factor) // align) * align
        o = expert_order(experts_N, E, div=K, stride=C, fused=self.fused)
        st = DispatchState(T, o.rows_N.view(T, K), route.probs_TK, route.keep_TK, torch.full_like(o.counts_E, C))
        st.extra.update(holes=True)
        x_ND = gather_tokens(x_TD, o.src_R, st.rows_TK, route.keep_TK, zero_row=True, fused=self.fused,
                             quant=self._row_quant(st, x_TD))
        self.weight_rows(st, route.probs_TK, st.rows_TK, route.keep_TK, x_ND.shape[0], o.src_R)
        return x_ND, st

    def rows_feed_experts(self) -> bool:
        """Whether the rows ``dispatch_preprocess`` gathers reach the experts as they are, and the gradient the combine
        gathers in backward is their output's: one rank (no exchange), no re-sort, no FP8 dispatch rounding."""
        return (self.ctx.ep == 1 and self.ctx.etp == 1 and self.experts_read_preprocess()
                and not getattr(self, "fp8_dispatch", False))

    def _row_quant(self, st: DispatchState, x: Optional[torch.Tensor] = None):
        """``fp8_rows`` where this call's gathered rows feed the experts as they are, else None: not where the experts
        mask a tail (dropless with dropped copies; padded layouts have none, their dropped copies are zero holes),
        nor where autocast casts ``x`` (bf16-mixed: fc1 gets a new tensor)."""
        if self.fp8_rows is None or st.has_tail or not self.rows_feed_experts():
            return None
        if x is not None and torch.is_autocast_enabled(x.device.type) and \
                x.dtype != torch.get_autocast_dtype(x.device.type):
            return None
        return self.fp8_rows

    def weight_rows(self, st: DispatchState, probs_TK: torch.Tensor, rows_TK: torch.Tensor,
                    keep_TK: Optional[torch.Tensor], num_rows: int, src_N: torch.Tensor, key: str = "src") -> None:
        """With ``probs_in_experts``: each of the ``num_rows`` rows just gathered gets its probability
        (``st.probs_M``), and ``st.extra[key]`` keeps their tokens for a combine that sums them (``combine_rows``
        without probabilities) once the experts set ``st.probs_applied``; experts that do not (``dispatch()`` followed
        by experts without ``probs_M``) leave the weighting to the combine."""
        if self.cfg.probs_in_experts:
            st.probs_M = row_probs(probs_TK, rows_TK, keep_TK, num_rows)
            st.extra[key] = src_N

    def experts_read_preprocess(self) -> bool:
        """Whether dispatch_preprocess's layout is the experts' input (nothing re-sorts it): the place to pad."""
        return True

    def dispatch_postprocess(self, x_MD: torch.Tensor, st: DispatchState) -> tuple[torch.Tensor, torch.Tensor]:
        return x_MD, st.extra.get("sizes_E", st.tokens_per_expert_E)

    def combine_preprocess(self, y_MD: torch.Tensor, st: DispatchState) -> torch.Tensor:
        return y_MD

    def combine_postprocess(self, y_ND: torch.Tensor, st: DispatchState) -> torch.Tensor:
        """Gather each assignment's expert output and sum over top-k, weighted by the router probabilities unless
        the experts applied them."""
        src = st.extra.get("src") if st.probs_applied else None
        return combine_rows(y_ND, st.probs_TK if src is None else None, st.rows_TK, st.keep_TK,
                            permutation=not st.extra["holes"], fused=self.fused, src_N=src,
                            quant=self._row_quant(st) if src is not None else None)

    # ------------------------------------------------------------------ communication steps
    def token_dispatch(self, x_ND: torch.Tensor, st: DispatchState) -> torch.Tensor:
        return x_ND

    def token_combine(self, y_MD: torch.Tensor, st: DispatchState) -> torch.Tensor:
        return y_MD

    # ------------------------------------------------------------------ convenience
    def dispatch(self, x_TD: torch.Tensor, route) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        x_ND, st = self.dispatch_preprocess(x_TD, route)
        x_MD = self.token_dispatch(x_ND, st)
        x_MD, tokens_per_local_expert_L = self.dispatch_postprocess(x_MD, st)
        return x_MD, tokens_per_local_expert_L, st

    def combine(self, y_MD: torch.Tensor, st: DispatchState) -> torch.Tensor:
        y = self.combine_preprocess(y_MD, st)
        y = self.token_combine(y, st)
        return self.combine_postprocess(y, st)


def build_dispatcher(cfg: ModelConfig, ctx: ParallelContext) -> TokenDispatcher:
    """Resolve ``cfg.dispatcher``: a built-in name or a ``package.module.ClassName`` path."""
    name = cfg.dispatcher
    if name == "deepep":
        from lightning_moe.modules.deepep_dispatcher import DeepEPDispatcher
        return DeepEPDispatcher(cfg, ctx)
    if name in ("alltoall", "alltoall_dedup", "allgather"):
        from lightning_moe.modules import dispatchers
        cls = {"alltoall": dispatchers.AllToAllDispatcher, "alltoall_dedup": dispatchers.AllToAllDedupDispatcher,
               "allgather": dispatchers.AllGatherDispatcher}[name]
    else:
        module_name, _, cls_name = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"ModelConfig.dispatcher: cannot import {name!r}: {e}") from e
        if not (isinstance(cls, type) and issubclass(cls, TokenDispatcher)):
            raise ValueError(f"ModelConfig.dispatcher: {name!r} is not a TokenDispatcher subclass")
    return cls(cfg, ctx)
