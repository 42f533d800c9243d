"""Point-to-point transfers between pipeline stages.

Every (directed edge, kind) of the pipeline ring has its own two-rank process group: ``act`` carries forward
activations from position i to i+1, ``grad`` carries input gradients from position i to i-1 (positions mod pp, so
the last rank feeds the first one's next model chunk under interleaving). Each group therefore carries messages in
one direction of one kind only, in the order the schedules produce and consume them (checked by
``schedules.check_p2p_order``). This is what makes untagged FIFO matching safe on NCCL, and it means no stream ever
holds a send queued behind a receive from the same peer, which could deadlock. Shapes and dtypes are known ahead (every
stage sees the same batch), so there is no shape handshake.

With ``overlap_p2p_comm`` (``OverlappedComm``) the transfers instead go through one group per pipeline (``ring``): a
post of the plan is one batch_isend_irecv there, and the plan (``schedules.overlap_plan``) fixes a message order
that both ends of every pair share (``schedules.plan_problems``).
"""

from __future__ import annotations

from collections import deque
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
    ring: Optional[dist.ProcessGroup] = None  # every rank of this pipeline: the overlapped executor's batches

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

    def warmup_ring(self, device: torch.device) -> None:
        """Connect the ring group to both neighbours before the first schedule (see ``warmup``): a collective first
        (torch wants every rank of a group in its first batched p2p), then one batch both ways round the ring, which
        every rank posts at once; then the tied-embedding group, as ``warmup`` does."""
        t = torch.zeros(1 << 16, device=device)
        dist.all_reduce(t[:1], group=self.ring)
        bufs = [torch.empty_like(t), torch.empty_like(t)]
        ops = [dist.P2POp(dist.isend, t, self.next_rank, self.ring), dist.P2POp(dist.irecv, bufs[0], self.prev_rank,
                                                                                 self.ring),
               dist.P2POp(dist.isend, t, self.prev_rank, self.ring), dist.P2POp(dist.irecv, bufs[1], self.next_rank,
                                                                                 self.ring)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        if self.embed is not None:
            dist.all_reduce(t[:1], group=self.embed)
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
        g = dist.new_group(list(ranks), **kwargs)
        if pos is not None:
            mine.ring = g
    return mine


def _p2p(op, t: torch.Tensor, peer: int, group):
    # through batch_isend_irecv (as Megatron does): NCCL then uses the group's own communicator, created by
    # PipelineGroups.warmup, instead of initialising a separate pair communicator lazily mid-schedule
    return dist.batch_isend_irecv([dist.P2POp(op, t, peer, group)])[0]


class StageComm:
    """The synchronous transfers of one pipeline rank (``overlap_p2p_comm=False``), one exchange per post of
    ``schedules.phase_plan``: the sends the previous phase produced go out together with the receives this phase
    needs, and all of them complete before the rank computes again.

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

    # the executor's interface (OverlappedComm's): messages are (kind, microbatch, stage)
    def post(self, index: int, sends: list, recvs: list) -> None:
        self.exchange([(msg[0], t) for msg, t in sends], [(msg[0], buf) for msg, buf in recvs])

    def wait(self, index: int) -> None:
        pass  # post already completed it

    def finish(self) -> None:
        pass


class OverlappedComm:
    """The transfers of one pipeline rank that overlap its compute (``overlap_p2p_comm=True``), posted as
    ``schedules.overlap_plan`` says: each post is one ``batch_isend_irecv`` on the pipeline's ``ring`` group, so a
    post's transfers are one NCCL group launch that progresses as a whole, and a rank's posts complete one after
    another on that communicator's stream. Under exactly these rules ``schedules.simulate_plans`` proves the plans
    free of deadlock even when a host blocks on its pending receives at any moment (the implicit device
    synchronisation that hung the first version, which prefetched each next op's input: a plan that check rejects).

    An op waits only for the batch holding its input, and only on the GPU: ``Work.wait`` makes the current stream
    wait for NCCL's, the host runs on and launches the op. Each batch's tensors stay referenced until it has been
    waited for, so the caching allocator never hands a buffer NCCL still reads or writes to a later kernel.
    Collectives on other communicators (EP all-to-all, DP gradient buckets) run while a batch is pending, as in
    Megatron's ``overlap_p2p_comm``."""

    def __init__(self, groups: PipelineGroups):
        self.groups = groups
        self._pending: deque = deque()  # (post index, works, tensors) not yet waited for, in posting order

    def post(self, index: int, sends: list, recvs: list) -> None:
        """``sends``: [(message, tensor)]; ``recvs``: [(message, buffer)]; returns at once."""
        g = self.groups
        ops = [(msg, dist.isend, t.detach().contiguous(), g.next_rank if msg[0] == "act" else g.prev_rank)
               for msg, t in sends]
        ops += [(msg, dist.irecv, buf, g.prev_rank if msg[0] == "act" else g.next_rank) for msg, buf in recvs]
        # by message: the order in which the other end posts them too (schedules.plan_problems checks it), since
        # NCCL matches a pair's messages in order and with pp = 2 one pair carries activations and gradients
        ops.sort(key=lambda o: o[0])
        works = dist.batch_isend_irecv([dist.P2POp(op, t, peer, g.ring) for _, op, t, peer in ops])
        self._pending.append((index, works, [t for _, _, t, _ in ops]))

    def wait(self, index: int) -> None:
        """The current stream waits for post ``index`` and the ones before it (earlier on the same NCCL stream, so
        this adds no delay); their tensors are released."""
        while self._pending and self._pending[0][0] <= index:
            for w in self._pending.popleft()[1]:
                w.wait()

    def finish(self) -> None:
        while self._pending:
            for w in self._pending.popleft()[1]:
                w.wait()
