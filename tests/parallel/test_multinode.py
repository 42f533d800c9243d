"""Several nodes on this machine: two torchrun agents (2 nodes x 2 processes, c10d rendezvous on localhost) train
against the 1-process reference, and 4 processes with SLURM's variables (2 nodes x 2 tasks) build their groups."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch

from tests.parallel.harness import free_port, run_ranks
from tests.parallel.parity import TOL, Case, check_case, make_tokens, train

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 240  # the whole torchrun job; the workers' own alarm is a little later
LAUNCHER_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
                 "GROUP_RANK", "PL_GLOBAL_SEED")


def _agent_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_", "PET_"))}
    # the agents' workers import this checkout (and tests.parallel) first, whatever is installed
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(OMP_NUM_THREADS="1", LMOE_PARITY_TIMEOUT="60", LMOE_WORKER_DEADLINE_S=str(DEADLINE_S + 30))
    return env


def _stop(agents: list, work: Path) -> None:
    """End both agents (SIGTERM lets torchrun stop its workers), then any worker still alive, by its recorded pid."""
    for a in agents:
        if a.poll() is None:
            os.killpg(a.pid, signal.SIGTERM)
    for a in agents:
        try:
            a.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(a.pid, signal.SIGKILL)
            a.wait()
    for f in work.glob("pid*"):
        pid = int(f.read_text())
        try:
            if "torchrun_worker" in Path(f"/proc/{pid}/cmdline").read_text():
                os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass  # already gone


def _run_torchrun(work: Path, nnodes: int, nproc: int) -> tuple[list, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"lmoe-{port}",
           "--max-restarts", "0", "--monitor-interval", "0.5", "-m", "tests.parallel.torchrun_worker", str(work)]
    logs = [open(work / f"agent{i}.log", "wb") for i in range(nnodes)]
    agents = []
    try:
        for log in logs:
            agents.append(subprocess.Popen(cmd, cwd=ROOT, env=_agent_env(), stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))
        end = time.monotonic() + DEADLINE_S
        while time.monotonic() < end and any(a.poll() is None for a in agents):
            time.sleep(0.5)
        timed_out = any(a.poll() is None for a in agents)
    finally:
        _stop(agents, work)
        for log in logs:
            log.close()
    text = "\n".join(f"--- agent {i} ---\n" + (work / f"agent{i}.log").read_text(errors="replace")[-6000:]
                     for i in range(nnodes))
    assert not timed_out, f"the torchrun agents were still running after {DEADLINE_S} s:\n{text}"
    return [a.returncode for a in agents], text


def test_two_nodes_under_torchrun_match_one_process(tmp_path):
    """``Trainer(num_nodes=2, devices=2)`` under two torchrun agents: TP2 x DP2 attention, EP2 x EDP2 MoE. TP and EP
    stay inside a node, DP and EDP cross; loss, gradients and weights equal one process's."""
    # dp > 1: the aux loss over the global batch, as the reference computes it
    case = Case("tp2_ep2_two_nodes", world=4, tp=2, ep=2, nodes=2, model=dict(load_balancing="global_aux_loss"))
    tokens = make_tokens(str(tmp_path / "tokens.bin"))
    ref = train(case, tokens, str(tmp_path / "ref"), parallel=False)
    ref.pop("ctx")
    work = tmp_path / "work"
    work.mkdir()
    torch.save({"case": case, "tokens": tokens, "root": str(tmp_path / "run"), "ref": ref}, work / "job.pt")

    codes, logs = _run_torchrun(work, nnodes=2, nproc=2)
    results = []
    for rank in range(4):
        f = work / f"rank{rank}.pt"
        assert f.exists(), f"rank {rank} wrote no result (agents' exit codes {codes}):\n{logs}"
        res = torch.load(f, weights_only=False)  # written by our own worker
        assert res["ok"], f"rank {rank} failed:\n{res['error']}"
        results.append(res["value"])
    assert codes == [0, 0], logs

    for rank, r in enumerate(results):
        env, placement = r["env"], r["placement"]
        assert env["TORCHELASTIC_RUN_ID"] and env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "2"
        # torchrun hands each agent (node) a block of consecutive ranks
        assert (int(env["GROUP_RANK"]), int(env["LOCAL_RANK"])) == (rank // 2, rank % 2), env
        assert placement["environment"] == "TorchElasticEnvironment"
        assert placement["node_of_rank"] == (0, 0, 1, 1)
        # tp {0,1}/{2,3} and ep {0,1}/{2,3} inside the nodes; dp and edp {0,2}/{1,3} between them
        assert placement["cross_node_groups"] == {"dp": ((0, 2), (1, 3)), "dp_cp": ((0, 2), (1, 3)),
                                                  "tp_dp_cp": ((0, 1, 2, 3),), "edp": ((0, 2), (1, 3))}
    assert "cross nodes" not in logs  # no placement warning
    check_case(case, [r["compare"] for r in results], TOL)


def _slurm_env(rank: int, world: int) -> dict:
    """srun's variables for 2 nodes x 2 tasks, block distribution (what srun sets; no torchrun variables)."""
    return dict(SLURM_NTASKS=str(world), SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="2", SLURM_PROCID=str(rank),
                SLURM_LOCALID=str(rank % 2), SLURM_NODEID=str(rank // 2), SLURM_JOB_NAME="lmoe-test",
                SLURM_JOB_ID="4242")


def _slurm_setup(rank, world):
    from lightning_moe import MoEFoldStrategy
    s = MoEFoldStrategy(tensor_parallel_size=2, expert_parallel_size=4, timeout=60)
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=s, logger=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s.setup_environment()
        s._check_placement()  # a second time: no second warning
    total = s.reduce(torch.tensor([float(rank)]), reduce_op="sum").item()
    ctx = s.parallel_context
    out = {"environment": type(s.cluster_environment).__name__, "global_rank": s.global_rank,
           "node_rank": s.node_rank, "local_rank": s.local_rank, "world_size": s.world_size,
           "node_of_rank": s.node_of_rank, "crossing": sorted(s.cross_node_groups), "total": total,
           "tp": ctx.members["tp"], "ep": ctx.members["ep"], "dp": ctx.members["dp"],
           "warnings": [str(w.message) for w in caught if "cross nodes" in str(w.message)]}
    del trainer
    return out


def test_slurm_two_nodes_places_tp_inside_and_warns_once_for_ep(tmp_path):
    """``Trainer(num_nodes=2, devices=2)`` in srun's environment: Lightning's SLURMEnvironment gives the ranks, TP2
    stays inside a node and EP4 cannot (4 ranks over nodes of 2): rank 0 warns once, naming the EP group."""
    res = run_ranks(_slurm_setup, 4, out_dir=str(tmp_path), env=_slurm_env, timeout=120, start_method="fork")
    for rank, r in enumerate(res):
        assert r["environment"] == "SLURMEnvironment"
        assert (r["global_rank"], r["node_rank"], r["local_rank"], r["world_size"]) == (rank, rank // 2, rank % 2, 4)
        assert r["node_of_rank"] == (0, 0, 1, 1)
        assert r["total"] == 6.0  # 0 + 1 + 2 + 3 over the world group
        assert r["tp"] == [2 * (rank // 2), 2 * (rank // 2) + 1]  # on this rank's node
        assert r["ep"] == [0, 1, 2, 3] and r["dp"] == [rank % 2, rank % 2 + 2]
        assert r["crossing"] == ["dp", "dp_cp", "ep", "etp_ep", "tp_dp_cp"]  # edp = 1: no EDP groups
    assert len(res[0]["warnings"]) == 1, res[0]["warnings"]
    msg = res[0]["warnings"][0]
    assert "1 of 1 ep groups (size 4, e.g. ranks [0, 1, 2, 3] on nodes [0, 0, 1, 1])" in msg, msg
    assert "etp*ep = 4 consecutive ranks" in msg and "divide 2" in msg and "tp groups" not in msg, msg
    assert all(not r["warnings"] for r in res[1:])  # rank zero only
