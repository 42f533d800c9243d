"""Rank math of MoE Parallel Folding (lightning_moe.strategy.layout), no processes needed."""

from __future__ import annotations

import itertools

import pytest

from lightning_moe.strategy.layout import GROUP_KINDS, build_layout


def _as_lists(groups):
    return [list(g) for g in groups]


# --------------------------------------------------------------------------------------------- Megatron's examples
def test_megatron_attention_tp2_cp2_dp2():
    lay = build_layout(8, tp=2, cp=2)
    assert (lay.tp, lay.cp, lay.dp, lay.pp) == (2, 2, 2, 1)
    assert _as_lists(lay.groups["tp"]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _as_lists(lay.groups["cp"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert _as_lists(lay.groups["dp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _as_lists(lay.groups["pp"]) == [[0], [1], [2], [3], [4], [5], [6], [7]]
    assert _as_lists(lay.groups["dp_cp"]) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert _as_lists(lay.groups["tp_cp"]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _as_lists(lay.groups["tp_dp_cp"]) == [[0, 1, 2, 3, 4, 5, 6, 7]]


def test_megatron_moe_etp2_ep2_edp2():
    lay = build_layout(8, ep=2, etp=2)
    assert (lay.etp, lay.ep, lay.edp) == (2, 2, 2)
    assert _as_lists(lay.groups["etp"]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _as_lists(lay.groups["ep"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert _as_lists(lay.groups["edp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _as_lists(lay.groups["etp_ep"]) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_megatron_moe_etp1_ep8():
    lay = build_layout(8, ep=8)
    assert lay.edp == 1
    assert _as_lists(lay.groups["ep"]) == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert _as_lists(lay.groups["edp"]) == [[0], [1], [2], [3], [4], [5], [6], [7]]
    assert lay.rank_in("ep", 5) == 5


def test_folding_ep_exceeds_dp():
    # TP2 attention and EP2 MoE on the same 2 ranks: DP=1, EDP=1.
    lay = build_layout(2, tp=2, ep=2)
    assert (lay.dp, lay.edp) == (1, 1)
    assert _as_lists(lay.groups["tp"]) == [[0, 1]]
    assert _as_lists(lay.groups["ep"]) == [[0, 1]]
    assert _as_lists(lay.groups["dp"]) == [[0], [1]]


# ------------------------------------------------------------------------------------------ larger hand-made cases
def test_16_ranks_tp2_cp2_pp2_ep4():
    # attention rank = tp + 2*cp + 4*dp + 8*pp (dp=2); MoE rank = ep + 4*edp + 8*pp (edp=2)
    lay = build_layout(16, tp=2, cp=2, pp=2, ep=4, etp=1)
    assert (lay.dp, lay.edp) == (2, 2)
    assert _as_lists(lay.groups["tp"]) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert _as_lists(lay.groups["cp"]) == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert _as_lists(lay.groups["dp"]) == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert _as_lists(lay.groups["pp"]) == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert _as_lists(lay.groups["dp_cp"]) == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert _as_lists(lay.groups["tp_dp_cp"]) == [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]
    assert _as_lists(lay.groups["ep"]) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert _as_lists(lay.groups["edp"]) == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert _as_lists(lay.groups["etp"]) == [[r] for r in range(16)]
    assert lay.coords(13) == {"tp": 1, "cp": 0, "dp": 1, "pp": 1, "etp": 0, "ep": 1, "edp": 1}


def test_32_ranks_tp4_dp4_pp2_etp2_ep4():
    # attention rank = tp + 4*dp + 16*pp (dp=4); MoE rank = etp + 2*ep + 8*edp + 16*pp (edp=2)
    lay = build_layout(32, tp=4, pp=2, ep=4, etp=2)
    assert (lay.dp, lay.edp) == (4, 2)
    assert _as_lists(lay.groups["ep"]) == [
        [0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15],
        [16, 18, 20, 22], [17, 19, 21, 23], [24, 26, 28, 30], [25, 27, 29, 31],
    ]  # fmt: skip
    assert _as_lists(lay.groups["edp"]) == [
        [0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15],
        [16, 24], [17, 25], [18, 26], [19, 27], [20, 28], [21, 29], [22, 30], [23, 31],
    ]  # fmt: skip
    assert _as_lists(lay.groups["dp"]) == [
        [0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15],
        [16, 20, 24, 28], [17, 21, 25, 29], [18, 22, 26, 30], [19, 23, 27, 31],
    ]  # fmt: skip
    assert _as_lists(lay.groups["tp"]) == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15],
        [16, 17, 18, 19], [20, 21, 22, 23], [24, 25, 26, 27], [28, 29, 30, 31],
    ]  # fmt: skip
    assert _as_lists(lay.groups["pp"]) == [
        [0, 16], [1, 17], [2, 18], [3, 19], [4, 20], [5, 21], [6, 22], [7, 23],
        [8, 24], [9, 25], [10, 26], [11, 27], [12, 28], [13, 29], [14, 30], [15, 31],
    ]  # fmt: skip
    assert _as_lists(lay.groups["etp_ep"]) == [
        [0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15],
        [16, 17, 18, 19, 20, 21, 22, 23], [24, 25, 26, 27, 28, 29, 30, 31],
    ]  # fmt: skip
    assert lay.group_of("ep", 19) == (17, 19, 21, 23)
    assert lay.rank_in("ep", 19) == 1
    assert lay.group_of("edp", 19) == (19, 27)
    assert lay.coords(27) == {"tp": 3, "cp": 0, "dp": 2, "pp": 1, "etp": 1, "ep": 1, "edp": 1}


def test_vpp_is_carried():
    assert build_layout(4, pp=2, vpp=3).vpp == 3
    assert build_layout(4, pp=2).vpp is None


# --------------------------------------------------------------------------------------------------- properties
def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _all_layouts(world):
    for tp, cp, pp in itertools.product(_divisors(world), repeat=3):
        if world % (tp * cp * pp):
            continue
        for etp, ep in itertools.product(_divisors(world), repeat=2):
            if world % (etp * ep * pp) == 0:
                yield dict(tp=tp, cp=cp, pp=pp, ep=ep, etp=etp)


LAYOUTS = [(w, kw) for w in (1, 2, 4, 8, 16) for kw in _all_layouts(w)] + [
    (32, dict(tp=4, cp=1, pp=2, ep=4, etp=2)),
    (32, dict(tp=2, cp=2, pp=2, ep=8, etp=1)),
    (32, dict(tp=1, cp=8, pp=1, ep=8, etp=2)),
    (32, dict(tp=2, cp=4, pp=4, ep=2, etp=4)),
    (32, dict(tp=1, cp=1, pp=1, ep=32, etp=1)),
]

SIZE_OF = {  # expected group size for each kind
    "tp": lambda l: l.tp, "cp": lambda l: l.cp, "dp": lambda l: l.dp, "pp": lambda l: l.pp,
    "dp_cp": lambda l: l.dp * l.cp, "tp_cp": lambda l: l.tp * l.cp, "tp_dp_cp": lambda l: l.tp * l.dp * l.cp,
    "etp": lambda l: l.etp, "ep": lambda l: l.ep, "edp": lambda l: l.edp, "etp_ep": lambda l: l.etp * l.ep,
}  # fmt: skip
PAIRS = [("tp", "dp"), ("tp", "cp"), ("cp", "dp"), ("ep", "edp"), ("etp", "ep"), ("etp", "edp")]


def test_layout_enumeration_is_broad():
    assert len(LAYOUTS) > 300
    assert set(SIZE_OF) == set(GROUP_KINDS)


def test_properties_over_many_layouts():
    for world, kw in LAYOUTS:
        lay = build_layout(world, **kw)
        ctx = f"world={world} {kw}"
        assert lay.tp * lay.cp * lay.dp * lay.pp == world, ctx
        assert lay.etp * lay.ep * lay.edp * lay.pp == world, ctx
        assert set(lay.groups) == set(GROUP_KINDS), ctx
        for kind, groups in lay.groups.items():
            size = SIZE_OF[kind](lay)
            assert all(len(g) == size for g in groups), (ctx, kind)
            assert len(groups) * size == world, (ctx, kind)
            flat = sorted(r for g in groups for r in g)
            assert flat == list(range(world)), (ctx, kind)  # each rank in exactly one group
            assert all(list(g) == sorted(g) for g in groups), (ctx, kind)
        # PP groups identical from both layouts (recomputed from the MoE coordinates here)
        moe_pp = {}
        for r in range(world):
            c = lay.coords(r)
            moe_pp.setdefault((c["etp"], c["ep"], c["edp"]), []).append(r)
        assert sorted(tuple(g) for g in moe_pp.values()) == list(lay.groups["pp"]), ctx
        for r in range(world):
            c = lay.coords(r)
            # coords round-trip through both rank formulas
            assert c["tp"] + lay.tp * (c["cp"] + lay.cp * (c["dp"] + lay.dp * c["pp"])) == r, ctx
            assert c["etp"] + lay.etp * (c["ep"] + lay.ep * (c["edp"] + lay.edp * c["pp"])) == r, ctx
            # group-rank order: fastest varying axis first
            assert lay.rank_in("tp", r) == c["tp"] and lay.rank_in("cp", r) == c["cp"], ctx
            assert lay.rank_in("dp", r) == c["dp"] and lay.rank_in("pp", r) == c["pp"], ctx
            assert lay.rank_in("etp", r) == c["etp"] and lay.rank_in("ep", r) == c["ep"], ctx
            assert lay.rank_in("edp", r) == c["edp"], ctx
            assert lay.rank_in("dp_cp", r) == c["cp"] + lay.cp * c["dp"], ctx
            assert lay.rank_in("tp_cp", r) == c["tp"] + lay.tp * c["cp"], ctx
            assert lay.rank_in("tp_dp_cp", r) == c["tp"] + lay.tp * (c["cp"] + lay.cp * c["dp"]), ctx
            assert lay.rank_in("etp_ep", r) == c["etp"] + lay.etp * c["ep"], ctx
            for kind in GROUP_KINDS:
                g = lay.group_of(kind, r)
                assert g[lay.rank_in(kind, r)] == r, (ctx, kind)
            # two orthogonal axes meet only at r
            for a, b in PAIRS:
                assert set(lay.group_of(a, r)) & set(lay.group_of(b, r)) == {r}, (ctx, a, b)
            # composite groups are unions of their parts
            dp_cp = {m for q in lay.group_of("cp", r) for m in lay.group_of("dp", q)}
            assert dp_cp == set(lay.group_of("dp_cp", r)), ctx
            tp_cp = {m for q in lay.group_of("tp", r) for m in lay.group_of("cp", q)}
            assert tp_cp == set(lay.group_of("tp_cp", r)), ctx
            tp_dp_cp = {m for q in lay.group_of("tp_cp", r) for m in lay.group_of("dp", q)}
            assert tp_dp_cp == set(lay.group_of("tp_dp_cp", r)), ctx
            etp_ep = {m for q in lay.group_of("etp", r) for m in lay.group_of("ep", q)}
            assert etp_ep == set(lay.group_of("etp_ep", r)), ctx
            # a pp stage is the same set of ranks on both sides
            assert set(lay.group_of("tp_dp_cp", r)) == {
                m for q in lay.group_of("etp_ep", r) for m in lay.group_of("edp", q)
            }, ctx


def test_lookup_errors():
    lay = build_layout(4, tp=2)
    with pytest.raises(KeyError, match="nope"):
        lay.group_of("nope", 0)
    with pytest.raises(ValueError, match="rank=4"):
        lay.coords(4)
    with pytest.raises(ValueError, match="rank=-1"):
        lay.rank_in("tp", -1)


# ------------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(world_size=0), r"world_size=0 must be"),
        (dict(world_size=8, tp=0), r"tp=0 must be"),
        (dict(world_size=8, cp=-1), r"cp=-1 must be"),
        (dict(world_size=8, pp=0), r"pp=0 must be"),
        (dict(world_size=8, ep=0), r"ep=0 must be"),
        (dict(world_size=8, etp=0), r"etp=0 must be"),
        (dict(world_size=6, tp=2, cp=2), r"world_size=6 is not divisible by tp\*cp\*pp = 4 \(tp=2, cp=2, pp=1"),
        (dict(world_size=8, tp=2, cp=3, pp=1), r"world_size=8 is not divisible by tp\*cp\*pp = 6 \(tp=2, cp=3, pp=1"),
        (dict(world_size=8, pp=2, ep=8), r"world_size=8 is not divisible by etp\*ep\*pp = 16 \(etp=1, ep=8, pp=2"),
        (dict(world_size=12, ep=4, etp=2), r"world_size=12 is not divisible by etp\*ep\*pp = 8 \(etp=2, ep=4, pp=1"),
        (dict(world_size=8, pp=1, vpp=2), r"vpp=2 requires pp > 1, got pp=1"),
        (dict(world_size=8, pp=2, vpp=0), r"vpp=0 must be"),
    ],
)
def test_invalid_layouts(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern) as info:
        build_layout(**kwargs)
    # the full requested layout is in every message
    assert f"world_size={kwargs['world_size']}, tp={kwargs.get('tp', 1)}, cp={kwargs.get('cp', 1)}" in str(info.value)
    assert f"vpp={kwargs.get('vpp')}" in str(info.value)


def test_sizes_checked_before_divisibility():
    with pytest.raises(ValueError, match="tp=0 must be"):
        build_layout(7, tp=0, cp=3)


def test_check_num_experts():
    lay = build_layout(8, ep=4, etp=2)
    lay.check_num_experts(8)
    lay.check_num_experts(4)
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by ep=4 .*world_size=8.*etp=2"):
        lay.check_num_experts(6)
    with pytest.raises(ValueError, match=r"num_experts=2 is not divisible by ep=4"):
        lay.check_num_experts(2)
    with pytest.raises(ValueError, match=r"num_experts=0"):
        lay.check_num_experts(0)
