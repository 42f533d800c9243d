"""A test double of DeepEP's intranode Buffer on gloo, so the ``deepep`` dispatcher's logic runs in CPU parity tests.

It keeps DeepEP's contract as its kernels define it (csrc/kernels/intranode.cu, v1.2.1): a token travels once to each
rank holding one of its experts; received rows are ordered by source rank, then token; top-k ids arrive as local
ids (-1 elsewhere) with weight 0 where not local; ``num_worst_tokens`` pads the receive side with rows whose ids are
-1; combine sums each token's rows (and weights) over the ranks; a dispatch with a handle repeats the layout.
The real kernels are checked against the same parity cases on GPUs (LMOE_PARITY_ACCELERATOR=gpu).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_moe.modules.deepep_dispatcher import DeepEPDispatcher


def _exchange(x, send_rows, recv_rows, group):
    out = x.new_empty((sum(recv_rows), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_rows, send_rows, group=group)
    return out


class FakeBuffer:
    wire_dtype = None  # keep the dtype: float32 parity on CPU

    def __init__(self, group):
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)

    def get_dispatch_layout(self, topk_idx, num_experts):
        L = num_experts // self.size
        ok = topk_idx >= 0
        dest_TK = torch.where(ok, topk_idx // L, self.size)  # dropped copies: a spare column
        in_rank = torch.zeros(topk_idx.shape[0], self.size + 1, dtype=torch.bool).scatter_(1, dest_TK, True)
        in_rank = in_rank[:, : self.size].contiguous()
        per_expert = torch.bincount(topk_idx[ok], minlength=num_experts).int()
        return in_rank.sum(0).int(), None, per_expert, in_rank, None

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, **_):
        if handle is not None:  # repeat a layout (the backward of combine)
            tok_n, send, recv, worst = handle
            out = _exchange(x[tok_n], send, recv, self.group)
            return self._pad(out, worst), None, None, None, None, None
        in_rank = is_token_in_rank
        dest_n, tok_n = in_rank.t().nonzero(as_tuple=True)  # rank-major, token order within a rank
        send = in_rank.sum(0).tolist()
        counts = torch.tensor(send)
        recv_t = torch.empty_like(counts)
        dist.all_to_all_single(recv_t, counts, group=self.group)
        recv = recv_t.tolist()
        L = num_tokens_per_expert.shape[0] // self.size
        local_nK = topk_idx[tok_n] - dest_n.unsqueeze(1) * L
        on_dest = (topk_idx[tok_n] >= 0) & (local_nK >= 0) & (local_nK < L)
        idx_nK = torch.where(on_dest, local_nK, -1)
        w_nK = torch.where(on_dest, topk_weights[tok_n], 0.0)
        outs = [_exchange(t, send, recv, self.group) for t in (x[tok_n], idx_nK, w_nK)]
        worst = num_worst_tokens
        r_x, r_idx, r_w = self._pad(outs[0], worst), self._pad(outs[1], worst, -1), self._pad(outs[2], worst)
        counts_list = [] if worst else torch.bincount(r_idx[r_idx >= 0], minlength=L).tolist()
        return r_x, r_idx, r_w, counts_list, (tok_n, send, recv, worst), None

    def combine(self, x, handle, topk_weights=None, **_):
        tok_n, send, recv, worst = handle
        n = sum(recv)
        back = _exchange(x[:n], recv, send, self.group)
        out = x.new_zeros(self.T, x.shape[1]).index_add_(0, tok_n, back)
        w = None
        if topk_weights is not None:
            w = topk_weights.new_zeros(self.T, topk_weights.shape[1]).index_add_(
                0, tok_n, _exchange(topk_weights[:n], recv, send, self.group))
        return out, w, None

    @staticmethod
    def _pad(t, worst, value=0):
        if not worst:
            return t
        return torch.cat([t, t.new_full((worst - t.shape[0], *t.shape[1:]), value)])


class GlooDeepEPDispatcher(DeepEPDispatcher):
    """The ``deepep`` dispatcher with the fake buffer: CPU, float32."""

    def _import(self):
        return None

    def _buffer(self, hidden):
        key = ("fake_deepep", hidden)
        if key not in self.ctx.comm_buffers:
            self.ctx.comm_buffers[key] = FakeBuffer(self.ctx.group("ep"))
        return self.ctx.comm_buffers[key]

    def _check_input(self, x_TD):
        pass

    def token_dispatch(self, x_TD, st):
        if st.extra.get("deepep"):
            self._buffer(x_TD.shape[1]).T = x_TD.shape[0]  # combine returns one row per local token
        return super().token_dispatch(x_TD, st)


class GlooDeepEPSyncFree(GlooDeepEPDispatcher):
    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.sync_free = True
