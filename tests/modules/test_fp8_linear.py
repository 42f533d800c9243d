"""The FP8 linear (forward, dgrad, wgrad) against float64, and under tensor parallelism (2 gloo ranks, column- and
row-parallel) against the one-process FP8 linear on the whole weight: the amax reductions give every scale the value it
has on one process, so the quantized operands are the same and the results agree to float32 summation order."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.modules.fp8 import RECIPES
from lightning_moe.modules.fp8_linear import FP8Spec, fp8_linear
from tests.parallel.harness import run_ranks

M, K, N = 128, 256, 256


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-1, 1, K)  # columns of different magnitude
    w = torch.randn(N, K, generator=g) * 0.05
    dy = torch.randn(M, N, generator=g) * torch.logspace(-2, 0, N)
    return x, w, dy


def _run(x, w, dy, spec):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(x, w, spec)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("emulate", [False, True], ids=["kernel", "emulated"])
def test_fp8_linear_against_float64(recipe, emulate):
    x, w, dy = _data()
    y, dx, dw = _run(x, w, dy, FP8Spec(recipe, emulate=emulate))
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    yd = xd @ wd.t()
    yd.backward(dy.double())
    for got, ref, bound in ((y, yd.detach(), 0.04), (dx, xd.grad, 0.08), (dw, wd.grad, 0.08)):
        err = ((got.double() - ref).norm() / ref.norm()).item()
        assert err < bound, (recipe, err)  # E4M3 forward; E5M2 gradients (tensorwise, delayed) keep one bit less


@pytest.mark.parametrize("emulate", [False, True], ids=["kernel", "emulated"])
def test_unquantized_wgrad(emulate):
    """``FP8Spec(fp8_wgrad=False)``: the forward and dgrad of the FP8 wgrad's run, bit for bit; the weight gradient of
    the unquantized operands (float64's up to float32 summation order), where the FP8 one carries its quantization."""
    x, w, dy = _data()
    y1, dx1, dw1 = _run(x, w, dy, FP8Spec("rowwise", emulate=emulate))
    y0, dx0, dw0 = _run(x, w, dy, FP8Spec("rowwise", emulate=emulate, fp8_wgrad=False))
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    ref = dy.double().t() @ x.double()
    rel = [((dw.double() - ref).norm() / ref.norm()).item() for dw in (dw0, dw1)]
    assert rel[0] < 1e-6 and rel[1] > 1e-3, rel


def _tp(rank, world):
    import torch.distributed as dist
    dist.init_process_group("gloo")  # the harness sets MASTER_ADDR/PORT, RANK and WORLD_SIZE
    out = {recipe: _tp_recipe(rank, world, recipe) for recipe in RECIPES}
    dist.destroy_process_group()
    return out


def _tp_recipe(rank, world, recipe):
    import torch.distributed as dist
    x, w, dy = _data()
    ref = [_run(x, w, dy, FP8Spec(recipe)) for _ in range(3)]  # 3 steps: delayed scaling's history moves
    group = dist.group.WORLD
    n, k = N // world, K // world
    out = {}
    # column-parallel: this rank's output features
    col = FP8Spec(recipe, group=group, split="out")
    for step in range(3):
        y, dx, dw = _run(x, w[rank * n:(rank + 1) * n], dy[:, rank * n:(rank + 1) * n], col)
        dist.all_reduce(dx)  # the partial dgrads of the two output halves
        out[f"col{step}"] = [_rel(y, ref[step][0][:, rank * n:(rank + 1) * n]), _rel(dx, ref[step][1]),
                             _rel(dw, ref[step][2][rank * n:(rank + 1) * n])]
    row = FP8Spec(recipe, group=group, split="in")
    for step in range(3):
        y, dx, dw = _run(x[:, rank * k:(rank + 1) * k], w[:, rank * k:(rank + 1) * k], dy, row)
        dist.all_reduce(y)  # the partial outputs of the two input halves
        out[f"row{step}"] = [_rel(y, ref[step][0]), _rel(dx, ref[step][1][:, rank * k:(rank + 1) * k]),
                             _rel(dw, ref[step][2][:, rank * k:(rank + 1) * k])]
    # without the reductions the split operands get other scales: the same comparison must then fail
    y, _, _ = _run(x[:, rank * k:(rank + 1) * k], w[:, rank * k:(rank + 1) * k], dy, FP8Spec(recipe, split="in"))
    dist.all_reduce(y)
    out["unreduced"] = _rel(y, ref[0][0])
    return out


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    return run_ranks(_tp, 2, out_dir=str(tmp_path_factory.mktemp("fp8tp")))


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_linear_tensor_parallel_matches_one_process(tp_results, recipe):
    for rank, all_res in enumerate(tp_results):
        res = all_res[recipe]
        for key, errs in res.items():
            if key == "unreduced":
                continue
            assert max(errs) < 1e-5, (rank, key, errs)  # the same quantized operands: float32 summation order only
        if recipe != "blockwise":  # (blockwise tiles never straddle ranks: nothing to reduce)
            assert res["unreduced"] > 1e-4, res["unreduced"]


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype,device", [(torch.bfloat16, "cpu"),  # fp32 weights: autograd's gradient is fp32 already
                                          pytest.param(torch.bfloat16, "cuda", marks=[pytest.mark.gpu, _CUDA])])
def test_unquantized_wgrad_into_main_grads(dtype, device):
    """``FP8Spec(fp8_wgrad=False)`` under GradSync's gradient-accumulation fusion: the wgrad's GEMM adds into the fp32
    main grad over two micro-batches (float64's up to the summation order, no bf16 rounding of each micro-batch's
    gradient); the output and dgrad are those of the unfused run, bit for bit."""
    from lightning_moe.strategy.grad_sync import GradSync
    from lightning_moe.strategy.parallel_context import ParallelContext
    x, w, dy = (t.to(dtype).to(device) for t in _data())
    p = torch.nn.Parameter(w.clone())
    p.wgrad_fusable = True
    sync = GradSync([p], ParallelContext.single(), main_grads=True, fuse_wgrad=True)
    spec = FP8Spec("rowwise", emulate=device == "cpu", fp8_wgrad=False)  # CUDA: the FP8 kernels (Hopper)
    for i, scale in enumerate((1.0, 2.0)):
        if i == 1:
            sync.arm()
        xg = x.clone().requires_grad_()
        y = fp8_linear(xg, p, spec)
        y.backward(dy * scale)
        assert p.grad is None  # the hook dropped the placeholder
    sync.finish()
    y0, dx0, dw0 = _run(x, w, dy * 2.0, spec)
    assert torch.equal(y, y0) and torch.equal(xg.grad, dx0)
    ref = 3 * dy.double().t() @ x.double()
    assert p.main_grad.dtype == torch.float32
    assert ((p.main_grad.double() - ref).norm() / ref.norm()).item() < 1e-6
    # the unfused gradient is rounded to bf16 before the hook adds it
    assert ((dw0.double() * 1.5 - ref).norm() / ref.norm()).item() > 1e-4


def count_quantizations(monkeypatch) -> list:
    """The names of the operands ``fp8_linear`` quantizes from now on (its ``_quantized`` calls), in order."""
    from lightning_moe.modules import fp8_linear as fl
    calls, quantized = [], fl._quantized

    def counting(spec, name, *args, **kwargs):
        calls.append(name)
        return quantized(spec, name, *args, **kwargs)

    monkeypatch.setattr(fl, "_quantized", counting)
    return calls


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise", "delayed"])
def test_linears_reading_one_input_quantize_it_once(recipe, monkeypatch):
    """``FP8Spec.inputs`` (``SharedInput``, FP8Training's for the dense linears): three linears reading the very same
    tensor (q, k and v) quantize it once and give the unshared linears' outputs and gradients bit for bit; another
    tensor, or the same one changed in place, is quantized anew; delayed scaling (a history per linear) never shares."""
    from lightning_moe.modules import fp8_linear as fl
    calls = count_quantizations(monkeypatch)
    x, w, dy = _data(1)
    ws = [w, w.flip(0), w * 2]

    def three(shared, x):
        xr = x.clone().requires_grad_()
        outs = [fp8_linear(xr, wi.clone().requires_grad_(), FP8Spec(recipe, inputs=shared)) for wi in ws]
        sum(y * dy for y in outs).sum().backward()
        return [y.detach() for y in outs], xr.grad

    calls.clear()
    ref_y, ref_dx = three(None, x)
    assert calls.count("x") == 3
    shared = fl.SharedInput()
    calls.clear()
    y, dx = three(shared, x)
    assert calls.count("x") == (3 if recipe == "delayed" else 1)
    assert all(torch.equal(a, b) for a, b in zip(y, ref_y)) and torch.equal(dx, ref_dx)
    if recipe == "delayed":
        return
    calls.clear()
    xs = x.clone()
    fp8_linear(xs, w, FP8Spec(recipe, inputs=shared))
    fp8_linear(xs, w, FP8Spec(recipe, inputs=shared))
    xs.mul_(2)  # changed in place: its version moved
    y2 = fp8_linear(xs, w, FP8Spec(recipe, inputs=shared))
    assert calls.count("x") == 2 and torch.equal(y2, fp8_linear(xs, w, FP8Spec(recipe)))
