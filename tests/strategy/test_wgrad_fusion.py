"""Gradient-accumulation fusion (``modules/wgrad_fusion.py``): the dense linears' weight-gradient GEMMs write or add
their fp32 result straight into ``main_grad``; the hook drops the placeholder gradient."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.modules.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from lightning_moe.strategy.grad_sync import GradSync
from lightning_moe.strategy.optimizer_options import OptimizerOptions
from lightning_moe.strategy.parallel_context import ParallelContext


def _pair(seed=0):
    ctx = ParallelContext.single()
    torch.manual_seed(seed)
    col, row = ColumnParallelLinear(16, 32, ctx), RowParallelLinear(32, 16, ctx)
    with torch.no_grad():
        for m in (col, row):
            m.weight.normal_(0, 0.3)
    return col.to(torch.bfloat16), row.to(torch.bfloat16)


def _micro(n=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(2, 5, 16, generator=g).to(torch.bfloat16), torch.randn(2, 5, 16, generator=g).to(torch.bfloat16))
            for _ in range(n)]


def _run(fuse: bool, steps=2):
    col, row = _pair()
    sync = GradSync(list(col.parameters()) + list(row.parameters()), ParallelContext.single(), main_grads=True,
                    fuse_wgrad=fuse)
    out = []
    for _ in range(steps):
        dxs = []
        for i, (x, dy) in enumerate(_micro()):
            x = x.clone().requires_grad_()
            if i == 2:
                sync.arm()
            row(col(x)).backward(dy)
            dxs.append(x.grad)
        sync.finish()
        out.append(([p.main_grad.clone() for p in (col.weight, row.weight)], dxs,
                     [p.grad for p in (col.weight, row.weight)]))
        sync.discard()
    return out, sync, col, row


def test_fused_wgrad_is_the_fp32_sum_of_the_micro_batches():
    (step0, step1), sync, col, row = _run(True)
    assert {id(p) for p in sync.fused_params} == {id(col.weight), id(row.weight)}
    # the reference: each micro-batch's dy^T x from fp32 copies of the bf16 operands, summed in fp32
    want_col, want_row = torch.zeros(32, 16), torch.zeros(16, 32)
    for x, dy in _micro():
        h = col(x)
        dh = dy @ row.weight  # the fused backward's input gradient
        want_row += dy.reshape(-1, 16).t().float() @ h.reshape(-1, 32).float()
        want_col += dh.reshape(-1, 32).t().float() @ x.reshape(-1, 16).float()
    for main_grads, _, grads in (step0, step1):  # the second step starts over (no stale accumulation)
        assert torch.equal(main_grads[0], want_col) and torch.equal(main_grads[1], want_row)
        assert grads == [None, None]  # the placeholder was dropped unread


def test_input_gradients_equal_the_unfused_ones_and_main_grads_are_closer_to_float64():
    (fused,), *_ = _run(True, steps=1)
    (plain,), *_ = _run(False, steps=1)
    for a, b in zip(fused[1], plain[1]):
        assert torch.equal(a, b)
    # float64 reference of the same bf16 weights and inputs
    col, row = _pair()
    c64, r64 = col.weight.double(), row.weight.double()
    want_col, want_row = torch.zeros(32, 16, dtype=torch.float64), torch.zeros(16, 32, dtype=torch.float64)
    for x, dy in _micro():
        x, dy = x.double().reshape(-1, 16), dy.double().reshape(-1, 16)
        h = x @ c64.t()
        want_row += dy.t() @ h
        want_col += (dy @ r64).t() @ x
    for i, want in enumerate((want_col, want_row)):
        err_fused = (fused[0][i].double() - want).abs().max()
        err_plain = (plain[0][i].double() - want).abs().max()
        assert err_plain > 0 and err_fused < err_plain, (i, err_fused, err_plain)  # bf16 rounding removed


def test_a_weight_used_twice_in_one_backward_adds_both():
    col, _ = _pair()
    sync = GradSync(list(col.parameters()), ParallelContext.single(), main_grads=True, fuse_wgrad=True)
    x1, x2 = torch.randn(4, 16).to(torch.bfloat16), torch.randn(4, 16).to(torch.bfloat16)
    sync.arm()
    (col(x1).float().sum() + col(x2).float().sum()).backward()
    sync.finish()
    ones = torch.ones(4, 32)
    want = ones.t() @ x1.float() + ones.t() @ x2.float()
    torch.testing.assert_close(col.weight.main_grad, want, rtol=1e-6, atol=1e-6)


def _replayed(on=lambda: True):
    """``grad_sync._capturing`` for the CPU emulation of CUDA graphs: true inside a backward that a capture would
    record (while ``on()``), false in GradSync's hooks and ``finish``, which run eagerly around every replay."""
    import sys

    def capturing(t):
        f = sys._getframe(1)
        while f is not None:
            if f.f_code.co_name in ("_on_grad_ready", "finish"):
                return False
            f = f.f_back
        return on()
    return capturing


def test_captured_wgrad_adds_into_main_grads_that_zero_grad_zeroes(monkeypatch):
    """Under CUDA graphs a captured backward replays as it was captured, so its fused GEMMs cannot choose between
    writing (a step's first micro-batch) and adding: they always add, GradSync zeroes those main grads at zero_grad
    (``discard``), and the hook drops each replay's placeholder gradient. Emulated on the CPU by running every backward
    as the capture does (the same GEMMs, then the same hook, as a replay gives), over main grads left stale: the sums
    are the eager run's, bit for bit, step after step."""
    from lightning_moe.strategy import grad_sync as gs
    eager, *_ = _run(True)
    col, row = _pair()
    sync = GradSync(list(col.parameters()) + list(row.parameters()), ParallelContext.single(), main_grads=True,
                    fuse_wgrad=True)
    monkeypatch.setattr(gs, "_capturing", _replayed())
    for p in (col.weight, row.weight):
        p.main_grad.fill_(7.0)  # stale
    x, dy = _micro()[0]
    x = x.clone().requires_grad_()
    # the capture, before the first step's zero_grad: autograd.grad, as make_graphed_callables runs it (no hooks)
    torch.autograd.grad(row(col(x)), (x, col.weight, row.weight), dy)
    for step in range(2):
        sync.discard()  # Lightning's zero_grad, before the step's first backward
        for i, (x, dy) in enumerate(_micro()):
            if i == 2:
                sync.arm()
            row(col(x.clone().requires_grad_())).backward(dy)
        sync.finish()
        assert torch.equal(col.weight.main_grad, eager[step][0][0])
        assert torch.equal(row.weight.main_grad, eager[step][0][1])
        assert col.weight.grad is None and row.weight.grad is None  # placeholders dropped unread
        assert {id(col.weight), id(row.weight)} <= sync.had_main_grad
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        sync.defer_wgrad(col.weight, None, None)
    monkeypatch.setattr(gs, "_capturing", lambda t: False)
    sync.graphs_released()  # eager again: the step's first micro-batch overwrites, no zeroing needed
    col.weight.main_grad.fill_(7.0)
    sync.discard()
    assert torch.equal(col.weight.main_grad, torch.full_like(col.weight.main_grad, 7.0))
    for i, (x, dy) in enumerate(_micro()):
        if i == 2:
            sync.arm()
        row(col(x.clone().requires_grad_())).backward(dy)
    sync.finish()
    assert torch.equal(col.weight.main_grad, eager[0][0][0])


def test_no_sink_without_fusion_and_release_detaches():
    _, sync, col, row = _run(False, steps=1)
    assert not sync.fused_params and not hasattr(col.weight, "main_grad_sink")
    _, sync, col, row = _run(True, steps=1)
    assert col.weight.main_grad_sink() is sync
    sync.release()
    assert not hasattr(col.weight, "main_grad_sink")


def test_options_refuse_what_cannot_apply():
    on = OptimizerOptions(gradient_accumulation_fusion=True)
    with pytest.raises(ValueError, match=r"gradient_accumulation_fusion=True\) needs main grads"):
        on.fuse_wgrad(main_grads=False)
    assert on.fuse_wgrad(main_grads=True)  # CUDA graphs included (the captured GEMMs add)
    auto = OptimizerOptions()
    assert auto.fuse_wgrad(True) and not auto.fuse_wgrad(False)
    assert not OptimizerOptions(gradient_accumulation_fusion=False).fuse_wgrad(True)
    with pytest.raises(ValueError, match=r"gradient_accumulation_fusion='yes'\): must be True, False or None"):
        OptimizerOptions.parse(False, True, None, None, None, None, 0.0, gradient_accumulation_fusion="yes")
    with pytest.raises(ValueError, match="fuse_wgrad=True\\) needs main_grads=True"):
        GradSync([], ParallelContext.single(), main_grads=False, fuse_wgrad=True)


def test_trainer_bf16_true_fuses_the_linears_and_experts_and_trains_like_the_unfused_run(tmp_path):
    from lightning_moe.modules.experts import GroupedExperts
    from tests.strategy.test_main_params import _fit
    losses, fused = {}, {}
    for fuse in (None, False):  # None: the default, on with main grads
        trainer, model = _fit(tmp_path / str(fuse), 4, gradient_accumulation_fusion=fuse,
                              callbacks=[_Losses(losses.setdefault(fuse, []), fused.setdefault(fuse, set()))])
        linears = [m.weight for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
        experts = [w for m in model.modules() if isinstance(m, GroupedExperts) for w in (m.w13, m.w2)]
        assert len(linears) > 4 and experts
        assert fused[fuse] == ({id(w) for w in linears + experts} if fuse is None else set()), fuse
    a, b = torch.tensor(losses[None]), torch.tensor(losses[False])
    assert len(a) == 8 and torch.isfinite(a).all()
    # the same training up to the bf16 rounding of each micro-batch's weight gradient, which fusion removes
    assert not torch.equal(a[2:], b[2:])
    torch.testing.assert_close(a, b, rtol=2e-2, atol=0)


@pytest.mark.parametrize("callback", ["recompute_full", "offload"])
def test_fusion_under_recompute_and_saved_tensor_hooks(tmp_path, callback, monkeypatch):
    """Recompute re-runs the forward inside backward and hands saved tensors back as new objects: the fused backward
    must still find the parameter's main_grad (found by the 128k H100 run with Recompute(["full"]))."""
    from lightning_moe import Recompute
    from tests.strategy.test_main_params import _fit
    losses, fused = {}, {}
    if callback == "offload":  # saved-tensor hooks that pack every save (ActivationOffload needs CUDA)
        extra = [_HookAll()]
    else:
        extra = [Recompute(["full"])]
    for name, cbs in (("plain", []), (callback, extra)):
        _fit(tmp_path / name, 2, callbacks=[_Losses(losses.setdefault(name, []), fused.setdefault(name, set())),
                                            *cbs])
    assert fused["plain"] and len(fused[callback]) == len(fused["plain"])  # ids: two models
    assert losses[callback] == losses["plain"]  # the same arithmetic, recomputed or not


def test_strategy_refuses_fusion_without_main_grads(tmp_path):
    import lightning as L

    from lightning_moe import MoEFoldStrategy, MoELanguageModel, TokenDataModule
    from tests.parallel.parity import make_tokens
    model = MoELanguageModel(preset="tiny", overrides=dict(seq_length=32, num_layers=2, hidden_size=32,
                                                           num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                                                           moe_ffn_hidden_size=32, num_experts=4, topk=2),
                             log_expert_load=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=MoEFoldStrategy(gradient_accumulation_fusion=True),
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path), limit_val_batches=0)
    with pytest.raises(ValueError, match=r"gradient_accumulation_fusion=True\) needs main grads"):
        trainer.fit(model, datamodule=TokenDataModule(path=make_tokens(str(tmp_path / "t.bin")), seq_length=32,
                                                      batch_size=4))


class _HookAll:
    """Saved-tensor hooks around every training step that hand back a copy: a saved tensor returns as another
    object, as under offload."""

    def __new__(cls):
        import lightning as L

        class Cb(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                self.ctx = torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().clone(), lambda t: t)
                self.ctx.__enter__()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                self.ctx.__exit__(None, None, None)
        return Cb()


class _Losses:
    def __new__(cls, out, fused):
        import lightning as L

        class Cb(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                out.append(float(outputs["loss"]))
                fused.update(id(p) for p in trainer.strategy._grad_sync.fused_params)
        return Cb()


def _experts_run(fuse: bool, micro=3) -> tuple:
    """bf16 GroupedExperts (4 experts, one empty, rows past the last) under GradSync; each micro-batch's main grads
    and input gradient."""
    from lightning_moe.modules.experts import GroupedExperts
    torch.manual_seed(0)
    ex = GroupedExperts(4, 16, 32, init_std=0.3, out_std=0.3)
    ex.reset_parameters_sharded(0, "experts")
    ex = ex.to(torch.bfloat16)
    sync = GradSync(list(ex.parameters()), ParallelContext.single(), main_grads=True, fuse_wgrad=fuse)
    g = torch.Generator().manual_seed(2)
    counts = torch.tensor([5, 0, 9, 6])
    out = []
    sync.arm()
    for _ in range(micro):
        x = torch.randn(int(counts.sum()) + 3, 16, generator=g).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(x.shape[0], 16, generator=g).to(torch.bfloat16)
        ex(x, counts, has_tail=True).backward(dy)
        out.append((x.detach(), dy, x.grad))
    sync.finish()
    return ex, sync, out


def _deferred_steps(window, graphs: bool, monkeypatch, steps=2, micro=4, abandon=(), start=0) -> tuple:
    """bf16 GroupedExperts with the deferred wgrad (``expert_deferral = (True, window)``), ``steps`` optimizer steps of
    ``micro`` micro-batches; each step's main grads. ``graphs``: emulated CUDA graphs, on the CPU. A warm-up backward
    (``autograd.grad``, no hooks, as make_graphed_callables runs it) finds the window; then every backward runs as the
    capture of the copy that the strategy would replay does (``graph_copy``), with ``_capturing`` true: its operands
    stay with that copy, and the weight's hook fires, as at a replay. ``abandon``: micro-batches whose step never
    finishes, run before the second step. ``start``: the first step begins at this micro-batch (a fit resumed
    mid-step: the capture at that micro-batch, and no zero_grad before its backward)."""
    from lightning_moe.modules.experts import GroupedExperts
    from lightning_moe.strategy import grad_sync as gs
    torch.manual_seed(0)
    ex = GroupedExperts(4, 16, 32, init_std=0.3, out_std=0.3)
    ex.reset_parameters_sharded(0, "experts")
    ex = ex.to(torch.bfloat16)
    sync = GradSync(list(ex.parameters()), ParallelContext.single(), main_grads=True, fuse_wgrad=True)
    sync.expert_deferral = (True, window)
    g = torch.Generator().manual_seed(2)
    counts = torch.tensor([5, 0, 9, 6])
    batches = [tuple(torch.randn(23, 16, generator=g).to(torch.bfloat16) for _ in range(2))
               for _ in range(steps * micro)]
    if graphs:
        sync.graph_window = micro
        sync.begin_copy(0)  # the first copy's warm-up, eager
        monkeypatch.setattr(gs, "_capturing", lambda t: False)
        x = batches[0][0].clone().requires_grad_()
        torch.autograd.grad(ex(x, counts, has_tail=True), (x, ex.w13, ex.w2), batches[0][1])
        assert len(sync._copies) == 2 and sync.graph_copies() == (window or micro)
        monkeypatch.setattr(gs, "_capturing", _replayed())
        sync.capture_copy = None
        sync.discard()  # MoEFoldStrategy, after the capture: the warm-up's held operands
    out = []
    for step in range(steps):
        if abandon and step == 1:  # a step left after 2 micro-batches (Lightning skipped the rest of the epoch)
            for x, dy in abandon:
                sync.begin_copy(sync.graph_copy())
                ex(x.clone().requires_grad_(), counts, has_tail=True).backward(dy)
            assert not graphs or sync.graph_copy() == 2
        if not (start and step == 0):
            sync.new_step()  # MoEFoldStrategy.training_step, before the step's first forward
        for i in range(start if step == 0 else 0, micro):
            if i == micro - 1:
                sync.arm()
            x, dy = batches[step * micro + i]
            sync.begin_copy(sync.graph_copy())  # as if the copy this micro-batch's forward replays were captured
            if i == 0:
                sync.discard()  # Lightning's zero_grad: after the step's first forward, before its backward
            ex(x.clone().requires_grad_(), counts, has_tail=True).backward(dy)
            assert not graphs or sync.capture_copy == (i - (start if step == 0 else 0)) % (window or micro)
            assert not graphs or not sync._deferred  # nothing held eagerly: all with the graph copies
        sync.finish()
        out.append((ex.w13.main_grad.clone(), ex.w2.main_grad.clone()))
        assert ex.w13.grad is None and ex.w2.grad is None
    if graphs:
        assert all(c.filled == 0 for c in sync._copies.values()) and sync.graph_copy() == 0  # every window ran
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_deferred_expert_wgrad_through_graph_copies_equals_the_eager_deferral(window, monkeypatch):
    """Under CUDA graphs the deferred wgrad's operands stay with one copy of the graphs per micro-batch of the window
    (``graph_deferral.py``): the main grads are the eager deferral's, bit for bit, for windows that fill at the
    step's last micro-batch (None) and that do not (3 of 4: a full window, then the armed backward's rest)."""
    eager = _deferred_steps(window, False, monkeypatch)
    graphed = _deferred_steps(window, True, monkeypatch)
    for (a13, a2), (b13, b2) in zip(eager, graphed):
        assert torch.equal(a13, b13) and torch.equal(a2, b2)
    assert not torch.equal(eager[0][0], eager[1][0])  # the steps differ: a stale copy would show


@pytest.mark.parametrize("window", [None, 2])
def test_a_fit_resumed_mid_step_captures_without_the_warm_ups_leftovers(window, monkeypatch):
    """A fit resumed at a step's third micro-batch captures there, with no zero_grad before that backward: the
    warm-up's held operands are dropped after the capture (``discard``, as MoEFoldStrategy calls it), so the main
    grads are the eager run's from the same micro-batch on, bit for bit."""
    eager = _deferred_steps(window, False, monkeypatch, start=2)
    graphed = _deferred_steps(window, True, monkeypatch, start=2)
    for (a13, a2), (b13, b2) in zip(eager, graphed):
        assert torch.equal(a13, b13) and torch.equal(a2, b2)


def test_a_step_left_unfinished_does_not_shift_the_next_steps_graph_copies(monkeypatch):
    """Lightning may leave a step after some micro-batches (``on_train_batch_start`` returning -1 skips the rest of
    the epoch): their replays filled graph copies 0 and 1, and no pass ran. The next step's first forward must replay
    copy 0 (``new_step``, before that forward; ``discard`` runs only after it), as eagerly the held operands are
    dropped: the main grads equal the eager deferral's, bit for bit. Without ``new_step`` the hook refuses the
    mismatch."""
    g = torch.Generator().manual_seed(9)
    left = [tuple(torch.randn(23, 16, generator=g).to(torch.bfloat16) for _ in range(2)) for _ in range(2)]
    eager = _deferred_steps(None, False, monkeypatch, abandon=left)
    graphed = _deferred_steps(None, True, monkeypatch, abandon=left)
    for (a13, a2), (b13, b2) in zip(eager, graphed):
        assert torch.equal(a13, b13) and torch.equal(a2, b2)
    from lightning_moe.strategy import grad_sync as gs
    monkeypatch.setattr(gs.GradSync, "new_step", lambda self: None)
    with pytest.raises(RuntimeError, match="backward of graph copy 2 would count as copy 0"):
        _deferred_steps(None, True, monkeypatch, abandon=left)


@pytest.mark.parametrize("pattern", ["replay,replay,eager", "eager,replay,replay", "replay,eager,replay"])
def test_replays_and_eager_calls_are_all_in_main_grad_when_the_bucket_launches(pattern, monkeypatch):
    """A step mixing graph replays (their operands with the graph copies) with eager calls of another shape (held as
    they are),
    under data parallelism: whichever the armed backward is, every micro-batch's wgrad is in main_grad when the
    weight's bucket is handed to the all-reduce (the spy), not added by ``finish`` afterwards."""
    from lightning_moe.modules.experts import GroupedExperts
    from lightning_moe.strategy import grad_sync as gs
    torch.manual_seed(0)
    ex = GroupedExperts(4, 16, 32, init_std=0.3, out_std=0.3)
    ex.reset_parameters_sharded(0, "experts")
    ex = ex.to(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    counts = torch.tensor([5, 0, 9, 6])
    kinds = pattern.split(",")
    data = [(torch.randn(23 if k == "replay" else 26, 16, generator=g).to(torch.bfloat16),) for k in kinds]
    data = [(x, torch.randn(x.shape[0], 16, generator=g).to(torch.bfloat16)) for (x,) in data]

    def run(graphs):
        sync = GradSync(list(ex.parameters()), ParallelContext.single(), main_grads=True, fuse_wgrad=True)
        sync.expert_deferral = (True, None)
        launched = []
        for state in sync.groups.values():
            for b in state.buckets:
                b.reduce = True  # as under data parallelism: the bucket launches at the armed backward
        sync._launch = lambda b: launched.append([(p, p.main_grad.clone()) for p in b.params])
        if graphs:  # the capture's warm-up, on a replay's shapes
            sync.graph_window = len(kinds)
            sync.begin_copy(0)
            x, dy = data[kinds.index("replay")]
            x = x.clone().requires_grad_()
            torch.autograd.grad(ex(x, counts, has_tail=True), (x, ex.w13, ex.w2), dy)
        sync.discard()
        for i, (kind, (x, dy)) in enumerate(zip(kinds, data)):
            if i == len(kinds) - 1:
                sync.arm()
            monkeypatch.setattr(gs, "_capturing", _replayed(lambda: graphs and kind == "replay"))
            sync.begin_copy(sync.graph_copy())
            ex(x.clone().requires_grad_(), counts, has_tail=True).backward(dy)
        assert len(launched) == 1
        sync.finish()
        assert all(torch.equal(a, p.main_grad) for p, a in launched[0])  # finish added nothing after the launch
        sync.release()  # its hooks off the shared weights
        return [a for _, a in launched[0]]

    want = run(False)  # every call eager: one pass at the armed backward
    got = run(True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # the same sums, in another order


def test_captured_writes_add_and_each_graph_copy_keeps_its_operands(monkeypatch):
    """What a replay repeats is what the capture recorded: the fused GEMM's write with ``first=False`` (a replay never
    overwrites). The deferred wgrad's operands stay with the copy being captured; the pass takes the replayed copies'
    in micro-batch order, and refuses a replayed copy that was never captured or one past the window."""
    from lightning_moe.strategy import grad_sync as gs
    from lightning_moe.strategy.graph_deferral import HeldCopies
    p = torch.nn.Parameter(torch.zeros(2, 3))
    sync = GradSync([p], ParallelContext.single(), main_grads=True)
    firsts = []
    monkeypatch.setattr(gs, "_capturing", _replayed())
    sync.accumulate_wgrad(p, lambda main, first: firsts.append(first))
    assert firsts == [False] and id(p) in sync._graphed
    with pytest.raises(RuntimeError, match="without the warm-up"):
        sync.defer_wgrad(p, (torch.zeros(1),), None)  # no window found yet
    copies = HeldCopies(p, 3)
    for k in (2, 0, 1):  # captured in any order: each copy's own operands
        copies.capture(k, (torch.full((2,), float(k)),), None)
    with pytest.raises(RuntimeError, match="copy 3 captured for a window of 3"):
        copies.capture(3, (torch.zeros(2),), None)
    with pytest.raises(RuntimeError, match="copies 0 and 1 hold the same operand memory"):
        copies.capture(1, copies.held[0], None)  # e.g. a buffer every copy shares: the pass would read one value
    with pytest.raises(RuntimeError, match="copies 1 and 2 hold the same operand memory"):
        copies.capture(2, copies.held[1], None)
    assert not copies.replayed() and not copies.replayed() and [h[0][0].item() for h in copies.take()] == [0, 1]
    assert copies.replayed()  # the window is full
    fresh = HeldCopies(p, 2)
    fresh.capture(1, (torch.zeros(2),), None)
    fresh.replayed()
    with pytest.raises(RuntimeError, match=r"copies \[0\] were replayed but never captured"):
        fresh.take()


def test_graph_copies_refuse_mixed_windows_and_finish_runs_what_is_left():
    """Every deferred weight replays one copy per micro-batch of one window (weights with other windows are refused);
    ``finish`` runs copies that a last backward never reached (their pass queued then), and ``discard`` resets what a
    step abandoned, so that the next forward replays copy 0."""
    from lightning_moe.strategy.graph_deferral import HeldCopies
    p, q = torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(2))
    sync = GradSync([p, q], ParallelContext.single(), main_grads=True)
    assert sync.graph_copies() == 1 and sync.graph_copy() == 0  # nothing deferred: one copy
    sync._copies[id(p)] = copies = HeldCopies(p, 2)
    sync._copies[id(q)] = HeldCopies(q, 3)
    with pytest.raises(RuntimeError, match=r"windows \[2, 3\] differ"):
        sync.graph_copies()
    del sync._copies[id(q)]
    ran = []
    copies.capture(0, (torch.ones(4, 3), torch.tensor([1, 4])), lambda main, first, helds: ran.append((first, helds)))
    copies.replayed()
    assert sync.graph_copy() == 1  # the next forward replays copy 1
    sync.finish()
    assert len(ran) == 1 and ran[0][0] and torch.equal(ran[0][1][0][1], torch.tensor([1, 4]))
    assert copies.filled == 0 and sync.graph_copy() == 0 and id(p) in sync.had_main_grad
    copies.replayed()
    sync.discard()
    assert copies.filled == 0 and sync.graph_copy() == 0
    sync._placeholders[torch.float32] = torch.empty(3)
    sync.graphs_released()
    assert not sync._copies and not sync._placeholders and sync.graph_window is None and sync.capture_copy is None


def test_captured_placeholders_share_one_buffer_made_in_the_warm_up(monkeypatch):
    """A fused GEMM's placeholder gradient (dropped unread by the hook) is, inside a capture, a view of one buffer per
    dtype that the capture's warm-up made large enough for every weight, instead of a static output per graph copy;
    outside a capture it is a tensor of its own."""
    from lightning_moe.strategy import grad_sync as gs
    big, small = torch.nn.Parameter(torch.zeros(4, 6)), torch.nn.Parameter(torch.zeros(3, 2))
    sync = GradSync([big, small], ParallelContext.single(), main_grads=True)
    assert sync.placeholder(big).shape == (4, 6) and not sync._placeholders  # no capture coming
    sync.graph_window = 2
    sync.begin_copy(0)  # the first copy's warm-up
    sync.placeholder(small)
    sync.placeholder(big)
    sync.placeholder(small)
    buf = sync._placeholders[torch.float32]
    assert buf.numel() == 24
    monkeypatch.setattr(gs, "_capturing", _replayed())
    a, b = sync.placeholder(big), sync.placeholder(small, (2, 3))
    assert a.shape == (4, 6) and b.shape == (2, 3) and a.is_contiguous()
    assert a.data_ptr() == b.data_ptr() == buf.data_ptr()
    half = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.bfloat16))
    half.main_grad = torch.zeros(2, 2)
    assert sync.placeholder(half).data_ptr() != buf.data_ptr()  # no buffer of its dtype: a tensor of its own
    monkeypatch.setattr(gs, "_capturing", lambda t: False)
    sync.capture_copy = None  # captured: an eager weight larger than any block's (the head) grows no buffer
    head = torch.nn.Parameter(torch.zeros(10, 10))
    head.main_grad = torch.zeros(10, 10)
    assert sync.placeholder(head).shape == (10, 10) and sync._placeholders[torch.float32] is buf


def test_graph_capture_makes_the_copies_the_window_needs(monkeypatch):
    """``capture_blocks`` captures the blocks once, asks how many copies the warm-up found a need for, captures the
    rest in the same pool without warm-up (``on_copy(k)`` before copy k), then each training forward replays the
    copy ``select()`` names; eval, no-grad and other shapes run eagerly; a copy past those captured is refused."""
    from lightning_moe.strategy import cuda_graphs as cg

    class Block(torch.nn.Module):
        def forward(self, x, positions):
            return x + 1, None

    calls = []

    def fake_capture(callables, samples, num_warmup_iters, allow_unused_input, pool):
        k = len(calls)
        calls.append((num_warmup_iters, pool))
        for blk in callables:
            blk.forward = lambda x, pos, k=k: ("copy", k)

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    blocks = [Block(), Block()]
    seen, which = [], [0]
    cg.capture_blocks(blocks, (2, 3), torch.float32, torch.arange(3), copy_param_grads=False,
                      copies=lambda: (seen.append("asked"), 3)[1], on_copy=seen.append, select=lambda: which[0])
    assert seen == [0, "asked", 1, 2] and calls == [(3, "pool"), (0, "pool"), (0, "pool")]
    x = torch.zeros(2, 3)
    for k in (0, 2, 1):
        which[0] = k
        assert blocks[1](x, None) == ("copy", k)
    assert torch.equal(blocks[0](torch.zeros(1, 3), None)[0], torch.ones(1, 3))  # another shape: eager
    with torch.no_grad():
        assert torch.equal(blocks[0](x, None)[0], torch.ones(2, 3))
    which[0] = 3
    with pytest.raises(RuntimeError, match="copy 3 asked for, 3 captured"):
        blocks[0](x, None)
    cg.release_blocks(blocks, [])
    assert torch.equal(blocks[0](x, None)[0], torch.ones(2, 3))


def test_expert_wgrad_is_the_fp32_sum_of_the_micro_batches_and_dx_is_unchanged():
    ex, sync, fused = _experts_run(True)
    _, _, plain = _experts_run(False)
    assert {id(p) for p in sync.fused_params} == {id(ex.w13), id(ex.w2)}
    assert ex.w13.grad is None and ex.w2.grad is None  # the placeholders were dropped unread
    for (_, _, a), (_, _, b) in zip(fused, plain):
        assert torch.equal(a, b)  # the input gradient is grouped_mm's either way
    # the reference: each micro-batch's x_l^T dy_l from fp32 copies of the bf16 operands, summed in fp32
    bounds = [0, 5, 5, 14, 20]
    want13, want2 = torch.zeros_like(ex.w13, dtype=torch.float32), torch.zeros_like(ex.w2, dtype=torch.float32)
    for x, dy, _ in fused:
        x = torch.where(torch.arange(x.shape[0]).unsqueeze(1) < 20, x, 0)  # has_tail masks the rows past the last
        h = torch.cat([x[a:b] @ ex.w13[l] for l, (a, b) in enumerate(zip(bounds, bounds[1:]))])
        gate, up = h.chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up
        for l, (a, b) in enumerate(zip(bounds, bounds[1:])):
            want2[l] += act[a:b].float().t() @ dy[a:b].float()
            dact = dy[a:b] @ ex.w2[l].t()
            dgate = torch.ops.aten.silu_backward(dact * up[a:b], gate[a:b])
            want13[l] += x[a:b].float().t() @ torch.cat([dgate, dact * torch.nn.functional.silu(gate[a:b])], -1).float()
    torch.testing.assert_close(ex.w2.main_grad, want2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ex.w13.main_grad, want13, rtol=2e-2, atol=2e-2)  # dgate: the bf16 SwiGLU backward
    # unfused, each micro-batch's gradient was rounded to bf16 first: further from the fp32 sum
    ex_plain, _, _ = _experts_run(False)
    err_fused, err_plain = ((m - want2).abs().max() for m in (ex.w2.main_grad, ex_plain.w2.main_grad))
    assert err_plain > 1e-4 and err_fused < err_plain / 10, (err_fused, err_plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_expert_fusion_only_for_16_bit_weights(dtype):
    """An fp32 weight's autograd gradient is already fp32 (nothing to save), and float64 has no grouped_mm: both run
    the plain GEMM, and the hook accumulates as without fusion."""
    from lightning_moe.modules.experts import GroupedExperts
    ex = GroupedExperts(2, 16, 32, init_std=0.3, out_std=0.3)
    ex.reset_parameters_sharded(0, "experts")
    ex = ex.to(dtype)
    sync = GradSync(list(ex.parameters()), ParallelContext.single(), main_grads=True, fuse_wgrad=True)
    assert {id(p) for p in sync.fused_params} == {id(ex.w13), id(ex.w2)}  # asked for, but declined per call
    x = torch.randn(6, 16, dtype=dtype)
    sync.arm()
    ex(x, torch.tensor([4, 2])).sum().backward()
    sync.finish()
    ref = GroupedExperts(2, 16, 32, init_std=0.3, out_std=0.3)
    ref.reset_parameters_sharded(0, "experts")
    ref = ref.to(dtype)
    ref(x, torch.tensor([4, 2])).sum().backward()
    assert torch.equal(ex.w13.main_grad, ref.w13.grad.to(ex.w13.main_grad.dtype))


def test_defer_expert_wgrad_options():
    parse = lambda v: OptimizerOptions.parse(False, True, None, None, None, None, 0.0,  # noqa: E731
                                             defer_expert_wgrad=v)
    for bad in (1, 0, -3, 2.5, "4", None):
        with pytest.raises(ValueError, match=r"defer_expert_wgrad=.*want True .*or an int N >= 2"):
            parse(bad)
    assert parse(True).expert_deferral(True) == (True, None)
    assert parse(4).expert_deferral(True) == (True, 4)
    assert parse(False).expert_deferral(False) == (False, None)
    with pytest.raises(ValueError, match=r"defer_expert_wgrad=4\) needs gradient-accumulation fusion"):
        parse(4).expert_deferral(False)


@pytest.mark.parametrize("defer", [True, 2])
def test_trainer_defers_the_experts_bf16_wgrad_and_trains_alike(tmp_path, defer):
    """``MoEFoldStrategy(defer_expert_wgrad=...)`` over 4 micro-batches per step: each expert weight's operands held
    from micro-batch to micro-batch until the step's last (True), or run at every second one (a window of 2); nothing
    else held. On the CPU's reference (one pass per segment, in order) the training is the undeferred one's, bit for
    bit."""
    import lightning as L

    from lightning_moe.modules.experts import GroupedExperts
    from tests.strategy.test_main_params import _fit
    held = []

    class Held(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            sync = trainer.strategy._grad_sync
            held.append((batch_idx, sum(len(sync.held(p)) for p in pl_module.parameters()), sync.expert_deferral))

    losses = {}
    for name, kw in (("plain", {}), ("defer", dict(defer_expert_wgrad=defer))):
        trainer, model = _fit(tmp_path / name, 2, accumulate=4,
                              callbacks=[_Losses(losses.setdefault(name, []), set()),
                                         *([Held()] if name == "defer" else [])], **kw)
    n = len([w for m in model.modules() if isinstance(m, GroupedExperts) for w in (m.w13, m.w2)])
    want = (True, None if defer is True else 2)
    per_step = [n, 2 * n, 3 * n, 0] if defer is True else [n, 0, n, 0]
    assert held == [(i, per_step[i % 4], want) for i in range(8)]
    assert len(losses["defer"]) == 8 and losses["defer"] == losses["plain"]


def test_strategy_refuses_deferral_without_fusion(tmp_path):
    from tests.strategy.test_main_params import _fit
    with pytest.raises(ValueError, match=r"defer_expert_wgrad=True\) needs gradient-accumulation fusion"):
        _fit(tmp_path, 1, gradient_accumulation_fusion=False, defer_expert_wgrad=True)


def test_the_strategy_starts_each_step_at_graph_copy_0(monkeypatch):
    """``MoEFoldStrategy.training_step`` under graphs resets the graph copies before the forward of each optimizer
    step's first micro-batch (batch_idx a multiple of accumulate_grad_batches, as Lightning counts it), and only
    there."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import Strategy

    from lightning_moe import MoEFoldStrategy
    strategy = MoEFoldStrategy(cuda_graphs=True)
    calls = []
    loop = SimpleNamespace(batch_idx=0)
    trainer = SimpleNamespace(accumulate_grad_batches=3, fit_loop=SimpleNamespace(epoch_loop=loop))
    monkeypatch.setattr(MoEFoldStrategy, "lightning_module", property(lambda self: SimpleNamespace(trainer=trainer)))
    monkeypatch.setattr(Strategy, "training_step", lambda self, *a, **k: calls.append(("forward", loop.batch_idx)))
    strategy._pipeline, strategy._graphs, strategy._sharded = None, ([], []), None
    strategy._grad_sync = SimpleNamespace(new_step=lambda: calls.append(("new_step", loop.batch_idx)))
    for i in (0, 1, 2, 3, 4, 0, 1):  # a short last step of an epoch (3, 4), then the next epoch
        loop.batch_idx = i
        strategy.training_step({"tokens": None}, i)
    assert calls == [("new_step", 0), ("forward", 0), ("forward", 1), ("forward", 2), ("new_step", 3),
                     ("forward", 3), ("forward", 4), ("new_step", 0), ("forward", 0), ("forward", 1)]


def _capture_rig(monkeypatch, fail_at=None):
    """MoEFoldStrategy._capture_cuda_graphs over two stand-in blocks with a stand-in capture (CPU): the first copy's
    warm-up finds a window of 3, leaves held operands, a fused write and a stale graphed main grad, and bumps a routing
    counter; ``fail_at``: the copy whose capture raises."""
    from types import SimpleNamespace

    from lightning_moe import MoEFoldStrategy
    from lightning_moe.strategy.graph_deferral import HeldCopies
    p, d = torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(2))
    sync = GradSync([p, d], ParallelContext.single(), main_grads=True)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(()))

        def forward(self, x, positions):
            return x + 1, None

    blocks, seen = [Block(), Block()], []

    def fake_capture(callables, samples, num_warmup_iters, allow_unused_input, pool):
        k = sync.capture_copy
        seen.append((k, num_warmup_iters, pool, all("forward" not in vars(b) for b in callables)))
        if k == 0:
            sync._copies[id(p)] = HeldCopies(p, 3)
            sync._deferred[id(p)] = (p, None, [(torch.ones(1),)])
            sync._holding.add(id(p))
            sync._fused.add(id(d))
            for b in callables:
                b.count += 1
        sync._graphed[id(d)] = d
        d.main_grad.fill_(5.0)
        if k == fail_at:
            raise torch.cuda.OutOfMemoryError("stand-in")
        for b in callables:
            b.forward = lambda x, pos, k=k: ("copy", k)

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    strategy = MoEFoldStrategy(cuda_graphs=True)
    strategy._grad_sync = sync
    module = SimpleNamespace(trainer=SimpleNamespace(accumulate_grad_batches=4),
                             cuda_graph_blocks=lambda batch: (blocks, (2, 3), torch.float32, torch.arange(3)))
    monkeypatch.setattr(MoEFoldStrategy, "lightning_module", property(lambda self: module))
    return strategy, sync, blocks, seen, p, d


def test_the_strategy_captures_a_copy_per_micro_batch_of_the_window_and_drops_the_warm_ups_leftovers(monkeypatch):
    """``_capture_cuda_graphs``: copies 0, 1, 2 (the window the warm-up found), each captured from the eager forwards
    in one pool, the warm-up only for the first; afterwards no copy is being captured, the warm-up's held operands and
    writes are dropped (a capture mid-step has no zero_grad before its backward), the routing counters are restored,
    and each forward replays the copy ``graph_copy`` names."""
    strategy, sync, blocks, seen, p, d = _capture_rig(monkeypatch)
    strategy._capture_cuda_graphs(None)
    assert seen == [(0, 3, "pool", True), (1, 0, "pool", True), (2, 0, "pool", True)]
    assert sync.capture_copy is None and sync.graph_window == 4 and strategy._graphs is not None
    assert not sync._deferred and not sync._holding and not sync._fused and not d.main_grad.any()
    assert all(b.count.item() == 0 for b in blocks)
    x = torch.zeros(2, 3)
    for k in (0, 2, 1):
        sync._copies[id(p)].filled = k
        assert blocks[1](x, None) == ("copy", k)


def test_a_failed_capture_leaves_eager_blocks_and_no_graph_state(monkeypatch):
    """A capture that raises (say out of memory at the second copy) leaves the blocks eager as they were, the routing
    counters restored, and GradSync with no copies, no copy being captured and none of the warm-up's leftovers."""
    strategy, sync, blocks, seen, p, d = _capture_rig(monkeypatch, fail_at=1)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        strategy._capture_cuda_graphs(None)
    assert [s[0] for s in seen] == [0, 1] and strategy._graphs is None
    assert all("forward" not in vars(b) and b.count.item() == 0 for b in blocks)
    assert torch.equal(blocks[0](torch.zeros(2, 3), None)[0], torch.ones(2, 3))
    assert sync.capture_copy is None and sync.graph_window is None and not sync._copies and not sync._graphed
    assert not sync._deferred and not sync._holding and not sync._fused and not d.main_grad.any()


def test_a_weight_deferred_twice_in_one_captured_backward_is_refused(monkeypatch):
    """One graph copy holds one micro-batch's operands per weight: a second deferred GEMM of the same weight in one
    captured backward (a weight used twice) is refused; the next copy's capture may hold it again."""
    from lightning_moe.strategy import grad_sync as gs
    from lightning_moe.strategy.graph_deferral import HeldCopies
    p = torch.nn.Parameter(torch.zeros(2, 3))
    sync = GradSync([p], ParallelContext.single(), main_grads=True)
    sync._copies[id(p)] = HeldCopies(p, 2)
    monkeypatch.setattr(gs, "_capturing", _replayed())
    sync.begin_copy(0)
    sync.defer_wgrad(p, (torch.zeros(2),), None)
    with pytest.raises(RuntimeError, match="used twice in the forward"):
        sync.defer_wgrad(p, (torch.ones(2),), None)
    sync.begin_copy(1)
    sync.defer_wgrad(p, (torch.ones(2),), None)
    assert [h[0][0].item() for h in sync._copies[id(p)].held] == [0.0, 1.0]
