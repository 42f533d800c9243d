"""Which groups cross nodes (lightning_moe.strategy.placement), and the launch checks of Trainer(num_nodes=...) under
torchrun's and SLURM's variables; no processes needed."""

from __future__ import annotations

import lightning as L
import pytest
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from lightning_moe import MoEFoldStrategy
from lightning_moe.strategy.layout import GROUP_KINDS, build_layout
from lightning_moe.strategy.placement import contiguous_nodes, crossing_groups, placement_warning, span
from tests.strategy.test_layout import LAYOUTS, _divisors


def _crossing(world, ranks_per_node, **sizes):
    lay = build_layout(world, **sizes)
    return {k: [list(g) for g in gs] for k, gs in crossing_groups(lay, contiguous_nodes(world, ranks_per_node)).items()
            if gs}


# ----------------------------------------------------------------------------------------------- hand-made layouts
def test_two_nodes_of_two_tp2_ep2():
    assert _crossing(4, 2, tp=2, ep=2) == {"dp": [[0, 2], [1, 3]], "dp_cp": [[0, 2], [1, 3]],
                                           "tp_dp_cp": [[0, 1, 2, 3]], "edp": [[0, 2], [1, 3]]}


def test_nodes_of_8_keep_tp_cp_ep_and_even_dp_inside():
    # 16 ranks, tp2 cp2 pp2 ep4: tp*cp*dp = 8 = one node per pipeline stage, so only PP goes between nodes
    assert _crossing(16, 8, tp=2, cp=2, pp=2, ep=4) == {"pp": [[r, r + 8] for r in range(8)]}


def test_megatron_like_32_ranks_on_nodes_of_8():
    # tp4 pp2 etp2 ep4: etp*ep = 8 fills a node; dp (stride 4), edp (stride 8) and pp (stride 16) cross
    got = _crossing(32, 8, tp=4, pp=2, ep=4, etp=2)
    assert set(got) == {"dp", "dp_cp", "tp_dp_cp", "edp", "pp"}
    assert got["dp"][0] == [0, 4, 8, 12] and got["edp"][0] == [0, 8] and len(got["pp"]) == 16


def test_tp_larger_than_a_node():
    got = _crossing(8, 4, tp=8)
    assert got["tp"] == [list(range(8))] and "ep" not in got


def test_cp_and_ep_spill_out_of_nodes_of_2():
    got = _crossing(8, 2, tp=2, cp=2, ep=4)
    assert "tp" not in got  # TP first: it keeps the node
    assert got["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert got["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_node_size_that_ep_does_not_divide():
    # 12 ranks on nodes of 6, ep4: [0..3] and [8..11] fit, [4..7] straddles the boundary at 6
    assert _crossing(12, 6, ep=4)["ep"] == [[4, 5, 6, 7]]


def test_cyclic_rank_order_puts_tp_across_nodes():
    lay = build_layout(4, tp=2)
    cyclic = (0, 1, 0, 1)  # srun --distribution=cyclic: rank r on node r % 2
    assert crossing_groups(lay, cyclic)["tp"] == ((0, 1), (2, 3))
    msg = placement_warning(lay, cyclic)
    assert "2 of 2 tp groups (size 2, e.g. ranks [0, 1] on nodes [0, 1])" in msg and "consecutive ranks" in msg, msg


def test_warning_names_the_groups_and_what_would_fit():
    lay = build_layout(8, tp=2, cp=2, ep=4)
    msg = placement_warning(lay, contiguous_nodes(8, 2))
    assert "4 of 4 cp groups (size 2, e.g. ranks [0, 2] on nodes [0, 1])" in msg, msg
    assert "2 of 2 ep groups (size 4, e.g. ranks [0, 1, 2, 3] on nodes [0, 0, 1, 1])" in msg, msg
    assert "tp groups" not in msg and "ranks per node: [2, 2, 2, 2]" in msg, msg
    assert "cp needs tp*cp = 4 consecutive ranks, ep needs etp*ep = 4 consecutive ranks" in msg, msg
    assert "divide 2" in msg, msg
    # DP, EDP and PP across nodes are expected: no warning
    assert placement_warning(build_layout(16, tp=2, cp=2, pp=2, ep=4), contiguous_nodes(16, 4)) is None
    assert placement_warning(build_layout(8, tp=8, ep=8), contiguous_nodes(8, 8)) is None


# --------------------------------------------------------------------------------------------------- properties
def test_a_kind_crosses_exactly_when_its_span_does_not_divide_the_node():
    """Over every layout of tests/strategy/test_layout.py and every node size: groups of a kind cross nodes iff
    the kind's span (its axis times the faster ones) does not divide the ranks per node (and the groups have more than
    one rank); one process per node, or one node, never crosses."""
    checked = 0
    for world, kw in LAYOUTS + [(12, dict(tp=1, cp=1, pp=1, ep=4, etp=1)), (24, dict(tp=2, cp=3, pp=1, ep=4, etp=3))]:
        lay = build_layout(world, **kw)
        for n in sorted(set(_divisors(world)) | ({6} if world % 6 == 0 else set())):
            crossing = crossing_groups(lay, contiguous_nodes(world, n))
            for kind in GROUP_KINDS:
                size = len(lay.groups[kind][0])
                assert bool(crossing[kind]) == (size > 1 and n % span(lay, kind) != 0), (world, kw, n, kind)
                checked += 1
            if n == world:
                assert not any(crossing.values()), (world, kw)
    assert checked > 20_000


def test_span():
    lay = build_layout(32, tp=4, pp=2, ep=4, etp=2)
    assert {k: span(lay, k) for k in ("tp", "cp", "dp", "pp", "etp", "ep", "edp")} == \
        {"tp": 4, "cp": 4, "dp": 16, "pp": 32, "etp": 2, "ep": 8, "edp": 16}


@pytest.mark.parametrize("world,per_node,match", [(6, 4, "not divisible by ranks_per_node=4"),
                                                  (4, 0, "ranks_per_node=0"), (4, 1.5, "ranks_per_node=1.5")])
def test_bad_node_sizes(world, per_node, match):
    with pytest.raises(ValueError, match=match):
        contiguous_nodes(world, per_node)


def test_node_map_of_the_wrong_length():
    with pytest.raises(ValueError, match="node_of has 3 entries for world_size=4"):
        crossing_groups(build_layout(4, tp=2), (0, 0, 1))


# --------------------------------------------------------------------- Trainer(num_nodes=...) under a launcher
@pytest.fixture
def keep_rank_zero():
    """The Trainer sets Lightning's rank_zero_only.rank from the environment: restore it for the next tests."""
    saved = rank_zero_only.rank, utils_rank_zero_only.rank
    yield
    rank_zero_only.rank, utils_rank_zero_only.rank = saved


def _torchrun(monkeypatch, world, local_world, rank):
    for k, v in dict(TORCHELASTIC_RUN_ID="t", WORLD_SIZE=world, LOCAL_WORLD_SIZE=local_world, RANK=rank,
                     LOCAL_RANK=rank % local_world, GROUP_RANK=rank // local_world, MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=29400).items():
        monkeypatch.setenv(k, str(v))


def _srun(monkeypatch, nodes, per_node, rank):
    for k, v in dict(SLURM_NTASKS=nodes * per_node, SLURM_NTASKS_PER_NODE=per_node, SLURM_NNODES=nodes,
                     SLURM_PROCID=rank, SLURM_LOCALID=rank % per_node, SLURM_NODEID=rank // per_node,
                     SLURM_JOB_NAME="train", SLURM_JOB_ID=77).items():
        monkeypatch.setenv(k, str(v))


def _trainer(devices, num_nodes, **sizes):
    return L.Trainer(strategy=MoEFoldStrategy(**sizes), accelerator="cpu", devices=devices, num_nodes=num_nodes,
                     logger=False)


def test_torchrun_ranks_reach_the_strategy(monkeypatch, keep_rank_zero):
    _torchrun(monkeypatch, world=4, local_world=2, rank=3)
    s = _trainer(2, 2, tensor_parallel_size=2, expert_parallel_size=2).strategy
    assert isinstance(s.cluster_environment, TorchElasticEnvironment)
    assert (s.global_rank, s.local_rank, s.node_rank, s.world_size, s.num_nodes) == (3, 1, 1, 4, 2)
    assert s.launcher is None  # torchrun made the processes


def test_slurm_ranks_reach_the_strategy(monkeypatch, keep_rank_zero):
    _srun(monkeypatch, nodes=2, per_node=2, rank=2)
    s = _trainer(2, 2, expert_parallel_size=4).strategy
    assert isinstance(s.cluster_environment, SLURMEnvironment)
    assert (s.global_rank, s.local_rank, s.node_rank, s.world_size, s.num_nodes) == (2, 0, 1, 4, 2)


@pytest.mark.parametrize("launcher,devices,num_nodes,sizes,match", [
    ("torchrun", 2, 1, {}, r"started 4 processes in all, but Trainer\(num_nodes=1, devices=2\) expects num_nodes x "
                           r"devices = 2"),
    ("torchrun", 2, 4, {}, r"started 4 processes in all, .* expects num_nodes x devices = 8"),
    ("torchrun", 4, 1, {}, r"LOCAL_WORLD_SIZE=2 processes run on this node, but Trainer\(num_nodes=1, devices=4\)"),
    ("srun", 2, 4, {}, r"started 4 processes in all, .* expects num_nodes x devices = 8"),
    ("srun", 4, 1, {}, r"SLURM_NTASKS_PER_NODE=2 processes run on this node"),
    ("torchrun", 2, 2, dict(expert_parallel_size=3), r"world_size=4 is not divisible by etp\*ep\*pp = 3"),
    ("srun", 2, 2, dict(tensor_parallel_size=8), r"world_size=4 is not divisible by tp\*cp\*pp = 8"),
])
def test_bad_launches_fail_at_trainer_construction(monkeypatch, keep_rank_zero, launcher, devices, num_nodes, sizes,
                                                   match):
    (_torchrun(monkeypatch, 4, 2, 0) if launcher == "torchrun" else _srun(monkeypatch, 2, 2, 0))
    with pytest.raises(ValueError, match=match):
        _trainer(devices, num_nodes, **sizes)
