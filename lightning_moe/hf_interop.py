"""Hugging Face interop: Mixtral, Qwen3-MoE and DeepSeek-V3 configs and safetensors weights, in and out.

``config_from_hf`` maps a transformers config onto ``ModelConfig`` and refuses (ValueError) what our model would
compute differently. ``load_hf_weights`` fills a model, or one rank's TP/EP/ETP/PP shard of it, reading only the
slices that rank holds (``safe_open(...).get_slice``). ``export_hf_weights`` / ``save_hf`` write the layout that
``save_pretrained`` writes (per-expert weights, Mixtral's ``block_sparse_moe``), which the hub checkpoints use too.

Layout differences handled here:
  * HF Linear weights are [out, in]; our experts are [E, D, 2F] ([gate | up] per ETP shard) and [E, F, D].
  * DeepSeek-V3 with ``rope_interleave`` rotates (x0, x1), (x2, x3), ... pairs; our MLA rotates (x_j, x_{j+R/2}).
    That is a fixed permutation of the rope rows of q_b_proj (q_proj) and kv_a_proj_with_mqa.
  * The DeepSeek ``e_score_correction_bias`` is our router's ``expert_bias`` buffer.
Multi-token-prediction layers of DeepSeek checkpoints (not part of the HF model either) are ignored.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from lightning_moe.modules.config import ModelConfig
from lightning_moe.modules.experts import GroupedExperts, SwiGLU
from lightning_moe.modules.mla import MLAttention
from lightning_moe.modules.transformer import MoETransformer

ARCHITECTURES = ("mixtral", "qwen3_moe", "deepseek_v3")
_HF_CLASSES = {"mixtral": "MixtralConfig", "qwen3_moe": "Qwen3MoeConfig", "deepseek_v3": "DeepseekV3Config"}
_DEFAULT_SEQ_LENGTH = 4096  # our seq_length is the training length, not the model's maximum context


# ------------------------------------------------------------------------------------------------ config
def _unsupported(hf, what: str) -> ValueError:
    return ValueError(f"config_from_hf: {hf.model_type} with {what} has no equivalent in ModelConfig")


def _rope_theta(hf) -> float:
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if not params and getattr(hf, "rope_scaling", None):  # transformers < 5 keeps scaling apart
        params = dict(hf.rope_scaling)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise _unsupported(hf, f"rope_type={rope_type!r} (only plain RoPE; YaRN and other scalings are not applied)")
    if getattr(hf, "partial_rotary_factor", 1.0) not in (None, 1.0):
        raise _unsupported(hf, f"partial_rotary_factor={hf.partial_rotary_factor}")
    return float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))


def _common(hf) -> dict:
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise _unsupported(hf, f"hidden_act={hf.hidden_act!r} (experts are SwiGLU)")
    if getattr(hf, "attention_bias", False):
        raise _unsupported(hf, "attention_bias=True")
    if getattr(hf, "attention_dropout", 0.0):
        raise _unsupported(hf, f"attention_dropout={hf.attention_dropout}")
    if getattr(hf, "sliding_window", None) is not None:
        raise _unsupported(hf, f"sliding_window={hf.sliding_window} (attention is full causal)")
    return dict(vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_layers=hf.num_hidden_layers,
                num_attention_heads=hf.num_attention_heads, rope_theta=_rope_theta(hf), norm_eps=hf.rms_norm_eps,
                tie_embeddings=bool(hf.tie_word_embeddings), init_std=hf.initializer_range,
                seq_length=min(hf.max_position_embeddings, _DEFAULT_SEQ_LENGTH), topk=hf.num_experts_per_tok)


def _softmax_router(hf, renormalise: bool) -> dict:
    # top-k of the softmax renormalised == softmax over the top-k logits (our pre_softmax=False); without
    # renormalisation the gates are the full softmax's top-k (pre_softmax=True)
    if renormalise and hf.num_experts_per_tok == 1:
        raise _unsupported(hf, "top-1 routing with renormalised gates (always 1.0)")
    return dict(score_function="softmax", pre_softmax=not renormalise, load_balancing="aux_loss",
                aux_loss_coeff=hf.router_aux_loss_coef)


def _head_dims(hf) -> dict:
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return dict(num_kv_heads=hf.num_key_value_heads, head_dim=head_dim)


def _mixtral(hf) -> dict:
    if getattr(hf, "router_jitter_noise", 0.0):
        raise _unsupported(hf, f"router_jitter_noise={hf.router_jitter_noise}")
    return dict(**_head_dims(hf), ffn_hidden_size=hf.intermediate_size, num_experts=hf.num_local_experts,
                moe_ffn_hidden_size=hf.intermediate_size, **_softmax_router(hf, renormalise=True))


def _qwen3_moe(hf) -> dict:
    if getattr(hf, "use_sliding_window", False):
        raise _unsupported(hf, "use_sliding_window=True")
    if not hf.num_experts:
        raise _unsupported(hf, "num_experts=0 (a dense model)")
    dense = set(hf.mlp_only_layers or [])
    moe = [int(i not in dense and (i + 1) % hf.decoder_sparse_step == 0) for i in range(hf.num_hidden_layers)]
    return dict(**_head_dims(hf), qk_norm=True, ffn_hidden_size=hf.intermediate_size, num_experts=hf.num_experts,
                moe_ffn_hidden_size=hf.moe_intermediate_size, moe_layer_freq=1 if all(moe) else moe,
                **_softmax_router(hf, renormalise=bool(hf.norm_topk_prob)))


def _deepseek_groups(hf) -> dict:
    n_group, topk_group, k = hf.n_group or 1, hf.topk_group or 1, hf.num_experts_per_tok
    if n_group == 1 or topk_group >= n_group:  # every group selected: plain top-k
        return {}
    # HF scores a group by the sum of its best 2 biased scores; Megatron (ours) by its best topk/group_topk
    if k % topk_group or k // topk_group != 2:
        raise _unsupported(hf, f"n_group={n_group}, topk_group={topk_group}, num_experts_per_tok={k} (group scores "
                               "match only when num_experts_per_tok / topk_group == 2)")
    return dict(num_groups=n_group, group_topk=topk_group)


def _deepseek_v3(hf) -> dict:
    if hf.num_key_value_heads not in (None, hf.num_attention_heads):
        raise _unsupported(hf, f"num_key_value_heads={hf.num_key_value_heads} != num_attention_heads")
    if hf.rms_norm_eps != 1e-6:  # HF's q_a/kv_a latent norms use eps=1e-6 whatever rms_norm_eps says; ours one eps
        raise _unsupported(hf, f"rms_norm_eps={hf.rms_norm_eps} (the latent norms use 1e-6)")
    if getattr(hf, "scoring_func", "sigmoid") != "sigmoid":
        raise _unsupported(hf, f"scoring_func={hf.scoring_func!r}")
    if bool(hf.norm_topk_prob) != (hf.num_experts_per_tok > 1):  # our sigmoid gates are renormalised iff topk > 1
        raise _unsupported(hf, f"norm_topk_prob={hf.norm_topk_prob} with num_experts_per_tok={hf.num_experts_per_tok}")
    scale = hf.routed_scaling_factor
    return dict(attention_type="mla", q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank,
                qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
                ffn_hidden_size=hf.intermediate_size, num_experts=hf.n_routed_experts,
                moe_ffn_hidden_size=hf.moe_intermediate_size, first_k_dense=hf.first_k_dense_replace or 0,
                shared_expert_ffn_size=(hf.n_shared_experts or 0) * hf.moe_intermediate_size,
                score_function="sigmoid", topk_scaling_factor=None if scale in (None, 1.0) else float(scale),
                expert_bias=True, load_balancing="seq_aux_loss", aux_loss_coeff=1e-4, **_deepseek_groups(hf))


_FROM_HF = {"mixtral": _mixtral, "qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3}


def read_hf_config(path: str):
    """The transformers config of a local Hugging Face model directory (no hub access)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory: config.json is missing")
    try:
        import transformers
    except ImportError as e:  # an optional dependency: pip install 'lightning-moe[hf]'
        raise ImportError("importing Hugging Face checkpoints needs transformers and safetensors: "
                          "pip install 'lightning-moe[hf]'") from e
    return transformers.AutoConfig.from_pretrained(path, local_files_only=True)


def config_from_hf(hf_config, **overrides) -> ModelConfig:
    """Our ModelConfig for a transformers MixtralConfig, Qwen3MoeConfig or DeepseekV3Config. ``overrides`` set
    further fields (``seq_length``, ``dispatcher``, ``capacity_factor``, ...). The HF config travels in
    ``cfg.extra["hf_config"]`` so that ``save_hf`` writes the same config.json back."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _FROM_HF:
        raise ValueError(f"config_from_hf: unsupported model_type {model_type!r}; supported: {ARCHITECTURES}")
    fields = {**_common(hf_config), **_FROM_HF[model_type](hf_config)}
    extra = {"hf_model_type": model_type, "hf_config": hf_config.to_dict()}
    return ModelConfig(**{**fields, "extra": extra, **overrides})


def _check_exportable(cfg: ModelConfig, arch: str) -> None:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"{arch} cannot express this ModelConfig: {what}")

    moe = [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
    need(not cfg.expert_bias or arch == "deepseek_v3", "expert_bias")
    if arch == "deepseek_v3":
        need(cfg.attention_type == "mla" and cfg.score_function == "sigmoid", "MLA with sigmoid routing")
        need(moe == [i >= cfg.first_k_dense for i in range(cfg.num_layers)], "MoE layers after first_k_dense only")
        need(cfg.shared_expert_ffn_size % cfg.moe_ffn_hidden_size == 0, "shared experts of whole expert size")
        need(not cfg.num_groups or cfg.topk // cfg.group_topk == 2, "groups scored by their best 2 experts")
        need(cfg.norm_eps == 1e-6, "norm_eps=1e-6")
        return
    need(cfg.attention_type == "gqa" and cfg.score_function == "softmax", "GQA with softmax routing")
    need(not cfg.num_groups and not cfg.topk_scaling_factor and not cfg.shared_expert_ffn_size,
         "no groups, scaling or shared experts")
    need(cfg.qk_norm == (arch == "qwen3_moe"), f"qk_norm={cfg.qk_norm}")
    if arch == "mixtral":
        need(all(moe) and not cfg.pre_softmax, "every layer MoE with renormalised top-k gates")


def hf_config_for(cfg: ModelConfig, model_type: Optional[str] = None):
    """The transformers config of ``cfg`` (the inverse of ``config_from_hf``), starting from the HF config it came
    from, if any, so that fields we do not model (token ids, max_position_embeddings) survive."""
    import transformers

    arch = _arch(cfg, model_type)
    _check_exportable(cfg, arch)
    d = dict(cfg.extra.get("hf_config") or {}) if cfg.extra.get("hf_model_type") == arch else {}
    d.setdefault("max_position_embeddings", cfg.seq_length)
    d.update(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
             num_attention_heads=cfg.num_attention_heads, rms_norm_eps=cfg.norm_eps,
             tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std,
             num_experts_per_tok=cfg.topk, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})
    if arch == "deepseek_v3":
        d.update(num_key_value_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank,
                 kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                 qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                 intermediate_size=cfg.ffn_hidden_size, moe_intermediate_size=cfg.moe_ffn_hidden_size,
                 n_routed_experts=cfg.num_experts, first_k_dense_replace=cfg.first_k_dense,
                 n_shared_experts=cfg.shared_expert_ffn_size // cfg.moe_ffn_hidden_size,
                 n_group=cfg.num_groups or 1, topk_group=cfg.group_topk or 1, norm_topk_prob=cfg.topk > 1,
                 routed_scaling_factor=cfg.topk_scaling_factor or 1.0, rope_interleave=_rope_interleave(cfg))
    else:
        d.update(num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, router_aux_loss_coef=cfg.aux_loss_coeff)
    if arch == "mixtral":
        d.update(intermediate_size=cfg.moe_ffn_hidden_size, num_local_experts=cfg.num_experts)
    elif arch == "qwen3_moe":
        d.update(intermediate_size=cfg.ffn_hidden_size, moe_intermediate_size=cfg.moe_ffn_hidden_size,
                 num_experts=cfg.num_experts, norm_topk_prob=not cfg.pre_softmax, decoder_sparse_step=1,
                 mlp_only_layers=[i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)])
        d.pop("num_local_experts", None)  # to_dict's name for num_experts; a stale copy would win in from_dict
    return getattr(transformers, _HF_CLASSES[arch]).from_dict(d)


def _arch(cfg: ModelConfig, model_type: Optional[str] = None) -> str:
    arch = model_type or cfg.extra.get("hf_model_type")
    if arch is None:  # a model not made from an HF config: the architecture its features select
        arch = "deepseek_v3" if cfg.attention_type == "mla" else "qwen3_moe" if cfg.qk_norm else "mixtral"
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported HF model_type {arch!r}; supported: {ARCHITECTURES}")
    return arch


def _rope_interleave(cfg: ModelConfig) -> bool:
    return bool((cfg.extra.get("hf_config") or {}).get("rope_interleave", True))


# ------------------------------------------------------------------------------------------------ name mapping
@dataclass
class _Dense:
    """A non-expert tensor of ours: the HF tensors ``keys`` stacked along dim 0 (SwiGLU's gate and up), each
    TP-sharded along ``shard_dim`` if set; ``perm``: our rows are the HF rows ``perm`` (rope layout)."""
    keys: tuple[str, ...]
    shard_dim: Optional[int] = None
    perm: Optional[torch.Tensor] = None


@dataclass
class _Experts:
    """GroupedExperts.w13 (``which="w13"``) or .w2 of one layer; ``prefix``: the HF experts module."""
    prefix: str
    which: str
    mixtral: bool


def _rope_perm(n_heads: int, nope: int, rope: int, offset: int = 0) -> torch.Tensor:
    """Row order of ours in HF's interleaved layout: our rope row j < R/2 is HF's 2j, row R/2 + j is HF's 2j+1."""
    inner = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    head = torch.cat([torch.arange(nope), nope + inner])
    return offset + (torch.arange(n_heads).unsqueeze(1) * (nope + rope) + head).flatten()


def _attention_specs(attn: nn.Module, hf: str, interleave: bool) -> dict[str, _Dense]:
    if not isinstance(attn, MLAttention):
        specs = {f"w{x}.weight": _Dense((f"{hf}.{x}_proj.weight",), 0) for x in "qkv"}
        specs["wo.weight"] = _Dense((f"{hf}.o_proj.weight",), 1)
        if attn.q_norm is not None:
            specs.update({f"{x}_norm.weight": _Dense((f"{hf}.{x}_norm.weight",)) for x in "qk"})
        return specs
    cfg = attn.cfg
    H, N, R, C = cfg.num_attention_heads, attn.nope, attn.rope_dim, attn.kv_lora
    q_perm = _rope_perm(H, N, R) if interleave else None
    kv_perm = _rope_perm(1, C, R) if interleave else None
    specs = {"wkv_a.weight": _Dense((f"{hf}.kv_a_proj_with_mqa.weight",), perm=kv_perm),
             "kv_a_norm.weight": _Dense((f"{hf}.kv_a_layernorm.weight",)),
             "wkv_b.weight": _Dense((f"{hf}.kv_b_proj.weight",), 0),
             "wo.weight": _Dense((f"{hf}.o_proj.weight",), 1)}
    if cfg.q_lora_rank:
        specs.update({"wq_a.weight": _Dense((f"{hf}.q_a_proj.weight",)),
                      "q_a_norm.weight": _Dense((f"{hf}.q_a_layernorm.weight",)),
                      "wq_b.weight": _Dense((f"{hf}.q_b_proj.weight",), 0, q_perm)})
    else:
        specs["wq.weight"] = _Dense((f"{hf}.q_proj.weight",), 0, q_perm)
    return specs


def _mlp_specs(hf: str) -> dict[str, _Dense]:
    return {"w13.weight": _Dense((f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight"), 0),
            "w2.weight": _Dense((f"{hf}.down_proj.weight",), 1)}


def _block_specs(block: nn.Module, i: int, arch: str, interleave: bool) -> dict[str, object]:
    hf = f"model.layers.{i}"
    specs: dict[str, object] = {"attn_norm.weight": _Dense((f"{hf}.input_layernorm.weight",)),
                                "ffn_norm.weight": _Dense((f"{hf}.post_attention_layernorm.weight",))}
    specs.update({f"attn.{k}": v for k, v in _attention_specs(block.attn, f"{hf}.self_attn", interleave).items()})
    if isinstance(block.ffn, SwiGLU):
        specs.update({f"ffn.{k}": v for k, v in _mlp_specs(f"{hf}.mlp").items()})
        return specs
    moe = f"{hf}.block_sparse_moe" if arch == "mixtral" else f"{hf}.mlp"
    specs["ffn.router.weight"] = _Dense((f"{moe}.gate.weight",))
    if block.ffn.router.expert_bias is not None:
        specs["ffn.router.expert_bias"] = _Dense((f"{moe}.gate.e_score_correction_bias",))
    for w in ("w13", "w2"):
        specs[f"ffn.experts.{w}"] = _Experts(f"{moe}.experts", w, arch == "mixtral")
    if block.ffn.shared_experts is not None:
        specs.update({f"ffn.shared_experts.{k}": v for k, v in _mlp_specs(f"{moe}.shared_experts").items()})
    return specs


def _specs(model: MoETransformer, arch: str) -> dict[str, object]:
    """Our tensor name -> where it lives in the HF checkpoint, for every tensor this rank holds."""
    interleave = arch == "deepseek_v3" and _rope_interleave(model.cfg)
    specs: dict[str, object] = {}
    if model.embed is not None:
        specs["embed.weight"] = _Dense(("model.embed_tokens.weight",), 0)
    if model.norm is not None:
        specs["norm.weight"] = _Dense(("model.norm.weight",))
    if model.head is not None:
        specs["head.weight"] = _Dense(("lm_head.weight",), 0)
    for block in model.layers:
        i = block.layer_idx
        specs.update({f"layers.{i}.{k}": v for k, v in _block_specs(block, i, arch, interleave).items()})
    return specs


def _tensors(model: MoETransformer) -> dict[str, torch.Tensor]:
    """Parameters and the expert-bias buffers: what a checkpoint fills (router counters are training state)."""
    out = dict(model.named_parameters())
    out.update({n: b for n, b in model.named_buffers() if n.endswith("router.expert_bias")})
    return out


# ------------------------------------------------------------------------------------------------ reading
class _Checkpoint:
    """A safetensors directory opened lazily: tensor name -> file, slices read on demand (memory-mapped)."""

    def __init__(self, path: str, stack: contextlib.ExitStack):
        from safetensors import safe_open

        self._open, self._stack, self._handles = safe_open, stack, {}
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                self.files = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
        else:
            files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
            if not files:
                raise ValueError(f"load_hf_weights: no *.safetensors file in {path}")
            self.files = {k: fn for fn in files for k in self._handle(fn).keys()}

    def _handle(self, fn: str):
        if fn not in self._handles:
            self._handles[fn] = self._stack.enter_context(self._open(fn, framework="pt"))
        return self._handles[fn]

    def _key(self, key: str) -> str:
        # Mixtral's MoE block is block_sparse_moe on the hub and in save_pretrained, mlp in transformers 5 memory
        alias = key.replace(".block_sparse_moe.", ".mlp.")
        return alias if key not in self.files and alias in self.files else key

    def has(self, key: str) -> bool:
        return self._key(key) in self.files

    def shape(self, key: str) -> tuple[int, ...]:
        if not self.has(key):
            raise ValueError(f"load_hf_weights: tensor {key!r} is missing from the checkpoint")
        key = self._key(key)
        return tuple(self._handle(self.files[key]).get_slice(key).get_shape())

    def read(self, key: str, index: tuple) -> torch.Tensor:
        key = self._key(key)
        return self._handle(self.files[key]).get_slice(key)[index]


def _check_shape(key: str, got: tuple, want: tuple) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"load_hf_weights: tensor {key!r} has shape {list(got)}, the model needs {list(want)}")


def _read_dense(ck: _Checkpoint, spec: _Dense, local: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    parts, want = len(spec.keys), list(local.shape)
    want[0] //= parts  # the full shape of each HF tensor
    if spec.shard_dim is not None:
        want[spec.shard_dim] *= tp
    pieces = []
    for key in spec.keys:
        _check_shape(key, ck.shape(key), want)
        index = [slice(None)] * len(want)
        if spec.shard_dim is not None:
            n = want[spec.shard_dim] // tp
            index[spec.shard_dim] = slice(tp_rank * n, (tp_rank + 1) * n)
        if spec.perm is None:
            pieces.append(ck.read(key, tuple(index)))
            continue
        # the HF rows of our local rows form one contiguous range (the permutation stays inside a head)
        rows = spec.perm[index[0]]
        lo, hi = int(rows.min()), int(rows.max()) + 1
        pieces.append(ck.read(key, (slice(lo, hi), *index[1:]))[rows - lo])
    return torch.cat(pieces, dim=0) if parts > 1 else pieces[0]


def _read_experts(ck: _Checkpoint, spec: _Experts, ex: GroupedExperts, hidden: int) -> torch.Tensor:
    L, off, Fl, r = ex.num_local_experts, ex.expert_offset, ex.ffn, ex.etp_rank
    F_, cols = Fl * ex.etp_size, slice(r * Fl, (r + 1) * Fl)
    gate, up, down = ("w1", "w3", "w2") if spec.mixtral else ("gate_proj", "up_proj", "down_proj")
    per_expert = f"{spec.prefix}.{off}.{gate}.weight"
    if not ck.has(per_expert) and ck.has(f"{spec.prefix}.gate_up_proj"):
        return _read_fused_experts(ck, spec, ex, hidden)
    out = []
    for e in range(off, off + L):
        keys = [f"{spec.prefix}.{e}.{w}.weight" for w in (gate, up, down)]
        if spec.which == "w13":
            for k in keys[:2]:
                _check_shape(k, ck.shape(k), (F_, hidden))
            out.append(torch.cat([ck.read(k, (cols, slice(None))).t() for k in keys[:2]], dim=1))
        else:
            _check_shape(keys[2], ck.shape(keys[2]), (hidden, F_))
            out.append(ck.read(keys[2], (slice(None), cols)).t())
    return torch.stack(out)


def _read_fused_experts(ck: _Checkpoint, spec: _Experts, ex: GroupedExperts, hidden: int) -> torch.Tensor:
    """transformers >= 5 in-memory layout: gate_up_proj [E, 2F, D] ([gate; up]) and down_proj [E, D, F]."""
    L, off, Fl, r = ex.num_local_experts, ex.expert_offset, ex.ffn, ex.etp_rank
    F_, experts = Fl * ex.etp_size, slice(off, off + L)
    prefix = spec.prefix.replace(".block_sparse_moe.", ".mlp.")
    key = f"{prefix}.gate_up_proj" if spec.which == "w13" else f"{prefix}.down_proj"
    shape = ck.shape(key)
    E = shape[0]  # the number of experts is checked by the router weight; here the per-expert shape
    if spec.which == "w2":
        _check_shape(key, shape, (E, hidden, F_))
        return ck.read(key, (experts, slice(None), slice(r * Fl, (r + 1) * Fl))).transpose(1, 2)
    _check_shape(key, shape, (E, 2 * F_, hidden))
    gate = ck.read(key, (experts, slice(r * Fl, (r + 1) * Fl), slice(None)))
    up = ck.read(key, (experts, slice(F_ + r * Fl, F_ + (r + 1) * Fl), slice(None)))
    return torch.cat([gate, up], dim=1).transpose(1, 2)


def _hf_model_type(path: str, cfg: ModelConfig) -> str:
    config_json = os.path.join(path, "config.json")
    if os.path.isfile(config_json):
        with open(config_json) as f:
            hf = json.load(f)
        if hf.get("quantization_config"):  # e.g. the FP8 DeepSeek-V3 release: block scales we do not apply
            raise ValueError(f"load_hf_weights: {path} is quantized ({hf['quantization_config'].get('quant_method')}); "
                             "dequantize it to bf16/fp32 first")
        return hf.get("model_type") or _arch(cfg)
    return _arch(cfg)


@torch.no_grad()
def load_hf_weights(model: MoETransformer, path: str) -> None:
    """Fill ``model`` (this rank's shard under TP/EP/ETP/PP) from the HF safetensors checkpoint directory ``path``,
    reading only this rank's slices. Raises ValueError naming the tensor when one is missing or misshapen."""
    arch = _hf_model_type(path, model.cfg)
    if arch not in ARCHITECTURES:
        raise ValueError(f"load_hf_weights: unsupported model_type {arch!r} in {path}; supported: {ARCHITECTURES}")
    specs, tensors = _specs(model, arch), _tensors(model)
    unmapped = sorted(set(tensors) - set(specs))
    if unmapped:
        raise ValueError(f"load_hf_weights: no {arch} tensor for {unmapped[:5]}")
    tp_rank, tp = model.ctx.rank("tp"), model.ctx.tp
    modules = dict(model.named_modules())
    with contextlib.ExitStack() as stack:
        ck = _Checkpoint(path, stack)
        for name, t in tensors.items():
            spec = specs[name]
            if isinstance(spec, _Experts):
                value = _read_experts(ck, spec, modules[name.rsplit(".", 1)[0]], model.cfg.hidden_size)
            else:
                value = _read_dense(ck, spec, t, tp_rank, tp)
            if value.shape != t.shape:  # a bug here, not in the checkpoint
                raise ValueError(f"load_hf_weights: {name} read as {list(value.shape)}, needs {list(t.shape)}")
            t.copy_(value)


# ------------------------------------------------------------------------------------------------ export
def _export_dense(spec: _Dense, t: torch.Tensor) -> dict[str, torch.Tensor]:
    if spec.perm is not None:
        t = t[torch.argsort(spec.perm)]
    return {k: p.contiguous() for k, p in zip(spec.keys, t.chunk(len(spec.keys), dim=0))}


def _export_experts(spec: _Experts, t: torch.Tensor) -> dict[str, torch.Tensor]:
    gate, up, down = ("w1", "w3", "w2") if spec.mixtral else ("gate_proj", "up_proj", "down_proj")
    out = {}
    for e in range(t.shape[0]):
        if spec.which == "w2":
            out[f"{spec.prefix}.{e}.{down}.weight"] = t[e].t().contiguous()
            continue
        g, u = t[e].chunk(2, dim=1)
        out[f"{spec.prefix}.{e}.{gate}.weight"] = g.t().contiguous()
        out[f"{spec.prefix}.{e}.{up}.weight"] = u.t().contiguous()
    return out


@torch.no_grad()
def export_hf_weights(model: MoETransformer, model_type: Optional[str] = None) -> dict[str, torch.Tensor]:
    """The HF state dict (the layout ``save_pretrained`` writes) of a whole one-process model."""
    ctx = model.ctx
    if ctx.world_size != 1 or any(ctx.size(n) != 1 for n in ("tp", "pp", "ep", "etp", "cp")):
        raise ValueError(f"export_hf_weights: needs the whole model on one process, got {ctx}")
    arch = _arch(model.cfg, model_type)
    specs, out = _specs(model, arch), {}
    for name, t in _tensors(model).items():
        spec = specs[name]
        out.update(_export_experts(spec, t) if isinstance(spec, _Experts) else _export_dense(spec, t))
    if arch == "deepseek_v3":  # HF always has the correction bias: zeros select like no bias
        for block in model.layers:
            if block.is_moe and block.ffn.router.expert_bias is None:
                out[f"model.layers.{block.layer_idx}.mlp.gate.e_score_correction_bias"] = torch.zeros(
                    model.cfg.num_experts)
    return out


def save_hf(model: MoETransformer, path: str, model_type: Optional[str] = None) -> None:
    """Write ``model`` as an HF checkpoint directory: model.safetensors and config.json."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    hf_config = hf_config_for(model.cfg, model_type)
    state = export_hf_weights(model, hf_config.model_type)
    hf_config.architectures = [_HF_CLASSES[hf_config.model_type].replace("Config", "ForCausalLM")]
    hf_config.save_pretrained(path)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def export_checkpoint(ckpt_dir: str, out_dir: str, model_type: Optional[str] = None) -> None:
    """Write a ``moe_fold`` checkpoint (written under any layout) as an HF checkpoint directory, on one process: the
    model config from the checkpoint's hyperparameters, the weights (fp32 main copies when the run had them) from
    its layout-independent tensors. Nothing is unpickled beyond ``weights_only`` loading."""
    from lightning_moe.strategy.checkpoint import MODEL_DCP, shard_name
    from lightning_moe.strategy.parallel_context import ParallelContext
    from lightning_moe.strategy.reshard import load_pieces, model_pieces

    shard = os.path.join(ckpt_dir, shard_name(0))
    if not os.path.isfile(shard) or not os.path.isfile(os.path.join(ckpt_dir, MODEL_DCP, ".metadata")):
        raise ValueError(f"{ckpt_dir} is not a moe_fold checkpoint with layout-independent tensors "
                         f"({shard_name(0)} and {MODEL_DCP}/ expected)")
    hparams = torch.load(shard, map_location="cpu", weights_only=True).get("hyper_parameters", {})
    if "config" not in hparams:
        raise ValueError(f"{shard} has no model config in its hyper_parameters (not a MoELanguageModel checkpoint)")
    ctx = ParallelContext.single()
    model = MoETransformer(ModelConfig(**hparams["config"]), ctx)
    # the checkpoint's keys are the LightningModule's: MoELanguageModel holds the transformer as ``model``
    load_pieces(model_pieces(model, ctx, prefix="model."), os.path.join(ckpt_dir, MODEL_DCP))
    save_hf(model, out_dir, model_type)
