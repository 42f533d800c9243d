"""Step time of a planned layout: per layer, compute on the measured kernel throughputs (``kernels.py``) and the
communication of its parallel groups; per pipeline rank, the micro-batches through the schedule simulator's bubble;
then the optimizer. Returns the seconds of each kind of cost, whose largest is the layout's dominant cost."""

from __future__ import annotations

import math
from typing import NamedTuple

from lightning_moe.planner import kernels as K
from lightning_moe.planner.activations import BF16, OFFLOADED, loss_bytes
from lightning_moe.planner.candidate import Candidate
from lightning_moe.planner.gpus import GPU
from lightning_moe.planner.settings import Settings
from lightning_moe.planner.shape import ModelShape

class StepTime(NamedTuple):
    seconds: float
    parts: dict[str, float]  # seconds of the step: compute, all-to-all, TP/CP collectives, bubble, optimizer

    @property
    def dominant(self) -> str:
        return max(self.parts, key=self.parts.get)


def _link(gpu: GPU, span: int) -> float:
    """Bandwidth of a group whose ranks lie within ``span`` consecutive ranks (inside one node or not)."""
    return gpu.nvlink_bytes_s if span <= gpu.gpus_per_node else gpu.network_bytes_s


def layer_time(model: ModelShape, moe: bool, c: Candidate, s: Settings, gpu: GPU) -> tuple[float, float, float]:
    """(compute, all-to-all, TP/CP) seconds of one micro-batch's forward + backward through one layer on one rank."""
    cfg, flops = model.cfg, model.flops
    T = c.mb * model.seq / c.cp  # this rank's tokens of the micro-batch
    Tm = T / c.tp  # the tokens its MoE layer routes (sequence parallel)
    h, peak = cfg.hidden_size, gpu.bf16_flops
    terms = model.terms(moe, c.tp, c.cp, c.etp)
    dense = T / c.tp * (flops["attention_proj"] + (flops["shared_experts"] if moe else flops["dense_mlp"]))
    t = dense / (peak * K.DENSE_GEMM) + T / c.tp * flops["core_attention"] / (peak * K.CORE_ATTENTION)
    t += K.ELEMENTWISE_PASSES * sum(terms.values()) * T / gpu.hbm_bytes_s
    if cfg.rope_fusion:
        if cfg.attention_type == "mla":  # the fused rope heads of q and k (mla.rope_heads)
            qk_bytes = BF16 * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) / c.tp
            saved = K.MLA_ROPE_FUSION_SAVED_PASSES
        else:
            qk_bytes = BF16 * (cfg.num_attention_heads + cfg.num_kv_heads) * cfg.head_dim / c.tp
            saved = K.ROPE_FUSION_SAVED_PASSES + K.QK_NORM_FUSION_SAVED_PASSES * cfg.qk_norm
        # the constants fitted before the fusion carry torch's RoPE in every term above, not in one of them; at most
        # half of them, so that shapes far from the measured ones (few hidden units, many heads) stay positive
        t -= min(saved * qk_bytes * T / gpu.hbm_bytes_s, t / 2)
    a2a = 0.0
    if moe:
        rows = cfg.topk * Tm * c.etp  # routed rows this rank computes
        eff = K.grouped_gemm_efficiency(h, cfg.moe_ffn_hidden_size // c.etp, rows * c.ep / cfg.num_experts)
        imbalance = 1 + K.EP_IMBALANCE * math.log2(c.ep)  # the most loaded rank paces the all-to-all
        t += Tm * flops["experts"] / (peak * eff) * imbalance
        t += K.ROUTER_S + K.PERMUTE_PASSES * rows * h * BF16 / gpu.hbm_bytes_s
        if c.ep * c.etp > 1:  # dispatch + combine, forward and backward; ETP all-gathers / reduce-scatters rows
            moved = 4 * cfg.topk * Tm * h * BF16 * ((c.ep - 1) / c.ep + (c.etp - 1))
            a2a = (moved / (_link(gpu, c.ep * c.etp) * K.A2A_EFFICIENCY) + 4 * c.ep * c.etp * K.A2A_LATENCY_S
                   + K.EP_SYNC_S)
    kept, rebuilt = model.kept(moe, s, c.tp, c.cp, c.etp)
    if "full" in s.recompute:  # one more forward: a third of forward + backward
        t *= 4 / 3
    elif rebuilt:
        t += rebuilt / (kept + rebuilt) * t / 3
    offloaded = sum(v for name, v in terms.items() if any(name in OFFLOADED[m] for m in s.offload))
    t += K.OFFLOAD_EXPOSED * 2 * offloaded * T / K.PCIE_BYTES_S
    # idle gaps while the host launches the layer's many small kernels, and the recompute hooks' host time
    t += K.HOST_LAYER_S + K.HOST_MOE_S * moe + K.HOST_MLA_S * (cfg.attention_type == "mla")
    t += K.RECOMPUTE_HOOK_S * bool(s.recompute)
    tp_cp = 0.0
    if c.tp > 1:  # SP: all-gather in, reduce-scatter out, for attention and each dense/shared MLP, fwd and bwd
        n = 4 * (1 + (not moe or bool(cfg.shared_expert_ffn_size)))
        tp_cp += n * T * h * BF16 * (c.tp - 1) / c.tp / (_link(gpu, c.tp) * K.COLLECTIVE_EFFICIENCY)
    if c.cp > 1:  # K/V all-gather forward, their gradients reduce-scattered backward
        kv = model.terms(moe, c.tp, 1, c.etp)["kv"]
        tp_cp += 2 * T * kv * (c.cp - 1) / (_link(gpu, c.tp * c.cp) * K.COLLECTIVE_EFFICIENCY)
    return t, a2a, tp_cp


def step_time(model: ModelShape, c: Candidate, s: Settings, gpu: GPU) -> StepTime:
    cfg = model.cfg
    T = c.mb * model.seq / c.cp
    per_kind = {moe: layer_time(model, moe, c, s, gpu) for moe in (False, True) if moe in model.params}
    ranks = []
    for r, rank in enumerate(c.ranks(model)):
        counts = [sum(k) for k in zip(*rank.kinds)]
        compute, a2a, tp_cp = (sum(n * per_kind[moe][j] for moe, n in zip((False, True), counts) if n)
                               for j in range(3))
        dense, expert = c.rank_params(model, r)
        main_grad = K.MAIN_GRAD_BYTES[s.precision] if s.fp32_main_params or s.precision != "bf16-true" else 2
        fused = s.expert_wgrad_fusion and s.precision == "bf16-true" and s.fp32_main_params
        compute += (main_grad * dense + (K.MAIN_GRAD_FUSED_EXPERT_BYTES if fused else main_grad) * expert) / gpu.hbm_bytes_s
        if r == c.pp - 1:  # head GEMM and the fp32 loss over the logits
            compute += T / c.tp * model.flops["logits"] / (gpu.bf16_flops * K.DENSE_GEMM)
            compute += K.LOSS_PASSES * loss_bytes(cfg, c.tp) * T / gpu.hbm_bytes_s
        ranks.append((compute, a2a, tp_cp, dense, expert))
    slow = max(range(c.pp), key=lambda r: sum(ranks[r][:3]))
    compute, a2a, tp_cp, dense, expert = ranks[slow]
    busy = compute + a2a + tp_cp
    work = c.m * busy
    bubble = 0.0
    if c.pp > 1:  # each exchange synchronises, then waits for the host to launch the next op
        p2p = T / c.tp * cfg.hidden_size * BF16 / _link(gpu, c.gpus)
        exchanges = c.pipeline(model).exchanges * (K.PP_EXCHANGE_S + p2p)
        bubble = (work + exchanges) / (1 - c.pipeline(model).bubble) - work
    parts = {"compute": c.m * compute, "all-to-all": c.m * a2a, "TP/CP collectives": c.m * tp_cp,
             "bubble": bubble, "optimizer": optimizer_time(s, gpu, c, dense, expert, busy)}
    return StepTime(sum(parts.values()), parts)


def optimizer_time(s: Settings, gpu: GPU, c: Candidate, dense: float, expert: float, last_microbatch: float) -> float:
    """The optimizer step, the CPU's share under offload, and the gradient reduction not hidden behind the last
    micro-batch's backward."""
    d_dense, d_expert = c.dp * c.cp, c.edp
    owned = dense / d_dense + expert / d_expert if s.distributed_optimizer else dense + expert
    per_param = (K.ADAM_BF16_MOMENTS_BYTES if s.moments_dtype == "bf16" else K.ADAM_BYTES) - (
        6 if s.precision != "bf16-true" else 0)  # no bf16 write-back without main params
    if s.fused_optimizer_writeback and s.precision == "bf16-true" and s.fp32_main_params and not s.moments_dtype:
        per_param = K.ADAM_FUSED_WRITEBACK_BYTES  # where moe_fold fuses the two passes (the device part, offloaded)
    t = owned * (1 - s.optimizer_cpu_offload) * per_param / gpu.hbm_bytes_s
    t += owned * s.optimizer_cpu_offload / K.CPU_ADAM_PARAMS_S[s.moments_dtype]
    reduce = 0.0
    for n, d in ((dense, d_dense), (expert, d_expert)):
        if d > 1:  # ring all-reduce of fp32 grads (a reduce-scatter, half of it, with the distributed optimizer)
            ring = (1 if s.distributed_optimizer else 2) * (d - 1) / d
            reduce += ring * n * 4 / (_link(gpu, c.gpus // c.pp) * K.COLLECTIVE_EFFICIENCY)
    return t + max(0.0, reduce - 2 / 3 * last_microbatch)
