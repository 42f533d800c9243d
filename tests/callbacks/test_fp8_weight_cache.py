"""FP8Training(cache_weights=True): the experts' quantized weights are made once per optimizer step
(``FP8Spec.cached_weight``), keyed by ``trainer.global_step``, which the callback sets before every batch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_moe import FP8Training
from lightning_moe.modules.fp8_linear import FP8Spec
from tests.callbacks.test_fp8_training import _lm, _start


def test_cached_weight_is_made_once_per_step_and_weight():
    spec, w, calls = FP8Spec("rowwise"), torch.ones(2, 3), []

    def make():
        calls.append(1)
        return torch.full((1,), float(len(calls)))

    assert spec.cached_weight("w", w, make).item() == 1 and len(calls) == 1  # no step: never cached
    spec.step = 0
    first = spec.cached_weight("w", w, make)
    assert spec.cached_weight("w", w, make) is first and len(calls) == 2  # the second micro-batch reuses it
    assert spec.cached_weight("w_t", w, make) is not first and len(calls) == 3  # another operand: its own entry
    spec.step = 1  # the optimizer stepped: stale
    assert spec.cached_weight("w", w, make) is not first and len(calls) == 4
    other = torch.ones(2, 3)  # another weight tensor (e.g. a reload) at the same step: stale too
    spec.cached_weight("w", other, make)
    assert len(calls) == 5 and len(spec.weights) == 2
    delayed = FP8Spec("delayed", step=0)  # cached too: its weights' amax histories advance once per step
    delayed.cached_weight("w", w, make), delayed.cached_weight("w", w, make)
    assert len(calls) == 6 and list(delayed.weights) == ["w"]


def test_delayed_weights_history_advances_once_per_step():
    """The delayed recipe's emulated expert weights under the cache: one quantization (and one push into the weight's
    amax history) per optimizer step, however many micro-batches use them; the forward's and dgrad's copies alike."""
    from lightning_moe.modules.fp8_grouped import fp8_grouped_mm
    torch.manual_seed(0)
    spec = FP8Spec("delayed", history=4, step=0)
    w = torch.randn(2, 8, 4, requires_grad=True)
    offs = torch.tensor([3, 6], dtype=torch.int32)
    for step in range(2):
        spec.step = step
        if step:  # the optimizer's update, in place
            with torch.no_grad():
                w.mul_(2)
        for _ in range(3):  # micro-batches
            fp8_grouped_mm(torch.randn(6, 8), w, offs, spec).sum().backward()
    assert sorted(spec.weights) == ["emulated_w", "emulated_w_t"]
    past = spec.histories["w"].past.reshape(4, -1)  # 4 slots: the first use fills them, then one push per step
    first = w.detach().abs().amax((1, 2)) / 2
    assert sum(torch.equal(row, 2 * first) for row in past) == 1 and sum(torch.equal(row, first) for row in past) == 3
    assert torch.equal(spec.histories["w_t"].past.reshape(4, -1), past)
    assert spec.histories["x"].pushed == 6  # activations: one push per use


def test_in_place_cache_rewrites_the_same_tensors_at_a_new_step():
    """Under CUDA graphs (``in_place``): a new step's quantization is written over the old one's tensors, nested as
    the GEMMs keep them, so a captured GEMM that reads them where they were sees the new weights. ``refresh`` does
    it for every entry before the step's first batch; a hit at the same step makes nothing."""
    w = torch.randn(4, 6)
    spec, calls = FP8Spec("rowwise", step=0, in_place=True), []

    def make():
        calls.append(1)
        q = (w * 2).t()  # a transposed view, as the grouped GEMMs keep their column-major copy
        return (q, w.abs().amax(1)), w.sum().reshape(1)

    first = spec.cached_weight("w", w, make)
    leaves = [first[0][0], first[0][1], first[1]]
    ptrs = [t.data_ptr() for t in leaves]
    assert spec.cached_weight("w", w, make) is first and len(calls) == 1
    w.mul_(-3)  # the optimizer's step, in place
    spec.step = 1  # a lazy hit at a new step (an eager call before any refresh) rewrites too
    assert spec.cached_weight("w", w, make) is first and len(calls) == 2  # made once more, then copied over
    assert [t.data_ptr() for t in leaves] == ptrs
    assert torch.equal(first[0][0], (w * 2).t()) and torch.equal(first[1], w.sum().reshape(1))
    spec.cached_weight("w_t", w, make)
    w.add_(1)
    spec.refresh(2)
    assert spec.step == 2 and all(hit[0] == 2 for hit in spec.weights.values())
    assert torch.equal(first[0][1], w.abs().amax(1)) and torch.equal(spec.weights["w_t"][2][1], w.sum().reshape(1))
    n = len(calls)
    spec.refresh(2)  # nothing stale: nothing made
    assert len(calls) == n
    eager = FP8Spec("rowwise", step=0)  # outside graphs a new step's copy replaces the old (freed first)
    old = eager.cached_weight("w", w, make)
    eager.step = 1
    assert eager.cached_weight("w", w, make)[1] is not old[1]


def test_in_place_cache_made_under_inference_mode_is_rewritten_in_training_and_a_moved_weight_raises():
    """Lightning's sanity check validates under ``inference_mode`` before the first training batch: an in-place entry
    it makes must still take the next step's rewrite (no inference tensors). A weight that moved (another tensor)
    cannot be followed by graphs that read the old copy: a clear error instead of a freed address."""
    w = torch.nn.Parameter(torch.randn(4, 6))
    spec = FP8Spec("rowwise", step=0, in_place=True)
    with torch.inference_mode():
        kept = spec.cached_weight("w", w, lambda: w * 2)
    assert not kept.is_inference() and not kept.requires_grad  # no graph back to the weight held with it
    w = w.detach()
    w.add_(1)
    spec.refresh(1)
    assert torch.equal(kept, w * 2)
    with pytest.raises(RuntimeError, match="the weight moved"):
        spec.cached_weight("w", w.clone(), lambda: w * 2)


def test_callback_refreshes_in_place_under_cuda_graphs_before_every_batch():
    """FP8Training under ``cuda_graphs``: the step's batch start rewrites each cached copy where it is (outside the
    graphs), so the replayed forward of the next micro-batch reads the new weights."""
    spec, w = FP8Spec("rowwise", in_place=True), torch.ones(3)
    cb = FP8Training("rowwise")
    cb._cached = [spec]
    cb.on_train_batch_start(SimpleNamespace(global_step=0), None, None, 0)
    kept = spec.cached_weight("w", w, lambda: w * 2)
    w.fill_(5.0)
    cb.on_train_batch_start(SimpleNamespace(global_step=0), None, None, 1)  # the same step: kept as it is
    assert torch.equal(kept, torch.full((3,), 2.0))
    cb.on_train_batch_start(SimpleNamespace(global_step=1), None, None, 2)
    assert torch.equal(kept, torch.full((3,), 10.0)) and spec.weights["w"][0] == 1
    # the distributed optimizer's weight all-gathers (overlapped with the next forward eagerly) are waited for before
    # the rewrite reads the weights: the graphs' blocks replay without the per-block waits
    order = []
    spec.weights["w"] = (1, w.data_ptr(), kept, lambda: order.append("make") or w * 3)
    trainer = SimpleNamespace(global_step=2, strategy=SimpleNamespace(
        sharded_optimizer=SimpleNamespace(wait_all=lambda: order.append("wait"))))
    cb.on_train_batch_start(trainer, None, None, 3)
    cb.on_train_batch_start(trainer, None, None, 4)  # nothing stale: no wait
    assert order == ["wait", "make"] and torch.equal(kept, torch.full((3,), 15.0))


def test_callback_sets_the_step_before_every_batch_and_clears_at_teardown():
    lm = _lm()
    cb = FP8Training("rowwise")
    _start(cb, lm)
    specs = cb._cached
    assert specs and all(s.step is None for s in specs)
    cb.on_train_batch_start(SimpleNamespace(global_step=3), lm, None, 0)
    assert all(s.step == 3 for s in specs)
    cb.on_validation_batch_start(SimpleNamespace(global_step=4), lm, None, 0, 0)
    assert all(s.step == 4 for s in specs)
    specs[0].weights["w"] = (4, 0, None, None)
    cb.teardown(None, lm, "fit")
    assert all(s.step is None and not s.weights for s in specs) and not cb._cached
    off = FP8Training("rowwise", cache_weights=False)
    _start(off, _lm())
    assert not off._cached
    # under CUDA graphs the cache is rewritten in place: a captured graph reads the copy where it was at its capture
    graphs = FP8Training("rowwise")
    graphs.on_fit_start(SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu"), cuda_graphs=True)),
                        _lm())
    assert graphs._cached and all(s.in_place for s in graphs._cached) and not any(s.in_place for s in specs)
    # its deferred wgrad would hold the graphs' static buffers, which the next replay overwrites: refused
    with pytest.raises(ValueError, match=r"defer_expert_wgrad=...\) with MoEFoldStrategy\(cuda_graphs=True\)"):
        FP8Training("rowwise", defer_expert_wgrad=True).on_fit_start(
            SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu"), cuda_graphs=True)), _lm())
    # the delayed recipe's amax history advances in Python at every use, which a replayed graph would not: refused
    with pytest.raises(ValueError, match="amax history"):
        FP8Training("delayed").on_fit_start(
            SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu"), cuda_graphs=True)), _lm())


def test_dense_linear_weight_is_quantized_once_per_step():
    """A dense FP8 linear under a step: its weight's forward and (transposed) dgrad operands are quantized at the first
    micro-batch and reused by the next, with the same outputs and gradients as quantizing every time; a new step (the
    optimizer changed the weight) makes them again."""
    from lightning_moe.modules import fp8_linear as fl
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=g, requires_grad=True)
    xs = [torch.randn(16, 32, generator=g) for _ in range(2)]
    dys = [torch.randn(16, 48, generator=g) for _ in range(2)]

    def run(spec):
        outs = []
        for x, dy in zip(xs, dys):
            x = x.clone().requires_grad_()
            y = fl.fp8_linear(x, w, spec)
            dx, dw = torch.autograd.grad(y, (x, w), dy)
            outs += [y, dx, dw]
        return outs

    for recipe in ("tensorwise", "rowwise"):
        ref = run(FP8Spec(recipe))  # no step: quantized at every use
        spec = FP8Spec(recipe, step=0)
        made = []
        real = fl._quantized
        try:
            fl._quantized = lambda spec, name, *a, **k: made.append(name) or real(spec, name, *a, **k)
            got = run(spec)
        finally:
            fl._quantized = real
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), recipe
        weights = [name for name in made if name in ("w", "w_t")]  # not the activations
        assert weights == ["w", "w_t"] and set(spec.weights) == {"w", "w_t"}  # once each, two micro-batches
        first = spec.weights["w"][2]
        spec.step = 1
        run(spec)
        assert spec.weights["w"][2] is not first


def test_delayed_histories_made_under_inference_mode_take_later_pushes():
    """A delayed history first made in an inference-mode forward (an evaluation callback) is written in place by the
    training steps after it: it must not be an inference tensor."""
    from lightning_moe.modules.fp8_grouped import fp8_grouped_mm
    from lightning_moe.modules.fp8_linear import fp8_linear
    torch.manual_seed(0)
    dense, grouped = FP8Spec("delayed", history=2), FP8Spec("delayed", history=2)
    x, w = torch.randn(8, 16), torch.randn(12, 16, requires_grad=True)
    xe, we, offs = torch.randn(6, 8), torch.randn(2, 8, 4, requires_grad=True), torch.tensor([3, 6], dtype=torch.int32)
    with torch.inference_mode():
        fp8_linear(x, w, dense), fp8_grouped_mm(xe, we, offs, grouped)
    for _ in range(2):
        fp8_linear(x, w, dense).sum().backward()
        fp8_grouped_mm(xe, we, offs, grouped).sum().backward()
    assert dense.histories["x"].pushed == 3 and grouped.histories["x"].pushed == 3
    assert not dense.histories["x"].history.is_inference() and not grouped.histories["x"].past.is_inference()
