"""The all-to-all and all-gather token dispatchers (Megatron's two classic designs) on the TokenDispatcher interface.

AllToAllDispatcher: permute locally by global expert, all-to-all over EP, all-gather over ETP, experts,
reduce-scatter over ETP, all-to-all back, unpermute. Dropless split sizes are data-dependent, so one small
device->host copy per layer is unavoidable there (Megatron pays the same); padded capacity has static splits.
With ``fp8_dispatch`` (set by ``FP8Training``) the token all-to-all carries E4M3 rows and their scales
(``fp8_dispatch.py``); the combine stays in the activations' precision.

AllGatherDispatcher: all-gather every token of the ETP x EP group, run the local experts on the copies routed to
them, weight by the router probabilities, reduce-scatter the sums back. All shapes are static: no host sync.
"""

from __future__ import annotations

import torch

from lightning_moe.modules.dispatcher import DispatchState, TokenDispatcher
from lightning_moe.modules.fp8_dispatch import fp8_all_to_all
from lightning_moe.modules.expert_order import expert_order, resort_by_expert
from lightning_moe.modules.permute import combine_rows, gather_tokens, move_rows, take_rows
from lightning_moe.strategy import comm


class AllToAllDispatcher(TokenDispatcher):
    fp8_dispatch = False  # FP8Training(fp8_dispatch=True): tokens travel in E4M3 with a scale per row

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
        if st.probs_M is not None:  # the rows' probabilities travel with them (float32, also under FP8 dispatch)
            st.extra["probs_N"], st.probs_M = st.probs_M[:kept], None
        st.has_tail = False  # only kept rows travel
        return x_ND[:kept], st

    def token_dispatch(self, x_ND, st):
        if "send" not in st.extra:  # one rank: FP8 dispatch still rounds here, so that it matches the EP run
            return fp8_all_to_all(x_ND) if self.fp8_dispatch else x_ND
        ep, etp, L = self.ctx.ep, self.ctx.etp, self.num_local_experts
        rh = st.extra["recv_host"]
        per_src = [sum(rh[s * L:(s + 1) * L]) for s in range(etp * ep)]
        ep_recv = per_src[self.ctx.rank("etp") * ep:(self.ctx.rank("etp") + 1) * ep]
        all_to_all = fp8_all_to_all if self.fp8_dispatch else comm.all_to_all
        x_MD = all_to_all(x_ND, ep_recv, st.extra["send"], self.ctx.group("ep"))
        etp_sizes = [sum(per_src[j * ep:(j + 1) * ep]) for j in range(etp)]
        st.extra.update(ep_recv=ep_recv, etp_sizes=etp_sizes)
        if "probs_N" in st.extra:
            p_M1 = comm.all_to_all(st.extra.pop("probs_N").unsqueeze(1), ep_recv, st.extra["send"], self.ctx.group("ep"))
            st.extra["probs_M"] = comm.all_gather_v(p_M1, etp_sizes, self.ctx.group("etp"))
        return comm.all_gather_v(x_MD, etp_sizes, self.ctx.group("etp"))

    def dispatch_postprocess(self, x_MD, st):
        if "send" not in st.extra:  # EP = ETP = 1: laid out by dispatch_preprocess, padded to expert_rows_align
            return x_MD, st.extra.get("sizes_E", st.tokens_per_expert_E)
        # rows arrive grouped by (source, local expert); the experts want them grouped by local expert, which the
        # counts alone give (on the device already: no host copy, no argsort)
        dest_M, sizes_L, R = resort_by_expert(st.extra["recv_SL"], x_MD.shape[0], self.cfg.expert_rows_align,
                                              self.fused)
        st.extra.update(dest_M=dest_M)
        if "probs_M" in st.extra:
            st.probs_M = move_rows(st.extra.pop("probs_M"), dest_M, R).squeeze(1)
        return move_rows(x_MD, dest_M, R), sizes_L

    def experts_read_preprocess(self) -> bool:
        return self.ctx.ep == 1 and self.ctx.etp == 1  # else dispatch_postprocess re-sorts (and pads) what arrives

    def combine_preprocess(self, y_MD, st):
        if "send" not in st.extra:
            return y_MD
        return take_rows(y_MD, st.extra["dest_M"])

    def token_combine(self, y_MD, st):
        if "send" not in st.extra:
            return y_MD
        y_MD = comm.reduce_scatter_v(y_MD, st.extra["etp_sizes"], self.ctx.group("etp"))
        y_ND = comm.all_to_all(y_MD, st.extra["send"], st.extra["ep_recv"], self.ctx.group("ep"))
        missing = st.extra["num_rows"] - y_ND.shape[0]  # dropped copies: never read back, pad to keep indices valid
        return torch.cat([y_ND, y_ND.new_zeros(missing, y_ND.shape[1])]) if missing else y_ND


class AllGatherDispatcher(TokenDispatcher):
    def rows_feed_experts(self) -> bool:
        return False  # its gathers run in dispatch_postprocess, which does not quantize for the experts

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
        align = self.cfg.expert_rows_align
        o = expert_order(key_N, L, div=K, align=align, fused=self.fused)
        st.extra.update(mine=mine_PTK, rows=o.rows_N.view(mine_PTK.shape), holes=align > 1)
        st.has_tail = True
        x_ND = gather_tokens(x_PTD, o.src_R, st.extra["rows"], mine_PTK, zero_row=align > 1, fused=self.fused)
        self.weight_rows(st, st.extra["probs"], st.extra["rows"], mine_PTK, x_ND.shape[0], o.src_R)
        return x_ND, o.sizes_E

    def combine_preprocess(self, y_ND, st):
        src = st.extra.get("src") if st.probs_applied else None
        return combine_rows(y_ND, st.extra["probs"] if src is None else None, st.extra["rows"], st.extra["mine"],
                            permutation=not st.extra["holes"], fused=self.fused, src_N=src)

    def token_combine(self, y_PTD, st):
        return comm.reduce_scatter(y_PTD, self.ctx.group("etp_ep"))

    def combine_postprocess(self, y_TD, st):
        return y_TD


class AllToAllDedupDispatcher(TokenDispatcher):
    """All-to-all that sends each token once per destination EP rank (as DeepEP does), not once per expert copy.

    A token travels with its K slots (the local expert id on that rank, or -1) and router probabilities; the
    receiver permutes its rows' slots into local-expert order, runs the experts, and sums each row's slots weighted
    by the probabilities before sending one partial output per (token, rank) back. At E=128, k=8, EP=2 the traffic
    to the other rank drops ~4x. Dropless and capacity-dropping; ETP gathers rows over the ETP group as above.
    """

    def dispatch_preprocess(self, x_TD, route):
        ep, etp, L = self.ctx.ep, self.ctx.etp, self.num_local_experts
        if ep == 1 and etp == 1:
            return super().dispatch_preprocess(x_TD, route)
        T, K = route.experts_TK.shape
        keep_TK = route.keep_TK if route.keep_TK is not None else torch.ones_like(route.experts_TK, dtype=torch.bool)
        dest_TK = route.experts_TK // L
        slot_TKP = (dest_TK.unsqueeze(-1) == torch.arange(ep, device=x_TD.device)) & keep_TK.unsqueeze(-1)
        pair_TP = slot_TKP.any(1)
        # per destination: rows (distinct tokens) and slots (expert copies), exchanged together
        send_P2 = torch.stack([pair_TP.sum(0), slot_TKP.sum((0, 1))], dim=1)
        recv_P2 = comm.all_to_all(send_P2, [1] * ep, [1] * ep, self.ctx.group("ep"))
        recv_JP2 = comm.all_gather_nograd(recv_P2, self.ctx.group("etp")).view(etp, ep, 2)
        # the one host sync: split sizes for the all-to-all and the ETP gather, and the receiver's slot count
        host = torch.cat([send_P2[:, 0], recv_JP2.flatten()]).cpu().tolist()
        send, recv_JP2_host = host[:ep], host[ep:]
        recv_JP_host = [recv_JP2_host[j * 2 * ep:(j + 1) * 2 * ep:2] for j in range(etp)]
        local_slots = sum(recv_JP2_host[1::2])  # slots for this rank's experts, over every source of the group
        n = sum(send)
        # rows in (destination, token) order; rows_TP[t, p] = row of pair (t, p), or the spare index n if absent
        key_X = torch.where(pair_TP.t(), torch.arange(ep, device=x_TD.device).unsqueeze(1), ep).flatten()
        o = expert_order(key_X, ep, fused=self.fused)  # pairs grouped by destination, token order within
        rows_TP = torch.where(pair_TP, o.rows_N.view(ep, T).t(), n)
        order_n = o.src_R[:n]
        dest_n, tok_n = order_n // T, order_n % T
        on_dest_nK = (dest_TK[tok_n] == dest_n.unsqueeze(1)) & keep_TK[tok_n]
        slots_nK = torch.where(on_dest_nK, route.experts_TK[tok_n] - dest_n.unsqueeze(1) * L, -1)
        st = DispatchState(T, rows_TP, route.probs_TK, pair_TP, route.tokens_per_expert_E)
        st.extra.update(dedup=True, send=send, recv_JP=recv_JP_host, n=n, slots=slots_nK, local_slots=local_slots,
                        probs=route.probs_TK.index_select(0, tok_n))
        return gather_tokens(x_TD, tok_n, rows_TP, pair_TP, fused=self.fused), st

    def token_dispatch(self, x_nD, st):
        if not st.extra.get("dedup"):
            return x_nD
        e = st.extra
        j = self.ctx.rank("etp")
        recv, etp_sizes = e["recv_JP"][j], [sum(r) for r in e["recv_JP"]]
        g_ep, g_etp = self.ctx.group("ep"), self.ctx.group("etp")
        moved = [comm.all_gather_v(comm.all_to_all(t, recv, e["send"], g_ep), etp_sizes, g_etp)
                 for t in (x_nD, e["slots"], e["probs"])]
        e.update(recv=recv, etp_sizes=etp_sizes, slots_rK=moved[1], probs_rK=moved[2])
        return moved[0]

    def dispatch_postprocess(self, x_rD, st):
        if not st.extra.get("dedup"):
            return super().dispatch_postprocess(x_rD, st)
        # the receiver's local permute: the slots of its rows that belong here, in local-expert order; the count M
        # came with the split sizes, so the expert input has exactly M rows (no tail of other ranks' slots)
        L, slots_rK, M = self.num_local_experts, st.extra["slots_rK"], st.extra["local_slots"]
        R, K = slots_rK.shape
        mine_rK = slots_rK >= 0
        key_N = torch.where(mine_rK, slots_rK, L).reshape(-1)
        align = self.cfg.expert_rows_align
        o = expert_order(key_N, L, div=K, align=align, fused=self.fused)
        M += L * (align - 1)  # room for every expert's padding; the other ranks' slots sort after it
        rows_rK = torch.where(mine_rK, o.rows_N.view(R, K), M)  # other ranks' slots point at the spare row M
        st.extra.update(rows_rK=rows_rK, mine_rK=mine_rK)
        st.has_tail = False
        x_MD = gather_tokens(x_rD, o.src_R[:M], rows_rK, mine_rK, zero_row=align > 1, fused=self.fused)
        self.weight_rows(st, st.extra["probs_rK"], rows_rK, mine_rK, M, o.src_R[:M], key="recv_src")
        return x_MD, o.sizes_E

    def combine_preprocess(self, y_ND, st):
        if not st.extra.get("dedup"):
            return y_ND
        e = st.extra
        # one partial output per row; rows_rK does not cover M exactly once (spare row M), hence permutation=False
        src = e.get("recv_src") if st.probs_applied else None
        return combine_rows(y_ND, e["probs_rK"] if src is None else None, e["rows_rK"], e["mine_rK"],
                            permutation=False, fused=self.fused, src_N=src)

    def token_combine(self, y_rD, st):
        if not st.extra.get("dedup"):
            return y_rD
        e = st.extra
        y_rD = comm.reduce_scatter_v(y_rD, e["etp_sizes"], self.ctx.group("etp"))
        return comm.all_to_all(y_rD, e["send"], e["recv"], self.ctx.group("ep"))

    def combine_postprocess(self, y_nD, st):
        if not st.extra.get("dedup"):
            return super().combine_postprocess(y_nD, st)
        # each token's output is the sum of its (token, rank) partial outputs: weights 1, absent pairs masked
        ones_TP = torch.ones(st.rows_TK.shape, device=y_nD.device, dtype=torch.float32)
        return combine_rows(y_nD, ones_TP, st.rows_TK, st.keep_TK, permutation=False, fused=self.fused)
