"""The MoE layer: router -> dispatcher -> grouped experts -> dispatcher, plus optional shared experts.

Reads like single-device code; the dispatcher and the expert shards are the parallel pieces swapped in.

Folding: the layer receives the attention layout's activations (this CP rank's tokens, replicated over TP or
sequence-sharded under SP) and routes each token on exactly one rank of the TP group, so that the MoE layout
(ETP x EP) sees every token once. Under SP the tokens are already distinct per TP rank; without SP the layer keeps
its TP rank's sequence chunk on entry and all-gathers the outputs on exit. Shared experts are a tensor-parallel MLP
in the attention layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from lightning_moe.modules import replay
from lightning_moe.modules.config import ModelConfig
from lightning_moe.modules.dispatcher import DispatchState, build_dispatcher
from lightning_moe.modules.experts import GroupedExperts, SwiGLU
from lightning_moe.modules.router import TopKRouter
from lightning_moe.modules.tensor_parallel import gather_seq_replicated, mark_grad_sum_over_tp, split_seq
from lightning_moe.strategy.parallel_context import ParallelContext


class MoELayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, out_std: float):
        super().__init__()
        self.ctx = ctx
        self.router = TopKRouter(cfg, ctx)
        mark_grad_sum_over_tp(self.router, ctx)  # each TP rank routes its own share of the tokens
        self.dispatcher = build_dispatcher(cfg, ctx)
        d = self.dispatcher
        self.experts = GroupedExperts(d.num_local_experts, cfg.hidden_size, cfg.moe_ffn_hidden_size,
                                      expert_offset=d.local_expert_offset, etp_rank=ctx.rank("etp"),
                                      etp_size=ctx.etp, init_std=cfg.init_std, out_std=out_std,
                                      fused=cfg.swiglu_fusion, rows_align=cfg.expert_rows_align)
        self.shared_experts = (SwiGLU(cfg.hidden_size, cfg.shared_expert_ffn_size, cfg.init_std, out_std, ctx,
                                      fused=cfg.swiglu_fusion)
                               if cfg.shared_expert_ffn_size else None)
        self.shared_expert_overlap = cfg.shared_expert_overlap
        self.last_stats: dict[str, torch.Tensor] = {}

    def _shared(self, x_BSD: torch.Tensor):
        """The shared experts, on a side stream when overlapped: returns (output, stream to join or None)."""
        if not (self.shared_expert_overlap and x_BSD.is_cuda) or torch.cuda.is_current_stream_capturing():
            return self.shared_experts(x_BSD), None
        main = torch.cuda.current_stream()
        key = ("shared_expert_stream", x_BSD.device)  # one side stream for all layers
        if key not in self.ctx.comm_buffers:
            self.ctx.comm_buffers[key] = torch.cuda.Stream(device=x_BSD.device)
        side = self.ctx.comm_buffers[key]
        side.wait_stream(main)  # x is ready
        with torch.cuda.stream(side):  # autograd runs their backward on this stream too
            shared_BSD = self.shared_experts(x_BSD)
        x_BSD.record_stream(side)  # the allocator must not reuse x while the side stream reads it
        return shared_BSD, side

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the layer output and its auxiliary loss (load balancing + z-loss, coefficients applied)."""
        s = self.begin(x_BSD)
        self.send(s)
        self.compute(s)
        self.receive(s)
        return self.finish(s)

    # The forward in five steps: local, communication, local, communication, local. ``overlap_moe_comm`` runs one
    # micro-batch's communication steps while another micro-batch computes (strategy/pipeline/moe_overlap.py).
    def begin(self, x_BSD: torch.Tensor) -> "MoEStep":
        """Shared experts (on a side stream when overlapped), the router, and the permute into expert order."""
        shared_BSD, side = self._shared(x_BSD) if self.shared_experts is not None else (None, None)
        tp_group = self.ctx.group("tp")
        split = tp_group is not None and not self.ctx.sequence_parallel
        if split:
            x_BSD = split_seq(x_BSD, tp_group)
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        route = self.router(x_TD, num_sequences=B)
        x_ND, st = self.dispatcher.dispatch_preprocess(x_TD, route)
        stats = {"tokens_per_expert": route.tokens_per_expert_E, "num_dropped": route.num_dropped,
                 "aux_loss": route.aux_loss.detach(), "z_loss": route.z_loss.detach()}
        return MoEStep(x_ND, st, (B, S, D), x_BSD.dtype, split, shared_BSD, side, route.aux_loss + route.z_loss,
                       stats)

    def send(self, s: "MoEStep") -> None:
        """Token dispatch (communication): the routed rows to the ranks that own their experts."""
        s.x = self.dispatcher.token_dispatch(s.x, s.st)

    def compute(self, s: "MoEStep") -> None:
        """Sort what arrived by local expert, run the experts, and undo the sort."""
        x_MD, tokens_per_local_expert_L = self.dispatcher.dispatch_postprocess(s.x, s.st)
        y_MD = self.experts(x_MD, tokens_per_local_expert_L, has_tail=s.st.has_tail, probs_M=s.st.probs_M)
        s.st.probs_applied = s.st.probs_M is not None  # the combine sums the weighted rows
        s.x = self.dispatcher.combine_preprocess(y_MD, s.st)

    def receive(self, s: "MoEStep") -> None:
        """Token combine (communication): the expert outputs back to the tokens' ranks."""
        s.x = self.dispatcher.token_combine(s.x, s.st)

    def finish(self, s: "MoEStep") -> tuple[torch.Tensor, torch.Tensor]:
        """Unpermute and weight by the router probabilities, then add the shared experts."""
        y_BSD = self.dispatcher.combine_postprocess(s.x, s.st).to(s.dtype).view(s.shape)
        if s.split:
            y_BSD = gather_seq_replicated(y_BSD, self.ctx.group("tp"))
        if s.side is not None:
            torch.cuda.current_stream().wait_stream(s.side)
            s.shared.record_stream(torch.cuda.current_stream())
        if s.shared is not None:
            y_BSD = y_BSD + s.shared
        if not replay.replaying():  # a recomputation's replay reports nothing new
            self.last_stats = s.stats
        return y_BSD, s.aux


@dataclass
class MoEStep:
    """One forward call's state between the steps of ``MoELayer``: the tensor in flight (routed rows, expert
    outputs, ...), the dispatcher's state, and what ``finish`` needs."""
    x: torch.Tensor
    st: DispatchState
    shape: tuple[int, int, int]  # (B, S, D) of the tokens this rank routes
    dtype: torch.dtype
    split: bool  # TP without SP: the layer kept this rank's sequence chunk and gathers the outputs at the end
    shared: Optional[torch.Tensor]
    side: Optional[torch.cuda.Stream]
    aux: torch.Tensor  # load-balancing + z-loss, coefficients applied
    stats: dict = field(default_factory=dict)
