"""Launching our Triton and Gluon kernels through their compiled launchers: ``launch(kernel, grid, *args, **kwargs)``
does what ``kernel[grid](*args, **kwargs)`` does, with less of the host's time.

Why: at the FP8 step's small GEMMs and quantization passes the GPU waits for the host (docs/PERFORMANCE.md).
``JITFunction.run`` does the same Python work at every call: it stringifies the launch options into a cache key,
re-checks the kernel's globals, builds the launch metadata and calls triton's (empty) launch hooks. On an H100 host
that took 26 µs per launch of the rowwise quantization and 46 µs of the Gluon GEMM, against 8 and 16 µs for the
compiled kernel's launcher alone.

How: each call still runs triton's own binder (native code) over its arguments, so it gets the specialization
``kernel[grid]`` would: dtypes, the 16-byte alignment of pointers, the divisibility of integers by 16, constexprs.
That specialization, the launch options and the knobs ``run`` adds to them (debug, instrumentation, sanitizer) key a
cache of compiled kernels. A hit launches the compiled kernel on the current device and stream straight through its
launcher; a miss goes through ``kernel[grid]`` (compiling as it does) and keeps the kernel it returns. A call therefore
never reuses a kernel compiled for another specialization or other options. Every call goes through ``kernel[grid]``
under the interpreter, for autotuned kernels (no binder of their own), with launch hooks set (proton), with pre-run
hooks, with a stages-inspection hook, for a callable grid or unhashable options, on a triton without ``knobs``
(before 3.3: other launcher arguments), or with ``LMOE_TRITON_LAUNCH=0`` (read at import; for comparisons).

What a hit skips that ``run`` does: the check that the kernel's global values have not changed since it was compiled
(ours are module constants) and the launch metadata that only launch hooks read.
"""

from __future__ import annotations

import os
from typing import Callable, Optional, Union

import torch

ENABLED = os.environ.get("LMOE_TRITON_LAUNCH", "1") != "0"

# id(kernel) -> (kernel, {key: the compiled kernel's (launcher, function, packed metadata)}), the kernel held so that
# a new kernel at a freed one's id never finds its entry; or (kernel, False) for a kernel that always goes through
# kernel[grid]. A cache of compiled kernels, like triton's own, not state.
_COMPILED: dict = {}
_KNOBS: Optional[tuple] = None  # (knobs.runtime, knobs.compilation), or () without knobs: read once (``_knobs``)


def _knobs() -> Optional[tuple]:
    """triton's ``knobs.runtime`` and ``knobs.compilation``; None on a triton without ``knobs``."""
    global _KNOBS
    if _KNOBS is None:
        try:
            from triton import knobs
            _KNOBS = (knobs.runtime, knobs.compilation)
        except (ImportError, AttributeError):
            _KNOBS = ()
    return _KNOBS or None


def _set(hook) -> bool:
    """Whether a launch hook is set: a HookChain with calls (triton >= 3.5), or a function (3.3-3.4)."""
    return bool(getattr(hook, "calls", hook))


def launch(kernel, grid: Union[tuple, Callable], /, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``: the same kernel, specialization and launch, on the current device and
    stream."""
    entry = _COMPILED.get(id(kernel))
    if entry is None or entry[0] is not kernel:  # this kernel's first launch: can it go through its launcher at all?
        ok = hasattr(kernel, "device_caches") and _knobs() is not None and not getattr(kernel, "pre_run_hooks", None)
        entry = _COMPILED[id(kernel)] = (kernel, {} if ok else False)
    compiled, knobs = entry[1], _KNOBS
    if compiled is False or not ENABLED or callable(grid):
        kernel[grid](*args, **kwargs)
        return
    rt, comp = knobs
    if (_set(rt.launch_enter_hook) or _set(rt.launch_exit_hook) or getattr(kernel, "pre_run_hooks", None)
            or getattr(rt, "add_stages_inspection_hook", None) is not None):
        kernel[grid](*args, **kwargs)
        return
    device = torch._C._cuda_getDevice()  # what triton's driver launches on: the current device
    params, specialization, options = kernel.device_caches[device][-1](*args, **kwargs)  # triton's binder
    key = (device, tuple(specialization), tuple(options.items()), getattr(kernel, "debug", None), rt.debug,
           getattr(comp, "instrumentation_mode", None), getattr(comp, "fpsan_homomorphic_casts", None))
    try:
        hit = compiled.get(key)
    except TypeError:  # an unhashable option or constexpr: triton's own path
        kernel[grid](*args, **kwargs)
        return
    if hit is None:
        k = kernel[grid](*args, **kwargs)  # compiles where needed, and launches
        if k is not None and hasattr(k, "packed_metadata"):
            compiled[key] = (k.run, k.function, k.packed_metadata)
        return
    run, function, metadata = hit
    n = len(grid)
    run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, torch._C._cuda_getCurrentRawStream(device),
        function, metadata, None, None, None, *params.values())
