"""The experts' wgrad GEMM into the fp32 main grads (``triton_grouped_wgrad.py``) against a float64 reference:
written on the first micro-batch, added on later ones, with uneven, empty and unaligned experts, rows past the last
expert that must not be read, and dims that are not tile multiples. On CPU under the Triton interpreter in a fresh
process (skipped without triton, as in CI); on CUDA directly (``gpu``), up to the Qwen3 and Mixtral shapes."""

from __future__ import annotations

import pytest
import torch

from tests.modules.interpreted import INSIDE, run_interpreted

# (rows per expert, K, N, dtype, rows past the last expert)
CASES = [([5, 0, 17, 33], 24, 40, torch.float32, 3), ([16, 16], 32, 48, torch.bfloat16, 0),
         ([0, 0, 7], 20, 36, torch.bfloat16, 5), ([40], 16, 16, torch.float32, 0)]


@pytest.mark.skipif(INSIDE, reason="the outer test only")
def test_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    run_interpreted(__file__, k="interpreted", passed=len(CASES) + 1 + len(SEGMENT_CASES))


def _check(counts, K, N, dtype, tail, device, main_dtype=torch.float32):
    from lightning_moe.modules import kernels
    tk = kernels.load("triton_grouped_wgrad", torch.empty(0, device=device))  # the kernel itself, any dtype
    assert tk is not None
    L, M = len(counts), sum(counts)
    g = torch.Generator().manual_seed(M + K + N)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).to(device)
    xs = [torch.randn(M + tail, K, generator=g).to(dtype).to(device) for _ in range(2)]
    dys = [torch.randn(M + tail, N, generator=g).to(dtype).to(device) for _ in range(2)]
    for x, dy in zip(xs, dys):  # the tail must not be read: make it poison
        x[M:], dy[M:] = float("nan"), float("nan")
    main = torch.full((L, K, N), float("nan"), device=device, dtype=main_dtype)  # the first micro-batch overwrites
    want = torch.zeros(L, K, N, dtype=torch.float64, device=device)
    bounds = [0] + torch.tensor(counts).cumsum(0).tolist()
    for i, (x, dy) in enumerate(zip(xs, dys)):
        tk.wgrad_into(main, x, dy, offs, first=i == 0)
        for l in range(L):  # the float64 reference, expert by expert
            a, b = bounds[l], bounds[l + 1]
            want[l] += x[a:b].double().t() @ dy[a:b].double()
        # entries are sums of up to max(counts) unit products (~sqrt(rows) in size), accumulated in fp32 from exact
        # bf16 products: ~1e-7 relative; a wrong row range, tile or overwrite is off by O(1)
        if main_dtype == torch.float32:
            torch.testing.assert_close(main.double(), want, rtol=1e-5, atol=5e-5 * max(counts) ** 0.5)
        else:  # bf16 main grads (bf16 main params): each store rounds to bf16 (2^-8 of entries ~sqrt(rows))
            torch.testing.assert_close(main.double(), want, rtol=1e-2, atol=2e-2 * max(counts) ** 0.5)


# (each segment's rows per expert, K, N, dtype): segments of different lengths, empty experts, one empty segment
SEGMENT_CASES = [([[5, 0, 17, 33], [0, 9, 1, 2], [16, 16, 0, 40]], 24, 40, torch.float32),
                 ([[16, 16], [0, 0], [7, 3]], 32, 48, torch.bfloat16)]


def _check_segments(segs, K, N, dtype, device, windows=2):
    """``wgrad_segments_into`` over each window of segments (the first window writes, later ones add), against
    float64; every segment in tensors of its own, with poisoned rows past its last expert; the second one a view one
    row into a larger tensor (off the kernel's 16-element alignment unless K is a multiple of 16)."""
    from lightning_moe.modules import kernels
    tk = kernels.load("triton_grouped_wgrad", torch.empty(0, device=device))
    L = len(segs[0])
    g = torch.Generator().manual_seed(L + K + N)
    main = torch.full((L, K, N), float("nan"), device=device)
    want = torch.zeros(L, K, N, dtype=torch.float64, device=device)
    for w in range(windows):
        segments = []
        for i, counts in enumerate(segs):
            M, tail, lead = sum(counts), 3, int(i == 1)
            x = torch.randn(lead + M + tail, K, generator=g).to(dtype).to(device)[lead:]
            dy = torch.randn(lead + M + tail, N, generator=g).to(dtype).to(device)[lead:]
            x[M:], dy[M:] = float("nan"), float("nan")
            segments.append((x, dy, torch.tensor(counts).cumsum(0).to(torch.int32).to(device)))
            bounds = [0] + torch.tensor(counts).cumsum(0).tolist()
            for l in range(L):
                want[l] += x[bounds[l]:bounds[l + 1]].double().t() @ dy[bounds[l]:bounds[l + 1]].double()
        tk.wgrad_segments_into(main, segments, first=w == 0)
        rows = max(sum(c[l] for c in segs) for l in range(L)) * (w + 1)
        torch.testing.assert_close(main.double(), want, rtol=1e-5, atol=5e-5 * rows ** 0.5)


@pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")
@pytest.mark.parametrize("segs,K,N,dtype", SEGMENT_CASES)
def test_grouped_wgrad_segments_interpreted(segs, K, N, dtype):
    _check_segments(segs, K, N, dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("segs,K,N,dtype", [c for c in SEGMENT_CASES if c[3] == torch.bfloat16] + [
    ([[5, 0, 17, 33], [0, 9, 1, 2], [16, 16, 0, 40]], 24, 40, torch.bfloat16),  # a view off the alignment
    ([[300, 0, 17, 513, 128, 77, 1, 1000], [0] * 8, [64] * 8], 512, 768, torch.bfloat16),
    ([[512] * 128] * 4, 2048, 1536, torch.bfloat16)])  # qwen3 fc1, four micro-batches
def test_grouped_wgrad_segments_on_gpu(segs, K, N, dtype):
    _check_segments(segs, K, N, dtype, "cuda")


@pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")
@pytest.mark.parametrize("counts,K,N,dtype,tail", CASES)
def test_grouped_wgrad_kernel_interpreted(counts, K, N, dtype, tail):
    _check(counts, K, N, dtype, tail, "cpu", main_dtype=torch.bfloat16 if K == 20 else torch.float32)


@pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")
def test_tuned_launches_interpreted(monkeypatch):
    """The GPU launches: the writing one through the autotuner (its cache filled here: tuning times CUDA), the
    accumulating one with the config the autotuner chose for the shape (found by K, N and the dtypes)."""
    import triton

    from lightning_moe.modules import triton_grouped_wgrad as tk
    monkeypatch.setattr(tk, "interpreting", lambda: False)
    small = triton.Config({"BLOCK_K": 16, "BLOCK_N": 32, "BLOCK_R": 16, "GROUP_K": 2}, num_warps=4, num_stages=2)
    K, N = 24, 40
    monkeypatch.setitem(tk._write.cache, (K, N, "torch.float32", "torch.float32", "torch.float32", "torch.int32"),
                        small)
    assert tk._tuned_config(K, N, ("torch.float32",) * 3 + ("torch.int32",)) is small
    assert tk._tuned_config(K + 1, N, ()) is tk.DEFAULT
    counts, g = [5, 0, 17, 33], torch.Generator().manual_seed(0)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    xs = [torch.randn(sum(counts), K, generator=g) for _ in range(2)]
    dys = [torch.randn(sum(counts), N, generator=g) for _ in range(2)]
    main, want = torch.full((4, K, N), float("nan")), torch.zeros(4, K, N, dtype=torch.float64)
    bounds = [0] + torch.tensor(counts).cumsum(0).tolist()
    for i, (x, dy) in enumerate(zip(xs, dys)):
        tk.wgrad_into(main, x, dy, offs, first=i == 0)
        for l in range(4):
            want[l] += x[bounds[l]:bounds[l + 1]].double().t() @ dy[bounds[l]:bounds[l + 1]].double()
        torch.testing.assert_close(main.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("counts,K,N,dtype,tail", [c for c in CASES if c[3] == torch.bfloat16] + [
    ([300, 0, 17, 513, 128, 77, 1, 1000], 512, 768, torch.bfloat16, 9),
    ([512] * 128, 2048, 1536, torch.bfloat16, 0),  # qwen3 fc1
    ([1024, 700, 1348, 1024, 0, 1024, 1024, 1072], 4096, 2 * 14336 // 4, torch.bfloat16, 0)])  # mixtral-like
def test_grouped_wgrad_kernel_on_gpu(counts, K, N, dtype, tail):
    _check(counts, K, N, dtype, tail, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_main_grads_and_the_tuners_choice_does_not_change_the_sum():
    """bf16 main grads (bf16 main params) store the fp32 tile in bf16; and two tile shapes the tuner may choose sum
    the rows in the same order: the same bits."""
    _check([300, 0, 17, 513], 512, 768, torch.bfloat16, 4, "cuda", main_dtype=torch.bfloat16)
    import triton

    from lightning_moe.modules.triton_grouped_wgrad import _wgrad_kernel
    g = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor([700, 0, 1300, 48], device="cuda")
    x = torch.randn(2048, 1024, device="cuda", generator=g).bfloat16()
    dy = torch.randn(2048, 1536, device="cuda", generator=g).bfloat16()
    offs = counts.cumsum(0).to(torch.int32)
    outs = []
    for bk, bn, warps, stages in ((128, 256, 8, 3), (128, 128, 4, 4), (64, 256, 4, 3)):
        out = torch.zeros(4, 1024, 1536, device="cuda")
        grid = (triton.cdiv(1024, bk) * triton.cdiv(1536, bn), 4)
        _wgrad_kernel[grid](x, dy, out, offs, 1024, 1536, x.stride(0), dy.stride(0), ACC=False, BLOCK_K=bk,
                            BLOCK_N=bn, BLOCK_R=64, GROUP_K=8, num_warps=warps, num_stages=stages)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
