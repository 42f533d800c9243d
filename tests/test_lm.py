"""ModelConfig presets and validation, MoETransformer layer placement, and short Lightning training runs."""

from __future__ import annotations

import csv
import glob
import math
import os
import warnings

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_moe.data import TokenDataModule, write_tokens
from lightning_moe.modules.config import PRESETS, ModelConfig
from lightning_moe.modules.experts import SwiGLU
from lightning_moe.modules.lm import MoELanguageModel, warmup_cosine
from lightning_moe.modules.moe_layer import MoELayer
from lightning_moe.modules.transformer import MoETransformer

# ------------------------------------------------------------------------------------------ presets
# (hidden, layers, heads, kv heads, experts, topk, moe ffn, vocab) from each model's published config.json
PUBLISHED = {
    "tiny": (64, 2, 4, 2, 8, 2, 128, 256),
    "mixtral-8x7b": (4096, 32, 32, 8, 8, 2, 14336, 32000),
    "qwen3-30b-a3b": (2048, 48, 32, 4, 128, 8, 768, 151936),
    "deepseek-v3": (7168, 61, 128, 128, 256, 8, 2048, 129280),
}


def key_fields(c: ModelConfig) -> tuple:
    return (c.hidden_size, c.num_layers, c.num_attention_heads, c.num_kv_heads, c.num_experts, c.topk,
            c.moe_ffn_hidden_size, c.vocab_size)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_published_shapes(name):
    assert set(PRESETS) == set(PUBLISHED)
    c = ModelConfig.from_preset(name)
    assert key_fields(c) == PUBLISHED[name]
    if name == "mixtral-8x7b":
        assert (c.ffn_hidden_size, c.rope_theta, c.norm_eps, c.score_function) == (14336, 1e6, 1e-5, "softmax")
        assert c.num_moe_layers == 32 and c.head_dim == 128 and not c.qk_norm
    if name == "qwen3-30b-a3b":
        assert c.head_dim == 128 and c.qk_norm and c.num_moe_layers == 48 and c.rope_theta == 1e6
    if name == "deepseek-v3":
        assert c.first_k_dense == 3 and c.num_moe_layers == 58
        assert c.shared_expert_ffn_size == 2048
        assert c.score_function == "sigmoid" and c.expert_bias
        assert (c.num_groups, c.group_topk, c.topk_scaling_factor) == (8, 4, 2.5)
        assert c.load_balancing == "seq_aux_loss" and c.aux_loss_coeff == 1e-4
        assert c.attention_type == "mla" and (c.q_lora_rank, c.kv_lora_rank) == (1536, 512)
        assert c.head_dim == 128 + 64 and c.v_head_dim == 128 and c.ffn_hidden_size == 18432
    if name == "tiny":
        assert c.ffn_hidden_size == 256 and c.z_loss_coeff == 1e-3 and c.seq_length == 128


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_shrinking_overrides(name):
    c = ModelConfig.from_preset(name, num_layers=2, vocab_size=32768)
    full = ModelConfig.from_preset(name)
    assert (c.num_layers, c.vocab_size) == (2, 32768)
    # everything else is kept
    assert key_fields(c)[2:7] == key_fields(full)[2:7] and c.hidden_size == full.hidden_size
    assert c.first_k_dense <= 1  # shrinking keeps at least one MoE layer
    assert c.num_moe_layers >= 1
    if name == "deepseek-v3":
        assert c.first_k_dense == 1 and [c.is_moe_layer(i) for i in range(2)] == [False, True]
        # an explicit first_k_dense is honoured
        assert ModelConfig.from_preset(name, num_layers=4, first_k_dense=2).first_k_dense == 2
        assert ModelConfig.from_preset(name, num_layers=8).first_k_dense == 3


@pytest.mark.parametrize("make,word", [
    (lambda: ModelConfig.from_preset("gpt-5"), "gpt-5"),
    (lambda: ModelConfig.from_preset("tiny", num_layerz=3), "num_layerz"),
    (lambda: ModelConfig(dispatcher="nccl"), "dispatcher"),
    (lambda: ModelConfig(score_function="relu"), "score_function"),
    (lambda: ModelConfig(num_experts=4, topk=5), "topk"),
    (lambda: ModelConfig(capacity_factor=0.0), "capacity_factor"),
    (lambda: ModelConfig(capacity_factor=-1.0), "capacity_factor"),
    (lambda: ModelConfig(num_experts=8, topk=3, num_groups=4, group_topk=2), "group_topk"),
    (lambda: ModelConfig(num_experts=8, topk=2, num_groups=4), "group_topk"),
    (lambda: ModelConfig(pad_to_capacity=True), "pad_to_capacity"),
    (lambda: ModelConfig(num_attention_heads=4, num_kv_heads=3), "num_kv_heads"),
    (lambda: ModelConfig(num_experts=6, num_groups=4, group_topk=2), "num_groups"),
    (lambda: ModelConfig(expert_bias=True), "expert_bias"),
    (lambda: ModelConfig(num_layers=2, moe_layer_freq=[1, 0, 1]), "moe_layer_freq"),
    (lambda: ModelConfig(num_layers=2, first_k_dense=3), "first_k_dense"),
])
def test_bad_config_names_the_field(make, word):
    with pytest.raises(ValueError, match=word):
        make()


@pytest.mark.parametrize("kwargs,word", [
    (dict(num_attention_heads=4, num_kv_heads=0), "num_kv_heads"),
    (dict(num_attention_heads=4, num_kv_heads=-2), "num_kv_heads"),
    (dict(head_dim=0), "head_dim"),
])
def test_bad_head_shapes_raise_value_error(kwargs, word):
    with pytest.raises(ValueError, match=word):
        ModelConfig(**kwargs)


def test_lm_module_rejects_bad_arguments():
    with pytest.raises(ValueError, match="either config or preset"):
        MoELanguageModel(config=ModelConfig(), preset="tiny")
    with pytest.raises(ValueError, match="lr"):
        MoELanguageModel(preset="tiny", lr=0.0)
    with pytest.raises(ValueError, match="unknown preset"):
        MoELanguageModel(preset="nope")


# ------------------------------------------------------------------------------------------ transformer
SMALL = dict(seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
             num_experts=4, moe_ffn_hidden_size=32, vocab_size=64)


def test_transformer_forward_shapes_and_loss():
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("tiny", **SMALL)
    model = MoETransformer(cfg)
    model.init_weights(7)
    model.train()
    tokens = torch.randint(0, 64, (3, 16))
    logits, aux = model(tokens)
    assert logits.shape == (3, 16, 64) and logits.dtype == torch.float32
    assert aux.shape == () and torch.isfinite(aux) and aux.item() > 0
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())
    assert torch.isfinite(loss)
    # freshly initialised (std 0.02): near-uniform predictions, loss ~ ln(vocab)
    assert abs(loss.item() - math.log(64)) < 0.3
    (loss + aux).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    # the same seed gives the same weights; the output is causal (the last token does not affect earlier logits)
    other = MoETransformer(cfg)
    other.init_weights(7)
    params, other_params = dict(model.named_parameters()), dict(other.named_parameters())
    assert params.keys() == other_params.keys()
    assert all(torch.equal(params[n], other_params[n]) for n in params)
    assert model.layers[0].ffn.router.local_tokens_per_expert.sum().item() == 3 * 16 * 2  # counted T*K copies
    model.eval()
    with torch.no_grad():
        changed = tokens.clone()
        changed[:, -1] = (changed[:, -1] + 1) % 64
        torch.testing.assert_close(model(tokens)[0][:, :-1], model(changed)[0][:, :-1])
        assert model(tokens)[1].item() == 0.0  # no aux loss outside training


@pytest.mark.parametrize("overrides,expected", [
    (dict(num_layers=4), [True, True, True, True]),
    (dict(num_layers=4, first_k_dense=1), [False, True, True, True]),
    (dict(num_layers=4, moe_layer_freq=2), [True, False, True, False]),
    (dict(num_layers=4, moe_layer_freq=2, first_k_dense=1), [False, False, True, False]),
    (dict(num_layers=5, moe_layer_freq=3), [True, False, False, True, False]),
    (dict(num_layers=4, moe_layer_freq=[0, 1, 1, 0]), [False, True, True, False]),
    (dict(num_layers=4, moe_layer_freq=[1, 1, 0, 1], first_k_dense=2), [False, False, False, True]),
    (dict(num_layers=3, moe_layer_freq=[0, 0, 0]), [False, False, False]),
])
def test_moe_layer_placement(overrides, expected):
    cfg = ModelConfig.from_preset("tiny", **{**SMALL, **overrides})
    model = MoETransformer(cfg)
    model.init_weights(0)
    placed = [isinstance(blk.ffn, MoELayer) for blk in model.layers]
    assert placed == expected
    assert [blk.is_moe for blk in model.layers] == expected
    assert all(isinstance(blk.ffn, SwiGLU) for blk, moe in zip(model.layers, expected) if not moe)
    assert cfg.num_moe_layers == sum(expected) == len(model.moe_layers())
    model.train()
    _, aux = model(torch.randint(0, 64, (2, 16)))
    assert (aux.item() > 0) == any(expected)  # dense-only models have exactly zero auxiliary loss


# ------------------------------------------------------------------------------------------ LR schedule
def test_warmup_cosine_hand_numbers():
    w, m, r = 10, 110, 0.1
    assert warmup_cosine(0, w, m, r) == pytest.approx(0.1)
    assert warmup_cosine(4, w, m, r) == pytest.approx(0.5)
    assert warmup_cosine(9, w, m, r) == pytest.approx(1.0)
    assert warmup_cosine(10, w, m, r) == pytest.approx(1.0)
    assert warmup_cosine(35, w, m, r) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.sqrt(0.5)))  # 0.86820
    assert warmup_cosine(35, w, m, r) == pytest.approx(0.868198, abs=1e-6)
    assert warmup_cosine(60, w, m, r) == pytest.approx(0.55)
    assert warmup_cosine(85, w, m, r) == pytest.approx(0.1 + 0.45 * (1 - math.sqrt(0.5)))
    assert warmup_cosine(110, w, m, r) == pytest.approx(0.1)
    assert warmup_cosine(500, w, m, r) == pytest.approx(0.1)  # clamped after max_steps
    assert warmup_cosine(0, 0, 100, 0.0) == pytest.approx(1.0)  # no warmup
    assert warmup_cosine(50, 0, 100, 0.0) == pytest.approx(0.5)


# ------------------------------------------------------------------------------------------ training runs
class LossRecorder(L.Callback):
    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


TRAIN_OVERRIDES = dict(seq_length=32, hidden_size=32, num_layers=2, num_attention_heads=2, num_kv_heads=1,
                       ffn_hidden_size=64, num_experts=4, moe_ffn_hidden_size=32)


@pytest.fixture(scope="module")
def pattern_file(tmp_path_factory):
    """A learnable stream: a fixed random cycle over 40 byte values, repeated (each token determines the next)."""
    rng = np.random.default_rng(0)
    cycle = rng.permutation(256)[:40]
    path = tmp_path_factory.mktemp("data") / "pattern.bin"
    return write_tokens(str(path), np.tile(cycle, 200), "uint16")


def trainer_(tmp_path, max_steps, callbacks=()):
    return L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=CSVLogger(str(tmp_path), name="lm"),
                     callbacks=list(callbacks), log_every_n_steps=1, limit_val_batches=0, num_sanity_val_steps=0,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def test_short_training_run_learns_and_logs(tmp_path, pattern_file):
    L.seed_everything(0, workers=True)
    model = MoELanguageModel(preset="tiny", overrides=TRAIN_OVERRIDES, lr=3e-3, warmup_steps=5)
    data = TokenDataModule(path=pattern_file, seq_length=32, batch_size=8, seed=1)
    rec = LossRecorder()
    trainer = trainer_(tmp_path, 30, [rec])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, data)

    assert trainer.global_step == 30 and len(rec.losses) == 30
    assert all(math.isfinite(v) for v in rec.losses)
    first, last = np.mean(rec.losses[:5]), np.mean(rec.losses[-5:])
    assert first > 4.5  # starts near ln(256) = 5.55
    assert last < first - 1.0, (first, last)  # measured: ~5.39 -> ~3.37

    m = trainer.callback_metrics
    for key in ("train_loss", "aux_loss", "z_loss", "load/layer0/imbalance", "load/layer1/imbalance",
                "load/layer0/dropped"):
        assert key in m, key
        assert torch.isfinite(m[key])
    assert m["aux_loss"].item() > 0 and m["z_loss"].item() > 0
    assert m["load/layer0/imbalance"].item() >= 1.0
    assert m["load/layer0/dropped"].item() == 0.0  # dropless
    frac = sum(m[f"load/layer0/expert{e}"].item() for e in range(4))
    assert frac == pytest.approx(1.0, abs=1e-5)

    # the CSV logger wrote them per step
    (csv_path,) = glob.glob(os.path.join(str(tmp_path), "lm", "version_*", "metrics.csv"))
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    cols = set(rows[0])
    assert {"train_loss", "aux_loss", "z_loss", "load/layer0/imbalance"} <= cols
    train_losses = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    assert len(train_losses) == 30 and all(math.isfinite(v) for v in train_losses)

    # the schedule reached its floor: lr * warmup_cosine(30, 5, 30, 0.1) = 3e-4
    assert model.hparams.max_steps is None
    lrs = [g["lr"] for g in trainer.optimizers[0].param_groups]
    assert lrs == pytest.approx([3e-4, 3e-4])
    # the router and the norms are in the no-decay group
    decay, no_decay = trainer.optimizers[0].param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    no_decay_ids = {id(p) for p in no_decay["params"]}
    for moe in model.model.moe_layers():
        assert id(moe.router.weight) in no_decay_ids
        assert id(moe.experts.w13) not in no_decay_ids


class StepLosses(L.Callback):
    """Each micro-batch's returned losses, and what ``callback_metrics`` holds after it."""

    def __init__(self):
        self.micro, self.logged = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.micro.append((float(outputs["lm_loss"]), float(outputs["aux_loss"])))
        m = trainer.callback_metrics
        self.logged.append(tuple(float(m[k]) if k in m else None for k in ("train_loss", "aux_loss", "z_loss")))


def test_train_losses_are_logged_once_per_step_as_the_steps_mean(tmp_path, pattern_file):
    """With 3 micro-batches per optimizer step, train_loss and aux_loss are the means of the step's micro-batches (as
    Megatron reports), logged at its last micro-batch; the micro-batches before it leave the logged values alone."""
    L.seed_everything(0, workers=True)
    model = MoELanguageModel(preset="tiny", overrides=TRAIN_OVERRIDES, lr=3e-3, warmup_steps=2)
    data = TokenDataModule(path=pattern_file, seq_length=32, batch_size=4, seed=1)
    rec = StepLosses()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, accumulate_grad_batches=3, logger=False,
                        callbacks=[rec], limit_val_batches=0, num_sanity_val_steps=0, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, data)
    assert len(rec.micro) == 12
    for step in range(4):
        micro, logged = rec.micro[3 * step:3 * step + 3], rec.logged[3 * step:3 * step + 3]
        before = rec.logged[3 * step - 1] if step else (None, None, None)
        assert logged[0] == logged[1] == before  # mid-step: nothing new
        assert logged[2][0] == pytest.approx(np.mean([lm for lm, _ in micro]), rel=1e-6)
        assert logged[2][1] + logged[2][2] == pytest.approx(np.mean([a for _, a in micro]), rel=1e-5)
        assert logged[2][0] != pytest.approx(micro[-1][0], rel=1e-6)  # not the last micro-batch's alone


def test_expert_bias_updates_and_counts_reset(tmp_path, pattern_file):
    L.seed_everything(0, workers=True)
    overrides = dict(TRAIN_OVERRIDES, score_function="sigmoid", expert_bias=True, bias_update_rate=1e-3)
    model = MoELanguageModel(preset="tiny", overrides=overrides, lr=3e-3, warmup_steps=5)
    data = TokenDataModule(path=pattern_file, seq_length=32, batch_size=8, seed=1)
    trainer = trainer_(tmp_path, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, data)
    assert trainer.global_step == 2
    routers = [moe.router for moe in model.model.moe_layers()]
    assert len(routers) == 2
    for r in routers:
        assert r.expert_bias is not None and torch.count_nonzero(r.expert_bias) > 0
        # two sign updates of size rate: every entry is a multiple of 1e-3 in [-2e-3, 2e-3]
        steps = r.expert_bias / 1e-3
        torch.testing.assert_close(steps, steps.round(), atol=1e-4, rtol=0)
        assert steps.abs().max() <= 2 + 1e-4
        assert torch.count_nonzero(r.local_tokens_per_expert) == 0
        assert "expert_bias" in r.state_dict() and "local_tokens_per_expert" in r.state_dict()


@pytest.mark.parametrize("how", ["preset", "config"])
def test_checkpoint_roundtrip_load_from_checkpoint(tmp_path, pattern_file, how):
    L.seed_everything(0, workers=True)
    overrides = dict(TRAIN_OVERRIDES, score_function="sigmoid", expert_bias=True)
    if how == "preset":
        model = MoELanguageModel(preset="tiny", overrides=overrides, lr=3e-3, warmup_steps=5)
    else:
        model = MoELanguageModel(config=ModelConfig.from_preset("tiny", **overrides), lr=3e-3, warmup_steps=5)
    data = TokenDataModule(path=pattern_file, seq_length=32, batch_size=8, seed=1)
    trainer = trainer_(tmp_path, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, data)
    ckpt = str(tmp_path / "last.ckpt")
    trainer.save_checkpoint(ckpt)
    loaded = MoELanguageModel.load_from_checkpoint(ckpt)
    assert isinstance(loaded.config, ModelConfig) and loaded.config == model.config
    ref, got = model.model.state_dict(), loaded.model.state_dict()
    assert ref.keys() == got.keys()
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert torch.count_nonzero(loaded.model.moe_layers()[0].router.expert_bias) > 0


def test_config_replace_rederives_head_fields():
    cfg = ModelConfig().replace(hidden_size=256, num_attention_heads=8)
    fresh = ModelConfig(hidden_size=256, num_attention_heads=8)
    assert (cfg.num_kv_heads, cfg.head_dim) == (fresh.num_kv_heads, fresh.head_dim) == (8, 32)
    assert ModelConfig(num_kv_heads=2).replace(hidden_size=128).num_kv_heads == 2  # explicit values are kept


def test_validate_before_fit(tmp_path):
    """A RoPE cache first built under inference mode (trainer.validate) must not break training afterwards."""
    import numpy as np
    tokens = write_tokens(str(tmp_path / "t.bin"), np.arange(5000) % 200, "uint16")
    model = MoELanguageModel(preset="tiny", overrides=dict(seq_length=16, hidden_size=32, num_layers=1,
                                                           moe_ffn_hidden_size=32))
    dm = TokenDataModule(path=tokens, seq_length=16, batch_size=2, val_batches=1)
    kw = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, default_root_dir=str(tmp_path))
    L.Trainer(**kw).validate(model, dm)
    trainer = L.Trainer(max_steps=2, limit_val_batches=0, **kw)
    trainer.fit(model, dm)
    assert trainer.global_step == 2


def test_progress_bar_shows_the_loss_from_host_values(tmp_path, pattern_file):
    """The bar's ``loss`` is a host value (Lightning reads bar values back after every batch; a device tensor would
    sync there); ``train_loss`` goes to loggers and callbacks only, exact."""
    model = MoELanguageModel(preset="tiny", overrides=TRAIN_OVERRIDES)
    lm_losses = []

    class Rec(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            lm_losses.append(outputs["lm_loss"].item())
            assert trainer.progress_bar_metrics["loss"] == lm_losses[-1]  # on CPU: no copy to wait for

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, callbacks=[Rec()],
                        limit_val_batches=0, enable_checkpointing=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, TokenDataModule(path=pattern_file, seq_length=32, batch_size=8, seed=1))
    assert len(lm_losses) == 3
    assert "train_loss" not in trainer.progress_bar_metrics
    assert trainer.callback_metrics["train_loss"].item() == lm_losses[-1]
