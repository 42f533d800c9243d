"""``GradSync.defer_wgrad`` (``FP8Training(defer_expert_wgrad=True)``): a fused GEMM's weight gradient held until
the step's last backward, then put into the fp32 main grad in one pass over every held micro-batch. The FP8 kernels
behind it run on a GPU (``tests/test_gpu_fp8.py``); here a GEMM of the same shape of call, and the callback's
refusals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_moe import FP8Training
from lightning_moe.callbacks import fp8_training
from lightning_moe.strategy.grad_sync import GradSync
from lightning_moe.strategy.parallel_context import ParallelContext
from tests.callbacks.test_fp8_training import _lm, _start


class _Deferred(torch.autograd.Function):
    """``x @ w`` whose wgrad ``x^T dy`` goes through ``defer_wgrad`` (held over at most ``window`` micro-batches);
    ``runs`` records each run's (first, count)."""

    @staticmethod
    def forward(ctx, x, w, sync, runs, window):
        ctx.save_for_backward(x)
        ctx.w, ctx.sync, ctx.runs, ctx.window = w, sync, runs, window
        return x @ w

    @staticmethod
    def backward(ctx, dy):
        (x,), w = ctx.saved_tensors, ctx.w

        def run(main, first, helds):
            ctx.runs.append((first, len(helds)))
            total = sum(a.t() @ b for a, b in helds)
            main.copy_(total) if first else main.add_(total)

        ctx.sync.defer_wgrad(w, (x.detach(), dy), run, ctx.window)
        return dy @ w.t(), torch.empty_like(w), None, None, None


def _setup():
    w = torch.nn.Parameter(torch.randn(4, 3))
    sync = GradSync([w], ParallelContext.single(), main_grads=True)
    return w, sync, []


def _micro(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)) for _ in range(n)]


def _backward(w, sync, runs, x, dy, window=None):
    _Deferred.apply(x, w, sync, runs, window).backward(dy)


def _want(batches):
    return sum(x.t() @ dy for x, dy in batches)


def test_held_until_the_armed_backward_then_one_pass_and_the_next_step_starts_over():
    w, sync, runs = _setup()
    for step in range(2):
        batches = _micro(3, seed=step)
        w.main_grad.fill_(float("nan"))  # never read: the deferred pass writes
        for i, (x, dy) in enumerate(batches):
            if i == 2:
                sync.arm()
            _backward(w, sync, runs, x, dy)
            assert w.grad is None  # the placeholder was dropped
            if i < 2:
                assert torch.isnan(w.main_grad).all() and not runs  # held, main grad untouched
        assert runs == [(True, 3)]
        sync.finish()
        torch.testing.assert_close(w.main_grad, _want(batches))
        assert id(w) in sync.had_main_grad
        sync.discard()
        runs.clear()


def test_a_window_runs_each_full_one_and_the_rest_at_the_armed_backward():
    """``window=2`` over five micro-batches: the second and fourth backwards run two each (the first writing, the
    second adding), the armed fifth the one left; the main grad is the sum of all five, and the next step starts over
    with a write."""
    w, sync, runs = _setup()
    for step in range(2):
        batches = _micro(5, seed=step)
        w.main_grad.fill_(float("nan"))
        for i, (x, dy) in enumerate(batches):
            if i == 4:
                sync.arm()
            _backward(w, sync, runs, x, dy, window=2)
            assert w.grad is None and len(sync.held(w)) == (1 if i in (0, 2) else 0)
            if i == 1:  # the first window, written
                torch.testing.assert_close(w.main_grad, _want(batches[:2]))
            if i == 2:  # held: the main grad as the first window left it
                torch.testing.assert_close(w.main_grad, _want(batches[:2]))
        assert runs == [(True, 2), (False, 2), (False, 1)]
        sync.finish()
        torch.testing.assert_close(w.main_grad, _want(batches))
        assert id(w) in sync.had_main_grad
        sync.discard()
        runs.clear()


def test_a_weight_used_twice_whose_window_fills_between_its_uses():
    """A weight used twice in each backward, ``window=3``, and a last backward that never reaches it: the second
    backward's first use fills the window (written), its second use is held; ``finish`` must then add what is held,
    not overwrite the window's sum."""
    w, sync, runs = _setup()
    batches = _micro(4, seed=5)
    for i in range(2):
        (x1, dy1), (x2, dy2) = batches[2 * i], batches[2 * i + 1]
        (_Deferred.apply(x1, w, sync, runs, 3) * dy1).sum().add((_Deferred.apply(x2, w, sync, runs, 3) * dy2).sum()
                                                                ).backward()
    sync.arm()  # a last backward that does not use w
    assert runs == [(True, 3)] and len(sync.held(w)) == 1
    sync.finish()
    assert runs == [(True, 3), (False, 1)]
    torch.testing.assert_close(w.main_grad, _want(batches))


def test_a_window_under_a_pipeline_schedule_and_at_finish():
    """``window=2`` inside a pipeline schedule's armed step (every backward armed, only the one ``expect_final`` names
    final): full windows run as they fill, the rest at the final backward; and what a window leaves held when no
    final backward reaches the weight runs at ``finish``, adding."""
    w, sync, runs = _setup()
    batches = _micro(5)
    sync.arm()
    sync.expect_final([])
    for i, (x, dy) in enumerate(batches):
        if i == 4:
            sync.expect_final([w])
        _backward(w, sync, runs, x, dy, window=2)
    assert runs == [(True, 2), (False, 2), (False, 1)]
    sync.finish()
    torch.testing.assert_close(w.main_grad, _want(batches))
    sync.discard()
    runs.clear()
    for x, dy in batches[:3]:
        _backward(w, sync, runs, x, dy, window=2)
    sync.arm()
    sync.finish()  # the armed backward never reached w: the third micro-batch is still held
    assert runs == [(True, 2), (False, 1)]
    torch.testing.assert_close(w.main_grad, _want(batches[:3]))


def test_one_micro_batch_runs_at_once():
    w, sync, runs = _setup()
    (x, dy), = _micro(1)
    sync.arm()
    _backward(w, sync, runs, x, dy)
    assert runs == [(True, 1)]
    sync.finish()
    torch.testing.assert_close(w.main_grad, _want([(x, dy)]))


def test_pipeline_schedule_runs_at_the_backward_expect_final_names():
    w, sync, runs = _setup()
    batches = _micro(3)
    sync.arm()
    sync.expect_final([])  # a pipeline schedule: every micro-batch's backward runs inside the armed step
    for i, (x, dy) in enumerate(batches):
        if i == 2:
            sync.expect_final([w])
        _backward(w, sync, runs, x, dy)
        assert runs == ([(True, 3)] if i == 2 else [])
    sync.finish()
    torch.testing.assert_close(w.main_grad, _want(batches))


def test_finish_runs_what_is_still_held_and_discard_drops_it():
    w, sync, runs = _setup()
    batches = _micro(2)
    for x, dy in batches:
        _backward(w, sync, runs, x, dy)
    sync.arm()
    sync.finish()  # the armed backward never reached w
    assert runs == [(True, 2)] and id(w) in sync.had_main_grad
    torch.testing.assert_close(w.main_grad, _want(batches))
    sync.discard()
    runs.clear()
    _backward(w, sync, runs, *batches[0])
    sync.discard()  # zero_grad without a step: the held micro-batch goes
    sync.arm()
    _backward(w, sync, runs, *batches[1])
    assert runs == [(True, 1)]
    sync.finish()
    torch.testing.assert_close(w.main_grad, _want(batches[1:]))


def test_callback_refuses_what_cannot_defer(monkeypatch):
    for bad in (1, 0, -2, 2.5, "4"):
        with pytest.raises(ValueError, match=r"want True .*or an int N >= 2"):
            FP8Training("rowwise", defer_expert_wgrad=bad)
    assert FP8Training("rowwise", defer_expert_wgrad=True).defer_window is None
    assert FP8Training("rowwise", defer_expert_wgrad=4).defer_window == 4
    for kwargs in (dict(recipe="tensorwise"), dict(recipe="blockwise"), dict(recipe="tensorwise", fp8_wgrad=False),
                   dict(recipe="delayed", fp8_wgrad=False, fp8_format="hybrid")):
        with pytest.raises(ValueError, match="only an expert wgrad behind E4M3 gradients can be deferred"):
            FP8Training(defer_expert_wgrad=True, **kwargs)
    # the one-pass experts' FP8 wgrad (tensorwise and delayed with E4M3 gradients) defers as the rowwise one does,
    # on the GPU only
    for recipe in ("tensorwise", "delayed"):
        assert FP8Training(recipe, fp8_format="e4m3", defer_expert_wgrad=2).defer_window == 2
        with pytest.raises(ValueError, match=r"needs the experts' Triton FP8 wgrad.*LMOE_FP8_BOTH not 0"):
            _start(FP8Training(recipe, fp8_format="e4m3", defer_expert_wgrad=True), _lm())
    # the bf16 wgrad behind E4M3 gradients defers too, but not on emulated experts (the CPU)
    FP8Training("tensorwise", fp8_wgrad=False, fp8_format="e4m3", defer_expert_wgrad=2)
    with pytest.raises(ValueError, match=r"fp8_wgrad=False, defer_expert_wgrad=True\) needs the experts' FP8 kernels"):
        _start(FP8Training("rowwise", fp8_wgrad=False, defer_expert_wgrad=True), _lm())
    with pytest.raises(ValueError, match="needs the experts' Triton FP8 wgrad"):  # the CPU: emulated experts
        _start(FP8Training("rowwise", defer_expert_wgrad=True), _lm())
    with pytest.raises(ValueError, match="no trainable expert GEMM runs in FP8"):
        _start(FP8Training("rowwise", defer_expert_wgrad=True, exclude=["*experts*"]), _lm())
    frozen = _lm()
    for n, p in frozen.named_parameters():
        p.requires_grad_(".experts.w" not in n)
    with pytest.raises(ValueError, match="no trainable expert GEMM runs in FP8"):
        _start(FP8Training("rowwise", defer_expert_wgrad=True), frozen)
    # a pipeline stage without FP8 experts, where another rank has four: nothing to defer here, no refusal
    others = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu"),
                                                      reduce=lambda t, reduce_op: t + torch.tensor([4, 0])))
    FP8Training("rowwise", defer_expert_wgrad=True, exclude=["*experts*"]).on_fit_start(others, _lm())
    # ... and a rank that can defer while another cannot: refused here too (no rank may raise alone)
    broken = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu"),
                                                      reduce=lambda t, reduce_op: t + torch.tensor([4, 1])))
    with pytest.raises(ValueError, match="cannot run on another rank"):
        FP8Training("rowwise", defer_expert_wgrad=True, exclude=["*experts*"]).on_fit_start(broken, _lm())
    # where the kernel runs but no GradSync fuses the experts' wgrad into main grads (no MoEFoldStrategy here)
    monkeypatch.setattr(fp8_training, "_triton_wgrad_runs", lambda *a: True)
    with pytest.raises(ValueError, match="gradient-accumulation fusion"):
        _start(FP8Training("rowwise", defer_expert_wgrad=True), _lm())
    lm = _lm()
    sync = GradSync([p for n, p in lm.named_parameters() if ".experts.w" in n], ParallelContext.single(),
                    main_grads=True)
    for n, p in lm.named_parameters():
        if ".experts.w" in n:
            p.main_grad_sink = lambda: sync  # as GradSync(fuse_wgrad=True) attaches it
    cb = FP8Training("rowwise", defer_expert_wgrad=3)
    _start(cb, lm)
    specs = {n: vars(m)["_mm"].keywords["spec"] for n, m in lm.named_modules() if "_mm" in vars(m)}
    experts = [n for n in specs if "experts.fc" in n]
    assert experts and all(specs[n].defer_wgrad == (n in experts) for n in specs)  # the dense linears: not deferred
    assert all(specs[n].defer_window == (3 if n in experts else None) for n in specs)
    # fp8_wgrad=False: the experts' FP8 kernels are what it needs (not the FP8 wgrad's)
    monkeypatch.setattr(fp8_training, "_triton_wgrad_runs", lambda *a: False)
    monkeypatch.setattr(fp8_training.grouped_kernels, "eligible", lambda *a: True)
    cb = FP8Training("rowwise", fp8_wgrad=False, defer_expert_wgrad=True)
    _start(cb, lm)
    specs = {n: vars(m)["_mm"].keywords["spec"] for n, m in lm.named_modules() if "_mm" in vars(m)}
    assert all(specs[n].defer_wgrad == (n in experts) and not specs[n].fp8_wgrad for n in specs)


def test_bf16_grouped_wgrad_held_then_run_over_the_window():
    """``wgrad_fusion.grouped_wgrad(defer=True)`` (the experts' bf16 wgrad under ``fp8_wgrad=False``): each micro-
    batch's operands held; a full window (2) runs them into the main grad, the armed backward the rest; the main grad
    is the sum over every micro-batch (float64's up to float32 summation order) and nothing stays held."""
    from lightning_moe.modules import wgrad_fusion
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(3, 8, 12))
    sync = GradSync([w], ParallelContext.single(), main_grads=True)
    want = torch.zeros(3, 8, 12, dtype=torch.float64)
    for mb in range(3):
        counts = torch.tensor([[4, 0, 7], [1, 2, 3], [0, 0, 9]][mb])
        x, dy = torch.randn(int(counts.sum()) + 2, 8, generator=g), torch.randn(int(counts.sum()) + 2, 12, generator=g)
        offs = counts.cumsum(0)
        ends = [0] + offs.tolist()
        for e in range(3):
            want[e] += x[ends[e]:ends[e + 1]].double().t() @ dy[ends[e]:ends[e + 1]].double()
        if mb == 2:
            sync.arm()
        wgrad_fusion.grouped_wgrad(sync, w, x, dy, offs, defer=True, window=2)
        assert len(sync.held(w)) == [1, 0, 0][mb]  # the window of two ran at the second; the armed one at once
        w.grad = torch.empty_like(w)
        sync._on_grad_ready(w)
    sync.finish()
    assert ((w.main_grad.double() - want).norm() / want.norm()).item() < 1e-6


def test_held_operands_go_side_by_side_into_the_arenas():
    """``_held_slots``: each micro-batch's operands at the next columns of the GEMM's arenas, while they fit;
    ``_side_by_side``: the held slices as one view of the arena (no concatenation), None for separate tensors."""
    from lightning_moe.modules.fp8_grouped_kernels import _held_slots, _side_by_side
    from lightning_moe.modules.fp8_linear import FP8Spec
    K, N, P = 4, 6, 128
    spec = FP8Spec("rowwise", defer_wgrad=True)
    assert _held_slots(spec, [], K, N, P) == (None, None)  # the first step: new tensors
    spec.wgrad_arena = (torch.zeros(K, 3 * P), torch.zeros(N, 3 * P))
    helds = []
    for i in range(3):
        a, b = _held_slots(spec, helds, K, N, P)
        assert a.shape == (K, P) and b.shape == (N, P) and a.data_ptr() == spec.wgrad_arena[0][:, i * P].data_ptr()
        a.fill_(i)
        helds.append(((a, None), (b, None), None))
    assert _held_slots(spec, helds, K, N, P) == (None, None)  # a fourth does not fit
    assert _held_slots(spec, [], K + 1, N, P) == (None, None)  # another GEMM's shape
    whole = _side_by_side([h[0][0] for h in helds])
    assert whole.data_ptr() == spec.wgrad_arena[0].data_ptr() and torch.equal(whole[:, P:2 * P], torch.ones(K, P))
    assert _side_by_side([torch.zeros(K, P), torch.zeros(K, P)]) is None
    assert _side_by_side([helds[1][0][0], helds[0][0][0]]) is None  # out of order


def test_strategy_deferral_refused_where_the_fp8_experts_would_not_take_it(monkeypatch):
    """``MoEFoldStrategy(defer_expert_wgrad=...)`` defers the bf16 wgrad (bf16 experts, or FP8 ones with
    ``fp8_wgrad=False`` on the kernels): with FP8 experts whose wgrad is an FP8 GEMM, E5M2 or emulated, it would do
    nothing, so FP8Training refuses it, naming why; where they take it (or the callback defers), it starts."""
    def trainer(defer):
        sync = SimpleNamespace(expert_deferral=(defer, None))
        return SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu"), _grad_sync=sync))

    for kwargs, why in ((dict(recipe="rowwise"), r"fp8_wgrad=True"),
                        (dict(recipe="tensorwise", fp8_wgrad=False), "E5M2"),
                        (dict(recipe="rowwise", fp8_wgrad=False), "runs emulated")):  # the CPU: emulated
        with pytest.raises(ValueError, match=r"MoEFoldStrategy\(defer_expert_wgrad=\.\.\.\) does not reach .*" + why):
            FP8Training(**kwargs).on_fit_start(trainer(True), _lm())
    FP8Training("rowwise").on_fit_start(trainer(False), _lm())  # off: nothing to check
    monkeypatch.setattr(fp8_training.grouped_kernels, "eligible", lambda *a: True)
    FP8Training("rowwise", fp8_wgrad=False).on_fit_start(trainer(True), _lm())  # on the kernels: it takes it


def test_a_deferral_that_deferred_nothing_warns_once():
    """``expert_deferral`` on, but the first step's expert GEMMs never called ``defer_wgrad``: one warning that the
    option had no effect; none where something was deferred, nor on a rank without experts."""
    import warnings
    for deferred, expert in ((False, True), (True, True), (False, False)):
        w, sync, runs = _setup()
        w.is_expert = expert
        sync.expert_deferral = (True, None)
        x, dy = _micro(1)[0]
        sync.arm()
        if deferred:
            _backward(w, sync, runs, x, dy)
        else:
            (x @ w).backward(dy)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sync.finish()
            sync.discard()
            sync.arm()
            (x @ w).backward(dy)
            sync.finish()  # the check runs once
        msgs = [str(c.message) for c in caught if "defer_expert_wgrad" in str(c.message)]
        assert len(msgs) == (not deferred and expert), (deferred, expert, msgs)
