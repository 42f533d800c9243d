"""The ``deepep`` dispatcher: DeepEP's intranode normal kernels move the tokens (NVLink, one node).

Like ``alltoall_dedup``, a token travels once to each EP rank that holds one of its experts, with its top-k expert
ids (local ids on arrival, -1 elsewhere) and router probabilities; the receiver permutes its slots into local-expert
order, and DeepEP's combine sums each token's partial outputs from every rank. The autograd backward of the
dispatch is DeepEP's combine, and that of the combine is a dispatch on the cached handle (as Megatron's
``fused_a2a`` does).

DeepEP's normal dispatch makes the CPU wait for the received counts (one host sync per layer). With
``ModelConfig.sync_free_dispatch`` the receive side is sized for the worst case (every token of every rank arrives
here: ``num_worst_tokens``), the counts stay on the device, the expert input has a static shape with a tail of
unused rows, and nothing waits for the host. It costs EP times the expert-input memory.

DeepEP moves bf16 (its FP8 path carries 1x128 block scales, which no recipe here produces): under autocast the
expert GEMMs run in bf16 anyway; plain fp32 training is refused rather than silently rounded.
"""

from __future__ import annotations

import torch

from lightning_moe.modules.dispatcher import DispatchState
from lightning_moe.modules.dispatchers import AllToAllDedupDispatcher
from lightning_moe.modules.expert_order import expert_order
from lightning_moe.modules.permute import combine_rows, gather_tokens


def import_deep_ep():
    try:
        import deep_ep
    except ImportError as e:
        raise ImportError("dispatcher='deepep' needs the DeepEP package (deep_ep), built from source with "
                          "benchmarks/build_deepep.sh; the PyPI package 'deep-ep' is not DeepEP. "
                          "Use 'alltoall' or 'alltoall_dedup' instead.") from e
    return deep_ep


def deepep_buffer(ctx, hidden: int):
    """One DeepEP buffer per EP group, shared by every MoE layer (its NVLink buffers are large)."""
    deep_ep = import_deep_ep()
    key = ("deepep", tuple(ctx.members.get("ep", ())), hidden)
    if key not in ctx.comm_buffers:
        ep, bytes_per_row = ctx.ep, hidden * 2  # bf16 rows
        nvl = max(cfg.get_nvl_buffer_size_hint(bytes_per_row, ep)
                  for cfg in (deep_ep.Buffer.get_dispatch_config(ep), deep_ep.Buffer.get_combine_config(ep)))
        buffer = deep_ep.Buffer(ctx.group("ep"), num_nvl_bytes=nvl, num_rdma_bytes=0)
        buffer.wire_dtype = torch.bfloat16  # DeepEP's combine takes bf16 only
        ctx.comm_buffers[key] = buffer
    return ctx.comm_buffers[key]


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, probs_TK, experts_TK, buffer, num_experts: int, worst_rows: int):
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(experts_TK, num_experts)
        x_rD, slots_rK, probs_rK, counts, handle, _ = buffer.dispatch(
            x_TD.to(buffer.wire_dtype).contiguous(), topk_idx=experts_TK, topk_weights=probs_TK.float().contiguous(),
            num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            num_worst_tokens=worst_rows)
        ctx.buffer, ctx.handle, ctx.dtypes = buffer, handle, (x_TD.dtype, probs_TK.dtype)
        ctx.mark_non_differentiable(slots_rK)
        # counts: a host list per local expert (normal mode; DeepEP already waited for it), empty when sync-free
        return x_rD, probs_rK.to(probs_TK.dtype), slots_rK, handle, counts

    @staticmethod
    def backward(ctx, g_rD, g_probs_rK, _slots, _handle, _counts):
        g_w = None if g_probs_rK is None else g_probs_rK.float().contiguous()
        g_TD, g_probs_TK, _ = ctx.buffer.combine(g_rD.to(ctx.buffer.wire_dtype).contiguous(), ctx.handle,
                                                 topk_weights=g_w)
        g_probs_TK = None if g_probs_TK is None else g_probs_TK.to(ctx.dtypes[1])
        return g_TD.to(ctx.dtypes[0]), g_probs_TK, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_rD, buffer, handle):
        y_TD, _, _ = buffer.combine(y_rD.to(buffer.wire_dtype).contiguous(), handle)
        ctx.buffer, ctx.handle, ctx.dtype = buffer, handle, y_rD.dtype
        return y_TD

    @staticmethod
    def backward(ctx, g_TD):
        g_rD, *_ = ctx.buffer.dispatch(g_TD.to(ctx.buffer.wire_dtype).contiguous(), handle=ctx.handle)
        return g_rD.to(ctx.dtype), None, None


class DeepEPDispatcher(AllToAllDedupDispatcher):
    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        if ctx.etp > 1:
            raise ValueError("dispatcher='deepep' needs expert_tensor_parallel_size=1 (DeepEP splits tokens over "
                             "EP only); use 'alltoall' or 'alltoall_dedup' with etp > 1")
        if cfg.pad_to_capacity:
            raise ValueError("dispatcher='deepep' does not pad experts to capacity; drop pad_to_capacity "
                             "(capacity_factor alone drops tokens and works)")
        self._import()  # fail when the model is built, not in the first forward
        self.sync_free = cfg.sync_free_dispatch

    # the two hooks a test double replaces (tests/parallel/fake_deep_ep.py runs the same logic on gloo)
    def _import(self):
        return import_deep_ep()

    def _buffer(self, hidden: int):
        return deepep_buffer(self.ctx, hidden)

    def _check_input(self, x_TD):
        if not x_TD.is_cuda:
            raise RuntimeError("dispatcher='deepep' runs on CUDA only (DeepEP's NVLink kernels); use 'alltoall'")
        if self.ctx.ep > 1 and x_TD.dtype == torch.float32 and not torch.is_autocast_enabled():
            raise RuntimeError("dispatcher='deepep' moves bf16 tokens; train with precision 'bf16-true' or "
                               "'bf16-mixed', or use 'alltoall' for fp32")

    def dispatch_preprocess(self, x_TD, route):
        self._check_input(x_TD)
        if self.ctx.ep == 1:
            return super().dispatch_preprocess(x_TD, route)
        experts_TK = route.experts_TK.long()
        if route.keep_TK is not None:  # capacity-dropped copies: DeepEP skips -1
            experts_TK = torch.where(route.keep_TK, experts_TK, -1)
        st = DispatchState(x_TD.shape[0], None, route.probs_TK, route.keep_TK, route.tokens_per_expert_E)
        st.extra.update(deepep=True, experts_TK=experts_TK)
        return x_TD, st

    def token_dispatch(self, x_TD, st):
        if not st.extra.get("deepep"):
            return x_TD
        buffer = self._buffer(x_TD.shape[1])
        worst = x_TD.shape[0] * self.ctx.ep if self.sync_free else 0
        x_rD, probs_rK, slots_rK, handle, counts = _Dispatch.apply(
            x_TD, st.probs_TK, st.extra["experts_TK"], buffer, self.num_experts, worst)
        st.extra.update(buffer=buffer, handle=handle, slots_rK=slots_rK, probs_rK=probs_rK,
                        local_slots=None if self.sync_free else sum(counts))
        return x_rD

    def dispatch_postprocess(self, x_rD, st):
        if not st.extra.get("deepep"):
            return super().dispatch_postprocess(x_rD, st)
        if not self.sync_free:  # the dedup receiver's permute, with DeepEP's count of local slots
            st.extra["dedup"] = True
            return super().dispatch_postprocess(x_rD, st)
        # sync-free: every slot keeps a row (static R*K rows); this rank's slots first in local-expert order, the rest
        # (other ranks' slots, padding rows past the received count, which DeepEP marks -1) form the unused tail
        L, slots_rK, align = self.num_local_experts, st.extra["slots_rK"], self.cfg.expert_rows_align
        R, K = slots_rK.shape
        mine_rK = slots_rK >= 0
        o = expert_order(torch.where(mine_rK, slots_rK, L).reshape(-1), L, div=K, align=align, fused=self.fused)
        rows_rK = o.rows_N.view(R, K)  # every slot has a row; masked ones are never read back
        st.extra.update(rows_rK=rows_rK, mine_rK=mine_rK)
        st.has_tail = True
        x_ND = gather_tokens(x_rD, o.src_R, rows_rK, mine_rK, zero_row=align > 1, fused=self.fused)
        self.weight_rows(st, st.extra["probs_rK"], rows_rK, mine_rK, x_ND.shape[0], o.src_R, key="recv_src")
        return x_ND, o.sizes_E

    def combine_preprocess(self, y_ND, st):
        if not st.extra.get("deepep"):
            return super().combine_preprocess(y_ND, st)
        e = st.extra  # one partial output per received token: its local slots (weighted by their probabilities)
        src = e.get("recv_src") if st.probs_applied else None
        return combine_rows(y_ND, e["probs_rK"] if src is None else None, e["rows_rK"], e["mine_rK"],
                            permutation=False, fused=self.fused, src_N=src)

    def token_combine(self, y_rD, st):
        if not st.extra.get("deepep"):
            return y_rD
        return _Combine.apply(y_rD, st.extra["buffer"], st.extra["handle"])  # sums each token's partials

    def combine_postprocess(self, y_TD, st):
        if not st.extra.get("deepep"):
            return super().combine_postprocess(y_TD, st)
        return y_TD  # bf16, as the experts' output is under autocast or bf16-true
