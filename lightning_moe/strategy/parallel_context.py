"""ParallelContext: the process groups of both folded layouts, handed to the model. No module-level state.

Group names (attention layout tp-cp-dp-pp, MoE layout etp-ep-edp-pp):
  tp, cp, dp, pp, dp_cp, tp_cp, tp_dp_cp   attention / dense side
  etp, ep, edp, etp_ep                     MoE side
A group of size 1 is stored as ``None`` and every collective on it is skipped, so the same model code runs on one
process without ``torch.distributed`` being initialised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from lightning_moe.strategy.pipeline.p2p import PipelineGroups, make_pipeline_groups

GROUP_NAMES = ("tp", "cp", "dp", "pp", "dp_cp", "tp_cp", "tp_dp_cp", "etp", "ep", "edp", "etp_ep")


@dataclass
class ParallelContext:
    world_size: int = 1
    global_rank: int = 0
    sizes: dict[str, int] = field(default_factory=lambda: {n: 1 for n in GROUP_NAMES})
    ranks: dict[str, int] = field(default_factory=lambda: {n: 0 for n in GROUP_NAMES})
    groups: dict[str, Optional[dist.ProcessGroup]] = field(default_factory=lambda: {n: None for n in GROUP_NAMES})
    # the global ranks of each group this rank belongs to, in group-rank order
    members: dict[str, list[int]] = field(default_factory=dict)
    layout: object = None  # lightning_moe.strategy.layout.Layout when built by the strategy
    sequence_parallel: bool = False
    virtual_pipeline_size: Optional[int] = None
    # explicit layer counts of the first/last virtual pipeline stages (None: even split), see pipeline/partition.py
    pipeline_first_layers: Optional[int] = None
    pipeline_last_layers: Optional[int] = None
    pipeline: Optional[PipelineGroups] = None  # neighbours and p2p groups when pp > 1
    # communication buffers the layers share (DeepEP's NVLink buffer), keyed by purpose and group; made lazily
    comm_buffers: dict = field(default_factory=dict)

    @classmethod
    def single(cls) -> "ParallelContext":
        """The context of a one-process run: every group has size 1."""
        return cls(members={n: [0] for n in GROUP_NAMES})

    @classmethod
    def from_layout(cls, layout, rank: int, sequence_parallel: bool = False, timeout=None,
                    pipeline_first_layers: Optional[int] = None,
                    pipeline_last_layers: Optional[int] = None) -> "ParallelContext":
        """Create every process group of both layouts (collective: all ranks call this in the same order)."""
        groups, members, made = {}, {}, {}
        for name in GROUP_NAMES:
            all_groups = [list(g) for g in layout.groups[name]]
            mine = list(layout.group_of(name, rank))
            members[name] = mine
            if len(mine) == 1:
                groups[name] = None
                continue
            kwargs = {"timeout": timeout} if timeout is not None else {}
            # new_group is collective over the world: every rank creates every group, keeping its own
            for ranks in all_groups:
                key = tuple(ranks)
                if key not in made:  # kinds with the same ranks (e.g. dp, dp_cp, ep when folded) share one
                    made[key] = dist.new_group(ranks, **kwargs)
                if rank in ranks:
                    groups[name] = made[key]
        pipeline = make_pipeline_groups(layout.groups["pp"], rank, timeout)
        return cls(world_size=layout.world_size, global_rank=rank,
                   sizes={n: len(members[n]) for n in GROUP_NAMES},
                   ranks={n: layout.rank_in(n, rank) for n in GROUP_NAMES},
                   groups=groups, members=members, layout=layout, sequence_parallel=sequence_parallel,
                   virtual_pipeline_size=layout.vpp, pipeline_first_layers=pipeline_first_layers,
                   pipeline_last_layers=pipeline_last_layers, pipeline=pipeline)

    def size(self, name: str) -> int:
        return self.sizes[name]

    def rank(self, name: str) -> int:
        return self.ranks[name]

    def group(self, name: str) -> Optional[dist.ProcessGroup]:
        return self.groups[name]

    # convenient aliases used all over the model code
    tp = property(lambda self: self.sizes["tp"])
    cp = property(lambda self: self.sizes["cp"])
    dp = property(lambda self: self.sizes["dp"])
    pp = property(lambda self: self.sizes["pp"])
    ep = property(lambda self: self.sizes["ep"])
    etp = property(lambda self: self.sizes["etp"])
    edp = property(lambda self: self.sizes["edp"])

    @property
    def vpp(self) -> int:
        return self.virtual_pipeline_size or 1

    def swap(self, **entries: tuple[int, int, Optional[dist.ProcessGroup]]) -> dict:
        """Replace the (size, rank, group) of named groups, e.g. ``cp`` for one micro-batch
        (``DynamicContextParallel``); returns the entries it replaced, to swap back. ``members`` and ``layout`` keep
        the static layout."""
        old = {n: (self.sizes[n], self.ranks[n], self.groups[n]) for n in entries}
        for n, (size, rank, group) in entries.items():
            self.sizes[n], self.ranks[n], self.groups[n] = size, rank, group
        return old

    def all_reduce_(self, t: torch.Tensor, name: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In-place all-reduce over a named group; a no-op for a group of size 1. Not differentiable."""
        if self.sizes[name] > 1:
            dist.all_reduce(t, op=op, group=self.groups[name])
        return t

    def __repr__(self) -> str:
        dims = " ".join(f"{n}={self.sizes[n]}" for n in ("tp", "cp", "dp", "pp", "etp", "ep", "edp"))
        return f"ParallelContext(rank={self.global_rank}/{self.world_size}, {dims})"
