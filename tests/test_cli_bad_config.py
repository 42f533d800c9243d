"""Bad configuration on the CLI: each out-of-range or wrongly typed field (model, strategy, data) stops
``lightning-moe fit`` before training, and before any rank process is spawned, with one error naming the field and
what would work. An unknown key anywhere in the config suggests the nearest valid one."""

from __future__ import annotations

import os

import pytest

from lightning_moe import cli

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny.yaml")
O, S, D = "--model.overrides.", "--trainer.strategy.init_args.", "--data."
BAD = [
    (O + "num_experts=0", "ModelConfig.num_experts: must be positive, got 0"),
    (O + "topk=99", "ModelConfig.topk: topk=99 exceeds num_experts"),
    (O + "hidden_size=abc", "ModelConfig.hidden_size: expected int, got 'abc'"),
    (O + "hiden_size=64", "unknown fields 'hiden_size' (did you mean 'hidden_size'?)"),
    (O + "qk_norm=maybe", "ModelConfig.qk_norm: expected bool, got 'maybe'"),
    (O + "score_function=relu", "ModelConfig.score_function: unknown 'relu'; choose from ('softmax', 'sigmoid')"),
    (O + "load_balancing=sometimes", "ModelConfig.load_balancing: unknown 'sometimes'; choose from"),
    (O + "attention_type=mqa", "ModelConfig.attention_type: unknown 'mqa'; choose from ('gqa', 'mla')"),
    (O + "dispatcher=nccl", "ModelConfig.dispatcher: unknown 'nccl'; choose from"),
    (O + "capacity_factor=-1", "ModelConfig.capacity_factor: must be > 0 or None (dropless), got -1"),
    (O + "pad_to_capacity=true", "ModelConfig.pad_to_capacity: needs capacity_factor to be set"),
    (O + "num_kv_heads=3", "ModelConfig.num_kv_heads: 3 must divide num_attention_heads"),
    (O + "aux_loss_coeff=-0.1", "ModelConfig.aux_loss_coeff: must be >= 0, got -0.1"),
    (O + "expert_bias=true", "ModelConfig.expert_bias: the aux-loss-free expert bias needs score_function='sigmoid'"),
    (O + "first_k_dense=9", "ModelConfig.first_k_dense: must be in 0..num_layers"),
    (O + "num_groups=2", "ModelConfig.group_topk: num_groups and group_topk must be set together"),
    (S + "expert_parallel_size=0", "expert_parallel_size must be a positive integer, got 0"),
    (S + "skip_nonfinite_steps=0", "skip_nonfinite_steps must be a positive integer or None, got 0"),
    (S + "optimizer_cpu_offload=2", "optimizer_cpu_offload=2.0): must be a fraction of the optimizer state in [0, 1]"),
    (D + "seq_length=0", "seq_length must be an integer >= 1, got 0"),
    (D + "batch_size=-1", "batch_size must be an integer >= 1, got -1"),
    (D + "dtype=int8", "dtype must be one of ['uint16', 'uint32'], got 'int8'"),
    (D + "long_documents=drop", "long_documents must be one of ('split', 'refuse'), got 'drop'"),
]


@pytest.mark.parametrize("arg,message", BAD, ids=[a.split("=")[0].lstrip("-") for a, _ in BAD])
def test_bad_value_names_the_field(arg, message, capsys, tmp_path):
    extra = [D + "pack_documents=true"] if "long_documents" in arg else []
    args = ["fit", "--config", TINY, "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path),
            D + f"cache_dir={tmp_path}", arg, *extra]
    with pytest.raises((ValueError, SystemExit)) as info:
        cli.main(args=args)
    shown = str(info.value) + capsys.readouterr().err
    assert message in shown, shown[-2000:]
    assert not os.path.exists(tmp_path / "lightning_logs")  # nothing ran


def _with(section, **keys):
    """tiny.yaml with ``keys`` added at ``section`` (a path of dict keys and list indices)."""
    import yaml
    with open(TINY) as f:
        cfg = yaml.safe_load(f)
    node = cfg
    for k in section:
        node = node[k]
    node.update(keys)
    return cfg


UNKNOWN = [  # (where, config with an unknown key or None, extra argument, the hint)
    ("trainer", _with(["trainer"], max_stepz=1), None, "unknown key 'trainer.max_stepz': did you mean "
                                                       "'trainer.max_steps'?"),
    ("data", _with(["data"], seq_lenght=8), None, "unknown key 'data.seq_lenght': did you mean 'data.seq_length'?"),
    ("model", _with(["model"], lrr=0.1), None, "unknown key 'model.lrr': did you mean 'model.lr'?"),
    ("top_level", _with([], seed_everythin=1), None, "unknown key 'seed_everythin': did you mean 'seed_everything'?"),
    ("strategy_init_args", _with(["trainer", "strategy", "init_args"], expert_paralel_size=2), None,
     "unknown init_args key 'expert_paralel_size' of lightning_moe.MoEFoldStrategy: did you mean "
     "'expert_parallel_size'?"),
    ("callback_init_args", _with(["trainer", "callbacks", 0, "init_args"], windo=3), None,
     "unknown init_args key 'windo' of lightning_moe.LossReport: did you mean 'window'?"),
    ("model_overrides", _with(["model", "overrides"], num_expert=4), None,
     "unknown fields 'num_expert' (did you mean 'num_experts'?)"),
    ("command_line", None, "--data.batch_sise=3", "unknown key 'data.batch_sise': did you mean 'data.batch_size'?"),
]


@pytest.mark.parametrize("cfg,extra,hint", [u[1:] for u in UNKNOWN], ids=[u[0] for u in UNKNOWN])
def test_unknown_key_suggests_the_nearest(cfg, extra, hint, capsys, tmp_path):
    """An unknown key anywhere in the YAML config (trainer, data, model, the top level, a class's init_args, the
    model's overrides) or on the command line stops the CLI with the nearest valid key (jsonargparse alone names
    the key, and suggests nothing)."""
    import yaml
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg if cfg is not None else _with([])))
    args = ["fit", "--config", str(path), "--trainer.default_root_dir", str(tmp_path), D + f"cache_dir={tmp_path}"]
    with pytest.raises((ValueError, SystemExit)) as info:
        cli.main(args=args + ([extra] if extra else []))
    shown = str(info.value) + capsys.readouterr().err
    assert hint in shown, shown[-2000:]
    assert not os.path.exists(tmp_path / "lightning_logs")  # nothing ran
