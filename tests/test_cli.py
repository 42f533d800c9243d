"""The ``lightning-moe`` CLI: an in-process fit on the shipped tiny config, --help and --print_config."""

from __future__ import annotations

import csv
import glob
import logging
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from lightning_moe import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny.yaml")


def _entry_point() -> str | None:
    for cand in (os.path.join(os.path.dirname(sys.executable), "lightning-moe"), "/work/venv/bin/lightning-moe",
                 shutil.which("lightning-moe")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def test_cli_fit_smoke(tmp_path, caplog):
    logs, cache = tmp_path / "logs", tmp_path / "cache"
    args = ["fit", "--config", TINY,
            "--trainer.devices", "1", "--trainer.strategy", "auto",
            "--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.log_every_n_steps", "1",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--data.batch_size", "2", "--data.cache_dir", str(cache),
            "--trainer.logger.init_args.save_dir", str(logs)]
    with caplog.at_level(logging.INFO):
        assert cli.main(args=args) is None  # returns normally: no SystemExit, no exception

    # the default corpus was built in the given cache dir (the stdlib's own bytes, vocab 256)
    corpus = cache / "stdlib_bytes_v1.bin"
    assert corpus.is_file() and corpus.stat().st_size > 2 * 128

    (metrics,) = glob.glob(os.path.join(str(logs), "lightning_logs", "version_*", "metrics.csv"))
    with open(metrics) as f:
        rows = list(csv.DictReader(f))
    assert "train_loss" in rows[0]
    train = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    assert len(train) == 3 and all(math.isfinite(v) for v in train)
    assert all(3.0 < v < 7.0 for v in train)  # byte-level model near ln(256) = 5.55 after 3 steps
    steps = sorted(int(r["step"]) for r in rows if r.get("train_loss"))
    assert steps == [0, 1, 2]
    val = [float(r["val_loss"]) for r in rows if r.get("val_loss")]
    assert len(val) == 1 and math.isfinite(val[0])  # val_check_interval 3 -> one validation at step 3
    assert {"aux_loss", "z_loss", "load/layer0/imbalance"} <= set(rows[0])

    # the resolved config is saved next to the metrics, with the overrides applied
    (saved,) = glob.glob(os.path.join(str(logs), "lightning_logs", "version_*", "config.yaml"))
    with open(saved) as f:
        conf = yaml.safe_load(f)
    assert conf["trainer"]["max_steps"] == 3 and conf["trainer"]["strategy"] == "auto"
    assert conf["data"]["batch_size"] == 2 and conf["model"]["preset"] == "tiny"
    # the LossReport callback of the config ran and reported over the 3 steps
    assert any("train_loss" in r.getMessage() and "over 3 steps" in r.getMessage() for r in caplog.records)


@pytest.fixture(scope="module")
def console_runs():
    """``lightning-moe --help`` and ``lightning-moe fit --config tiny.yaml --print_config``, started together (each
    pays the full import time; running them side by side halves the wall time)."""
    exe = _entry_point()
    if exe is None:
        pytest.skip("the lightning-moe console script is not installed")
    cmds = {"help": [exe, "--help"], "print_config": [exe, "fit", "--config", TINY, "--print_config"]}
    procs = {k: subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
             for k, c in cmds.items()}
    out = {}
    for k, p in procs.items():
        stdout, stderr = p.communicate(timeout=180)
        out[k] = (p.returncode, stdout, stderr)
    return out


def test_cli_fit_packed_documents(tmp_path):
    """``--data.pack_documents true``: the default corpus as one document per source file, packed rows with the
    document mask; training runs and the corpus of documents is built."""
    cache = tmp_path / "cache"
    args = ["fit", "--config", TINY, "--trainer.devices", "1", "--trainer.strategy", "auto",
            "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0", "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--trainer.enable_checkpointing", "false", "--data.batch_size", "2", "--data.cache_dir", str(cache),
            "--data.pack_documents", "true", "--trainer.default_root_dir", str(tmp_path)]
    assert cli.main(args=args) is None
    docs = np.fromfile(cache / "stdlib_documents_v1.bin", dtype=np.uint16)
    assert (docs == 0).sum() > 100  # one end-of-document token per source file


def test_cli_help_subprocess(console_runs):
    rc, stdout, stderr = console_runs["help"]
    assert rc == 0, stderr
    assert "Train Mixture-of-Experts language models." in stdout
    assert "fit" in stdout


def test_cli_print_config_subprocess(console_runs):
    rc, stdout, stderr = console_runs["print_config"]
    assert rc == 0, stderr
    assert "MoEFoldStrategy" in stdout or "moe_fold" in stdout
    conf = yaml.safe_load(stdout)
    assert conf["trainer"]["strategy"]["class_path"] == "lightning_moe.MoEFoldStrategy"
    assert conf["trainer"]["strategy"]["init_args"]["expert_parallel_size"] == 2
    assert conf["model"]["preset"] == "tiny" and conf["model"]["lr"] == 3.0e-3
    assert conf["data"]["seq_length"] == 128


@pytest.mark.parametrize("config", sorted(p.name for p in (Path(__file__).parent.parent / "configs").glob("*.yaml")))
def test_every_shipped_config_parses(config):
    """Each YAML in configs/ resolves against the current classes (GPU configs are parsed, not run)."""
    exe = shutil.which("lightning-moe") or str(Path(sys.executable).parent / "lightning-moe")
    if not Path(exe).exists():
        pytest.skip("lightning-moe console script not installed")
    root = Path(__file__).parent.parent
    out = subprocess.run([exe, "fit", "--config", str(root / "configs" / config), "--print_config"],
                         capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "MoEFoldStrategy" in out.stdout and "preset:" in out.stdout
