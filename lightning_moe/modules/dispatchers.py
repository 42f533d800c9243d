"""The all-to-all and all-gather token dispatchers (Megatron's two classic designs) on the TokenDispatcher interface.

AllToAllDispatcher: permute locally by global expert, all-to-all over EP, all-gather over ETP, experts,
reduce-scatter over ETP, all-to-all back, unpermute. Dropless split sizes are data-dependent, so one small
device->host copy per layer is unavoidable there (Megatron pays the same); padded capacity has static splits.

AllGatherDispatcher: all-gather every token of the ETP x EP group, run the local experts on the copies routed to
them, weight by the router probabilities, reduce-scatter the sums back. All shapes are static: no host sync.
"""

from __future__ import annotations

import torch

from lightning_moe.modules.dispatcher import DispatchState, TokenDispatcher
from lightning_moe.modules.permute import combine_rows, gather_tokens, permute_rows
from lightning_moe.strategy import comm


class AllToAllDispatcher(TokenDispatcher):
    def dispatch_preprocess(self, x_TD, route):
        x_ND, st = super().dispatch_preprocess(x_TD, route)
        ep, etp, L = self.ctx.ep, self.ctx.etp, self.num_local_experts
        if ep == 1 and etp == 1:
            return x_ND, st
        if self.pad_to_capacity:  # static splits: every (source, local expert) block is C rows, no exchange
            C = x_ND.shape[0] // self.num_experts
            send, recv_host, kept = [L * C] * ep, [C] * (etp * ep * L), x_ND.shape[0]
            recv_SL = torch.full((etp * ep, L), C, device=x_ND.device, dtype=torch.int64)
        else:
            # rows each (source rank, local expert) pair exchanges: counts travel first, over EP then ETP
            counts_PL = st.tokens_per_expert_E.view(ep, L)
            recv_PL = comm.all_gather_nograd(counts_PL, self.ctx.group("ep")).view(ep, ep, L)[:, self.ctx.rank("ep")]
            recv_SL = comm.all_gather_nograd(recv_PL, self.ctx.group("etp"))  # S = etp * ep sources, etp-major
            # the one host sync of a dropless step: split sizes for all_to_all_single
            host = torch.cat([counts_PL.sum(1), recv_SL.flatten()]).cpu().tolist()
            send, recv_host = host[:ep], host[ep:]
            kept = sum(send)
        st.extra.update(send=send, recv_SL=recv_SL, recv_host=recv_host, kept=kept, num_rows=x_ND.shape[0])
        st.has_tail = False  # only kept rows travel
        return x_ND[:kept], st

    def token_dispatch(self, x_ND, st):
        if "send" not in st.extra:
            return x_ND
        ep, etp, L = self.ctx.ep, self.ctx.etp, self.num_local_experts
        rh = st.extra["recv_host"]
        per_src = [sum(rh[s * L:(s + 1) * L]) for s in range(etp * ep)]
        ep_recv = per_src[self.ctx.rank("etp") * ep:(self.ctx.rank("etp") + 1) * ep]
        x_MD = comm.all_to_all(x_ND, ep_recv, st.extra["send"], self.ctx.group("ep"))
        etp_sizes = [sum(per_src[j * ep:(j + 1) * ep]) for j in range(etp)]
        st.extra.update(ep_recv=ep_recv, etp_sizes=etp_sizes)
        return comm.all_gather_v(x_MD, etp_sizes, self.ctx.group("etp"))

    def dispatch_postprocess(self, x_MD, st):
        if "send" not in st.extra:
            return x_MD, st.tokens_per_expert_E
        # rows arrive grouped by (source, local expert); the experts want them grouped by local expert
        L, counts_SL = self.num_local_experts, st.extra["recv_SL"]  # on the device already: no host copy
        expert_of_row = torch.repeat_interleave(torch.arange(L, device=x_MD.device).repeat(counts_SL.shape[0]),
                                                counts_SL.flatten(),
                                                output_size=x_MD.shape[0])
        order_M = torch.argsort(expert_of_row, stable=True)
        inverse_M = torch.empty_like(order_M).scatter_(0, order_M, torch.arange(len(order_M), device=x_MD.device))
        st.extra.update(order_M=order_M, inverse_M=inverse_M)
        return permute_rows(x_MD, order_M, inverse_M), counts_SL.sum(0)

    def combine_preprocess(self, y_MD, st):
        if "send" not in st.extra:
            return y_MD
        return permute_rows(y_MD, st.extra["inverse_M"], st.extra["order_M"])

    def token_combine(self, y_MD, st):
        if "send" not in st.extra:
            return y_MD
        y_MD = comm.reduce_scatter_v(y_MD, st.extra["etp_sizes"], self.ctx.group("etp"))
        y_ND = comm.all_to_all(y_MD, st.extra["send"], st.extra["ep_recv"], self.ctx.group("ep"))
        missing = st.extra["num_rows"] - y_ND.shape[0]  # dropped copies: never read back, pad to keep indices valid
        return torch.cat([y_ND, y_ND.new_zeros(missing, y_ND.shape[1])]) if missing else y_ND


class AllGatherDispatcher(TokenDispatcher):
    def dispatch_preprocess(self, x_TD, route):
        st = DispatchState(x_TD.shape[0], None, route.probs_TK, route.keep_TK, route.tokens_per_expert_E)
        st.extra["experts_TK"] = route.experts_TK  # rows are known only after the gather
        return x_TD, st

    def token_dispatch(self, x_TD, st):
        g = self.ctx.group("etp_ep")
        experts_TK = st.extra["experts_TK"]
        keep_TK = st.keep_TK if st.keep_TK is not None else torch.ones_like(experts_TK, dtype=torch.bool)
        st.extra.update(experts=comm.all_gather_nograd(experts_TK, g),
                        keep=comm.all_gather_nograd(keep_TK.to(torch.uint8), g).bool(),
                        probs=comm.all_gather(st.probs_TK, g))
        return comm.all_gather(x_TD, g)

    def dispatch_postprocess(self, x_PTD, st):
        # copies routed to this rank's experts first (in local-expert order), everything else behind a sentinel
        L, K = self.num_local_experts, self.topk
        local_PTK = st.extra["experts"] - self.local_expert_offset
        mine_PTK = (local_PTK >= 0) & (local_PTK < L) & st.extra["keep"]
        key_N = torch.where(mine_PTK, local_PTK, L).reshape(-1)
        counts_L = torch.zeros(L + 1, device=x_PTD.device, dtype=torch.int64).scatter_add_(
            0, key_N, torch.ones_like(key_N))[:L]
        order_N = torch.argsort(key_N, stable=True)
        rank_N = torch.empty_like(order_N).scatter_(0, order_N, torch.arange(len(order_N), device=x_PTD.device))
        st.extra.update(mine=mine_PTK, rows=rank_N.view(mine_PTK.shape))
        st.has_tail = True
        return gather_tokens(x_PTD, order_N // K, st.extra["rows"], mine_PTK), counts_L

    def combine_preprocess(self, y_ND, st):
        return combine_rows(y_ND, st.extra["probs"], st.extra["rows"], st.extra["mine"])

    def token_combine(self, y_PTD, st):
        return comm.reduce_scatter(y_PTD, self.ctx.group("etp_ep"))

    def combine_postprocess(self, y_TD, st):
        return y_TD
