"""HF interop against tiny random transformers models: logits parity, bit-exact round trips, sharded slice reads
(TP/EP/ETP/PP shards built from hand-made contexts, no process groups) and the errors for broken checkpoints."""

import json
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from lightning_moe import hf_interop  # noqa: E402
from lightning_moe.hf_interop import config_from_hf, export_hf_weights, load_hf_weights, save_hf  # noqa: E402
from lightning_moe.modules.experts import GroupedExperts  # noqa: E402
from lightning_moe.modules.tensor_parallel import tp_shard  # noqa: E402
from lightning_moe.modules.transformer import MoETransformer  # noqa: E402
from lightning_moe.strategy.parallel_context import ParallelContext  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
              attn_implementation="eager")
CASES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_hidden_layers=2, num_key_value_heads=2, intermediate_size=96, num_local_experts=4,
                     num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_hidden_layers=3, num_key_value_heads=2, head_dim=32, intermediate_size=96,
                       moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1])),
    "qwen3_moe_tied_norm": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                            dict(num_hidden_layers=2, num_key_value_heads=2, intermediate_size=96,
                                 moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                 tie_word_embeddings=True)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
                         qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=96,
                         moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=4, n_group=4,
                         topk_group=2, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5)),
    "deepseek_v3_no_q_lora": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                              dict(num_hidden_layers=2, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=96,
                                   moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
                                   topk_group=1, first_k_dense_replace=0, n_shared_experts=2)),
}


def _hf_model(name):
    cfg_cls, model_cls, kw = CASES[name]
    attn = COMMON["attn_implementation"]
    hf_cfg = getattr(transformers, cfg_cls)(**{k: v for k, v in COMMON.items() if k != "attn_implementation"}, **kw)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)._from_config(hf_cfg, attn_implementation=attn).eval()
    with torch.no_grad():  # norms start at 1 and the correction bias at 0: make them count
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.2 * torch.randn_like(p))
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, HF model, its checkpoint directory, our model loaded from it, random tokens)."""
    name = request.param
    hf = _hf_model(name)
    path = str(tmp_path_factory.mktemp(name))
    # the Qwen3 checkpoint is split into shards with an index, as large hub checkpoints are
    hf.save_pretrained(path, max_shard_size="40KB" if name == "qwen3_moe" else "1GB")
    ours = MoETransformer(config_from_hf(hf.config)).eval()
    load_hf_weights(ours, path)
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    return name, hf, path, ours, tokens


def _file_state(path):
    state = {}
    for fn in sorted(os.listdir(path)):
        if fn.endswith(".safetensors"):
            state.update(safetensors_torch.load_file(os.path.join(path, fn)))
    return state


def test_logits_match_transformers(case):
    name, hf, path, ours, tokens = case
    with torch.no_grad():
        ref = hf(tokens).logits
        got, _ = ours(tokens)
    diff = (got - ref).abs().max().item()
    print(f"{name}: max |logits diff| = {diff:.3g} (logits max {ref.abs().max().item():.3g})")
    assert diff < 1e-4


def test_export_round_trip_is_bit_exact(case, tmp_path):
    name, hf, path, ours, tokens = case
    exported, on_disk = export_hf_weights(ours), _file_state(path)
    assert sorted(exported) == sorted(on_disk)
    for k, v in on_disk.items():
        assert torch.equal(exported[k], v), k

    save_hf(ours, str(tmp_path))
    fresh = MoETransformer(config_from_hf(hf.config)).eval()
    load_hf_weights(fresh, str(tmp_path))
    mine = hf_interop._tensors(fresh)
    for k, v in hf_interop._tensors(ours).items():
        assert torch.equal(mine[k], v), k

    # transformers reads what save_hf wrote: same config and the same logits as the original
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    cfg_a, cfg_b = config_from_hf(again.config), ours.cfg
    assert {**vars(cfg_a), "extra": None} == {**vars(cfg_b), "extra": None}
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, hf(tokens).logits)


def _ctx(**sizes_ranks):
    ctx = ParallelContext.single()
    ctx.sizes = {**ctx.sizes, **{k: v[0] for k, v in sizes_ranks.items()}}
    ctx.ranks = {**ctx.ranks, **{k: v[1] for k, v in sizes_ranks.items()}}
    ctx.world_size = 8  # only the sizes and ranks shape the model; no process group is touched
    return ctx


def _expected_shard(full, name, param, module, ctx):
    if isinstance(module, GroupedExperts):
        local = full[module.expert_offset:module.expert_offset + module.num_local_experts]
        dim, parts = (2, 2) if name.endswith("w13") else (1, 1)
        return tp_shard(local, dim, ctx.rank("etp"), ctx.etp, parts)
    if hasattr(param, "tp_shard_dim"):
        return tp_shard(full, param.tp_shard_dim, ctx.rank("tp"), ctx.tp, getattr(param, "tp_parts", 1))
    return full


@pytest.mark.parametrize("ranks", [(0, 1, 0, 0), (1, 0, 1, 1)], ids=["tp0ep1etp0", "tp1ep0etp1"])
def test_sharded_import_reads_only_its_slices(case, ranks, monkeypatch):
    name, hf, path, ours, tokens = case
    tp_r, ep_r, etp_r, pp_r = ranks
    layout = dict(tp=(2, tp_r), ep=(2, ep_r), etp=(2, etp_r))
    if ours.cfg.num_layers % 2 == 0:
        layout["pp"] = (2, pp_r)
    ctx = _ctx(**layout)
    shard = MoETransformer(ours.cfg, ctx)
    read = []
    real_read = hf_interop._Checkpoint.read

    def counting_read(self, key, index):
        t = real_read(self, key, index)
        read.append(t.numel())
        return t

    monkeypatch.setattr(hf_interop._Checkpoint, "read", counting_read)
    load_hf_weights(shard, path)
    full, modules, local = hf_interop._tensors(ours), dict(shard.named_modules()), hf_interop._tensors(shard)
    for n, t in local.items():
        want = _expected_shard(full[n], n, t, modules[n.rsplit(".", 1)[0]], ctx)
        assert torch.equal(t, want), n
    # nothing beyond this rank's slices came off the disk (replicated tensors are read whole, as they are held)
    assert sum(read) == sum(t.numel() for t in local.values())
    assert sum(read) < sum(t.numel() for t in full.values())


def test_fused_expert_layout_loads(case, tmp_path):
    """transformers 5 keeps experts fused in memory (experts.gate_up_proj); a raw dump of it loads too."""
    name, hf, path, ours, tokens = case
    state = {k: v.contiguous().clone() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:  # the state dict lists the shared tensor twice; checkpoints hold it once
        state.pop("lm_head.weight")
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    shutil.copy(os.path.join(path, "config.json"), tmp_path / "config.json")
    fresh = MoETransformer(ours.cfg)
    load_hf_weights(fresh, str(tmp_path))
    mine = hf_interop._tensors(fresh)
    for k, v in hf_interop._tensors(ours).items():
        assert torch.equal(mine[k], v), k


def _broken_copy(src, dst, edit):
    state = _file_state(src)
    edit(state)
    os.makedirs(dst, exist_ok=True)
    safetensors_torch.save_file(state, os.path.join(dst, "model.safetensors"))
    shutil.copy(os.path.join(src, "config.json"), os.path.join(dst, "config.json"))
    return dst


def test_missing_and_misshapen_tensors_are_named(tmp_path):
    hf = _hf_model("mixtral")
    path = str(tmp_path / "ok")
    hf.save_pretrained(path)
    cfg = config_from_hf(hf.config)
    key = "model.layers.1.self_attn.q_proj.weight"
    missing = _broken_copy(path, str(tmp_path / "missing"), lambda s: s.pop(key))
    with pytest.raises(ValueError, match=key.replace(".", r"\.") + ".*missing"):
        load_hf_weights(MoETransformer(cfg), missing)
    expert = "model.layers.0.block_sparse_moe.experts.3.w2.weight"
    bad = _broken_copy(path, str(tmp_path / "bad"), lambda s: s.update({expert: torch.zeros(64, 95)}))
    with pytest.raises(ValueError, match=expert.replace(".", r"\.") + r".*shape \[64, 95\]"):
        load_hf_weights(MoETransformer(cfg), bad)


def test_unsupported_configs_raise():
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        config_from_hf(transformers.DeepseekV3Config(
            num_key_value_heads=128, rope_parameters={"rope_type": "yarn", "factor": 40.0, "rope_theta": 1e4,
                                                      "original_max_position_embeddings": 4096}))
    with pytest.raises(ValueError, match="sliding_window"):
        config_from_hf(transformers.MixtralConfig(sliding_window=4096))
    with pytest.raises(ValueError, match="topk_group"):
        config_from_hf(transformers.DeepseekV3Config(num_key_value_heads=128, n_group=8, topk_group=2))
    with pytest.raises(ValueError, match="unsupported model_type"):
        config_from_hf(transformers.LlamaConfig())


def test_presets_export_to_their_architectures():
    """The published presets map to the HF config classes with the published numbers."""
    from lightning_moe import ModelConfig
    ds = hf_interop.hf_config_for(ModelConfig.from_preset("deepseek-v3"))
    assert (ds.model_type, ds.n_group, ds.topk_group, ds.routed_scaling_factor, ds.first_k_dense_replace) == \
        ("deepseek_v3", 8, 4, 2.5, 3)
    qw = hf_interop.hf_config_for(ModelConfig.from_preset("qwen3-30b-a3b"))
    assert (qw.model_type, qw.norm_topk_prob, qw.head_dim, qw.num_experts) == ("qwen3_moe", True, 128, 128)
    mx = hf_interop.hf_config_for(ModelConfig.from_preset("mixtral-8x7b"))
    assert (mx.model_type, mx.num_local_experts, mx.intermediate_size) == ("mixtral", 8, 14336)
    assert config_from_hf(mx).moe_ffn_hidden_size == 14336
    # an imported config edited on our side exports the edit (not the stale HF value it came with)
    qcfg = config_from_hf(transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2))
    assert hf_interop.hf_config_for(qcfg.replace(num_experts=8)).num_experts == 8


def test_quantized_checkpoints_are_refused(tmp_path):
    hf = _hf_model("mixtral")
    hf.save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ValueError, match="quantized"):
        load_hf_weights(MoETransformer(config_from_hf(hf.config)), str(tmp_path))
