"""Layout-independent model checkpoints through ``torch.distributed.checkpoint`` (DCP).

Every tensor is saved as the *logical* tensor of the one-process model (same name, same global shape), each rank
writing only the blocks it holds, with their offsets: experts by EP rank (dim 0) and their FFN columns by ETP rank,
TP shards along their split dimension (``[gate | up]``-style fused weights as one block per part), everything else
whole. DCP records the global shapes and block offsets in its metadata, deduplicates replicas (DP, EDP, the tied
embedding copy under PP), and on load reads for each rank exactly the overlap of the saved blocks with the blocks it
holds now. So a checkpoint written under one TP/EP/ETP/PP/DP layout loads under any other, down to one process.
Only tensors are stored: loading unpickles nothing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType, LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from lightning_moe.strategy.flat_shards import flat_boxes, intersect, unravel


@dataclasses.dataclass
class Piece:
    """One block of a logical tensor held by this rank: ``local`` is a view into the live tensor."""
    key: str
    global_shape: tuple
    offsets: tuple
    local: torch.Tensor


def _expert_pieces(name: str, t: torch.Tensor, mod: nn.Module, ep: int) -> list[Piece]:
    E, e0, r, n = t.shape[0] * ep, mod.expert_offset, mod.etp_rank, mod.etp_size
    if name.endswith("w13"):  # [L, D, 2f] = [gate_r | up_r]; the logical tensor is [E, D, 2F] = [gate | up]
        D, f = t.shape[1], t.shape[2] // 2
        F = f * n
        return [Piece(name, (E, D, 2 * F), (e0, 0, part * F + r * f), t[:, :, part * f:(part + 1) * f])
                for part in (0, 1)]
    f, D = t.shape[1], t.shape[2]  # w2: [L, f, D]
    return [Piece(name, (E, f * n, D), (e0, r * f, 0), t)]


def _tp_pieces(name: str, t: torch.Tensor, dim: int, parts: int, rank: int, size: int) -> list[Piece]:
    n = t.shape[dim] // parts  # this rank's rows of each part
    full = n * size  # one part's full size
    shape = list(t.shape)
    shape[dim] = full * parts
    pieces = []
    for j in range(parts):
        offsets = [0] * t.ndim
        offsets[dim] = j * full + rank * n
        pieces.append(Piece(name, tuple(shape), tuple(offsets), t.narrow(dim, j * n, n)))
    return pieces


def model_pieces(model: nn.Module, ctx, prefix: str = "", tensors: Optional[dict] = None,
                 params: Optional[dict] = None) -> list[Piece]:
    """The logical blocks of every tensor of ``model.state_dict()`` this rank holds. ``tensors`` stands in for the
    state dict's tensors (same names and shapes, e.g. fp32 main copies of bf16 weights); the module still tells how
    each one is sharded."""
    pieces = []
    params = params if params is not None else dict(model.named_parameters())
    source = tensors if tensors is not None else model.state_dict(keep_vars=True)
    for name, t in source.items():
        t = t.detach()
        p = params.get(name)
        if p is not None and getattr(p, "is_expert", False):
            mod = model.get_submodule(name.rsplit(".", 1)[0])
            pieces += [dataclasses.replace(pc, key=prefix + pc.key) for pc in _expert_pieces(name, t, mod, ctx.ep)]
        elif p is not None and getattr(p, "tp_shard_dim", None) is not None and ctx.tp > 1:
            pieces += _tp_pieces(prefix + name, t, p.tp_shard_dim, getattr(p, "tp_parts", 1), ctx.rank("tp"), ctx.tp)
        else:
            pieces.append(Piece(prefix + name, tuple(t.shape), (0,) * t.ndim, t))
    return pieces


def range_pieces(model: nn.Module, ctx, name: str, shape, lo: int, hi: int, data: torch.Tensor,
                 prefix: str = "", params: Optional[dict] = None) -> list[Piece]:
    """The logical blocks of elements ``[lo, hi)`` (flat, C order) of this rank's tensor ``name`` (local ``shape``),
    whose values are the 1-D ``data``: a distributed-optimizer slice. The slice splits into rectangular blocks
    (``flat_boxes``), each cut by the blocks the tensor maps to in the logical tensor (``model_pieces``)."""
    template = torch.empty(tuple(shape), device="meta")
    blocks = [(b, unravel(b.local.storage_offset(), shape), tuple(b.local.shape))
              for b in model_pieces(model, ctx, prefix=prefix, tensors={name: template}, params=params)]
    out = []
    for off, size, start in flat_boxes(shape, lo, hi):
        box = data[start - lo:start - lo + math.prod(size)].view(size)
        for b, b_off, b_size in blocks:
            cut = intersect(off, size, b_off, b_size)
            if cut is None:
                continue
            c_off, c_size = cut
            view = box
            for d, (o, n) in enumerate(zip(c_off, c_size)):
                view = view.narrow(d, o - off[d], n)
            out.append(Piece(b.key, b.global_shape, tuple(g + o - bo for g, o, bo in zip(b.offsets, c_off, b_off)),
                             view))
    return out


class _SavePlanner(DefaultSavePlanner):
    def __init__(self, pieces: list[Piece]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=True)
        self.pieces = {(p.key, tuple(p.offsets)): p for p in pieces}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(p.key, torch.Size(p.offsets)), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(
                               chunk=ChunkStorageMetadata(offsets=torch.Size(p.offsets),
                                                          sizes=torch.Size(p.local.shape)),
                               properties=TensorProperties.create_from_tensor(p.local),
                               size=torch.Size(p.global_shape)))
                 for p in self.pieces.values()]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        p = self.pieces[(write_item.index.fqn, tuple(write_item.index.offset))]
        return p.local.contiguous().cpu()


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self, pieces: list[Piece]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces, self.copies = {}, {}  # one read per block; further pieces of the same block get copies
        for p in pieces:
            key = (p.key, tuple(p.offsets))
            if key in self.pieces:  # e.g. the step count of two optimizer slices of one parameter
                self.copies.setdefault(key, []).append(p)
            else:
                self.pieces[key] = p

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = {}, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        requests = []
        for p in self.pieces.values():
            md = saved.get(p.key)
            if not isinstance(md, TensorStorageMetadata):
                raise ValueError(f"checkpoint has no tensor {p.key!r} (a different model: compare the configs)")
            if tuple(md.size) != tuple(p.global_shape):
                raise ValueError(f"checkpoint tensor {p.key!r} has shape {tuple(md.size)}, this model's is "
                                 f"{tuple(p.global_shape)} (a different model config: hidden size, experts, vocab...)")
            chunk = ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=torch.Size(p.local.shape))
            requests += create_read_items_for_chunk_list(p.key, md, [chunk])
        return LoadPlan(requests)

    def resolve_tensor(self, read_item):
        p = self.pieces[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        view = p.local
        for d, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(d, start, length)
        return view

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        # resolve_tensor returned a view of the live tensor: the reader copied into it in place
        for p in self.copies.get((read_item.dest_index.fqn, tuple(read_item.dest_index.offset)), ()):
            view = p.local
            for d, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                view = view.narrow(d, start, length)
            view.copy_(tensor)


def save_pieces(pieces: list[Piece], path: str, process_group: Optional[object] = None) -> None:
    """Collective: every rank writes its ``pieces`` into the DCP directory ``path``."""
    try:
        dcp.save({}, storage_writer=dcp.FileSystemWriter(path), planner=_SavePlanner(pieces),
                 process_group=process_group)
    except CheckpointException as e:
        raise _unwrap(e, path) from None


def _unwrap(e: CheckpointException, path: str) -> Exception:
    # DCP gathers every rank's failure into a BaseException (so `except Exception` would miss it): a ValueError of
    # our planner (a config mismatch naming the tensor) stays one; anything else (a truncated file) a RuntimeError
    errors = [f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values()]
    first = next((x for x in errors if isinstance(x, ValueError)), None)
    if first is not None:
        return ValueError(str(first))
    return RuntimeError(f"{path}: {type(errors[0]).__name__}: {errors[0]}" if errors else f"{path}: {e}")


@torch.no_grad()
def load_pieces(pieces: list[Piece], path: str, process_group: Optional[object] = None) -> None:
    """Collective: fill every rank's ``pieces`` (in place) from a DCP directory written under any layout."""
    try:
        dcp.load({}, storage_reader=dcp.FileSystemReader(path), planner=_LoadPlanner(pieces),
                 process_group=process_group)
    except CheckpointException as e:
        raise _unwrap(e, path) from None


def read_tensor_metadata(path: str) -> dict[str, TensorStorageMetadata]:
    """Every tensor a DCP directory holds: name -> global size and dtype."""
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {k: v for k, v in md.items() if isinstance(v, TensorStorageMetadata)}


def save_model(model: nn.Module, ctx, path: str, tensors: Optional[dict] = None,
               process_group: Optional[object] = None) -> None:
    """Collective: every rank writes its blocks of ``model``'s logical tensors (or of ``tensors``, see
    ``model_pieces``) into the DCP directory ``path``."""
    save_pieces(model_pieces(model, ctx, tensors=tensors), path, process_group)


def load_model(model: nn.Module, ctx, path: str, tensors: Optional[dict] = None,
               process_group: Optional[object] = None) -> None:
    """Collective: fill this rank's blocks of ``model`` (or of ``tensors``) from a DCP directory written under any
    layout."""
    load_pieces(model_pieces(model, ctx, tensors=tensors), path, process_group)
