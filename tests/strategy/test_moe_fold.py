"""MoEFoldStrategy construction and validation (single process)."""

import lightning as L
import pytest

import lightning_moe
from lightning_moe import MoEFoldStrategy


def test_registered_by_import():
    trainer = L.Trainer(strategy="moe_fold", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, MoEFoldStrategy)
    assert trainer.strategy.is_distributed


@pytest.mark.parametrize("kwargs,devices,match", [
    (dict(expert_parallel_size=3), 2, r"world_size=2 is not divisible by etp\*ep\*pp = 3"),
    (dict(expert_parallel_size=2, expert_tensor_parallel_size=2), 2, r"etp\*ep\*pp = 4"),
    (dict(expert_parallel_size=4), 2, "ep=4"),
])
def test_impossible_layout_fails_at_trainer_construction(kwargs, devices, match):
    with pytest.raises(ValueError, match=match):
        L.Trainer(strategy=MoEFoldStrategy(**kwargs), accelerator="cpu", devices=devices, logger=False)


@pytest.mark.parametrize("kwargs,match", [
    (dict(virtual_pipeline_size=2), "needs pipeline_parallel_size > 1"),
    (dict(pipeline_parallel_size=2, virtual_pipeline_size=0), "virtual_pipeline_size must be a positive integer"),
    (dict(pipeline_parallel_size=2, virtual_pipeline_size=2, num_microbatches=3), "num_microbatches=3"),
    (dict(pipeline_parallel_size=2, pipeline_schedule="zero_bubble"), "unknown pipeline schedule 'zero_bubble'"),
    (dict(pipeline_parallel_size=2, virtual_pipeline_size=2, pipeline_schedule="1f1b"), "interleaved_1f1b"),
    (dict(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b"), "virtual_pipeline_size"),
    (dict(pipeline_parallel_size=2, num_microbatches=0), "num_microbatches"),
    (dict(pipeline_parallel_size=2, num_microbatches=4, overlap_p2p_comm="yes"), "overlap_p2p_comm must be True or"),
])
def test_bad_pipeline_options_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoEFoldStrategy(**kwargs)


def test_fewer_microbatches_than_stages_warns():
    with pytest.warns(UserWarning, match="idle 50%"):
        MoEFoldStrategy(pipeline_parallel_size=2, num_microbatches=1)


def test_default_schedules():
    assert MoEFoldStrategy(pipeline_parallel_size=2, num_microbatches=4).pipeline_schedule == "1f1b"
    assert MoEFoldStrategy(pipeline_parallel_size=2, num_microbatches=4).overlap_p2p_comm is True  # the default
    assert MoEFoldStrategy(pipeline_parallel_size=2, virtual_pipeline_size=2,
                           num_microbatches=4).pipeline_schedule == "interleaved_1f1b"


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_bad_sizes(bad):
    with pytest.raises(ValueError, match="expert_parallel_size"):
        MoEFoldStrategy(expert_parallel_size=bad)


def test_public_api():
    for name in ("MoEFoldStrategy", "MoELanguageModel", "ModelConfig", "ParallelContext", "TokenDataModule",
                 "TokenDispatcher", "build_layout"):
        assert hasattr(lightning_moe, name)


def test_sequence_parallel_defaults():
    assert MoEFoldStrategy(tensor_parallel_size=2).sequence_parallel  # Megatron's recommendation with TP
    assert not MoEFoldStrategy(tensor_parallel_size=2, sequence_parallel=False).sequence_parallel
    assert not MoEFoldStrategy().sequence_parallel
    with pytest.warns(UserWarning, match="no effect without tensor parallelism"):
        assert not MoEFoldStrategy(sequence_parallel=True).sequence_parallel


@pytest.mark.parametrize("kwargs, match", [
    (dict(expert_parallel_size=2), "ep=2"),
    (dict(tensor_parallel_size=2), "tp=2"),
    (dict(num_microbatches=2), "forwards and backwards must alternate"),
])
def test_cuda_graphs_refuse_layouts_with_collectives_or_schedules(kwargs, match):
    with pytest.raises(ValueError, match=f"cuda_graphs=True.*{match}"):
        MoEFoldStrategy(cuda_graphs=True, **kwargs)


def test_cuda_graphs_need_cuda(tmp_path):
    from lightning_moe import MoELanguageModel, TokenDataModule
    from lightning_moe.data import write_tokens
    import numpy as np
    tokens = write_tokens(str(tmp_path / "t.bin"), np.random.default_rng(0).integers(0, 256, 4000), "uint16")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=MoEFoldStrategy(cuda_graphs=True), max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False)
    model = MoELanguageModel(preset="tiny", overrides=dict(seq_length=16, hidden_size=32, num_layers=1))
    with pytest.raises(ValueError, match="cuda_graphs=True. needs CUDA devices, not cpu"):
        trainer.fit(model, TokenDataModule(path=tokens, seq_length=16, batch_size=2))
    assert trainer.global_step == 0
