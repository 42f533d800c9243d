"""Launching our Triton and Gluon kernels through their compiled launchers: ``launch(kernel, grid, *args, **kwargs)``
does what ``kernel[grid](*args, **kwargs)`` does, with less of the host's time.

Why: at the FP8 step's small GEMMs and quantization passes the GPU waits for the host (docs/PERFORMANCE.md).
``JITFunction.run`` does the same Python work at every call: it stringifies the launch options into a cache key,
re-checks the kernel's globals, builds the launch metadata and calls triton's (empty) launch hooks. On an H100 host
that took 26 µs per launch of the rowwise quantization and 46 µs of the Gluon GEMM, against 8 and 16 µs for the
compiled kernel's launcher alone.

How: each call still runs triton's own binder (native code) over its arguments, so it gets the specialization
``kernel[grid]`` would: dtypes, the 16-byte alignment of pointers, the divisibility of integers by 16, constexprs.
That specialization and the launch options key a cache of compiled kernels. A hit launches the compiled kernel on the
current stream straight through its launcher; a miss goes through ``kernel[grid]`` (compiling or tuning as it does) and
keeps the kernel it returns. A call therefore never reuses a kernel compiled for another specialization. Every call goes
through ``kernel[grid]`` under the interpreter, with launch hooks set (proton, ``knobs.runtime.launch_enter_hook``),
with pre-run hooks, for a callable grid, or with ``LMOE_TRITON_LAUNCH=0`` (for comparisons).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

ENABLED = os.environ.get("LMOE_TRITON_LAUNCH", "1") != "0"

# id(kernel) -> {(device, specialization, options): the compiled kernel's (launcher, function, packed metadata)}, or
# False for a kernel that always goes through kernel[grid] (interpreted, with pre-run hooks): a cache of compiled
# kernels, like triton's own, not state
_COMPILED: dict = {}
_HOOKS: Optional[tuple] = None  # triton's launch hooks, read once (``_hooks``)


def _hooks() -> Optional[tuple]:
    """triton's launch hooks (``knobs.runtime``'s HookChains, whose calls change but not the objects), read once; None
    on a triton without ``knobs`` (before 3.3), whose launchers take other arguments: every launch then goes through
    ``kernel[grid]``."""
    global _HOOKS
    if _HOOKS is None:
        try:
            from triton import knobs
            _HOOKS = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
        except (ImportError, AttributeError):
            _HOOKS = ()
    return _HOOKS or None


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``: the same kernel, specialization and launch, on the current device and
    stream."""
    compiled = _COMPILED.get(id(kernel))
    if compiled is None:  # the first launch of this kernel: can it go through its launcher at all?
        compiled = _COMPILED[id(kernel)] = {} if (hasattr(kernel, "device_caches") and _hooks() is not None
                                                  and not getattr(kernel, "pre_run_hooks", None)) else False
    if compiled is False or not ENABLED or callable(grid) or any(getattr(h, "calls", h) for h in _hooks() or ()):
        kernel[grid](*args, **kwargs)
        return
    device = torch._C._cuda_getDevice()  # what triton's driver launches on: the current device
    params, specialization, options = kernel.device_caches[device][-1](*args, **kwargs)  # triton's binder
    key = (device, tuple(specialization), tuple(options.items()))
    hit = compiled.get(key)
    if hit is None:
        k = kernel[grid](*args, **kwargs)  # compiles where needed, and launches
        if k is not None and hasattr(k, "packed_metadata"):
            compiled[key] = (k.run, k.function, k.packed_metadata)
        return
    run, function, metadata = hit
    n = len(grid)
    run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, torch._C._cuda_getCurrentRawStream(device),
        function, metadata, None, None, None, *params.values())
