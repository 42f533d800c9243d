"""``MoEFoldStrategy(fused_optimizer_writeback=...)``: Adam/AdamW and the bf16 write-back in one Triton kernel
(``strategy/fused_adam.py``, ``modules/triton_adam.py``).

- the kernel against torch's fused Adam/AdamW over several steps (weight decay both ways, maximize, the step count
  read on the device or given by the host), and the bf16 copy against the fp32 weight's rounding;
- through the Trainer: the same weights, optimizer state and checkpoint as the unfused step, the LR scheduler and
  the step hooks still see their step;
- the same for the distributed optimizer's flat slices;
- where it cannot apply, True is refused naming why and None leaves torch's step.

The kernel runs on CPU under the Triton interpreter in a fresh process (skipped without triton, as in CI), and on CUDA
(``gpu``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_moe import MoEFoldStrategy
from lightning_moe.strategy.main_params import MainParams
from lightning_moe.strategy.optimizer_setup import fuse_steps
from tests.modules.interpreted import INSIDE, run_interpreted

# (class, weight decay, maximize, fused reference: the step count on the device)
CASES = [(torch.optim.AdamW, 0.1, False, True), (torch.optim.Adam, 0.05, False, True),
         (torch.optim.AdamW, 0.0, True, True), (torch.optim.Adam, 0.0, False, False)]
BF16_ULP = 2.0 ** -7  # relative spacing of bf16 around a value: the write-back rounds (the interpreter truncates)


@pytest.mark.skipif(INSIDE, reason="the outer test only")
def test_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    run_interpreted(__file__, k="interpreted", passed=7)  # 3 kernel cases, 2 Trainer, 2 ranks, the fallback


def _kernel_case(cls, wd, maximize, device_step, device):
    from lightning_moe.strategy.fused_adam import FusedAdamStep
    g = torch.Generator().manual_seed(int(wd * 100) + 2 * maximize)
    shapes = [(37, 53), (4096 + 5,), (3, 1, 7)]  # more than one block; odd sizes: the tail is masked
    mains = [torch.randn(s, generator=g).to(device) for s in shapes]
    ref, first = [m.clone() for m in mains], [m.clone() for m in mains]
    lows = [m.to(torch.bfloat16) for m in mains]
    kw = dict(lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd, maximize=maximize)
    # the reference: torch's own fused kernel (same terms in the same order) where the step count is on the device;
    # its per-tensor loop otherwise (the step count on the host, as by default)
    opt_ref = cls(ref, fused=True, **kw) if device_step else cls(ref, foreach=False, **kw)
    opt = cls(mains, fused=device_step or None, foreach=False if not device_step else None, **kw)
    FusedAdamStep(opt, {id(m): low for m, low in zip(mains, lows)})
    for _ in range(4):
        for m, r in zip(mains, ref):
            r.grad = torch.randn(r.shape, generator=g).to(device)
            m.grad = r.grad.clone()
        opt.step()
        opt_ref.step()
    for m, r, low in zip(mains, ref, lows):
        torch.testing.assert_close(m, r, rtol=2e-6, atol=1e-7)
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[m][k], opt_ref.state[r][k], rtol=2e-6, atol=1e-7)
        assert opt.state[m]["step"].device == opt_ref.state[r]["step"].device and float(opt.state[m]["step"]) == 4
        if device.type == "cuda":  # round to nearest, as the unfused copy
            assert torch.equal(low, m.to(torch.bfloat16))
        else:
            assert ((low.float() - m).abs() <= m.abs() * BF16_ULP).all()
    assert all(not torch.equal(m, m0) for m, m0 in zip(mains, first))  # the weights moved


@pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")
@pytest.mark.parametrize("cls,wd,maximize,device_step", [c for c in CASES if c[3]])
def test_adam_kernel_matches_torch_interpreted(cls, wd, maximize, device_step):
    _kernel_case(cls, wd, maximize, device_step, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cls,wd,maximize,device_step", CASES)
def test_adam_kernel_matches_torch_cuda(cls, wd, maximize, device_step):
    _kernel_case(cls, wd, maximize, device_step, torch.device("cuda"))


class StepCheck:
    """A callback: before each optimizer step (after backward) it keeps the fp32 weights, the moments and each group's
    hyperparameters; after the step it replays it with torch's own AdamW on copies, from the gradients the step used
    (clipped in place, still attached), and records the largest difference. The bf16 weights must be the fp32 ones
    rounded (truncated under the interpreter)."""

    def __new__(cls, full: bool = False):
        import lightning as L

        class _Check(L.Callback):
            def __init__(self):
                self.worst, self.steps, self.before, self.written = 0.0, 0, None, False
                self.full, self.full_checked = full, 0

            def on_before_optimizer_step(self, trainer, pl_module, optimizer):
                self.before = [(dict((k, v) for k, v in g.items() if k != "params"),
                                [(p.detach().clone(), {k: v.clone() for k, v in optimizer.state.get(p, {}).items()})
                                 for p in g["params"]]) for g in optimizer.param_groups]

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if self.before is None:
                    return
                sharded = trainer.strategy.sharded_optimizer
                self.written = self.written or bool(sharded is not None and sharded._written)
                opt, main = trainer.optimizers[0], trainer.strategy._main_params
                for (hp, kept), group in zip(self.before, opt.param_groups):
                    ps = [p.clone().cpu().requires_grad_(False) for p, _ in kept]
                    ref = torch.optim.AdamW(ps, lr=hp["lr"], betas=hp["betas"], eps=hp["eps"],
                                            weight_decay=hp["weight_decay"], fused=True)
                    for q, (_, st), now in zip(ps, kept, group["params"]):
                        q.grad = now.grad.detach().cpu().clone()
                        if st:
                            ref.state[q] = {k: v.cpu().clone() for k, v in st.items()}
                    ref.step()
                    for q, now in zip(ps, group["params"]):
                        scale = q.abs().max().clamp_min(1e-30)
                        self.worst = max(self.worst, ((now.detach().cpu() - q).abs().max() / scale).item())
                self.steps += 1
                self.before = None
                if main is not None:
                    pairs = [(p, main.main_of(p)) for p in pl_module.parameters() if main.main_of(p) is not p]
                else:  # the sharded optimizer: each fp32 slice against its slice of the bf16 weight
                    sharded = trainer.strategy.sharded_optimizer
                    pairs = [(s.weight(), s.tensor) for s in sharded.device_slots if not s.is_view]
                assert pairs
                if main is None and self.full:  # every rank's whole bf16 weights: the owners' fp32 slices, gathered
                    full = trainer.strategy.sharded_optimizer.full_main_params()
                    for p in pl_module.parameters():
                        if p.dtype == torch.bfloat16:
                            m = full[id(p)].float()
                            assert ((p.float() - m).abs() <= m.abs() * BF16_ULP).all()
                            self.full_checked += 1
                for p, m in pairs:
                    if p.is_cuda:
                        assert torch.equal(p, m.to(p.dtype))
                    else:
                        assert ((p.float() - m).abs() <= m.abs() * BF16_ULP).all()

        return _Check()


def _distributed_rank(rank, world, tokens, root):
    """One of 2 gloo ranks (DP2, EP2, the distributed optimizer) with the fused write-back: every step replayed on
    this rank's slices, and the gathered bf16 weights the fp32 slices' rounding on every rank."""
    import lightning as L

    from lightning_moe import MoEFoldStrategy, MoELanguageModel, TokenDataModule
    check = StepCheck(full=True)
    model = MoELanguageModel(preset="tiny", overrides=dict(seq_length=32, num_layers=2, hidden_size=32,
                                                           num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                                                           moe_ffn_hidden_size=32, num_experts=4, topk=2),
                             lr=1e-2, warmup_steps=1, max_steps=8, log_expert_load=False)
    trainer = L.Trainer(accelerator="cpu", devices=world, precision="bf16-true", max_steps=3, accumulate_grad_batches=2,
                        gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=root, limit_val_batches=0, callbacks=[check],
                        strategy=MoEFoldStrategy(expert_parallel_size=2, distributed_optimizer=True,
                                                 fused_optimizer_writeback=True))
    trainer.fit(model, datamodule=TokenDataModule(path=tokens, seq_length=32, batch_size=4, seed=3))
    return {"worst": check.worst, "steps": check.steps, "written": check.written, "full": check.full_checked}


@pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")
def test_distributed_two_ranks_interpreted(tmp_path):
    from tests.parallel.harness import run_ranks
    from tests.parallel.parity import make_tokens
    res = run_ranks(_distributed_rank, 2, make_tokens(str(tmp_path / "t.bin")), str(tmp_path / "r"),
                    out_dir=str(tmp_path))
    for v in res:
        assert v["steps"] == 3 and v["written"] and v["full"] > 0 and v["worst"] < 1e-6, v


def _trainer_case(tmp_path, **strategy_kw):
    """Through the Trainer (bf16-true, 2 micro-batches, clipping, warmup LR schedule, no decay on norms): each fused
    step equals torch's AdamW replayed on its inputs; the LR scheduler warns of nothing, the step hooks run once per
    step, and the state has torch's keys. ``strategy_kw``: e.g. the distributed optimizer (flat slices)."""
    import lightning as L

    from tests.strategy.test_main_params import _fit

    calls = {"pre": 0, "post": 0}

    class Count(L.Callback):
        def on_train_start(self, trainer, pl_module):
            opt = trainer.optimizers[0]
            opt.register_step_pre_hook(lambda *a: calls.__setitem__("pre", calls["pre"] + 1))
            opt.register_step_post_hook(lambda *a: calls.__setitem__("post", calls["post"] + 1))

    check = StepCheck()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, model = _fit(tmp_path, 3, callbacks=[Count(), check], fused_optimizer_writeback=True, **strategy_kw)
    assert not [w for w in caught if any(k in str(w.message) for k in ("lr_scheduler", "optimizer.step",
                                                                        "fused_optimizer"))]
    opt = trainer.optimizers[0]
    if strategy_kw.get("distributed_optimizer"):
        assert trainer.strategy.sharded_optimizer.fuse_writeback and check.written
    else:
        assert opt.step.__qualname__.startswith("FusedAdamStep")
    assert check.steps == 3 and check.worst < 1e-6, check.worst
    assert calls == {"pre": 3, "post": 3}
    assert all(sorted(s) == ["exp_avg", "exp_avg_sq", "step"] and s["step"].item() == 3 for s in opt.state.values())


@pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")
@pytest.mark.parametrize("kw", [{}, dict(distributed_optimizer=True)], ids=["main_params", "distributed"])
def test_trainer_steps_match_torch_interpreted(tmp_path, kw):
    _trainer_case(tmp_path, **kw)


# ---------------------------------------------------------------------------------------------- where it cannot apply
def _net_and_main(opt_cls=torch.optim.AdamW, **kw):
    net = nn.Linear(8, 4).bfloat16()
    opt = opt_cls(net.parameters(), lr=1e-3, **kw)
    return net, opt, MainParams([opt])


@pytest.mark.skipif(INSIDE, reason="CPU without the interpreter")
@pytest.mark.parametrize("opt_cls,kw,why", [(torch.optim.AdamW, {}, "on cpu, not CUDA"),
                                            (torch.optim.SGD, {}, "SGD, not torch.optim.Adam or AdamW"),
                                            (torch.optim.AdamW, {"amsgrad": True}, "amsgrad=True")])
def test_true_where_it_cannot_apply_is_refused(opt_cls, kw, why):
    net, opt, main = _net_and_main(opt_cls, **kw)
    step = opt.step
    with pytest.raises(ValueError, match=f"fused_optimizer_writeback=True.*{why}"):
        fuse_steps([opt], main, True, torch.device("cpu"))
    fuse_steps([opt], main, None, torch.device("cpu"))  # None: torch's step, and the copy stays
    assert opt.step == step and main._copy == main._low


def test_without_main_params_or_bf16_weights_true_is_refused():
    net = nn.Linear(8, 4)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="no bf16 weight is stepped through an fp32 main copy"):
        fuse_steps([opt], None, True, torch.device("cuda"))


def test_option_values_are_checked():
    with pytest.raises(ValueError, match="fused_optimizer_writeback='yes'.*True, False or None"):
        MoEFoldStrategy(fused_optimizer_writeback="yes")
    assert MoEFoldStrategy(fused_optimizer_writeback=False).optimizer_options.fused_optimizer_writeback is False


@pytest.mark.skipif(INSIDE, reason="CPU without the interpreter")
@pytest.mark.parametrize("kw,why", [(dict(distributed_optimizer=True), "on cpu, not CUDA"),
                                    (dict(exp_avg_dtype="bf16"), "moments are kept in bf16"),
                                    (dict(optimizer_cpu_offload=1.0), "whole optimizer is on the host")])
def test_true_where_the_sharded_optimizer_cannot_fuse_is_refused(tmp_path, kw, why, monkeypatch):
    from lightning_moe.modules import kernels
    from tests.strategy.test_main_params import _fit
    if "cpu" not in why:  # past the device check, to reach the sharded optimizer's own reasons
        monkeypatch.setattr(kernels, "interpreting", lambda: True)
        monkeypatch.setattr(kernels, "load", lambda *a, **k: object())
    with pytest.raises(ValueError, match=f"fused_optimizer_writeback=True\\) cannot apply: .*{why}"):
        _fit(tmp_path, 1, fused_optimizer_writeback=True, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kw", [{}, dict(distributed_optimizer=True), dict(distributed_optimizer=True,
                                                                           optimizer_cpu_offload=0.5)],
                         ids=["main_params", "distributed", "distributed_half_offloaded"])
def test_trainer_steps_match_torch_cuda(tmp_path, kw):
    """On the GPU the fused step is the default: each step against torch's AdamW replayed on its inputs, and the bf16
    weights the fp32 ones rounded to nearest, bit for bit (with the distributed optimizer: the device slices; the
    host half steps on the CPU)."""
    from tests.test_gpu_optimizer import _fit
    check = StepCheck(full=bool(kw))
    trainer, _ = _fit(tmp_path, steps=4, callbacks=[check], **kw)
    if kw:
        assert trainer.strategy.sharded_optimizer.fuse_writeback and check.written and check.full_checked
    else:
        assert trainer.optimizers[0].step.__qualname__.startswith("FusedAdamStep")
    assert check.steps == 4 and check.worst < 1e-6, check.worst


@pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")
def test_a_step_the_kernel_cannot_take_runs_torchs_interpreted():
    """A non-contiguous gradient: that step is torch's own AdamW and the copy, with one warning naming why."""
    from lightning_moe.strategy.fused_adam import FusedAdamStep
    g = torch.Generator().manual_seed(0)
    main, ref = torch.randn(6, 5, generator=g), None
    ref = main.clone()
    low = main.to(torch.bfloat16)
    opt = torch.optim.AdamW([main], lr=1e-2, weight_decay=0.1)
    opt_ref = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1)
    FusedAdamStep(opt, {id(main): low})
    ref.grad = torch.randn(5, 6, generator=g).t()
    main.grad = ref.grad.clone().t().contiguous().t()  # the same values, not contiguous
    with pytest.warns(UserWarning, match="not a contiguous fp32 tensor"):
        opt.step()
    opt_ref.step()
    assert torch.equal(main, ref) and torch.equal(low, main.to(torch.bfloat16))
