"""Which groups of a folded layout cross nodes (pure rank math, no torch).

The global rank order follows the layout (``layout.py``): TP varies fastest, then CP, DP, PP in the attention
layout, and ETP, then EP, EDP, PP in the MoE layout. torchrun, and srun with its default block distribution, give each
node consecutive global ranks. So a group stays inside a node when its *span* divides the number of ranks per node:
the span is the product of its own axis and of the faster ones (``tp`` for TP, ``tp*cp`` for CP, ``etp`` for ETP,
``etp*ep`` for EP). DP, EDP and PP are the outer axes: they cross nodes first, as in Megatron.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod
from typing import Optional

from lightning_moe.strategy.layout import GROUP_KINDS, Layout

# the groups whose collectives are on the critical path of every layer: keep them on NVLink when they fit
NODE_LOCAL_KINDS = ("tp", "cp", "etp", "ep")


def contiguous_nodes(world_size: int, ranks_per_node: int) -> tuple[int, ...]:
    """The node of each global rank when every node holds ``ranks_per_node`` consecutive ranks."""
    if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node={ranks_per_node!r} must be an integer >= 1")
    if world_size % ranks_per_node:
        raise ValueError(f"world_size={world_size} is not divisible by ranks_per_node={ranks_per_node}: every node "
                         "must run the same number of processes")
    return tuple(r // ranks_per_node for r in range(world_size))


def span(layout: Layout, kind: str) -> int:
    """How many consecutive ranks one block of groups of ``kind`` covers: the product of the sizes of the kind's
    slowest axis and of every faster axis of its layout."""
    sizes = dict(layout.attention_axes + layout.moe_axes)
    return prod(sizes[a] for a in _span_name(kind).split("*"))


def crossing_groups(layout: Layout, node_of: Sequence[int]) -> dict[str, tuple[tuple[int, ...], ...]]:
    """For each group kind, the groups whose ranks lie on more than one node (``node_of[rank]`` is the rank's node)."""
    if len(node_of) != layout.world_size:
        raise ValueError(f"node_of has {len(node_of)} entries for world_size={layout.world_size}")
    return {kind: tuple(g for g in groups if len({node_of[r] for r in g}) > 1) for kind, groups in layout.groups.items()}


def placement_warning(layout: Layout, node_of: Sequence[int]) -> Optional[str]:
    """A message when a TP, CP, ETP or EP group crosses nodes (None when all stay inside one node)."""
    crossing = crossing_groups(layout, node_of)
    kinds = [k for k in NODE_LOCAL_KINDS if crossing[k]]
    if not kinds:
        return None
    counts = [list(node_of).count(n) for n in sorted(set(node_of))]
    lines = []
    for k in kinds:
        g = crossing[k][0]
        lines.append(f"{len(crossing[k])} of {len(layout.groups[k])} {k} groups (size {len(g)}, e.g. ranks "
                     f"{list(g)} on nodes {[node_of[r] for r in g]})")
    msg = (f"MoEFoldStrategy: {'; '.join(lines)} cross nodes, so their collectives run over the network instead of "
           f"within a node (layout: {layout.describe()}; ranks per node: {counts}).")
    if list(node_of) != sorted(node_of):
        return msg + (" The launcher did not give each node consecutive ranks: use torchrun, or srun with its default "
                      "block distribution (not --distribution=cyclic).")
    n = counts[0]
    hints = [f"{k} needs {_span_name(k)} = {span(layout, k)} consecutive ranks" for k in kinds]
    return msg + f" With {n} ranks per node, {', '.join(hints)}: choose sizes whose products divide {n}."


def _span_name(kind: str) -> str:
    order, varying = GROUP_KINDS[kind]
    return "*".join(order[:max(order.index(a) for a in varying) + 1])
