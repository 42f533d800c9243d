"""``triton_launch.launch``: our kernels through their compiled launchers. On CUDA (``gpu``): the same results as
``kernel[grid]``, a kernel compiled again wherever triton's specialization of the arguments changes (an unaligned
pointer, an integer that is no longer a multiple of 16, another constexpr), launches on the current stream, and
triton's own path while a launch hook is set. Under the Triton interpreter (a fresh CPU process, skipped without
triton): the same results as ``kernel[grid]``."""

from __future__ import annotations

import pytest
import torch

from tests.modules.interpreted import INSIDE, run_interpreted

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def _axpb_kernel(x_ptr, out_ptr, n, a, B: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out_ptr + i, tl.load(x_ptr + i, mask=m) * a + B, mask=m)


def _run(x: torch.Tensor, out: torch.Tensor, a: float, b: int, through_launch: bool) -> torch.Tensor:
    from lightning_moe.modules.triton_launch import launch
    n = x.numel()
    grid = (triton.cdiv(n, 64),)
    if through_launch:
        launch(_axpb_kernel, grid, x, out, n, a, B=b, BLOCK=64)
    else:
        _axpb_kernel[grid](x, out, n, a, B=b, BLOCK=64)
    return out


@pytest.mark.skipif(INSIDE, reason="the outer test only")
def test_launch_under_the_interpreter():
    run_interpreted(__file__, k="interpreted", passed=1, timeout=300)


@pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")
def test_interpreted_launch_is_the_kernels():
    x = torch.randn(100)
    want = _run(x, torch.empty(100), 2.5, 3, False)
    assert torch.equal(_run(x, torch.empty(100), 2.5, 3, True), want)
    torch.testing.assert_close(want, x * 2.5 + 3)


cuda = pytest.mark.skipif(not torch.cuda.is_available() or INSIDE, reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_launch_matches_the_kernel_and_respects_its_specialization():
    from lightning_moe.modules import triton_launch
    triton_launch._COMPILED.pop(id(_axpb_kernel), None)
    base = torch.randn(4097, device="cuda")
    cases = [(base[:4096], 1.5, 0),  # aligned, n % 16 == 0
             (base[:4096], -2.0, 0),  # the same specialization: a cache hit
             (base[1:4097], 1.5, 0),  # a pointer off the 16-byte alignment
             (base[:4001], 1.5, 0),  # n no longer a multiple of 16
             (base[:4096], 1.5, 7)]  # another constexpr
    for x, a, b in cases:
        want = _run(x, torch.full_like(x, float("nan")), a, b, False)
        for _ in range(2):  # the first may compile; the second is a hit
            got = _run(x, torch.full_like(x, float("nan")), a, b, True)
            assert torch.equal(got, want), (x.data_ptr() % 16, x.numel(), a, b)
        torch.testing.assert_close(want, x * a + b)  # the kernel may contract into an FMA
    # one compiled kernel per specialization: 4 (the second case reused the first's)
    assert len(triton_launch._COMPILED[id(_axpb_kernel)][1]) == 4


@pytest.mark.gpu
@cuda
def test_launch_runs_on_the_current_stream():
    x = torch.randn(4096, device="cuda")
    _run(x, torch.empty_like(x), 1.0, 1, True)  # compiled and cached: the launch below goes through the launcher
    out = torch.zeros_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on this stream only
        _run(x, out, 1.0, 1, True)
    early = out.cpu()  # the default stream's copy: not behind the side stream's sleep
    side.synchronize()
    assert torch.count_nonzero(early) == 0, "the launch did not wait for its stream's sleep"
    assert torch.equal(out, x + 1)


@pytest.mark.gpu
@cuda
def test_a_launch_hook_sees_every_launch():
    from triton import knobs
    seen = []
    hook = knobs.runtime.launch_enter_hook
    if not hasattr(hook, "add"):
        pytest.skip("this triton's launch hooks are not a HookChain")
    x = torch.randn(256, device="cuda")
    _run(x, torch.empty_like(x), 1.0, 0, True)  # cached before the hook is set
    fn = seen.append
    hook.add(fn)
    try:
        _run(x, torch.empty_like(x), 1.0, 0, True)
    finally:
        hook.remove(fn)
    assert len(seen) == 1
