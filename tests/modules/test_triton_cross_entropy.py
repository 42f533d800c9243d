"""The Triton cross-entropy (``triton_cross_entropy.py``, ``vocab_parallel_cross_entropy(..., fused=True)``) against
``F.cross_entropy`` of the float32 logits: the loss (mean, sum, none) and the logits' gradient, with ignored targets,
vocabularies shorter and longer than one block, float32 and bf16 logits; and on 2 gloo ranks, each holding half of
the vocabulary, against the same full reference. On CPU under the Triton interpreter in a fresh process (skipped
without triton, as in CI); on CUDA directly (``gpu``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.modules.interpreted import INSIDE, run_interpreted

# (rows, vocabulary, dtype)
CASES = [(7, 37, torch.float32), (16, 1000, torch.bfloat16), (5, 5000, torch.float32), (3, 9000, torch.bfloat16),
         (0, 64, torch.float32)]


@pytest.mark.skipif(INSIDE, reason="the outer test only")
def test_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    run_interpreted(__file__, k="interpreted", passed=len(CASES) + 1)


def _data(N, V, dtype, device):
    g = torch.Generator().manual_seed(N * 7 + V)
    logits = (torch.randn(N, V, generator=g) * 4).to(dtype).to(device)
    target = torch.randint(0, V, (N,), generator=g)
    target[::3] = -100  # ignored, as masked labels are
    return logits, target.to(device)


def _check(N, V, dtype, device):
    from lightning_moe.modules.tensor_parallel import vocab_parallel_cross_entropy
    from lightning_moe.strategy.parallel_context import ParallelContext
    logits, target = _data(N, V, dtype, device)
    for reduction in (("sum", "none") if N == 0 else ("mean", "sum", "none")):
        x_ref, x = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        ref = F.cross_entropy(x_ref.float(), target, reduction=reduction)
        got = vocab_parallel_cross_entropy(x, target, ParallelContext.single(), reduction=reduction, fused=True)
        assert got.dtype == torch.float32 and got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        go = torch.rand_like(ref)
        ref.backward(go)
        got.backward(go)
        assert x.grad.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
        else:  # both round a float32 gradient once; the kernel's exp differs from torch's in the last bits
            torch.testing.assert_close(x.grad.float(), x_ref.grad.float(), rtol=1.6e-2, atol=1e-5)
        assert not x.grad[target == -100].any()


@pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")
@pytest.mark.parametrize("N,V,dtype", CASES)
def test_cross_entropy_kernel_matches_torch_interpreted(N, V, dtype):
    _check(N, V, dtype, "cpu")


def _tp_worker(rank, world, logits, target):
    import torch.distributed as dist

    from lightning_moe.modules.tensor_parallel import vocab_parallel_cross_entropy
    from lightning_moe.strategy.layout import build_layout
    from lightning_moe.strategy.parallel_context import ParallelContext
    dist.init_process_group("gloo")
    ctx = ParallelContext.from_layout(build_layout(world, tp=world), rank)
    shard = logits.chunk(world, dim=1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, target, ctx, fused=True)
    loss.backward()
    dist.destroy_process_group()
    return loss.detach(), shard.grad


@pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")
def test_vocab_parallel_cross_entropy_kernel_on_two_ranks_interpreted(tmp_path):
    from tests.parallel.harness import run_ranks
    logits, target = _data(12, 300, torch.float32, "cpu")
    logits[1, 150:], target[1] = float("-inf"), 7  # one row's whole second shard is -inf: it adds nothing
    x_ref = logits.clone().requires_grad_()
    ref = F.cross_entropy(x_ref, target)
    ref.backward()
    for rank, (loss, grad) in enumerate(run_ranks(_tp_worker, 2, logits, target, out_dir=str(tmp_path))):
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, x_ref.grad.chunk(2, dim=1)[rank], rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("N,V,dtype", CASES + [(8192, 151936, torch.bfloat16), (4096, 32000, torch.bfloat16)])
def test_cross_entropy_kernel_matches_torch_on_gpu(N, V, dtype):
    _check(N, V, dtype, "cuda")
