"""Sharded checkpoints: a directory holding ``model_dcp/``, every model and optimizer tensor in
torch.distributed.checkpoint's format with global shapes (each rank writes its own blocks, see ``reshard.py`` and
``checkpoint_state.py``); one small shard file per rank with the rest of Lightning's checkpoint (progress, loops,
callbacks, schedulers, RNG); and ``meta.json`` describing the layout. Nothing is gathered to one rank, nothing is
stored twice, and a checkpoint written under one layout (TP, EP, ETP, PP, DP) loads under any other.

Saves are atomic: every rank writes into ``<path>.tmp``; only after all shards exist does rank 0 move the directory
into place, so a crash mid-save leaves the last good checkpoint untouched. Loads use ``torch.load(weights_only=True)``
and DCP's tensor reader (no arbitrary unpickling).
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


MODEL_DCP = "model_dcp"  # the layout-independent tensors (strategy/reshard.py)


def save_sharded(checkpoint: dict, path, rank: int, world_size: int, layout: dict, barrier: Callable[[str], None],
                 write_tensors: Optional[Callable[[Path], None]] = None) -> None:
    """``write_tensors(dir)``: collective, writes the layout-independent tensors into the save's directory."""
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
    if write_tensors is not None:
        write_tensors(tmp / MODEL_DCP)
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
                 fill: Optional[Callable[[dict, Path, bool], dict]] = None,
                 agree: Optional[Callable[[Optional[str]], Optional[str]]] = None) -> dict:
    """This rank's checkpoint dict: its own shard file under the same layout, shard 0's (the replicated state) under
    another; ``fill(checkpoint, dcp_dir, same_layout)`` (collective) puts this rank's tensors back from the
    checkpoint's ``model_dcp/``. ``agree(error or None)`` (collective) returns the first rank's error, so that a
    missing or corrupted shard on one rank fails every rank at once."""
    path = Path(path)
    if not path.exists():  # a save died between its two renames: read the newest complete copy where it lies (a
        # complete .tmp is newer than the .old); the next save puts it in place (``_recover``). Nothing is renamed
        # here: every rank reads, and none may move the files under the others
        for candidate in (path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")):
            if is_sharded_checkpoint(candidate):
                path = candidate
                break
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
    same = meta["world_size"] == world_size and meta["layout"] == layout
    has_dcp = (path / MODEL_DCP / ".metadata").is_file()
    if not same and not (fill is not None and has_dcp):
        diff = {k: (meta["layout"].get(k), v) for k, v in layout.items() if meta["layout"].get(k) != v}
        raise ValueError(f"{path} was written with world_size={meta['world_size']} and layout {meta['layout']}; "
                         f"this run has world_size={world_size} (differences saved -> now: {diff}). Loading a "
                         "checkpoint onto another layout needs its layout-independent tensors "
                         f"({MODEL_DCP}/), which this checkpoint lacks (written by an older version).")
    error, checkpoint = None, None
    try:
        checkpoint = _load_shard(path / shard_name(rank if same else 0))
    except ValueError as e:
        error = str(e)
    if agree is not None:  # every rank raises the first rank's error, instead of waiting in the collective load
        error = agree(error)
    if error:
        raise ValueError(error)
    if fill is None or not has_dcp:
        return checkpoint
    try:
        return fill(checkpoint, path / MODEL_DCP, same)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - DCP's reader errors (a truncated or missing .distcp file), with the path
        raise ValueError(f"{path / MODEL_DCP} is corrupted or truncated and cannot be loaded: "
                         f"{type(e).__name__}: {e}") from e


def _load_shard(shard: Path) -> dict:
    if not shard.is_file():
        raise ValueError(f"{shard.parent}: shard {shard.name} is missing (truncated checkpoint)")
    try:
        return torch.load(shard, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the file named
        raise ValueError(f"{shard} is corrupted or truncated and cannot be loaded: {e}") from e
