"""Top-k MoE router with Megatron Core's scoring, capacity and load-balancing semantics.

Shape suffixes: T = tokens, D = hidden, E = experts, K = topk, B = sequences, S = sequence length.
``x_TD`` is (T, D), ``logits_TE`` is (T, E), ``probs_TK`` / ``experts_TK`` are (T, K).

The pure functions keep the dtype of their input promoted to at least float32 (float64 stays float64, so they can be
checked with ``torch.autograd.gradcheck``). ``TopKRouter`` always routes in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from lightning_moe.modules import fused_router, replay
from lightning_moe.modules.config import ModelConfig
from lightning_moe.modules.init import fill_normal_
from lightning_moe.strategy.parallel_context import ParallelContext


class _Fp32Linear(torch.autograd.Function):
    """``x @ w.T`` in float32 that keeps ``x`` as it came (bf16) for backward, not its float32 copy: Megatron's
    ``router_gating_linear``. Autograd's ``F.linear(x.float(), w)`` keeps the copy, twice the bytes of the norm
    output it came from, and a copy that ``Recompute(["layernorm"])`` cannot drop. The gradients are the GEMMs
    autograd runs for ``mm(x, w.t())`` (``mm_mat1/mat2_backward``, w.t() being column-major), so the numbers are
    bit-identical."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_TD, w_ED)
        return torch.mm(_fp(x_TD), _fp(w_ED).t())

    @staticmethod
    def backward(ctx, g_TE: torch.Tensor):
        x_TD, w_ED = ctx.saved_tensors
        g_x = torch.mm(g_TE, _fp(w_ED)).to(x_TD.dtype) if ctx.needs_input_grad[0] else None
        g_w = torch.mm(g_TE.t(), _fp(x_TD)).to(w_ED.dtype) if ctx.needs_input_grad[1] else None
        return g_x, g_w


def fp32_linear(x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    """Router logits in float32 (autocast off) from a (T, D) input of any float dtype."""
    with torch.autocast(device_type=x_TD.device.type, enabled=False):
        return _Fp32Linear.apply(x_TD, w_ED)


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 x bf16 -> float32 with float32 accumulation: one cuBLAS call on CUDA (``mm(..., out_dtype)``); elsewhere
    the same products of the bf16 values, in float32."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


class _Bf16Linear(torch.autograd.Function):
    """``x @ w.T`` of the bf16 input and the weight rounded to bf16, accumulated and returned in float32 (Megatron's
    router GEMM in the input dtype, with float32 logits). Backward: the input gradient in bf16 (the incoming float32
    gradient rounded to bf16, as the bf16 GEMM's would be), the weight gradient in float32."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
        x16 = x_TD.to(torch.bfloat16)
        ctx.save_for_backward(x16, w_ED)  # the parameter, not its bf16 copy: the saved-tensor hooks know parameters
        ctx.x_dtype = x_TD.dtype
        return _mm_f32(x16, w_ED.to(torch.bfloat16).t())

    @staticmethod
    def backward(ctx, g_TE: torch.Tensor):
        x16, w_ED = ctx.saved_tensors
        x_dtype, w_dtype, w16 = ctx.x_dtype, w_ED.dtype, w_ED.to(torch.bfloat16)
        g16 = g_TE.to(torch.bfloat16)
        g_x = torch.mm(g16, w16).to(x_dtype) if ctx.needs_input_grad[0] else None
        g_w = _mm_f32(g16.t(), x16).to(w_dtype) if ctx.needs_input_grad[1] else None
        return g_x, g_w


def router_logits(x_TD: torch.Tensor, w_ED: torch.Tensor, dtype: str = "fp32") -> torch.Tensor:
    """The router's float32 logits: ``fp32_linear``, or with ``dtype="bf16"`` the bf16 GEMM (``_Bf16Linear``).
    float64 inputs (gradcheck) always take the float32-or-wider path."""
    if dtype == "bf16" and x_TD.dtype != torch.float64:
        with torch.autocast(device_type=x_TD.device.type, enabled=False):
            return _Bf16Linear.apply(x_TD, w_ED)
    return fp32_linear(x_TD, w_ED)


def _fp(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 or wider (bf16/fp16 logits are upcast; float64 is kept for gradcheck)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


# ---------------------------------------------------------------------------------------------------- scoring
def group_limited_topk(scores_TE: torch.Tensor, topk: int, num_groups: int,
                       group_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's device/node-limited routing: pick ``group_topk`` groups of contiguous experts, then top-k in them.

    A group's score is the sum of its best ``topk // group_topk`` scores (not just its maximum), so a group with
    several good experts beats one with a single outstanding expert.
    """
    T, E = scores_TE.shape
    scores_TGe = scores_TE.view(T, num_groups, E // num_groups)
    group_scores_TG = scores_TGe.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    groups_Tg = group_scores_TG.topk(group_topk, dim=-1).indices
    group_mask_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, groups_Tg, True)
    expert_mask_TE = group_mask_TG.unsqueeze(-1).expand_as(scores_TGe).reshape(T, E)
    masked_TE = scores_TE.masked_fill(~expert_mask_TE, float("-inf"))
    values_TK, indices_TK = masked_TE.topk(topk, dim=-1)
    return values_TK, indices_TK


def _select(scores_TE: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    if cfg.num_groups:
        return group_limited_topk(scores_TE, cfg.topk, cfg.num_groups, cfg.group_topk)
    return scores_TE.topk(cfg.topk, dim=-1)


def topk_routing(logits_TE: torch.Tensor, cfg: ModelConfig,
                 expert_bias_E: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``topk_softmax_with_capacity`` scoring without the capacity part. Returns (probs_TK, experts_TK)."""
    logits_TE = _fp(logits_TE)
    if cfg.score_function == "softmax":
        if cfg.pre_softmax:
            probs_TK, experts_TK = _select(torch.softmax(logits_TE, dim=-1), cfg)
        else:
            top_logits_TK, experts_TK = _select(logits_TE, cfg)
            probs_TK = torch.softmax(top_logits_TK, dim=-1)
    elif cfg.score_function == "sigmoid":
        scores_TE = torch.sigmoid(logits_TE)
        if expert_bias_E is not None:
            # the bias steers selection only (DeepSeek-V3's aux-loss-free balancing); the gates stay unbiased
            _, experts_TK = _select(scores_TE + expert_bias_E.to(scores_TE.dtype), cfg)
            probs_TK = scores_TE.gather(1, experts_TK)
        else:
            probs_TK, experts_TK = _select(scores_TE, cfg)
        if cfg.topk > 1:
            probs_TK = probs_TK / (probs_TK.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"topk_routing: unknown score_function {cfg.score_function!r}")
    if cfg.topk_scaling_factor:
        probs_TK = probs_TK * cfg.topk_scaling_factor
    return probs_TK, experts_TK


# ---------------------------------------------------------------------------------------------------- capacity
def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Megatron's ``get_capacity`` applied to the ``num_tokens * topk`` assignments."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def apply_capacity(probs_TK: torch.Tensor, experts_TK: torch.Tensor, num_experts: int, capacity: int,
                   drop_policy: str) -> torch.Tensor:
    """Bool keep_TK: at most ``capacity`` assignments per expert survive. Vectorised over experts, no host sync."""
    T = probs_TK.shape[0]
    routed_TE = torch.zeros(T, num_experts, dtype=torch.bool, device=experts_TK.device)
    routed_TE.scatter_(1, experts_TK, True)
    if drop_policy == "probs":
        # -inf for unrouted slots so that a routed gate of exactly 0 still outranks them
        gates_TE = torch.full((T, num_experts), float("-inf"), dtype=probs_TK.dtype, device=probs_TK.device)
        gates_TE.scatter_(1, experts_TK, probs_TK.detach())
        best_CE = gates_TE.topk(min(capacity, T), dim=0).indices
        keep_TE = torch.zeros_like(routed_TE).scatter_(0, best_CE, True) & routed_TE
    elif drop_policy == "position":
        keep_TE = routed_TE & (routed_TE.long().cumsum(dim=0) <= capacity)
    else:
        raise ValueError(f"apply_capacity: unknown drop_policy {drop_policy!r}")
    return keep_TE.gather(1, experts_TK)


# ---------------------------------------------------------------------------------------------------- losses
def aux_loss_scores(logits_TE: torch.Tensor, score_function: str, topk: int,
                    experts_TK: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``compute_routing_scores_for_aux_loss``: (scores_TE, routing_map_TE), no groups and no bias.

    ``experts_TK``: the router's own top-k when it selected on the same ranking (no groups, no bias); it saves a
    second top-k over T x E (scores are a monotonic function of the logits)."""
    logits_TE = _fp(logits_TE)
    if score_function == "softmax":
        scores_TE = torch.softmax(logits_TE, dim=-1)
    elif score_function == "sigmoid":
        scores_TE = torch.sigmoid(logits_TE)
        scores_TE = scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"aux_loss_scores: unknown score_function {score_function!r}")
    if experts_TK is None:
        experts_TK = scores_TE.topk(topk, dim=-1).indices
    routing_map_TE = torch.zeros_like(scores_TE, dtype=torch.bool).scatter_(1, experts_TK, True)
    return scores_TE, routing_map_TE


def switch_load_balancing_loss(scores_TE: torch.Tensor, tokens_per_expert_E: torch.Tensor, total_num_tokens: int,
                               topk: int, num_experts: int, coeff: float) -> torch.Tensor:
    """Megatron's ``switch_load_balancing_loss_func``; equals ``coeff`` for a perfectly uniform router."""
    return switch_loss_of_sums(scores_TE.sum(dim=0), tokens_per_expert_E, total_num_tokens, topk, num_experts, coeff)


def switch_loss_of_sums(aggregated_E: torch.Tensor, tokens_per_expert_E: torch.Tensor, total_num_tokens: int,
                        topk: int, num_experts: int, coeff: float) -> torch.Tensor:
    """The switch loss from the scores' column sums (what the fused router's kernel hands over)."""
    scale = num_experts * coeff / (topk * total_num_tokens * total_num_tokens)
    return (aggregated_E * tokens_per_expert_E.to(aggregated_E.dtype)).sum() * scale


def z_loss(logits_TE: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE router z-loss: keeps logits small so the softmax stays well conditioned."""
    return torch.logsumexp(_fp(logits_TE), dim=-1).square().mean() * coeff


def updated_expert_bias(bias_E: torch.Tensor, tokens_per_expert_E: torch.Tensor, rate: float) -> torch.Tensor:
    """Megatron's ``get_updated_expert_bias``: raise the bias of under-loaded experts, lower it for over-loaded."""
    tokens_E = tokens_per_expert_E.to(bias_E.dtype)
    return bias_E + rate * torch.sign(tokens_E.mean() - tokens_E)


# ---------------------------------------------------------------------------------------------------- module
def _route_local(logits_TE: torch.Tensor, cfg: ModelConfig, expert_bias_E: Optional[torch.Tensor],
                 training: bool, z_scale: float = 1.0):
    """Everything the router computes from its logits without communication: z-loss, top-k, capacity, counts."""
    zl = z_loss(logits_TE, cfg.z_loss_coeff) * z_scale if cfg.z_loss_coeff and training else logits_TE.new_zeros(())
    probs_TK, experts_TK = topk_routing(logits_TE, cfg, expert_bias_E)
    return (*_drop_and_count(probs_TK, experts_TK, cfg, logits_TE.shape[1]), zl)


def _drop_and_count(probs_TK: torch.Tensor, experts_TK: torch.Tensor, cfg: ModelConfig, E: int):
    """Capacity (if any) and the counts of kept assignments: (probs_TK, experts_TK, keep_TK, counts_E, dropped)."""
    keep_TK = None
    if cfg.capacity_factor is not None:
        # pad_to_capacity only fixes the dispatcher's buffer shapes; the kept set is the same either way
        capacity = expert_capacity(probs_TK.shape[0], E, cfg.topk, cfg.capacity_factor)
        keep_TK = apply_capacity(probs_TK, experts_TK, E, capacity, cfg.drop_policy)
        probs_TK = probs_TK * keep_TK
    with torch.no_grad():
        kept_TK = keep_TK.float() if keep_TK is not None else torch.ones_like(probs_TK, dtype=torch.float32)
        tokens_per_expert_E = torch.zeros(E, dtype=torch.float32, device=probs_TK.device)
        tokens_per_expert_E.scatter_add_(0, experts_TK.reshape(-1), kept_TK.reshape(-1))
        num_dropped = (kept_TK.numel() - kept_TK.sum()).float()
    return probs_TK, experts_TK, keep_TK, tokens_per_expert_E, num_dropped


_COMPILED: dict = {}  # a cache of compiled kernels (not parallel state)


def _compiled(fn):
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn]


@dataclass
class RouterOutput:
    probs_TK: torch.Tensor  # fp32 gates, 0 where the assignment was dropped
    experts_TK: torch.Tensor  # int64 expert ids
    keep_TK: Optional[torch.Tensor]  # bool, None when dropless
    aux_loss: torch.Tensor  # fp32 scalar, coefficient and parallel scale included
    z_loss: torch.Tensor  # fp32 scalar
    tokens_per_expert_E: torch.Tensor  # detached fp32 counts of kept assignments
    num_dropped: torch.Tensor  # detached fp32 scalar


class TopKRouter(nn.Module):
    """Linear gate (float32, outside autocast) + top-k scoring + optional capacity + load-balancing losses."""

    def __init__(self, cfg: ModelConfig, ctx: Optional[ParallelContext] = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.ctx = ctx if ctx is not None else ParallelContext.single()
        E = cfg.num_experts
        # router weights stay fp32 whatever the precision plugin does: routing decisions are sensitive to rounding
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size, dtype=torch.float32))
        nn.init.normal_(self.weight, mean=0.0, std=cfg.init_std)
        if cfg.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32), persistent=True)
        else:
            self.register_buffer("expert_bias", None)
        # counts since the last optimizer step, for the bias update; persistent so a resume mid-accumulation is exact
        self.register_buffer("local_tokens_per_expert", torch.zeros(E, dtype=torch.float32), persistent=True)
        # training micro-batches since the last optimizer step whose logits held a NaN or an infinity: counted on the
        # device (no host sync), read by the bias update and by MoEFoldStrategy at the step
        self.register_buffer("nonfinite_logits", torch.zeros((), dtype=torch.float32), persistent=False)
        if cfg.load_balancing == "global_aux_loss":
            self.register_buffer("global_tokens_per_expert", torch.zeros(E, dtype=torch.float32), persistent=True)
            self.register_buffer("global_aux_steps", torch.zeros((), dtype=torch.float32), persistent=True)

    def forward(self, x_TD: torch.Tensor, num_sequences: int) -> RouterOutput:
        cfg = self.cfg
        x_TD = x_TD.reshape(-1, x_TD.shape[-1])
        logits_TE = router_logits(x_TD, self.weight, cfg.router_dtype)
        training = self.training and torch.is_grad_enabled()

        want_aux = training and cfg.load_balancing != "none" and cfg.aux_loss_coeff > 0
        T = logits_TE.shape[0]
        if want_aux and cfg.load_balancing == "seq_aux_loss" and (num_sequences <= 0 or T % num_sequences):
            raise ValueError(f"TopKRouter: seq_aux_loss needs num_sequences ({num_sequences}) to divide the "
                             f"number of tokens ({T})")
        # the z-loss is a mean over this rank's tokens; the TP ranks hold shares of the same tokens and their
        # router gradients are summed (not averaged) over TP, hence 1/tp
        z_scale = 1.0 / self.ctx.tp
        if fused_router.supported(cfg, logits_TE):
            probs_TK, experts_TK, keep_TK, tokens_per_expert_E, num_dropped, zl, aux_in = self._route_fused(
                logits_TE, training, want_aux, num_sequences, z_scale)
        else:
            route = _compiled(_route_local) if cfg.compile_router and logits_TE.is_cuda else _route_local
            probs_TK, experts_TK, keep_TK, tokens_per_expert_E, num_dropped, zl = route(
                logits_TE, cfg, self.expert_bias, training, z_scale)
            same_ranking = not cfg.num_groups and self.expert_bias is None
            aux_in = self._aux_inputs(logits_TE, num_sequences, experts_TK if same_ranking else None) \
                if want_aux else None
        aux = self._aux_loss(*aux_in, T, num_sequences) if want_aux else logits_TE.new_zeros(())

        if training and not replay.replaying():  # a recomputation's replay must not count again
            with torch.no_grad():
                self.local_tokens_per_expert += tokens_per_expert_E
                self.nonfinite_logits += logits_TE.isfinite().all().logical_not()

        return RouterOutput(probs_TK=probs_TK, experts_TK=experts_TK, keep_TK=keep_TK, aux_loss=aux, z_loss=zl,
                            tokens_per_expert_E=tokens_per_expert_E, num_dropped=num_dropped)

    def _route_fused(self, logits_TE: torch.Tensor, training: bool, want_aux: bool, num_sequences: int,
                     z_scale: float):
        """The Triton router (fused_router.py): gates, counts and the loss partial sums in one kernel; the capacity
        drop (a top-k over tokens) and the counts of what it keeps stay the reference's."""
        cfg = self.cfg
        T, E = logits_TE.shape
        f = fused_router.score(logits_TE, cfg, self.expert_bias, z=bool(cfg.z_loss_coeff) and training,
                               aux=want_aux, num_sequences=num_sequences)
        zl = f.z_sum * (cfg.z_loss_coeff * z_scale / T) if f.z_sum is not None else logits_TE.new_zeros(())
        if cfg.capacity_factor is None:
            local = f.probs_TK, f.experts_TK, None, f.tokens_per_expert_E, logits_TE.new_zeros(())
        else:
            local = _drop_and_count(f.probs_TK, f.experts_TK, cfg, E)
        return (*local, zl, (f.aux_sums, f.aux_counts))

    def _aux_inputs(self, logits_TE: torch.Tensor, num_sequences: int,
                    experts_TK: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's (score column sums, routing-map counts): (E,) each, or (B, E) for seq_aux_loss."""
        cfg, E = self.cfg, self.cfg.num_experts
        scores_fn = _compiled(aux_loss_scores) if cfg.compile_router and logits_TE.is_cuda else aux_loss_scores
        scores_TE, routing_map_TE = scores_fn(logits_TE, cfg.score_function, cfg.topk, experts_TK)
        if cfg.load_balancing == "seq_aux_loss":
            B, S = num_sequences, logits_TE.shape[0] // num_sequences
            # (S, B*E): each (sequence, expert) pair acts as its own expert in the switch formula, as in Megatron
            sums_BE = scores_TE.view(B, S, E).transpose(0, 1).reshape(S, B * E).sum(dim=0).view(B, E)
            return sums_BE, routing_map_TE.view(B, S, E).sum(dim=1).float()
        return scores_TE.sum(dim=0), routing_map_TE.sum(dim=0).float()

    def _aux_loss(self, sums_X: torch.Tensor, counts_X: torch.Tensor, T: int, num_sequences: int) -> torch.Tensor:
        # Parallel scale factors: each rank sees only its share of the tokens (1/cp of every sequence, 1/dp of the
        # batch) but the token counts are all-reduced. The loss over the whole global batch is therefore the SUM of
        # the per-rank losses over the cp (and, for the global loss, dp) ranks. Gradients get AVERAGED over dp x cp,
        # so multiplying by the size of the summed-over group makes the averaged gradient equal to that of the loss
        # computed on the whole global batch by one process. TP ranks route disjoint shares of the same tokens and
        # their router gradients are summed over TP, so the tp factor is 1.
        cfg, ctx, E, K = self.cfg, self.ctx, self.cfg.num_experts, self.cfg.topk
        coeff = cfg.aux_loss_coeff
        if cfg.load_balancing == "aux_loss":
            tpe_E = ctx.all_reduce_(counts_X, "tp_cp")
            total = T * ctx.size("tp_cp")
            # the CP ranks sharing the micro-batch (tp_cp / tp): DynamicContextParallel may give "cp" fewer ranks
            cp_batch = ctx.size("tp_cp") // ctx.size("tp")
            return switch_loss_of_sums(sums_X, tpe_E, total, K, E, coeff) * cp_batch
        if cfg.load_balancing == "seq_aux_loss":
            B, S = num_sequences, T // num_sequences
            tpe_BE = ctx.all_reduce_(counts_X, "tp_cp")
            total = S * ctx.size("tp_cp")
            loss = switch_loss_of_sums(sums_X.reshape(B * E), tpe_BE.reshape(B * E), total, K, E, coeff) / B
            return loss * (ctx.size("tp_cp") // ctx.size("tp"))
        if cfg.load_balancing == "global_aux_loss":
            if replay.replaying():  # the first pass's window: later micro-batches have moved the counters since
                averaged_E = replay.entries(self).pop(0)  # (and no all-reduce: every rank replays alike)
            else:
                tpe_E = ctx.all_reduce_(counts_X, "tp_dp_cp")
                with torch.no_grad():
                    self.global_tokens_per_expert += tpe_E
                    self.global_aux_steps += 1
                averaged_E = self.global_tokens_per_expert / self.global_aux_steps
                if replay.recorded():  # this pass will be replayed in backward: keep what it saw (in the
                    replay.entries(self).append(averaged_E)  # invocation's store, freed with it)
            total = T * ctx.size("tp_dp_cp")
            return switch_loss_of_sums(sums_X, averaged_E, total, K, E, coeff) * ctx.size("dp_cp")
        raise ValueError(f"TopKRouter: unknown load_balancing {cfg.load_balancing!r}")

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Call once per optimizer step: nudge the expert bias from the counts since the last step, then reset them.

        A step whose logits held a NaN or an infinity on any rank of the layer routed by garbage: the bias stays as
        it was. The flag travels in the counts' all-reduce and the choice is made on the device (no host sync)."""
        if self.cfg.expert_bias:
            both = self.ctx.all_reduce_(torch.cat([self.local_tokens_per_expert, self.nonfinite_logits.view(1)]),
                                        "tp_dp_cp")
            updated_E = updated_expert_bias(self.expert_bias, both[:-1], self.cfg.bias_update_rate)
            self.expert_bias.copy_(torch.where(both[-1] > 0, self.expert_bias, updated_E))
        self.local_tokens_per_expert.zero_()
        self.nonfinite_logits.zero_()

    def _apply(self, fn, recurse=True):
        # Router weights, logits, bias and counters are fp32 by design: module.to(bf16) (e.g. precision="bf16-true")
        # may move them but not lower their precision (a bf16 counter stops counting at 256)
        super()._apply(fn, recurse)
        for name, t in list(self._parameters.items()) + list(self._buffers.items()):
            if t is not None and t.dtype in (torch.bfloat16, torch.float16):  # float64 (gradcheck) stays
                if isinstance(t, nn.Parameter):
                    t.data = t.data.float()
                else:
                    self._buffers[name] = t.float()
        return self

    @torch.no_grad()
    def reset_parameters_sharded(self, seed: int, name: str) -> None:
        """Layout-invariant init (see modules/init.py): the same weight on every rank and every layout."""
        fill_normal_(self.weight, self.cfg.init_std, seed, f"{name}.weight")

    def reset_global_aux_state(self) -> None:
        """Start a new averaging window for global_aux_loss (e.g. at the start of each global batch)."""
        if self.cfg.load_balancing == "global_aux_loss":
            self.global_tokens_per_expert.zero_()
            self.global_aux_steps.zero_()
