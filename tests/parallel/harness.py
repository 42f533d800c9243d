"""Spawn N gloo ranks (torchrun-style environment, so Lightning sees externally created processes) and collect
each rank's result. Results travel as torch files in a temp dir; failures carry the rank's traceback."""

from __future__ import annotations

import os
import socket
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out_dir: str, fn, args, env=None) -> None:
    if env is None:  # torchrun's variables on one node (without TORCHELASTIC_RUN_ID: Lightning's own environment)
        env = dict(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                   NODE_RANK="0", GROUP_RANK="0")
    else:
        env = env(rank, world)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", **env)
    torch.set_num_threads(1)
    try:
        result = {"ok": True, "value": fn(rank, world, *args)}
    except BaseException:  # noqa: BLE001 - the parent reports it
        result = {"ok": False, "error": traceback.format_exc()}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def run_ranks(fn, world: int, *args, out_dir: str, timeout: float = 600, env=None, start_method: str = "spawn",
              _tries: int = 3) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes; return the per-rank values. ``env(rank, world)``
    (a module-level function) gives each process's launcher variables instead of torchrun's on one node;
    ``start_method="fork"`` saves the imports for processes that only set up (no training: forked OpenMP pools)."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context(start_method)
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, out_dir, fn, args, env)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    results = []
    for r in range(world):
        f = Path(out_dir) / f"rank{r}.pt"
        if not f.exists():
            raise AssertionError(f"rank {r} produced no result (exit code {procs[r].exitcode})")
        results.append(torch.load(f, weights_only=False))  # our own test output, written just now
        f.unlink()
    if _tries > 1 and any(not res["ok"] and "EADDRINUSE" in res["error"] for res in results):
        # the free port was taken again before rank 0's store could listen (seen on a GPU host): another port
        return run_ranks(fn, world, *args, out_dir=out_dir, timeout=timeout, env=env, start_method=start_method,
                         _tries=_tries - 1)
    for r, res in enumerate(results):
        if not res["ok"]:
            raise AssertionError(f"rank {r} failed:\n{res['error']}")
    return [res["value"] for res in results]
