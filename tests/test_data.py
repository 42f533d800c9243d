import os

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_moe.data import TokenDataModule, default_corpus_path, write_tokens

N = 10000


@pytest.fixture
def token_file(tmp_path):
    # distinct values (uint16 arange) so every window locates uniquely in the file
    return write_tokens(str(tmp_path / "tok.bin"), np.arange(N), "uint16")


def batches(dm, n, loader="train"):
    it = iter(dm.train_dataloader() if loader == "train" else dm.val_dataloader())
    return [next(it) for _ in range(n)]


def test_shapes_and_windows(token_file):
    dm = TokenDataModule(path=token_file, seq_length=16, batch_size=3)
    data = np.fromfile(token_file, dtype=np.uint16).astype(np.int64)
    for b in batches(dm, 3) + batches(dm, 2, "val"):
        x, y = b["input_ids"], b["labels"]
        assert x.shape == y.shape == (3, 16) and x.dtype == y.dtype == torch.long
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row_x, row_y in zip(x, y):
            s = int(row_x[0])
            assert np.array_equal(row_x.numpy(), data[s : s + 16]) and np.array_equal(row_y.numpy(), data[s + 1 : s + 17])


def test_determinism_and_seed(token_file):
    a = batches(TokenDataModule(path=token_file, seq_length=8, batch_size=4, seed=1), 3)
    b = batches(TokenDataModule(path=token_file, seq_length=8, batch_size=4, seed=1), 3)
    c = batches(TokenDataModule(path=token_file, seq_length=8, batch_size=4, seed=2), 3)
    assert all(torch.equal(p["input_ids"], q["input_ids"]) for p, q in zip(a, b))
    assert not all(torch.equal(p["input_ids"], q["input_ids"]) for p, q in zip(a, c))
    v = batches(TokenDataModule(path=token_file, seq_length=8, batch_size=4, seed=1), 1, "val")[0]
    assert not torch.equal(v["input_ids"], a[0]["input_ids"])  # val is its own stream


@pytest.mark.parametrize("loader", ["train", "val"])
def test_layout_invariance(token_file, loader):
    steps = 4
    ref = TokenDataModule(path=token_file, seq_length=8, batch_size=4, val_batches=steps)
    ref.set_data_parallel(0, 1)
    ranks = []
    for r in range(2):
        dm = TokenDataModule(path=token_file, seq_length=8, batch_size=2, val_batches=steps)
        dm.set_data_parallel(r, 2)
        ranks.append(batches(dm, steps, loader))
    for g, full in enumerate(batches(ref, steps, loader)):
        for key in ("input_ids", "labels"):
            assert torch.equal(torch.cat([ranks[0][g][key], ranks[1][g][key]]), full[key])


def test_start_batch_and_epoch(token_file):
    dm = TokenDataModule(path=token_file, seq_length=8, batch_size=2, train_samples=20)
    full = batches(dm, 6)
    loader = dm.train_dataloader()
    loader.sampler.start_batch = 2
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(list(loader)[:4], full[2:6]))
    loader = dm.train_dataloader()  # 10 global batches per epoch; epoch 1 continues the stream
    assert len(loader) == 10
    loader.sampler.set_epoch(1)
    first = next(iter(loader))["input_ids"]
    dm2 = TokenDataModule(path=token_file, seq_length=8, batch_size=2, train_samples=40)
    assert torch.equal(first, batches(dm2, 11)[10]["input_ids"])


def test_default_corpus(tmp_path):
    p = default_corpus_path(str(tmp_path))
    arr = np.fromfile(p, dtype=np.uint16)
    assert 1_000_000 < arr.size <= 8 * 1024 * 1024 and arr.max() < 256
    mtime = os.stat(p).st_mtime_ns
    assert default_corpus_path(str(tmp_path)) == p and os.stat(p).st_mtime_ns == mtime
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp")]
    dm = TokenDataModule(cache_dir=str(tmp_path), seq_length=32, batch_size=2)
    assert batches(dm, 1)[0]["input_ids"].shape == (2, 32)


@pytest.mark.parametrize(
    "kwargs, field",
    [({"seq_length": 0}, "seq_length"), ({"batch_size": 0}, "batch_size"), ({"batch_size": -3}, "batch_size"),
     ({"dtype": "int64"}, "dtype"), ({"seq_length": N}, "seq_length")],
)
def test_value_errors(token_file, kwargs, field):
    with pytest.raises(ValueError, match=field):
        TokenDataModule(path=token_file, **kwargs)


def test_file_errors(tmp_path, token_file):
    missing = str(tmp_path / "nope.bin")
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        TokenDataModule(path=missing)
    short = write_tokens(str(tmp_path / "short.bin"), np.arange(5))
    with pytest.raises(ValueError, match=r"5 tokens.*seq_length \+ 1 = 9"):
        TokenDataModule(path=short, seq_length=8)
    with pytest.raises(ValueError, match="rank"):
        TokenDataModule(path=token_file).set_data_parallel(2, 2)


def test_sampler_survives_distributed_lightning(token_file, monkeypatch):
    # Lightning wraps any non-DistributedSampler when distributed; ours must come back untouched.
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
    from lightning.pytorch.trainer.states import RunningStage

    dm = TokenDataModule(path=token_file, seq_length=8, batch_size=2)
    dm.set_data_parallel(1, 2)
    loader = dm.train_dataloader()
    assert isinstance(loader.sampler, DistributedSampler)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    monkeypatch.setattr(_AcceleratorConnector, "is_distributed", property(lambda self: True))
    assert trainer._data_connector._prepare_dataloader(loader, shuffle=True, mode=RunningStage.TRAINING) is loader


class TinyLM(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(N, 8), torch.nn.Linear(8, N)

    def training_step(self, batch, _):
        logits = self.out(self.emb(batch["input_ids"]))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    validation_step = training_step

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_trainer_fit(token_file):
    dm = TokenDataModule(path=token_file, seq_length=8, batch_size=2, val_batches=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(TinyLM(), datamodule=dm)
    assert trainer.global_step == 1
    assert dm.data_parallel() == (0, 1)


def test_token_ids_past_the_vocabulary_fail_before_training(tmp_path):
    """A token id >= the model's vocabulary (it would index past the embedding) stops the fit at setup, naming the
    file, the id and its index; nothing has been trained."""
    from lightning_moe import MoELanguageModel
    tokens = np.random.default_rng(0).integers(0, 200, 5000)
    tokens[1234] = 300
    path = write_tokens(str(tmp_path / "t.bin"), tokens.astype(np.uint16))
    dm = TokenDataModule(path=path, seq_length=32, batch_size=2)
    dm.check_vocab(301)  # within a larger vocabulary: fine
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"t.bin' holds token id 300 at index 1234, not below the model's "
                                         r"vocab_size=256 \(model.overrides.vocab_size\)"):
        trainer.fit(MoELanguageModel(preset="tiny"), datamodule=dm)
    assert trainer.global_step == 0


def test_empty_and_ragged_token_files_name_the_file(tmp_path):
    """An empty file, or one that is not a whole number of tokens, stops the data module at construction (before any
    process starts), naming the file; so does a file without the end-of-document token when packing documents."""
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"path: '.*empty.bin' holds 0 tokens, too short for one window of "
                                         r"seq_length \+ 1 = 9"):
        TokenDataModule(path=str(empty), seq_length=8)
    ragged = tmp_path / "ragged.bin"
    ragged.write_bytes(b"\x01\x00" * 20 + b"\x07")
    with pytest.raises(ValueError, match=r"path: '.*ragged.bin' has 41 bytes, not a multiple of the uint16 size 2"):
        TokenDataModule(path=str(ragged), seq_length=8)
    no_eod = write_tokens(str(tmp_path / "no_eod.bin"), np.arange(1, 100))
    with pytest.raises(ValueError, match=r"eod_token_id=0: '.*no_eod.bin' has no such token"):
        TokenDataModule(path=no_eod, seq_length=8, pack_documents=True, eod_token_id=0).train_dataloader()


class _Batches(L.Callback):
    """(epoch, batch_idx) of every training batch, and the global step after it."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append((trainer.current_epoch, batch_idx, trainer.global_step))


class _Finite(torch.utils.data.IterableDataset):
    """A finite stream of ``n`` rows with no length: only exhausting it ends an epoch."""

    def __init__(self, path, n, seq_length=16):
        self.tokens, self.n, self.s = np.fromfile(path, dtype=np.uint16).astype(np.int64), n, seq_length

    def __iter__(self):
        for i in range(self.n):
            w = torch.from_numpy(self.tokens[i * 7: i * 7 + self.s + 1])
            yield {"input_ids": w[:-1], "labels": w[1:]}


def _fit_moe(tmp_path, data, max_steps, accumulate=1, **strategy):
    from lightning_moe import MoEFoldStrategy, MoELanguageModel
    cb = _Batches()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=MoEFoldStrategy(**strategy), max_steps=max_steps,
                        accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[cb],
                        default_root_dir=str(tmp_path))
    model = MoELanguageModel(preset="tiny", overrides=dict(seq_length=16, num_layers=1, hidden_size=32,
                                                           num_attention_heads=2, num_kv_heads=2, ffn_hidden_size=64,
                                                           moe_ffn_hidden_size=32, num_experts=4, topk=2), lr=1e-2)
    kwargs = {"datamodule": data} if isinstance(data, L.LightningDataModule) else {"train_dataloaders": data}
    trainer.fit(model, **kwargs)
    return trainer, cb.seen, model


def test_exhausting_the_data_ends_the_epoch_cleanly(tmp_path):
    """max_steps beyond one epoch of a tiny dataset: each epoch ends when its batches run out and the next begins,
    with the accumulation window cut at the epoch's end, until max_steps; every batch and step counted exactly, and
    the weights stay finite. TokenDataModule (3 batches an epoch, the stream continuing) and a finite iterable with
    no length (5 batches, the pipeline engine's micro-batches)."""
    token_file = write_tokens(str(tmp_path / "bytes.bin"), np.random.default_rng(0).integers(0, 256, 4000))
    dm = TokenDataModule(path=token_file, seq_length=16, batch_size=2, train_samples=6, val_batches=0)
    trainer, seen, _ = _fit_moe(tmp_path, dm, max_steps=7)
    # Lightning counts the epoch that max_steps cut short as completed: 2 full epochs + 1 started = 3
    assert trainer.global_step == 7 and trainer.current_epoch == 3 and trainer.num_training_batches == 3
    assert seen == [(e, b, 3 * e + b + 1) for e in range(3) for b in range(3)][:7]
    # accumulating 2 over 3-batch epochs: a step after batches 1 and 2 of each epoch (the last one alone)
    trainer, seen, _ = _fit_moe(tmp_path, dm, max_steps=5, accumulate=2)
    assert trainer.global_step == 5 and trainer.current_epoch == 3
    assert [(e, b) for e, b, _ in seen] == [(e, b) for e in range(3) for b in range(3)][:8]
    assert [s for _, _, s in seen] == [0, 1, 2, 2, 3, 4, 4, 5]
    loader = torch.utils.data.DataLoader(_Finite(token_file, 10), batch_size=2)
    trainer, seen, model = _fit_moe(tmp_path, loader, max_steps=7, accumulate=2, num_microbatches=2)
    assert trainer.global_step == 7 and trainer.current_epoch == 3
    assert [(e, b) for e, b, _ in seen] == [(e, b) for e in range(3) for b in range(5)][:12]
    assert [s for _, _, s in seen] == [0, 1, 1, 2, 3, 3, 4, 4, 5, 6, 6, 7]
    assert all(torch.isfinite(p).all() for p in model.parameters())
