"""Sharded checkpoints under EP=2: every rank's expert shards are saved, resume restores them, a crash mid-save
leaves the previous checkpoint intact, corruption and layout changes give clear errors."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch

from tests.parallel.harness import run_ranks
from tests.parallel.parity import make_tokens

OVR = dict(seq_length=16, hidden_size=32, num_layers=1, moe_ffn_hidden_size=32)


def _fit(rank, world, tokens, root, steps, ckpt_path=None, crash_save=False, ep=2):
    from lightning.pytorch.callbacks import ModelCheckpoint

    import lightning_moe.strategy.checkpoint as ck
    from lightning_moe import MoEFoldStrategy, MoELanguageModel, TokenDataModule
    if crash_save:  # rank 1 dies while writing its shard (the first save of the resumed run, at step 4)
        real_save, calls = torch.save, {"n": 0}

        def flaky_save(obj, f, *a, **k):
            calls["n"] += 1
            if rank == 1 and calls["n"] == 1:
                os._exit(5)
            return real_save(obj, f, *a, **k)
        ck.torch.save = flaky_save
    ckpt = ModelCheckpoint(dirpath=root, filename="last", every_n_train_steps=2, save_top_k=1,
                           enable_version_counter=False)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=MoEFoldStrategy(expert_parallel_size=ep,
                                                                                    timeout=20),
                        max_steps=steps, logger=False, enable_progress_bar=False, callbacks=[ckpt],
                        limit_val_batches=0)
    model = MoELanguageModel(preset="tiny", overrides=OVR, seed=11)
    error = None
    try:
        trainer.fit(model, datamodule=TokenDataModule(path=tokens, seq_length=16, batch_size=2), ckpt_path=ckpt_path)
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    return {"state": {k: v.clone() for k, v in model.model.state_dict().items()} if model.model else None,
            "step": trainer.global_step, "error": error}


def test_save_resume_and_crash(tmp_path):
    tokens = make_tokens(str(tmp_path / "t.bin"))
    ck = tmp_path / "ck"
    first = run_ranks(_fit, 2, tokens, str(ck), 2, out_dir=str(tmp_path / "a"))
    path = ck / "last.ckpt"
    assert (path / "meta.json").is_file() and (path / "shard_00000.pt").is_file() and (path / "shard_00001.pt").is_file()
    # the shard files hold no tensors of the model or the optimizer: those are in model_dcp/ once, with global shapes
    for r in range(2):
        shard = torch.load(path / f"shard_0000{r}.pt", weights_only=True)
        assert not [k for k, v in shard["state_dict"].items() if isinstance(v, torch.Tensor)]
        assert all(v is None for st in shard["optimizer_states"][0]["state"].values() for v in st.values())
    from lightning_moe.strategy.reshard import Piece, load_pieces, read_tensor_metadata
    md = read_tensor_metadata(str(path / "model_dcp"))
    key = next(k for k in md if k.endswith("experts.w13"))
    local = first[0]["state"][key.removeprefix("model.")]
    assert tuple(md[key].size) == (2 * local.shape[0], *local.shape[1:])  # the 8 experts of both ranks
    assert md[f"optim/0/exp_avg/{key}"].size == md[key].size and tuple(md[f"optim/0/step/{key}"].size) == ()
    full = torch.empty(tuple(md[key].size))
    load_pieces([Piece(key, tuple(full.shape), (0, 0, 0), full)], str(path / "model_dcp"))
    for r in range(2):  # rank r's experts at rows [r*4, r*4+4)
        n = local.shape[0]
        assert torch.equal(full[r * n:(r + 1) * n], first[r]["state"][key.removeprefix("model.")])

    # resume: the restored weights are exactly the saved ones (checked by training 0 further steps)
    resumed = run_ranks(_fit, 2, tokens, str(tmp_path / "ck2"), 2, str(path), out_dir=str(tmp_path / "b"))
    for r in range(2):
        assert resumed[r]["error"] is None and resumed[r]["step"] == 2
        for k, v in first[r]["state"].items():
            assert torch.equal(v, resumed[r]["state"][k]), k

    # a crash during the next save (rank 1 dies writing its shard) leaves last.ckpt loadable and unchanged
    before = {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}
    os.makedirs(tmp_path / "c", exist_ok=True)
    try:
        run_ranks(_fit, 2, tokens, str(ck), 4, str(path), True, out_dir=str(tmp_path / "c"))
    except AssertionError:
        pass  # rank 1 produced no result: expected
    after = {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}
    assert before == after
    again = run_ranks(_fit, 2, tokens, str(tmp_path / "ck3"), 2, str(path), out_dir=str(tmp_path / "d"))
    assert all(r["error"] is None for r in again)


def test_corrupt_and_mismatched_checkpoints(tmp_path):
    tokens = make_tokens(str(tmp_path / "t.bin"))
    ck = tmp_path / "ck"
    run_ranks(_fit, 2, tokens, str(ck), 2, out_dir=str(tmp_path / "a"))
    path = ck / "last.ckpt"
    # layout change (EP=1 on 2 ranks): the weights reshard (tests/parallel/test_resume.py checks the numbers)
    res = run_ranks(_fit, 2, tokens, str(tmp_path / "x"), 2, str(path), False, 1, out_dir=str(tmp_path / "b"))
    assert all(r["error"] is None and r["step"] == 2 for r in res), res
    # without the layout-independent copy (an older checkpoint), a layout change is refused naming the layout
    import shutil
    old = tmp_path / "old.ckpt"
    shutil.copytree(path, old)
    shutil.rmtree(old / "model_dcp")
    res = run_ranks(_fit, 2, tokens, str(tmp_path / "x2"), 2, str(old), False, 1, out_dir=str(tmp_path / "b2"))
    assert all(r["error"] and "'ep': (2, 1)" in r["error"] for r in res), res
    # a truncated tensor file -> every rank fails naming model_dcp, and nothing on disk changes
    bad = tmp_path / "bad.ckpt"
    shutil.copytree(path, bad)
    data = sorted((bad / "model_dcp").glob("*.distcp"))[-1]
    data.write_bytes(data.read_bytes()[:200])
    before = {str(p.relative_to(bad)): p.read_bytes() for p in bad.rglob("*") if p.is_file()}
    res = run_ranks(_fit, 2, tokens, str(tmp_path / "z"), 2, str(bad), out_dir=str(tmp_path / "e"))
    assert all(r["error"] and "model_dcp is corrupted or truncated" in r["error"] for r in res), res
    assert before == {str(p.relative_to(bad)): p.read_bytes() for p in bad.rglob("*") if p.is_file()}
    # truncated shard -> every rank fails at once, naming the file
    shard = path / "shard_00001.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    res = run_ranks(_fit, 2, tokens, str(tmp_path / "y"), 2, str(path), out_dir=str(tmp_path / "c"))
    assert all("shard_00001.pt is corrupted or truncated" in r["error"] for r in res), res
    # not a sharded checkpoint
    from lightning_moe.strategy.checkpoint import load_sharded
    with pytest.raises(ValueError, match="meta.json is missing"):
        load_sharded(tmp_path, 0, 2, {})
