"""GPU paths (skipped without CUDA): a dropless training step with no host-device sync, and bf16-mixed training."""

from __future__ import annotations

import lightning as L
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

OVR = dict(seq_length=256, hidden_size=256, num_layers=2, num_attention_heads=4, num_kv_heads=2,
           ffn_hidden_size=512, moe_ffn_hidden_size=256, num_experts=8, topk=2, vocab_size=512, z_loss_coeff=1e-3)


@pytest.mark.parametrize("extra", [
    dict(),
    dict(load_balancing="global_aux_loss"),
    dict(score_function="sigmoid", expert_bias=True, load_balancing="seq_aux_loss", num_groups=4, group_topk=2,
         shared_expert_ffn_size=256, first_k_dense=1),
    dict(capacity_factor=1.0, pad_to_capacity=True),
    dict(compile_router=True, router_fusion=False, load_balancing="seq_aux_loss"),
    dict(router_fusion=False, permute_fusion=False),
    dict(expert_rows_align=16, capacity_factor=1.0),
], ids=["softmax_aux", "global_aux", "dsv3_like", "padded_capacity", "compiled_router", "unfused", "fp8_aligned"])
def test_training_step_has_no_host_sync(extra):
    from lightning_moe.modules.lm import MoELanguageModel
    from lightning_moe.strategy.grad_sync import clip_grad_norm_global_
    lm = MoELanguageModel(preset="tiny", overrides={**OVR, **extra})
    lm.configure_model()
    model = lm.model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    tokens = torch.randint(0, 512, (4, 257), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, aux = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()) + aux
        loss.backward()
        clip_grad_norm_global_(list(model.parameters()), 1.0, lm.parallel_context)
        for moe in model.moe_layers():
            moe.router.update_expert_bias()
            moe.router.reset_global_aux_state()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(2):  # warm up: allocator, lazy inits, cuBLAS handles
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            loss = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item()


def test_bf16_main_params_step_has_no_host_sync():
    # the bf16-true path of MoEFoldStrategy: fp32 main-grad accumulation hooks, global-norm clip on the main grads,
    # fused AdamW on the fp32 main params, write-back to the bf16 weights
    from lightning_moe.modules.lm import MoELanguageModel
    from lightning_moe.strategy.grad_sync import GradSync, clip_grad_norm_global_
    from lightning_moe.strategy.main_params import MainParams
    lm = MoELanguageModel(preset="tiny", overrides=OVR)
    lm.configure_model()
    model = lm.model.cuda().bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    main = MainParams([opt])
    sync = GradSync(model.parameters(), lm.parallel_context, main_grads=True)
    tokens = torch.randint(0, 512, (4, 257), device="cuda")

    def step():
        for i in range(2):  # two micro-batches
            if i == 1:
                sync.arm()
            logits, aux = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()) + aux
            loss.backward()
        sync.finish()
        main.attach_grads(sync.had_main_grad)
        clip_grad_norm_global_(main.main_params, 1.0, lm.parallel_context)
        opt.step()
        opt.zero_grad(set_to_none=True)
        main.copy_to_model()
        return loss

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item()
    w = model.layers[1].ffn.experts.w13
    assert torch.equal(w, main.main_of(w).bfloat16())


def test_bf16_mixed_training_loss_falls(tmp_path):
    import numpy as np

    from lightning_moe import MoEFoldStrategy, MoELanguageModel, TokenDataModule
    from lightning_moe.data import write_tokens
    rng = np.random.default_rng(0)
    base = rng.integers(0, 512, size=97)
    tokens = write_tokens(str(tmp_path / "t.bin"), np.tile(base, 2000).astype(np.uint16))
    losses = []

    class Rec(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    # bf16-true under moe_fold: bf16 weights with fp32 main grads and params (MainParams)
    for strategy, precision in (("auto", "bf16-mixed"), (MoEFoldStrategy(), "bf16-mixed"),
                                (MoEFoldStrategy(), "bf16-true")):
        losses.clear()
        trainer = L.Trainer(accelerator="gpu", devices=1, strategy=strategy, precision=precision, max_steps=40,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False, callbacks=[Rec()],
                            limit_val_batches=0, gradient_clip_val=1.0)
        model = MoELanguageModel(preset="tiny", overrides=OVR, lr=3e-3, warmup_steps=5)
        trainer.fit(model, datamodule=TokenDataModule(path=tokens, seq_length=256, batch_size=4))
        assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, (precision, losses)
        if precision == "bf16-true":
            assert trainer.strategy._main_params is not None
            assert all(p.dtype == torch.float32 for g in trainer.optimizers[0].param_groups for p in g["params"])


@pytest.mark.parametrize("extra", [dict(), dict(score_function="sigmoid", expert_bias=True, num_groups=4, group_topk=2,
                                            capacity_factor=1.0, load_balancing="seq_aux_loss")])
def test_compiled_router_matches_eager(extra):
    from lightning_moe import ModelConfig
    from lightning_moe.modules.init import init_weights
    from lightning_moe.modules.router import TopKRouter
    outs = []
    for compiled in (False, True):
        cfg = ModelConfig(hidden_size=256, num_experts=8, topk=2, z_loss_coeff=1e-3, compile_router=compiled,
                          router_fusion=False, **extra)  # the compiled reference (the fused one: test_gpu_fused.py)
        router = TopKRouter(cfg).cuda()
        init_weights(router, 3)
        x = torch.randn(4 * 128, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        r = router(x, num_sequences=4)
        (r.probs_TK.sum() + r.aux_loss + r.z_loss).backward()
        outs.append((r.probs_TK.detach(), r.experts_TK, r.aux_loss.detach(), r.z_loss.detach(), router.weight.grad))
    for a, b in zip(*outs):
        if a.dtype == torch.int64:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_sharded_checkpoint_round_trip_on_gpu(tmp_path):
    """MoEFoldStrategy on one GPU (NCCL), bf16-true with fp32 main params: the DCP checkpoint written by
    ModelCheckpoint restores the bf16 weights, the fp32 main weights and Adam's state bit for bit."""
    import numpy as np
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_moe import MoEFoldStrategy, MoELanguageModel, TokenDataModule
    from lightning_moe.data import write_tokens
    tokens = write_tokens(str(tmp_path / "t.bin"), np.random.default_rng(0).integers(0, 512, 40000), "uint16")

    def fit(steps, ckpt_path=None, save=False):
        model = MoELanguageModel(preset="tiny", overrides=OVR, seed=3 if ckpt_path is None else 4)
        cb = [ModelCheckpoint(dirpath=tmp_path / "ck", filename="last", every_n_train_steps=2)] if save else []
        trainer = L.Trainer(accelerator="gpu", devices=1, strategy=MoEFoldStrategy(), precision="bf16-true",
                            max_steps=steps, logger=False, enable_progress_bar=False, limit_val_batches=0,
                            callbacks=cb, enable_checkpointing=save, enable_model_summary=False)
        trainer.fit(model, datamodule=TokenDataModule(path=tokens, seq_length=256, batch_size=2), ckpt_path=ckpt_path)
        opt = trainer.optimizers[0]
        return ({k: v.detach().cpu().clone() for k, v in model.model.state_dict().items()},
                [p.detach().cpu().clone() for g in opt.param_groups for p in g["params"]],
                [{k: v.cpu().clone() for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]])

    weights, mains, state = fit(2, save=True)
    weights2, mains2, state2 = fit(2, ckpt_path=str(tmp_path / "ck" / "last.ckpt"))  # restores, trains 0 steps
    assert all(torch.equal(v, weights2[k]) for k, v in weights.items())
    assert all(torch.equal(a, b) for a, b in zip(mains, mains2)) and mains[0].dtype == torch.float32
    assert all(torch.equal(a[k], b[k]) for a, b in zip(state, state2) for k in a) and state[0]


def test_trainer_loop_has_no_host_sync(tmp_path):
    """Whole Trainer steps on one GPU, once warm: bf16-true with fp32 main params, gradient clipping, accumulation,
    the progress bar, ``MoEThroughput`` and ``ExpertLoadMonitor`` with progress-bar values, and ``sync_dist``
    logging make no synchronising CUDA call but the expert-load report's (``torch.cuda.set_sync_debug_mode``), so
    the host runs ahead of the GPU through data loading and Lightning's hooks. The bar's ``loss`` is a recent step's
    mean loss."""
    import warnings

    import numpy as np

    from lightning_moe import MoEFoldStrategy, MoELanguageModel, TokenDataModule
    from lightning_moe.callbacks import ExpertLoadMonitor, MoEThroughput
    from lightning_moe.data import write_tokens
    tokens = write_tokens(str(tmp_path / "t.bin"), np.random.default_rng(0).integers(0, 512, 80000), "uint16")
    lm_losses = []

    class Watch(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 4:  # warm: the first steps allocate, compile and build the optimizer state
                torch.cuda.set_sync_debug_mode("warn")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            lm_losses.append(outputs["lm_loss"])

        def on_train_end(self, trainer, pl_module):
            torch.cuda.set_sync_debug_mode(0)

    callbacks = [Watch(), MoEThroughput(log_every_n_steps=2, warmup_steps=1),
                 ExpertLoadMonitor(every_n_steps=2, prog_bar=True)]
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=MoEFoldStrategy(), precision="bf16-true",
                        max_steps=8, accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False,
                        limit_val_batches=0, callbacks=callbacks, enable_checkpointing=False,
                        enable_model_summary=False)
    model = MoELanguageModel(preset="tiny", overrides=OVR, log_expert_load=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=TokenDataModule(path=tokens, seq_length=256, batch_size=2))
    torch.cuda.set_sync_debug_mode(0)
    syncs = [f"{w.filename}:{w.lineno}" for w in seen if "synchronizing" in str(w.message)]
    # the one deliberate sync: ExpertLoadMonitor copies its bar value to the host when it reports (every 2 steps);
    # seeing it also shows that the watch works
    assert any("expert_load.py" in s for s in syncs), syncs
    assert not [s for s in syncs if "expert_load.py" not in s], syncs
    assert trainer.global_step == 8 and "perf/tokens_per_sec" in trainer.progress_bar_metrics
    # the bar shows a recent optimizer step's loss: the mean of its 2 micro-batches (as train_loss), usually a step late
    last = [x.item() for x in lm_losses[-6:]]  # the last 3 steps' micro-batches
    step_means = [(last[i] + last[i + 1]) / 2 for i in (0, 2, 4)]
    assert any(abs(trainer.progress_bar_metrics["loss"] - m) <= 1e-6 * abs(m) for m in step_means), step_means


@pytest.mark.parametrize("main_params,fp8,fusion", [(True, False, False), (False, False, False), (True, True, False),
                                                    (True, False, True), (True, True, True), (True, False, "defer"),
                                                    (True, True, "defer")])
def test_cuda_graphs_match_eager(tmp_path, main_params, fp8, fusion):
    """MoEFoldStrategy(cuda_graphs=True) against eager, the same seed and data, bf16-true: 6 optimizer steps of 2
    micro-batches (gradients accumulate through the graphs' static gradient buffers: into fp32 main grads, or, without
    main params, into param.grad through copies), with clipping, validation in eval mode (eager) in between,
    DeepSeek-style routing (expert bias updated from the graphed counters), a shared expert and a dense first layer.
    float32 weights are refused before training: torch's float32 grouped GEMM cannot be captured. ``fp8``: under
    FP8Training("rowwise"), whose cached FP8 weights the graphs read where they were captured: they must be rewritten
    there with each step's weights (checked at every batch start). ``fusion``: gradient-accumulation fusion, whose
    captured wgrad GEMMs add into main grads zeroed at each step's zero_grad; ``"defer"``: with the experts' bf16
    wgrad deferred to the step's last micro-batch (the strategy's option; FP8Training's with ``fp8_wgrad=False``),
    whose captured operands stay with one copy of the graphs per micro-batch."""
    from lightning_moe import FP8Training
    from lightning_moe.modules import fp8_linear
    import numpy as np

    from lightning_moe import MoEFoldStrategy, MoELanguageModel, TokenDataModule
    from lightning_moe.data import write_tokens
    tokens = write_tokens(str(tmp_path / "t.bin"), np.random.default_rng(0).integers(0, 512, 80000), "uint16")
    ovr = {**OVR, "score_function": "sigmoid", "expert_bias": True, "num_groups": 4, "group_topk": 2,
           "shared_expert_ffn_size": 256, "first_k_dense": 1, "load_balancing": "seq_aux_loss", "num_layers": 3}

    def fit(graphs):
        losses, graphed = [], []

        defer = fusion == "defer"
        fp8_cb = (FP8Training("rowwise", fp8_wgrad=False, defer_expert_wgrad=True) if defer else
                  FP8Training("rowwise")) if fp8 else None
        cached = {}  # (spec, operand) -> the cached tensors' addresses at their first check

        class Rec(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # after FP8Training's (listed first)
                for spec in fp8_cb._cached if fp8 and graphs else []:  # eager: refreshed lazily, at first use
                    for name, (step, _, out, make) in spec.weights.items():
                        assert step == trainer.global_step
                        for kept, fresh in zip(fp8_linear._leaves(out), fp8_linear._leaves(make()), strict=True):
                            assert torch.equal(kept, fresh), name  # the current weights' quantization
                        ptrs = [t.data_ptr() for t in fp8_linear._leaves(out)]
                        assert cached.setdefault((id(spec), name), ptrs) == ptrs, name  # where it was captured

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                losses.append(outputs["lm_loss"].detach().clone())
                graphed.append("forward" in vars(pl_module.model.layers[1]))

            def on_train_end(self, trainer, pl_module):  # what the fusion covered, before the graphs are released
                sync = trainer.strategy._grad_sync
                fused.extend([len(sync.fused_params), len(sync._graphed), len(sync._copies),
                              {c.size for c in sync._copies.values()}])

        trainer = L.Trainer(accelerator="gpu", devices=1,
                            strategy=MoEFoldStrategy(cuda_graphs=graphs, fp32_main_params=main_params,
                                                     gradient_accumulation_fusion=None if fusion else False,
                                                     defer_expert_wgrad=defer and not fp8),
                            precision=precision, max_steps=6, accumulate_grad_batches=2, gradient_clip_val=1.0,
                            val_check_interval=4, limit_val_batches=2, num_sanity_val_steps=0, logger=False,
                            enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                            callbacks=([fp8_cb] if fp8 else []) + [Rec()])
        fused = []
        model = MoELanguageModel(preset="tiny", overrides=ovr, seed=3, lr=3e-3, warmup_steps=1)
        trainer.fit(model, datamodule=TokenDataModule(path=tokens, seq_length=256, batch_size=2))
        state = {k: v.detach().float().cpu() for k, v in model.model.state_dict().items()}
        if fp8 and graphs:
            assert cached, "no cached FP8 weight was checked"
        # the fusion ran where asked, and in the graphs it was captured; the deferred wgrad kept its operands with
        # one graph copy per micro-batch
        assert (fused[0] > 0) == bool(fusion) and (fused[1] > 0) == bool(fusion and graphs), fused
        assert (fused[2] > 0) == (defer and graphs) and fused[3] == ({2} if defer and graphs else set()), fused
        return torch.stack(losses).float().cpu(), state, graphed, trainer.callback_metrics["val_loss"].item()

    precision = "32-true"
    if not fp8:
        with pytest.raises(ValueError, match="needs bf16 expert weights"):
            fit(True)
    precision = "bf16-true"
    loss_e, state_e, graphed_e, val_e = fit(False)
    loss_g, state_g, graphed_g, val_g = fit(True)
    assert not any(graphed_e) and all(graphed_g) and len(loss_g) == 12
    torch.testing.assert_close(loss_g, loss_e, rtol=2e-3, atol=0)
    assert val_g == pytest.approx(val_e, rel=2e-3)
    worst = max(((state_g[k] - v).norm() / v.norm().clamp_min(1e-12)).item() for k, v in state_e.items())
    print(f"main_params={main_params} fp8={fp8} fusion={fusion}: max |loss diff| "
          f"{(loss_g - loss_e).abs().max().item():.3g}, val {abs(val_g - val_e):.3g}, worst param rel-norm diff "
          f"{worst:.3g}")
    assert worst < 2e-2, worst
    assert not torch.equal(state_e["layers.1.ffn.router.expert_bias"], torch.zeros(8))  # the bias did move


def test_cuda_graphs_fp8_cache_after_the_sanity_check(tmp_path):
    """FP8 under CUDA graphs with Lightning's sanity check on: the check validates under ``inference_mode`` before the
    capture, making the cached FP8 weights there; each later step rewrites them in place (an inference tensor could
    not be written), and at every batch start they equal a fresh quantization of the current weights."""
    import numpy as np

    from lightning_moe import FP8Training, MoEFoldStrategy, MoELanguageModel, TokenDataModule
    from lightning_moe.data import write_tokens
    from lightning_moe.modules import fp8_linear
    tokens = write_tokens(str(tmp_path / "t.bin"), np.random.default_rng(0).integers(0, 512, 40000), "uint16")
    cb, checked = FP8Training("rowwise"), []

    class Check(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # after FP8Training's (listed first)
            for spec in cb._cached:
                for name, (step, _, out, make) in spec.weights.items():
                    assert step == trainer.global_step and not any(t.is_inference() for t in fp8_linear._leaves(out))
                    assert all(torch.equal(a, b) for a, b in zip(fp8_linear._leaves(out), fp8_linear._leaves(make())))
                    checked.append(name)

    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=MoEFoldStrategy(cuda_graphs=True),
                        precision="bf16-true", max_steps=3, accumulate_grad_batches=2, num_sanity_val_steps=2,
                        limit_val_batches=2, val_check_interval=2, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, callbacks=[cb, Check()])
    model = MoELanguageModel(preset="tiny", overrides=OVR, seed=3, lr=3e-3, warmup_steps=1)
    trainer.fit(model, datamodule=TokenDataModule(path=tokens, seq_length=256, batch_size=2))
    assert checked and trainer.global_step == 3 and torch.isfinite(trainer.callback_metrics["val_loss"])


def test_cuda_graphs_deferral_windows_and_unfinished_steps_match_eager(tmp_path):
    """The deferred wgrad in graphs with a window smaller than the step (2 of 4 micro-batches: graph copies 0, 1, 0,
    1), epochs of 10 batches (a short last step of 2), and a step left mid-window: the module's
    ``on_train_batch_start`` returns -1 at batch 7 of epoch 1, which skips the rest of the epoch with no optimizer
    step, so epoch 2's zero_grad drops batches 4-6, whose replays filled copies 0, 1 (a pass) and 0. Each step's first
    micro-batch must replay copy 0, and losses and weights are eager's."""
    import numpy as np

    from lightning_moe import MoEFoldStrategy, MoELanguageModel, TokenDataModule
    from lightning_moe.data import write_tokens
    tokens = write_tokens(str(tmp_path / "t.bin"), np.random.default_rng(0).integers(0, 512, 80000), "uint16")

    def fit(graphs):
        losses, copies = [], []

        class Rec(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                losses.append(outputs["lm_loss"].detach().float().cpu())
                if graphs and batch_idx % 4 == 0:  # a step's first micro-batch: copy 0 replayed, 1 filled
                    copies.append((trainer.current_epoch, batch_idx,
                                   max(c.filled for c in trainer.strategy._grad_sync._copies.values())))

        trainer = L.Trainer(accelerator="gpu", devices=1, precision="bf16-true", max_steps=7,
                            strategy=MoEFoldStrategy(cuda_graphs=graphs, defer_expert_wgrad=2),
                            accumulate_grad_batches=4, limit_train_batches=10, gradient_clip_val=1.0,
                            limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_progress_bar=False,
                            enable_checkpointing=False, enable_model_summary=False, callbacks=[Rec()])
        model = MoELanguageModel(preset="tiny", overrides={**OVR, "num_layers": 3}, seed=3, lr=3e-3, warmup_steps=1)
        # the module's -1 (a callback's is ignored): batches 4-6 of epoch 1 never reach an optimizer step
        model.on_train_batch_start = lambda batch, i: -1 if (trainer.current_epoch, i) == (1, 7) else None
        trainer.fit(model, datamodule=TokenDataModule(path=tokens, seq_length=256, batch_size=2))
        state = {k: v.detach().float().cpu() for k, v in model.model.state_dict().items()}
        return torch.stack(losses), state, trainer.global_step, copies

    loss_e, state_e, steps_e, _ = fit(False)
    loss_g, state_g, steps_g, copies = fit(True)
    print("first micro-batches (epoch, batch, copies filled):", copies)
    assert steps_e == steps_g == 7 and {c[2] for c in copies} == {1}, copies
    assert [c[:2] for c in copies] == [(0, 0), (0, 4), (0, 8), (1, 0), (1, 4), (2, 0), (2, 4), (2, 8)], copies
    torch.testing.assert_close(loss_g, loss_e, rtol=2e-3, atol=0)
    worst = max(((state_g[k] - v).norm() / v.norm().clamp_min(1e-12)).item() for k, v in state_e.items())
    print(f"windows of 2 of 4, short and unfinished steps: max |loss diff| {(loss_g - loss_e).abs().max().item():.3g},"
          f" worst param rel-norm diff {worst:.3g}")
    assert worst < 2e-2, worst
