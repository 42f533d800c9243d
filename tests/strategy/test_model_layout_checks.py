"""A model that cannot be split over the requested layout fails with a clear error before any process group exists."""

import pytest

from lightning_moe import MoELanguageModel, ModelConfig, build_layout
from lightning_moe.modules.context_parallel import check_cp_seq_len
from lightning_moe.modules.transformer import check_model_layout

BASE = dict(hidden_size=32, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64, moe_ffn_hidden_size=32,
            vocab_size=256, seq_length=32, num_experts=8, first_k_dense=1)


@pytest.mark.parametrize("overrides,layout,match", [
    (dict(num_attention_heads=6, num_kv_heads=6), dict(world_size=4, tp=4), r"num_attention_heads=6 .*\(tp=4\)"),
    (dict(num_kv_heads=1), dict(world_size=2, tp=2), r"num_kv_heads=1 .*\(tp=2\) .*not replicated"),
    (dict(vocab_size=255), dict(world_size=2, tp=2), r"vocab_size=255"),
    (dict(ffn_hidden_size=63), dict(world_size=2, tp=2), r"ffn_hidden_size=63"),
    (dict(shared_expert_ffn_size=33), dict(world_size=2, tp=2), r"shared_expert_ffn_size=33"),
    (dict(moe_ffn_hidden_size=30), dict(world_size=4, ep=1, etp=4), r"moe_ffn_hidden_size=30 .*\(etp=4\)"),
    (dict(num_experts=6, topk=2), dict(world_size=4, ep=4), r"num_experts=6 .*\(ep=4\)"),
    (dict(seq_length=36), dict(world_size=4, cp=4), r"seq_length=36 .*2 x context_parallel_size = 8"),
    (dict(seq_length=20, num_kv_heads=4), dict(world_size=8, tp=4, cp=2), r"seq_length / context_parallel_size = 10"),
    (dict(num_layers=3), dict(world_size=2, pp=2), r"cannot split num_layers=3 over pipeline_parallel_size=2 = 2"),
    (dict(num_layers=4), dict(world_size=2, pp=2, vpp=4), r"x virtual_pipeline_size=4 = 8 stages"),
])
def test_bad_model_for_layout(overrides, layout, match):
    cfg = ModelConfig.from_preset("tiny", **{**BASE, **overrides})
    with pytest.raises(ValueError, match=match):
        MoELanguageModel(config=cfg).check_layout(build_layout(**layout))


def test_good_layouts_pass():
    cfg = ModelConfig.from_preset("tiny", **BASE)
    for layout in (dict(world_size=2, tp=2), dict(world_size=4, tp=2, cp=2, ep=2, etp=2), dict(world_size=8, cp=4),
                   dict(world_size=8, tp=2, ep=8)):
        check_model_layout(cfg, build_layout(**layout))


def test_mla_heads_checked_and_kv_heads_ignored():
    mla = dict(attention_type="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    # MLA has no separate kv heads: only the heads must split
    check_model_layout(ModelConfig.from_preset("tiny", **{**BASE, **mla, "num_kv_heads": 1}),
                       build_layout(2, tp=2))
    with pytest.raises(ValueError, match="num_attention_heads=3"):
        check_model_layout(ModelConfig.from_preset("tiny", **{**BASE, **mla, "num_attention_heads": 3,
                                                              "num_kv_heads": 3}), build_layout(2, tp=2))


def test_runtime_sequence_check():
    check_cp_seq_len(32, 4)
    with pytest.raises(ValueError, match="seq_len=30"):
        check_cp_seq_len(30, 2)


def test_explicit_first_last_stage_layers_checked():
    cfg = ModelConfig.from_preset("tiny", **{**BASE, "num_layers": 5})
    lay = build_layout(4, pp=4)
    check_model_layout(cfg, lay, 2, None)  # 2 + 1 + 1 + 1
    with pytest.raises(ValueError, match=r"with 3 layers on the first and None on the last stage: the remaining 2"):
        check_model_layout(cfg, lay, 3, None)
    with pytest.raises(ValueError, match="must be an integer >= 0"):
        check_model_layout(cfg, lay, -1, None)
