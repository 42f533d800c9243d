"""Which GEMMs a precision callback swaps, and the swap itself: the dense linears' and the experts' ``_mm`` swap
points (``ColumnParallelLinear``, ``RowParallelLinear``, ``GroupedMM``) and plain bias-free ``nn.Linear`` layers
(MLA's down-projections). The router (no swap point) keeps its fp32 GEMM."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, Sequence

from torch import nn

from lightning_moe.modules.experts import GroupedMM
from lightning_moe.modules.tensor_parallel import ColumnParallelLinear, RowParallelLinear


@dataclass
class Gemm:
    name: str
    module: nn.Module
    K: int  # the GEMM's reduction dimension (this rank's shard)
    N: int
    weight: nn.Parameter  # dense (N, K); the experts' (L, K, N)

    @property
    def grouped(self) -> bool:
        return isinstance(self.module, GroupedMM)


def gemms(pl_module, exclude: Sequence[str] = (), include_head: bool = False,
          skip_prefixes: Sequence[str] = ()) -> Iterator[Gemm]:
    """Every swappable GEMM of the LightningModule, but the excluded (``fnmatch`` patterns on module names), those
    under ``skip_prefixes``, and the head unless ``include_head``."""
    head = getattr(getattr(pl_module, "model", None), "head", None)
    for name, m in pl_module.named_modules():
        if (any(fnmatch.fnmatch(name, p) for p in exclude) or any(name.startswith(p) for p in skip_prefixes)
                or (m is head and not include_head)):
            continue
        if isinstance(m, GroupedMM):  # the weights are its experts'
            experts = pl_module.get_submodule(name.rsplit(".", 1)[0])
            w = experts.w13 if name.endswith("fc1") else experts.w2
            yield Gemm(name, m, w.shape[1], w.shape[2], w)
        elif isinstance(m, (ColumnParallelLinear, RowParallelLinear)) or (
                isinstance(m, nn.Linear) and m.bias is None and "router" not in name):
            yield Gemm(name, m, m.weight.shape[1], m.weight.shape[0], m.weight)


def swap(g: Gemm, dense: Callable, grouped: Callable, spec, swapped: list) -> None:
    """Route ``g``'s GEMM through ``dense(x, w, spec)`` or ``grouped(x, w, offs, spec)``; ``swapped`` records it."""
    m = g.module
    if g.grouped:
        m._mm = partial(grouped, spec=spec)
        swapped.append((m, "_mm"))
    elif isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
        m._mm = partial(dense, spec=spec)
        swapped.append((m, "_mm"))
    else:  # a plain bias-free nn.Linear
        m.forward = lambda x, mod=m: dense(x, mod.weight, spec)
        swapped.append((m, "forward"))


def unswap(swapped: list) -> None:
    for module, attr in swapped:
        module.__dict__.pop(attr, None)
    swapped.clear()
