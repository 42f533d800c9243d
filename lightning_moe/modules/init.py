"""Layout-invariant weight initialisation.

Every logical weight is drawn from a generator seeded by (seed, its name[, expert index]), full size, and each rank
keeps only its slice. A model sharded over any TP/EP/ETP layout therefore holds exactly the weights of the
one-process model built with the same seed, which is what the parity tests rely on.
"""

from __future__ import annotations

import zlib
from typing import Optional, Sequence

import torch


def _generator(seed: int, key: str, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63))
    return g


def full_normal(shape: Sequence[int], std: float, seed: int, key: str, device, dtype=torch.float32) -> torch.Tensor:
    """The full (unsharded) tensor of a weight, the same on every rank."""
    device = torch.device(device)
    out = torch.empty(tuple(shape), device=device, dtype=torch.float32)
    out.normal_(0.0, std, generator=_generator(seed, key, device))
    return out.to(dtype)


def shard(full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """The rank's contiguous slice of ``full`` along ``dim`` (sizes are validated before any model is built)."""
    if size == 1:
        return full
    return full.chunk(size, dim=dim)[rank]


@torch.no_grad()
def fill_normal_(param: torch.Tensor, std: float, seed: int, key: str,
                 shard_dim: Optional[int] = None, rank: int = 0, size: int = 1) -> None:
    full_shape = list(param.shape)
    if shard_dim is not None:
        full_shape[shard_dim] *= size
    full = full_normal(full_shape, std, seed, key, param.device, param.dtype)
    param.copy_(shard(full, shard_dim, rank, size) if shard_dim is not None else full)


@torch.no_grad()
def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Call ``reset_parameters_sharded(seed, name)`` on every submodule that defines it."""
    for name, module in model.named_modules():
        fn = getattr(module, "reset_parameters_sharded", None)
        if fn is not None:
            fn(seed, name)
