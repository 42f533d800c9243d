"""Starting from a Hugging Face directory: MoELanguageModel(init_from_hf=...) through the Trainer, the CLI option,
and a sharded start (TP2 x EP2 on 2 gloo ranks) that gives the transformers model's loss."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import lightning as L  # noqa: E402

from lightning_moe import MoEFoldStrategy, MoELanguageModel, TokenDataModule, cli  # noqa: E402
from tests.parallel.harness import run_ranks  # noqa: E402
from tests.parallel.parity import make_tokens  # noqa: E402

SEQ = 32


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf") / "qwen3_moe")
    cfg = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=2, intermediate_size=128, moe_intermediate_size=32,
                                      num_experts=8, num_experts_per_tok=2, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM._from_config(cfg, attn_implementation="eager").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return make_tokens(str(tmp_path_factory.mktemp("tok") / "tokens.bin"))


def _hf_loss(hf_dir, batch):
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = hf(batch["input_ids"]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item()


def _first_val_batch(tokens):
    dm = TokenDataModule(path=tokens, seq_length=SEQ, batch_size=4, seed=3)
    dm.setup("validate")
    return next(iter(dm.val_dataloader()))


def _validate(rank, world, hf_dir, tokens):
    strategy = MoEFoldStrategy(tensor_parallel_size=2, expert_parallel_size=2, timeout=60) if world > 1 else "auto"
    model = MoELanguageModel(init_from_hf=hf_dir, overrides={"seq_length": SEQ}, seed=1)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, logger=False, limit_val_batches=1,
                        enable_progress_bar=False, enable_model_summary=False)
    return trainer.validate(model, datamodule=TokenDataModule(path=tokens, seq_length=SEQ, batch_size=4, seed=3),
                            verbose=False)[0]["val_loss"]


def test_config_and_weights_come_from_the_hf_directory(hf_dir, tokens):
    model = MoELanguageModel(init_from_hf=hf_dir, overrides={"seq_length": SEQ})
    assert model.config.num_experts == 8 and model.config.seq_length == SEQ and model.config.qk_norm
    model.configure_model()
    batch = _first_val_batch(tokens)
    lm_loss, _ = model.model.loss(batch["input_ids"], batch["labels"])
    assert lm_loss.item() == pytest.approx(_hf_loss(hf_dir, batch), rel=1e-5)


def test_sharded_start_tp2_ep2_gives_the_hf_loss(hf_dir, tokens, tmp_path):
    ref = _hf_loss(hf_dir, _first_val_batch(tokens))
    losses = run_ranks(_validate, 2, hf_dir, tokens, out_dir=str(tmp_path))
    assert losses == pytest.approx([ref, ref], rel=1e-5)


def test_cli_init_from_hf(hf_dir, tokens, tmp_path):
    args = ["fit", "--model.init_from_hf", hf_dir, "--model.overrides", '{"seq_length": 32}',
            "--data.path", tokens, "--data.seq_length", "32", "--data.batch_size", "2",
            "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0", "--trainer.accelerator", "cpu",
            "--trainer.devices", "1", "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path)]
    c = cli.build_cli(args=args)
    assert c.model.config.num_experts == 8 and c.trainer.global_step == 2


def _finetune_and_save(rank, world, hf_dir, tokens, root):
    from lightning.pytorch.callbacks import ModelCheckpoint
    model = MoELanguageModel(init_from_hf=hf_dir, overrides={"seq_length": SEQ}, lr=1e-2, warmup_steps=0, seed=1)
    ckpt = ModelCheckpoint(dirpath=root, filename="last", every_n_train_steps=2, enable_version_counter=False)
    trainer = L.Trainer(accelerator="cpu", devices=world, logger=False, max_steps=2, limit_val_batches=1,
                        strategy=MoEFoldStrategy(tensor_parallel_size=2, expert_parallel_size=2, timeout=60),
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[ckpt])
    dm = TokenDataModule(path=tokens, seq_length=SEQ, batch_size=4, seed=3)
    trainer.fit(model, datamodule=dm)
    return trainer.validate(model, datamodule=dm, verbose=False)[0]["val_loss"]


def test_export_a_sharded_checkpoint_to_hf(hf_dir, tokens, tmp_path):
    """Fine-tuned on TP2 x EP2, checkpointed, exported on one process with ``lightning-moe export-hf``: transformers
    loads the export and gives the fine-tuned model's loss (so the weights moved and came back whole)."""
    tuned = run_ranks(_finetune_and_save, 2, hf_dir, tokens, str(tmp_path / "ck"), out_dir=str(tmp_path / "o"))
    out = str(tmp_path / "exported")
    cli.main(["export-hf", str(tmp_path / "ck" / "last.ckpt"), out])
    batch = _first_val_batch(tokens)
    assert _hf_loss(out, batch) == pytest.approx(tuned[0], rel=1e-5)
    assert abs(_hf_loss(hf_dir, batch) - tuned[0]) > 1e-3  # fine-tuning changed the weights
    with pytest.raises(SystemExit):
        cli.main(["export-hf"])  # missing arguments: argparse's usage error
    with pytest.raises(ValueError, match="not a moe_fold checkpoint"):
        cli.main(["export-hf", str(tmp_path), out])
