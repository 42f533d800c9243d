"""Pure rank math of MoE Parallel Folding (no torch, no torch.distributed).

Two layouts share the same ``world_size`` ranks (the first axis varies fastest):

* attention / dense: ``tp-cp-dp-pp``,   rank = tp + TP*(cp + CP*(dp + DP*pp)),      DP = world / (TP*CP*PP)
* MoE:               ``etp-ep-edp-pp``, rank = etp + ETP*(ep + EP*(edp + EDP*pp)), EDP = world / (ETP*EP*PP)

Group kinds (fixed names, see ``GROUP_KINDS``): a group of kind ``k`` holds the ranks that differ only in the axes
named in ``k``. Within a group, ranks are sorted ascending; because the global rank is a mixed-radix number, this
is the same as ordering by the varying coordinates with the fastest axis first. So ``rank_in("dp_cp", r)`` is
``cp + CP*dp`` and ``rank_in("etp_ep", r)`` is ``etp + ETP*ep``. Groups of one kind are sorted by their first rank.

Invalid layouts raise ``ValueError`` naming the numbers, before any process group exists. Launchers give each node
consecutive ranks, so the fastest axes (TP, CP; ETP, EP) stay inside a node when they fit (``placement.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

ATTENTION_ORDER = ("tp", "cp", "dp", "pp")
MOE_ORDER = ("etp", "ep", "edp", "pp")

# kind -> (layout order it lives in, axes that vary inside one group)
GROUP_KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "tp": (ATTENTION_ORDER, ("tp",)),
    "cp": (ATTENTION_ORDER, ("cp",)),
    "dp": (ATTENTION_ORDER, ("dp",)),
    "pp": (ATTENTION_ORDER, ("pp",)),
    "dp_cp": (ATTENTION_ORDER, ("cp", "dp")),
    "tp_cp": (ATTENTION_ORDER, ("tp", "cp")),
    "tp_dp_cp": (ATTENTION_ORDER, ("tp", "cp", "dp")),
    "etp": (MOE_ORDER, ("etp",)),
    "ep": (MOE_ORDER, ("ep",)),
    "edp": (MOE_ORDER, ("edp",)),
    "etp_ep": (MOE_ORDER, ("etp", "ep")),
}

Groups = tuple[tuple[int, ...], ...]


def _decompose(rank: int, axes: tuple[tuple[str, int], ...]) -> dict[str, int]:
    """Mixed-radix digits of ``rank``, first axis fastest."""
    coords = {}
    for name, size in axes:
        coords[name] = rank % size
        rank //= size
    return coords


def _compose(coords: dict[str, int], axes: tuple[tuple[str, int], ...]) -> int:
    rank, stride = 0, 1
    for name, size in axes:
        rank += coords[name] * stride
        stride *= size
    return rank


def _make_groups(world_size: int, axes: tuple[tuple[str, int], ...], varying: tuple[str, ...]) -> Groups:
    """Partition the ranks into groups whose members differ only in the ``varying`` axes."""
    buckets: dict[tuple[int, ...], list[int]] = {}
    for rank in range(world_size):  # ascending, so each bucket ends up sorted
        c = _decompose(rank, axes)
        key = tuple(c[name] for name, _ in axes if name not in varying)
        buckets.setdefault(key, []).append(rank)
    return tuple(sorted(tuple(g) for g in buckets.values()))


@dataclass(frozen=True)
class Layout:
    world_size: int
    tp: int
    cp: int
    dp: int
    pp: int
    etp: int
    ep: int
    edp: int
    vpp: Optional[int]
    groups: dict[str, Groups]
    # rank -> (group index, position) per kind; derived from ``groups``
    _index: dict[str, dict[int, tuple[int, int]]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index = {
            kind: {r: (gi, pos) for gi, g in enumerate(groups) for pos, r in enumerate(g)}
            for kind, groups in self.groups.items()
        }
        object.__setattr__(self, "_index", index)

    @property
    def attention_axes(self) -> tuple[tuple[str, int], ...]:
        return (("tp", self.tp), ("cp", self.cp), ("dp", self.dp), ("pp", self.pp))

    @property
    def moe_axes(self) -> tuple[tuple[str, int], ...]:
        return (("etp", self.etp), ("ep", self.ep), ("edp", self.edp), ("pp", self.pp))

    def describe(self) -> str:
        return (
            f"world_size={self.world_size}, tp={self.tp}, cp={self.cp}, dp={self.dp}, pp={self.pp}, "
            f"etp={self.etp}, ep={self.ep}, edp={self.edp}, vpp={self.vpp}"
        )

    def _lookup(self, name: str, rank: int) -> tuple[int, int]:
        if name not in self._index:
            raise KeyError(f"unknown group kind {name!r}; known: {sorted(self._index)}")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside world_size={self.world_size}")
        return self._index[name][rank]

    def group_of(self, name: str, rank: int) -> tuple[int, ...]:
        """The group of kind ``name`` that contains ``rank`` (global ranks, in group-rank order)."""
        return self.groups[name][self._lookup(name, rank)[0]]

    def rank_in(self, name: str, rank: int) -> int:
        """Position of ``rank`` inside its group of kind ``name``."""
        return self._lookup(name, rank)[1]

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` in both layouts: tp, cp, dp, pp, etp, ep, edp."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside world_size={self.world_size}")
        return {**_decompose(rank, self.attention_axes), **_decompose(rank, self.moe_axes)}

    def check_num_experts(self, num_experts: int) -> None:
        """Raise ``ValueError`` unless the experts split evenly over the EP ranks."""
        if num_experts < 1 or num_experts % self.ep:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by ep={self.ep} (layout: {self.describe()})"
            )


def check_sizes(world_size: int, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1, etp: int = 1,
                vpp: Optional[int] = None) -> tuple[int, int]:
    """Validate the requested sizes without building any group (cheap enough for a planner's search); returns
    ``(dp, edp)``. Raises ``ValueError`` naming the numbers."""
    requested = f"world_size={world_size}, tp={tp}, cp={cp}, pp={pp}, ep={ep}, etp={etp}, vpp={vpp}"
    sizes = {"world_size": world_size, "tp": tp, "cp": cp, "pp": pp, "ep": ep, "etp": etp}
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value} must be an integer >= 1 (requested: {requested})")
    if vpp is not None:
        if not isinstance(vpp, int) or vpp < 1:
            raise ValueError(f"vpp={vpp} must be an integer >= 1 or None (requested: {requested})")
        if pp == 1:
            raise ValueError(f"vpp={vpp} requires pp > 1, got pp={pp} (requested: {requested})")
    if world_size % (tp * cp * pp):
        raise ValueError(
            f"world_size={world_size} is not divisible by tp*cp*pp = {tp * cp * pp} "
            f"(tp={tp}, cp={cp}, pp={pp}; requested: {requested})"
        )
    if world_size % (etp * ep * pp):
        raise ValueError(
            f"world_size={world_size} is not divisible by etp*ep*pp = {etp * ep * pp} "
            f"(etp={etp}, ep={ep}, pp={pp}; requested: {requested})"
        )
    return world_size // (tp * cp * pp), world_size // (etp * ep * pp)


def build_layout(
    world_size: int,
    tp: int = 1,
    cp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int = 1,
    vpp: Optional[int] = None,
) -> Layout:
    """Validate the requested sizes and compute every group of both folded layouts."""
    requested = f"world_size={world_size}, tp={tp}, cp={cp}, pp={pp}, ep={ep}, etp={etp}, vpp={vpp}"
    dp, edp = check_sizes(world_size, tp, cp, pp, ep, etp, vpp)
    axes = {
        ATTENTION_ORDER: (("tp", tp), ("cp", cp), ("dp", dp), ("pp", pp)),
        MOE_ORDER: (("etp", etp), ("ep", ep), ("edp", edp), ("pp", pp)),
    }
    groups = {kind: _make_groups(world_size, axes[order], varying) for kind, (order, varying) in GROUP_KINDS.items()}
    # Folding only works if both layouts agree on the pipeline stages.
    moe_pp = _make_groups(world_size, axes[MOE_ORDER], ("pp",))
    if moe_pp != groups["pp"]:
        raise ValueError(
            f"PP groups differ between the attention and MoE layouts ({groups['pp']} vs {moe_pp}; "
            f"requested: {requested})"
        )
    return Layout(world_size, tp, cp, dp, pp, etp, ep, edp, vpp, groups)
