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
    run_interpreted(__file__, k="interpreted", passed=len(CASES))


def _check(counts, K, N, dtype, tail, device):
    from lightning_moe.modules import kernels
    from lightning_moe.modules.wgrad_fusion import grouped_wgrad_into
    if device == "cpu":
        assert kernels.load("triton_grouped_wgrad", torch.empty(0)) is not None  # the kernel, not the reference
    L, M = len(counts), sum(counts)
    g = torch.Generator().manual_seed(M + K + N)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).to(device)
    xs = [torch.randn(M + tail, K, generator=g).to(dtype).to(device) for _ in range(2)]
    dys = [torch.randn(M + tail, N, generator=g).to(dtype).to(device) for _ in range(2)]
    for x, dy in zip(xs, dys):  # the tail must not be read: make it poison
        x[M:], dy[M:] = float("nan"), float("nan")
    main = torch.full((L, K, N), float("nan"), device=device)  # the first micro-batch overwrites
    want = torch.zeros(L, K, N, dtype=torch.float64, device=device)
    bounds = [0] + torch.tensor(counts).cumsum(0).tolist()
    for i, (x, dy) in enumerate(zip(xs, dys)):
        grouped_wgrad_into(main, x, dy, offs, first=i == 0)
        for l in range(L):  # the float64 reference, expert by expert
            a, b = bounds[l], bounds[l + 1]
            want[l] += x[a:b].double().t() @ dy[a:b].double()
        # entries are sums of up to max(counts) unit products (~sqrt(rows) in size), accumulated in fp32 from exact
        # bf16 products: ~1e-7 relative; a wrong row range, tile or overwrite is off by O(1)
        torch.testing.assert_close(main.double(), want, rtol=1e-5, atol=5e-5 * max(counts) ** 0.5)


@pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")
@pytest.mark.parametrize("counts,K,N,dtype,tail", CASES)
def test_grouped_wgrad_kernel_interpreted(counts, K, N, dtype, tail):
    _check(counts, K, N, dtype, tail, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("counts,K,N,dtype,tail", [c for c in CASES if c[3] == torch.bfloat16] + [
    ([300, 0, 17, 513, 128, 77, 1, 1000], 512, 768, torch.bfloat16, 9),
    ([512] * 128, 2048, 1536, torch.bfloat16, 0),  # qwen3 fc1
    ([1024, 700, 1348, 1024, 0, 1024, 1024, 1072], 4096, 2 * 14336 // 4, torch.bfloat16, 0)])  # mixtral-like
def test_grouped_wgrad_kernel_on_gpu(counts, K, N, dtype, tail):
    _check(counts, K, N, dtype, tail, "cuda")
