"""Where the Triton kernels run: on CUDA tensors, and on CPU tensors under the Triton interpreter
(``TRITON_INTERPRET=1``, for tests). Kernel modules import triton at their top; they are imported here on first use,
so CPU installs without triton never import it and take the torch reference paths."""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Optional

import torch

_MODULES: dict[str, Optional[ModuleType]] = {}  # a cache of imported kernel modules, not state


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def load(name: str, t: torch.Tensor, wanted: bool = True) -> Optional[ModuleType]:
    """The kernel module ``lightning_moe.modules.<name>`` when its kernels run for ``t``; None: use the reference."""
    if not wanted or not (t.is_cuda or interpreting()):
        return None
    if name not in _MODULES:
        try:
            _MODULES[name] = importlib.import_module(f"lightning_moe.modules.{name}")
        except ImportError:  # no triton
            _MODULES[name] = None
    return _MODULES[name]
