"""Point-to-point transfers between pipeline stages.

Every (directed edge, kind) of the pipeline ring has its own two-rank process group: ``act`` carries forward
activations from position i to i+1, ``grad`` carries input gradients from position i to i-1 (positions mod pp, so
the last rank feeds the first one's next model chunk under interleaving). Each group therefore carries messages in
one direction of one kind only, in the order the schedules produce and consume them (checked by
``schedules.check_p2p_order``). This is what makes untagged FIFO matching safe on NCCL, and it means no stream ever
holds a send queued behind a receive from the same peer, which could deadlock. Shapes and dtypes are known ahead (every
stage sees the same batch), so there is no shape handshake.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

KINDS = ("act", "grad")


@dataclass
class PipelineGroups:
    """This rank's pipeline neighbours (global ranks) and the process groups of its four edges."""
    next_rank: int
    prev_rank: int
    send: dict = field(default_factory=dict)  # kind -> group
    recv: dict = field(default_factory=dict)  # kind -> group
    embed: Optional[dist.ProcessGroup] = None  # first and last stage: gradients of tied embeddings
    embed_ranks: tuple = ()
    ordered: list = field(default_factory=list)  # this rank's groups in the (global) order they were created

    def warmup(self, device: torch.device) -> None:
        """Create every communicator up front, in the global creation order (no rank waits on a peer that is
        initialising another one, which lazy NCCL initialisation inside a schedule could cause)."""
        t = torch.zeros(1, device=device)
        for g in self.ordered:
            dist.all_reduce(t, group=g)


def make_pipeline_groups(pp_groups, rank: int, timeout=None) -> Optional[PipelineGroups]:
    """Create the edge groups of every pipeline (collective over the world: every rank creates every group in the
    same order). ``pp_groups``: the global ranks of each pipeline in stage order."""
    kwargs = {"timeout": timeout} if timeout is not None else {}
    mine: Optional[PipelineGroups] = None
    for ranks in pp_groups:
        pp = len(ranks)
        if pp == 1:
            return None
        pos = ranks.index(rank) if rank in ranks else None
        if pos is not None:
            mine = PipelineGroups(next_rank=ranks[(pos + 1) % pp], prev_rank=ranks[(pos - 1) % pp])
        for kind, step in (("act", 1), ("grad", -1)):
            for i in range(pp):
                j = (i + step) % pp
                g = dist.new_group(sorted({ranks[i], ranks[j]}), **kwargs)
                if pos == i:
                    mine.send[kind] = g
                if pos == j:
                    mine.recv[kind] = g
                if pos in (i, j):
                    mine.ordered.append(g)
        embed_ranks = (ranks[0], ranks[-1])
        g = dist.new_group(list(embed_ranks), **kwargs)
        if pos is not None and rank in embed_ranks:
            mine.embed, mine.embed_ranks = g, embed_ranks
            mine.ordered.append(g)
    return mine


def _p2p(op, t: torch.Tensor, peer: int, group):
    # through batch_isend_irecv (as Megatron does): NCCL then uses the group's own communicator, created by
    # PipelineGroups.warmup, instead of initialising a separate pair communicator lazily mid-schedule
    return dist.batch_isend_irecv([dist.P2POp(op, t, peer, group)])[0]


class StageComm:
    """Asynchronous sends and receives of one pipeline rank. Sends are waited for at ``finish`` (the tensors are
    kept alive until then); a receive returns its buffer and a work handle to wait on before use."""

    def __init__(self, groups: PipelineGroups):
        self.groups = groups
        self._sends: list = []

    def send(self, kind: str, t: torch.Tensor) -> None:
        dst = self.groups.next_rank if kind == "act" else self.groups.prev_rank
        t = t.detach().contiguous()
        self._sends.append((_p2p(dist.isend, t, dst, self.groups.send[kind]), t))

    def recv(self, kind: str, shape, dtype: torch.dtype, device: torch.device):
        src = self.groups.prev_rank if kind == "act" else self.groups.next_rank
        buf = torch.empty(shape, dtype=dtype, device=device)
        return buf, _p2p(dist.irecv, buf, src, self.groups.recv[kind])

    def finish(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
