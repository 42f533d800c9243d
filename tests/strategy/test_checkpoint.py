"""Sharded checkpoint files on one process: atomic commit and recovery of a save interrupted between renames."""

import pytest
import torch

from lightning_moe.strategy.checkpoint import _recover, load_sharded, save_sharded

LAYOUT = {"tp": 1, "cp": 1, "dp": 1, "pp": 1, "etp": 1, "ep": 1, "edp": 1, "vpp": None}


def _save(path, value):
    save_sharded({"state_dict": {"w": torch.full((2,), float(value))}}, path, 0, 1, LAYOUT, lambda _: None)


def test_save_replaces_atomically_and_loads(tmp_path):
    path = tmp_path / "last.ckpt"
    _save(path, 1)
    _save(path, 2)
    assert load_sharded(path, 0, 1, LAYOUT)["state_dict"]["w"][0] == 2
    assert not (tmp_path / "last.ckpt.tmp").exists() and not (tmp_path / "last.ckpt.old").exists()


@pytest.mark.parametrize("complete_tmp", [True, False])
def test_interrupted_between_renames_is_recovered(tmp_path, complete_tmp):
    path, old, tmp = tmp_path / "c", tmp_path / "c.old", tmp_path / "c.tmp"
    _save(old, 1)  # the previous checkpoint, moved aside
    if complete_tmp:
        _save(tmp, 2)  # the new one, complete but not yet renamed
    # a resume loads the newest complete copy where it lies (Lightning loads before anything is saved)
    assert load_sharded(path, 0, 1, LAYOUT)["state_dict"]["w"][0] == (2 if complete_tmp else 1)
    assert not path.exists()  # loading moves nothing
    _recover(path)  # what the next save does first
    assert load_sharded(path, 0, 1, LAYOUT)["state_dict"]["w"][0] == (2 if complete_tmp else 1)
    assert not tmp.exists() and (complete_tmp or not old.exists())
