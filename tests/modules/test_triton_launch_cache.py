"""``triton_launch.launch``'s cache, on the CPU with a stand-in for a JIT kernel (no triton needed): a miss goes
through ``kernel[grid]`` and keeps the compiled kernel it returns, a hit calls that kernel's launcher with triton's
arguments; another specialization, other options or another debug knob miss; launch hooks (set or replaced),
pre-run hooks added later, a stages-inspection hook, a callable grid, unhashable options, ``ENABLED = False``,
kernels without a binder and a triton without ``knobs`` always take ``kernel[grid]``; a new kernel at a freed
kernel's id never uses its entry. The real kernels' launches are tested on a GPU (``test_triton_launch.py``)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from lightning_moe.modules import triton_launch


class _Chain:
    def __init__(self):
        self.calls = []


class _Compiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, object(), object()

    def run(self, *args):
        self.log.append(("run", args))


class _Kernel:
    """What ``launch`` uses of a JITFunction: ``device_caches[device][-1]`` (the binder: params, specialization,
    options) and ``kernel[grid](...)``, which returns the compiled kernel."""

    def __init__(self):
        self.log, self.compiled = [], []
        self.device_caches = {0: (None, None, None, None, self._binder)}
        self.debug, self.pre_run_hooks = False, []

    @staticmethod
    def _binder(x, n, BLOCK=16, **options):
        """x stands for a pointer (its value for data_ptr()), n for an integer argument."""
        spec = [("*fp32", "D" if x % 16 == 0 else ""), ("i32", "D" if n % 16 == 0 else ""), ("constexpr", BLOCK)]
        return {"x": x, "n": n, "BLOCK": BLOCK}, spec, options

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.log.append(("grid", grid, args, kwargs))
            k = _Compiled(self.log)
            self.compiled.append(k)
            return k
        return call


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA device 0 with stream 1234, and triton's knobs: (runtime, compilation)."""
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    knobs = (SimpleNamespace(launch_enter_hook=_Chain(), launch_exit_hook=_Chain(), debug=False),
             SimpleNamespace(instrumentation_mode=""))
    monkeypatch.setattr(triton_launch, "_KNOBS", knobs)
    monkeypatch.setattr(triton_launch, "_COMPILED", {})
    monkeypatch.setattr(triton_launch, "ENABLED", True)
    return knobs


def test_a_miss_goes_through_the_kernel_and_a_hit_through_its_launcher(fake_cuda):
    k = _Kernel()
    triton_launch.launch(k, (3,), 32, 64, BLOCK=16, num_warps=4)
    assert [e[0] for e in k.log] == ["grid"]
    triton_launch.launch(k, (5, 2), 48, 80, BLOCK=16, num_warps=4)  # other values, the same specialization
    assert k.log[-1] == ("run", (5, 2, 1, 1234, k.compiled[0].function, k.compiled[0].packed_metadata, None, None,
                                 None, 48, 80, 16))
    for args, kw in [((33, 64), dict(BLOCK=16, num_warps=4)),  # an unaligned pointer
                     ((32, 65), dict(BLOCK=16, num_warps=4)),  # n no longer a multiple of 16
                     ((32, 64), dict(BLOCK=32, num_warps=4)),  # another constexpr
                     ((32, 64), dict(BLOCK=16, num_warps=8))]:  # other launch options
        n = len(k.compiled)
        triton_launch.launch(k, (3,), *args, **kw)
        assert len(k.compiled) == n + 1 and k.log[-1][0] == "grid", (args, kw)
    k.debug = True  # what JITFunction.run adds to the options before binding
    triton_launch.launch(k, (3,), 32, 64, BLOCK=16, num_warps=4)
    fake_cuda[0].debug = True
    triton_launch.launch(k, (3,), 32, 64, BLOCK=16, num_warps=4)
    assert [e[0] for e in k.log[-2:]] == ["grid", "grid"]
    assert len(triton_launch._COMPILED[id(k)][1]) == 7


def test_hooks_callable_grids_and_the_switch_take_the_kernels_path(fake_cuda, monkeypatch):
    k = _Kernel()
    triton_launch.launch(k, (3,), 32, 64)  # compiled and kept
    fake_cuda[0].launch_enter_hook.calls.append(print)  # a launch hook (proton): it must see the launch
    triton_launch.launch(k, (3,), 32, 64)
    fake_cuda[0].launch_enter_hook = print  # replaced by assignment, as knobs.runtime allows
    triton_launch.launch(k, (3,), 32, 64)
    fake_cuda[0].launch_enter_hook = _Chain()
    k.pre_run_hooks.append(print)  # added after the first launch
    triton_launch.launch(k, (3,), 32, 64)
    k.pre_run_hooks.clear()
    fake_cuda[0].add_stages_inspection_hook = lambda: ("key", "hash")  # run adds a custom pipeline to the key
    triton_launch.launch(k, (3,), 32, 64)
    del fake_cuda[0].add_stages_inspection_hook
    triton_launch.launch(k, lambda meta: (3,), 32, 64)
    triton_launch.launch(k, (3,), 32, 64, extern_libs={"libdevice": "x"})  # an unhashable option
    monkeypatch.setattr(triton_launch, "ENABLED", False)
    triton_launch.launch(k, (3,), 32, 64)
    assert [e[0] for e in k.log] == ["grid"] * 8
    monkeypatch.setattr(triton_launch, "ENABLED", True)
    triton_launch.launch(k, (3,), 32, 64)
    assert k.log[-1][0] == "run"


def test_a_new_kernel_at_a_freed_kernels_id_starts_afresh(fake_cuda):
    old, k = _Kernel(), _Kernel()
    triton_launch.launch(old, (3,), 32, 64)
    triton_launch._COMPILED[id(k)] = triton_launch._COMPILED.pop(id(old))  # as if k had taken old's address
    triton_launch.launch(k, (3,), 32, 64)
    assert [e[0] for e in k.log] == ["grid"] and len(old.log) == 1


@pytest.mark.parametrize("kind", ["no binder", "pre-run hooks", "old triton"])
def test_kernels_it_cannot_launch_always_take_the_kernels_path(fake_cuda, monkeypatch, kind):
    k = _Kernel()
    if kind == "no binder":  # the interpreter's kernels
        del k.device_caches
    elif kind == "pre-run hooks":
        k.pre_run_hooks = [print]
    else:
        monkeypatch.setattr(triton_launch, "_KNOBS", ())
    for _ in range(3):
        triton_launch.launch(k, (3,), 32, 64)
    assert [e[0] for e in k.log] == ["grid"] * 3 and triton_launch._COMPILED[id(k)][1] is False


def test_without_triton_knobs_there_are_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # ``from triton import knobs`` raises ImportError
    monkeypatch.setattr(triton_launch, "_KNOBS", None)
    assert triton_launch._knobs() is None and triton_launch._KNOBS == ()
