"""Sharded checkpoints: a directory with one shard file per rank (its expert shards, optimizer state and Lightning's
metadata) plus ``meta.json`` describing the layout. Nothing is gathered to one rank.

Saves are atomic: every rank writes into ``<path>.tmp``; only after all shards exist does rank 0 move the directory
into place, so a crash mid-save leaves the last good checkpoint untouched. Loads use ``torch.load(weights_only=True)``
(no arbitrary unpickling). The same layout resumes exactly from the shard files. Every save also holds a
layout-independent copy of the model weights (``model_dcp/``, torch.distributed.checkpoint with global shapes, see
``reshard.py``), from which another layout (TP, EP, ETP, PP, DP) loads its own shards; the optimizer moments then
start afresh.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch

FORMAT = "lightning_moe.sharded/1"
META = "meta.json"


def shard_name(rank: int) -> str:
    return f"shard_{rank:05d}.pt"


def is_sharded_checkpoint(path) -> bool:
    return (Path(path) / META).is_file()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


MODEL_DCP = "model_dcp"  # layout-independent copy of the model weights (strategy/reshard.py)


def save_sharded(checkpoint: dict, path, rank: int, world_size: int, layout: dict, barrier: Callable[[str], None],
                 write_model: Optional[Callable[[Path], None]] = None) -> None:
    """``write_model(dir)``: collective, writes the layout-independent model copy into the save's directory."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if rank == 0:
        _recover(path)  # a previous save that died between its two renames
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
        tmp.mkdir(parents=True)
    barrier("moe_fold.save.begin")
    shard = tmp / shard_name(rank)
    with open(shard, "wb") as f:
        torch.save(checkpoint, f)
        f.flush()
        os.fsync(f.fileno())
    if write_model is not None:
        write_model(tmp / MODEL_DCP)
    barrier("moe_fold.save.written")
    if rank == 0:
        meta = {"format": FORMAT, "world_size": world_size, "layout": layout,
                "shards": [shard_name(r) for r in range(world_size)]}
        with open(tmp / META, "w") as f:
            f.write(json.dumps(meta, indent=1))
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        old = path.with_name(path.name + ".old")
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            (path.rename(old) if path.is_dir() else path.replace(old))
        tmp.rename(path)  # the commit point
        _fsync_dir(path.parent)
        if old.exists():
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    barrier("moe_fold.save.done")


def _recover(path: Path) -> None:
    """If a save died after moving the old checkpoint aside but before moving the new one in, finish or undo it:
    a complete ``.tmp`` (its meta.json is written last) becomes the checkpoint, else the ``.old`` one returns."""
    if path.exists():
        return
    for candidate in (path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")):
        if is_sharded_checkpoint(candidate):
            candidate.rename(path)
            return


def load_sharded(path, rank: int, world_size: int, layout: dict,
                 reshard_model: Optional[Callable[[Path], dict]] = None) -> dict:
    """This rank's checkpoint dict. Under another layout (``reshard_model`` given and the checkpoint has a
    layout-independent model copy): Lightning's replicated state from shard 0, ``state_dict`` from
    ``reshard_model(dir)``, and ``optimizer_states`` set to None (optimizer moments are not resharded)."""
    path = Path(path)
    if not path.exists() and (is_sharded_checkpoint(path.with_name(path.name + ".tmp"))
                              or is_sharded_checkpoint(path.with_name(path.name + ".old"))):
        raise FileNotFoundError(f"checkpoint not found: {path}, but a save was interrupted between its final renames: "
                                f"start training once more (it recovers the checkpoint) or rename {path.name}.tmp "
                                f"(complete) or {path.name}.old (previous) to {path.name}")
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if not is_sharded_checkpoint(path):
        raise ValueError(f"{path} is not a moe_fold sharded checkpoint ({META} is missing: an incomplete save, or a "
                         "checkpoint written by another strategy)")
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path / META} is unreadable or corrupted: {e}") from e
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown checkpoint format {meta.get('format')!r} (expected {FORMAT!r})")
    if meta["world_size"] != world_size or meta["layout"] != layout:
        diff = {k: (meta["layout"].get(k), v) for k, v in layout.items() if meta["layout"].get(k) != v}
        if reshard_model is not None and (path / MODEL_DCP / ".metadata").is_file():
            checkpoint = _load_shard(path / shard_name(0))
            checkpoint["state_dict"] = reshard_model(path / MODEL_DCP)
            checkpoint["optimizer_states"] = None
            return checkpoint
        raise ValueError(f"{path} was written with world_size={meta['world_size']} and layout {meta['layout']}; "
                         f"this run has world_size={world_size} (differences saved -> now: {diff}). Loading a "
                         "checkpoint onto another layout needs its layout-independent model copy "
                         f"({MODEL_DCP}/), which this checkpoint lacks (written by an older version).")
    return _load_shard(path / shard_name(rank))


def _load_shard(shard: Path) -> dict:
    if not shard.is_file():
        raise ValueError(f"{shard.parent}: shard {shard.name} is missing (truncated checkpoint)")
    try:
        return torch.load(shard, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the file named
        raise ValueError(f"{shard} is corrupted or truncated and cannot be loaded: {e}") from e
