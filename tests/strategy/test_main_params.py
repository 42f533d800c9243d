"""fp32 main grads and main params for bf16 weights (Megatron's mixed precision): exact against an fp32 reference."""

import lightning as L
import pytest
import torch
from torch import nn

from lightning_moe import MoEFoldStrategy, MoELanguageModel, TokenDataModule
from lightning_moe.strategy.grad_sync import GradSync
from lightning_moe.strategy.main_params import MainParams
from lightning_moe.strategy.parallel_context import ParallelContext


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16).bfloat16()
        self.b = nn.Linear(16, 4).bfloat16()
        self.unused = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
        self.gate = nn.Parameter(torch.randn(4, 8))  # an fp32 param among bf16 ones, like the router

    def forward(self, x):
        return (self.b(torch.relu(self.a(x))).float() + x.float() @ self.gate.T).square().mean()


def test_fp32_accumulation_step_and_writeback_are_exact():
    torch.manual_seed(0)
    net, ref = _Net(), _Net()
    ref.load_state_dict(net.state_dict())
    micro = [torch.randn(5, 8, dtype=torch.bfloat16) for _ in range(3)]
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, foreach=False)
    main = MainParams([opt])
    sync = GradSync(net.parameters(), ParallelContext.single(), main_grads=True)

    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
    assert main.main_of(net.gate) is net.gate  # fp32 params are their own main copy
    names = [n for n, _ in net.named_parameters()]
    ref_main = [m.detach().clone().requires_grad_() for m in main.main_params]
    ref_opt = torch.optim.AdamW(ref_main, lr=1e-2, foreach=False)
    for step in range(2):  # the second step checks that accumulation restarts (no stale main grads)
        ref.load_state_dict(net.state_dict())
        # reference: each micro-batch's bf16 gradients, summed in fp32
        want = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in ref.named_parameters()}
        for i, x in enumerate(micro):
            for n, g in zip(names, torch.autograd.grad(ref(x), list(ref.parameters()), allow_unused=True)):
                if g is not None:
                    want[n] += g.float()
            if i == len(micro) - 1:
                sync.arm()
            net(x).backward()
        sync.finish()
        for n, p in net.named_parameters():
            assert p.grad is None, f"{n}: the low-precision grad must be freed after accumulation"
            if n != "unused":
                assert torch.equal(p.main_grad, want[n]), n
        main.attach_grads(sync.had_main_grad)
        assert main.main_of(net.unused).grad is None  # never used: stays None, not a stale or zero gradient
        opt.step()
        opt.zero_grad()
        main.copy_to_model()

        for rm, n in zip(ref_main, names):  # the fp32 reference step on the same fp32 weights and gradients
            rm.grad = want[n] if n != "unused" else None
        ref_opt.step()
        for rm, m, (n, p) in zip(ref_main, main.main_params, net.named_parameters()):
            assert torch.equal(m, rm.detach()), n
            assert torch.equal(p, rm.detach().to(p.dtype)), f"{n}: model weight is not the rounded main weight"
    assert torch.equal(net.unused, torch.ones(3, dtype=torch.bfloat16))


def test_low_precision_accumulation_would_differ():
    # the point of main grads: summing many small bf16 gradients in bf16 loses them
    g = torch.full((4,), 1e-3, dtype=torch.bfloat16)
    acc_bf16, acc_fp32 = torch.ones(4, dtype=torch.bfloat16), torch.ones(4)
    for _ in range(64):
        acc_bf16 += g
        acc_fp32 += g.float()
    assert torch.equal(acc_bf16, torch.ones(4, dtype=torch.bfloat16)) and (acc_fp32 > 1.06).all()


def test_zero_grad_discards_accumulated_main_grads():
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sync = GradSync(net.parameters(), ParallelContext.single(), main_grads=True)
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    net(x).backward()
    once = net.a.weight.main_grad.clone()
    net(x).backward()
    assert torch.equal(net.a.weight.main_grad, 2 * once)
    sync.discard()  # what the strategy's zero_grad wrapper calls
    net(x).backward()
    assert torch.equal(net.a.weight.main_grad, once)
    del opt


def _fit(tmp_path, max_steps, ckpt_path=None, callbacks=(), lr=1e-2, accumulate=2, **strategy_kw):
    from tests.parallel.parity import make_tokens
    tokens = make_tokens(str(tmp_path / "tokens.bin"))
    model = MoELanguageModel(preset="tiny", overrides=dict(seq_length=32, num_layers=2, hidden_size=32,
                                                           num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                                                           moe_ffn_hidden_size=32, num_experts=4, topk=2),
                             lr=lr, warmup_steps=1, max_steps=8, log_expert_load=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=MoEFoldStrategy(**strategy_kw), precision="bf16-true",
                        max_steps=max_steps, accumulate_grad_batches=accumulate, gradient_clip_val=1.0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path), num_sanity_val_steps=0, limit_val_batches=0,
                        callbacks=list(callbacks))
    trainer.fit(model, datamodule=TokenDataModule(path=tokens, seq_length=32, batch_size=4, seed=3),
                ckpt_path=ckpt_path)
    return trainer, model


def test_bf16_true_trains_with_fp32_main_params_and_checkpoints_them(tmp_path):
    trainer, model = _fit(tmp_path, 4)
    main = trainer.strategy._main_params
    assert main is not None
    opt = trainer.optimizers[0]
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
    w = model.model.layers[0].ffn.experts.w13
    assert w.dtype == torch.bfloat16 and torch.equal(w, main.main_of(w).to(torch.bfloat16))
    assert not torch.equal(main.main_of(w), main.main_of(w).to(torch.bfloat16).float())  # fp32 bits beyond bf16
    assert model.model.layers[0].ffn.router.weight.dtype == torch.float32

    path = str(tmp_path / "ckpt")
    trainer.save_checkpoint(path)
    saved = {n: main.main_of(p).clone() for n, p in model.named_parameters()}
    sd = trainer.strategy.lightning_module_state_dict()
    assert sd["model.layers.0.ffn.experts.w13"].dtype == torch.float32
    assert torch.equal(sd["model.layers.0.ffn.experts.w13"], saved["model.layers.0.ffn.experts.w13"])

    # resume: the fp32 main weights come back bit for bit (not re-derived from the bf16 weights)
    trainer2, model2 = _fit(tmp_path, 4, ckpt_path=path)
    main2 = trainer2.strategy._main_params
    for n, p in model2.named_parameters():
        assert torch.equal(main2.main_of(p), saved[n]), n
        assert torch.equal(p, saved[n].to(p.dtype)), n


def test_weights_written_at_train_start_are_kept(tmp_path):
    # e.g. a callback that loads pretrained weights: the main copies adopt them instead of overwriting them
    class Load(L.Callback):
        def on_train_start(self, trainer, pl_module):
            with torch.no_grad():
                pl_module.model.layers[0].ffn.experts.w13.fill_(0.5)

    trainer, model = _fit(tmp_path, 1, callbacks=[Load()], lr=1e-6)
    w = model.model.layers[0].ffn.experts.w13
    assert abs(w.float().mean().item() - 0.5) < 1e-3
    assert abs(trainer.strategy._main_params.main_of(w).mean().item() - 0.5) < 1e-3


def test_teardown_releases_main_grad_buffers(tmp_path):
    trainer, model = _fit(tmp_path, 1)
    assert not any(hasattr(p, "main_grad") for p in model.parameters())


def test_opt_out_keeps_plain_bf16(tmp_path):
    trainer, model = _fit(tmp_path, 2, fp32_main_params=False)
    assert trainer.strategy._main_params is None
    w = model.model.layers[0].ffn.experts.w13
    assert any(p is w for g in trainer.optimizers[0].param_groups for p in g["params"])
    assert not hasattr(w, "main_grad")


def test_main_params_refuse_an_optimizer_with_state():
    p = nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones_like(p)
    opt.step()
    with pytest.raises(RuntimeError, match="already has state"):
        MainParams([opt])
