"""One process started by ``torchrun`` for ``tests/parallel/test_multinode.py``: it trains the parity case of
``WORK/job.pt`` through ``Trainer(num_nodes=...)`` (the environment is torchrun's, so Lightning picks
``TorchElasticEnvironment``) and writes ``WORK/rank{RANK}.pt`` with the comparison against the 1-process reference and
where the strategy placed the ranks.

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 ... -m tests.parallel.torchrun_worker WORK
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from pathlib import Path

import torch

ENV_KEYS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")


def main(work: str) -> int:
    rank = int(os.environ["RANK"])
    Path(work, f"pid{rank}").write_text(str(os.getpid()))  # the test kills what is left of its workers by pid
    # a last guard against a hang: SIGALRM's default action ends the process even inside a blocked collective
    signal.alarm(int(os.environ.get("LMOE_WORKER_DEADLINE_S", "300")))
    torch.set_num_threads(1)
    try:
        from tests.parallel.parity import compare, run_num_experts, train
        job = torch.load(Path(work, "job.pt"), weights_only=False)  # written by the test just before
        run = train(job["case"], job["tokens"], job["root"], parallel=True)
        result = {"ok": True, "value": {"compare": compare(run, job["ref"], run_num_experts(job["case"])),
                                        "placement": run["placement"],
                                        "env": {k: os.environ.get(k) for k in ENV_KEYS}}}
    except BaseException:  # noqa: BLE001 - the test reports it
        result = {"ok": False, "error": traceback.format_exc()}
    torch.save(result, Path(work, f"rank{rank}.pt"))
    if result["ok"]:  # a failed rank leaves at once: the others may be inside a collective it never joined
        _leave_together()
    return 0 if result["ok"] else 1


def _leave_together() -> None:
    """Every rank waits for the others, then the process groups go down in order. Left to the interpreter's exit,
    a gloo group's threads were once still joinable (``terminate called without an active exception``, SIGABRT),
    and the torchrun agents then failed on a closed rendezvous store although every rank had its result."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
