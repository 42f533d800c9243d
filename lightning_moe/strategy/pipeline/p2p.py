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


@dataclass
class PipelineGroups:
    """This rank's pipeline neighbours (global ranks) and the process groups of its four edges."""
    next_rank: int
    prev_rank: int
    send: dict = field(default_factory=dict)  # kind -> group
    recv: dict = field(default_factory=dict)  # kind -> group
    order: dict = field(default_factory=dict)  # (direction, kind) -> the group's global creation index
    embed: Optional[dist.ProcessGroup] = None  # first and last stage: gradients of tied embeddings
    # this rank's groups in the (global) order they were created: (group, "send"|"recv"|"all", peer)
    ordered: list = field(default_factory=list)

    def warmup(self, device: torch.device) -> None:
        """Connect every edge up front with one small transfer each, in the global creation order. NCCL sets up a
        peer connection on its first send/receive and blocks the host until the peer joins; inside a schedule that
        wait can close a cycle (a rank blocked posting a prefetched receive never issues the send its peer waits
        for), which hung the first NCCL runs."""
        t = torch.zeros(1 << 16, device=device)
        for g, role, peer in self.ordered:
            if role == "all":
                dist.all_reduce(t[:1], group=g)
            else:
                _p2p(dist.isend if role == "send" else dist.irecv, t, peer, g).wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def make_pipeline_groups(pp_groups, rank: int, timeout=None) -> Optional[PipelineGroups]:
    """Create the edge groups of every pipeline (collective over the world: every rank creates every group in the
    same order). ``pp_groups``: the global ranks of each pipeline in stage order."""
    kwargs = {"timeout": timeout} if timeout is not None else {}
    mine: Optional[PipelineGroups] = None
    created = 0
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
                created += 1
                if pos == i:
                    mine.send[kind], mine.order[("send", kind)] = g, created
                if pos == j:
                    mine.recv[kind], mine.order[("recv", kind)] = g, created
                if pos == i:
                    mine.ordered.append((g, "send", ranks[j]))
                elif pos == j:
                    mine.ordered.append((g, "recv", ranks[i]))
        embed_ranks = (ranks[0], ranks[-1])
        g = dist.new_group(list(embed_ranks), **kwargs)
        if pos is not None and rank in embed_ranks:
            mine.embed = g
            mine.ordered.append((g, "all", None))
    return mine


def _p2p(op, t: torch.Tensor, peer: int, group):
    # through batch_isend_irecv (as Megatron does): NCCL then uses the group's own communicator, created by
    # PipelineGroups.warmup, instead of initialising a separate pair communicator lazily mid-schedule
    return dist.batch_isend_irecv([dist.P2POp(op, t, peer, group)])[0]


class StageComm:
    """The transfers of one pipeline rank, one exchange per schedule op: the sends the previous op produced go out
    together with the receive this op needs, and all of them complete before the rank computes again.

    Completing them first is what NCCL requires of several communicators (its docs, "Using multiple NCCL
    communicators concurrently"): a receive kernel left waiting on the GPU while the host computes can be caught by an
    implicit device synchronisation (a Triton module load, a cudaFree), and then neither rank issues the send the
    other waits for -- the first NCCL runs hung exactly so. Megatron synchronises after its batched p2p for the same
    reason. The exchanges follow Megatron's structure (``schedules.exchange_phases``: a steady-state (F, B) pair
    receives both inputs at once and sends both outputs at once); ``schedules.simulate_rendezvous`` checks that no
    schedule deadlocks under these rendezvous semantics (one exchange per op does, for interleaved 1F1B)."""

    def __init__(self, groups: PipelineGroups):
        self.groups = groups

    def exchange(self, sends: list, recvs: list) -> None:
        """``sends``: [(kind, tensor)]; ``recvs``: [(kind, buffer)]. Returns when all have completed."""
        g = self.groups
        ops = [(g.order[("send", kind)], dist.isend, t.detach().contiguous(),
                g.next_rank if kind == "act" else g.prev_rank, g.send[kind]) for kind, t in sends]
        ops += [(g.order[("recv", kind)], dist.irecv, buf, g.prev_rank if kind == "act" else g.next_rank,
                 g.recv[kind]) for kind, buf in recvs]
        # both ends of every edge post in the same (global creation) order: if the GPU runs the NCCL kernels one after
        # another (e.g. CUDA_DEVICE_MAX_CONNECTIONS=1), a send queued before a receive its peer queued after its own
        # send could otherwise wait forever
        ops.sort(key=lambda o: o[0])
        works = [_p2p(op, t, peer, group) for _, op, t, peer, group in ops]
        for w in works:
            w.wait()
        if any(t.is_cuda for _, t in sends + recvs):
            torch.cuda.current_stream().synchronize()  # see the class docstring: nothing left running on the GPU
