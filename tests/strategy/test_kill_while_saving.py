"""A crash while saving, again and again: a forked process that writes sharded checkpoints in a loop is SIGKILLed at
random moments (24 trials, each at a different point of a save). After every kill, ``load_sharded`` finds a complete
checkpoint (recovering one left between its two renames) and never a partial one: every tensor in it holds one and
the same save's step, no earlier than the last save the writer reported done."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time

import pytest
import torch

from lightning_moe.strategy.checkpoint import load_sharded, save_sharded

LAYOUT = {"tp": 1, "cp": 1, "dp": 1, "pp": 1, "etp": 1, "ep": 1, "edp": 1, "vpp": None}


def _writer(path: str, start: int, done) -> None:
    for step in range(start, start + 10_000):
        ck = {"state_dict": {f"w{i}": torch.full((1 << 15,), float(step)) for i in range(8)}, "step": step}
        save_sharded(ck, path, 0, 1, LAYOUT, lambda _: None)
        done.value = step


@pytest.mark.slow
def test_random_kills_never_leave_a_partial_checkpoint(tmp_path):
    ctx, rng = mp.get_context("fork"), random.Random(0)  # fork: the writer starts at once, torch already imported
    path, step, done = str(tmp_path / "last.ckpt"), 0, ctx.Value("q", -1)
    for trial in range(24):
        proc = ctx.Process(target=_writer, args=(path, step, done), daemon=True)
        proc.start()
        deadline = time.monotonic() + 30
        while done.value < step and time.monotonic() < deadline:  # its first save is done: kill during a later one
            time.sleep(0.001)
        time.sleep(rng.uniform(0.0, 0.05))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        ck = load_sharded(path, 0, 1, LAYOUT)
        values = {float(t[0]) for t in ck["state_dict"].values()} | {float(ck["step"])}
        assert len(values) == 1, (trial, values)  # one save's tensors, never a mix
        assert ck["step"] >= done.value, (trial, ck["step"], done.value)  # no older than the last one reported
        step = ck["step"] + 1
    assert step > 24  # the trials made progress
