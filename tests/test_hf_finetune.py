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
