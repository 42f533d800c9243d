"""Model configuration: one dataclass, named presets with published shapes, and validation.

Router fields follow Megatron Core's names in snake_case (``moe_router_topk`` -> ``topk`` and so on).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Literal, Optional, Union, get_args, get_origin, get_type_hints

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
DROP_POLICIES = ("probs", "position")
BUILTIN_DISPATCHERS = ("alltoall", "alltoall_dedup", "allgather", "deepep")
ATTENTION_TYPES = ("gqa", "mla")
DOCUMENT_ATTENTION = ("auto", "flex", "dense")


@dataclass
class ModelConfig:
    # --- transformer ---
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    num_kv_heads: Optional[int] = None  # None: same as num_attention_heads (MHA)
    head_dim: Optional[int] = None  # None: hidden_size // num_attention_heads
    ffn_hidden_size: int = 256  # dense SwiGLU layers
    seq_length: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    qk_norm: bool = False  # Qwen3 normalises q and k per head
    tie_embeddings: bool = False
    init_std: float = 0.02
    attention_type: Literal["gqa", "mla"] = "gqa"
    # MLA shapes (DeepSeek-V3), used when attention_type="mla" (modules/mla.py); q_lora_rank None: no q LoRA
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None

    # --- MoE placement ---
    num_experts: int = 8
    moe_ffn_hidden_size: int = 128
    moe_layer_freq: Union[int, list[int]] = 1  # int N: every Nth layer is MoE; list: 1 = MoE, 0 = dense, per layer
    first_k_dense: int = 0  # the first k layers are dense whatever moe_layer_freq says
    shared_expert_ffn_size: int = 0  # 0: no shared expert (DeepSeek-V3: 1 x moe_ffn_hidden_size)

    # --- router (Megatron semantics) ---
    topk: int = 2
    score_function: Literal["softmax", "sigmoid"] = "softmax"
    pre_softmax: bool = False
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    topk_scaling_factor: Optional[float] = None
    load_balancing: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] = "aux_loss"
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: Optional[float] = None
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    capacity_factor: Optional[float] = None  # None: dropless
    drop_policy: Literal["probs", "position"] = "probs"
    pad_to_capacity: bool = False

    # --- execution ---
    dispatcher: str = "alltoall"  # "alltoall" | "allgather" | "deepep" | "package.module.ClassName"
    # deepep only: size the receive side for the worst case so that no host sync waits for the counts
    sync_free_dispatch: bool = False
    # the router GEMM (Megatron's --moe-router-dtype): "fp32" multiplies float32 copies of the input and the weight;
    # "bf16" multiplies the bf16 input by the weight rounded to bf16 with float32 accumulation and float32 logits (on
    # CUDA one kernel, 1.8x faster at the Qwen3 shape and 6.4x at DeepSeek-V3's, where the fp32 GEMM is most of the
    # router). Scoring, top-k and the losses run in float32 either way.
    router_dtype: Literal["fp32", "bf16"] = "fp32"
    # packed documents' attention mask (modules/document_mask.py): "flex" a FlexAttention BlockMask (compiled on
    # CUDA; on CPU eager and forward-only), "dense" a (B, 1, S, S) boolean mask for SDPA (O(S²) memory), "auto" flex
    # on CUDA and dense elsewhere
    document_attention: Literal["auto", "flex", "dense"] = "auto"
    compile_router: bool = False  # torch.compile the router's scoring math on CUDA (it is launch-bound: ~40 tiny ops)
    # Megatron's --moe-shared-expert-overlap: shared experts on a side CUDA stream while the router, the dispatch and
    # the routed experts run (their backward follows them there); in order on CPU
    shared_expert_overlap: bool = False
    # Triton kernels on CUDA (Megatron's --moe-router-fusion / --moe-permute-fusion); the torch code is the reference
    # and the CPU path. router_fusion wins over compile_router, which then compiles only the reference's fallbacks.
    router_fusion: bool = True  # scores, top-k, gates, counts, loss partial sums: modules/fused_router.py
    permute_fusion: bool = True  # expert order by count + prefix sum, no argsort: modules/expert_order.py
    swiglu_fusion: bool = True  # (weighted) SwiGLU in one pass forward and one backward (Megatron's --bias-swiglu-fusion)
    # RoPE in one pass forward and one backward, with the q/k norms folded in (Qwen3), and MLA's split, rotation and
    # cat of its rope heads in one pass each way (Megatron's --apply-rope-fusion, fused_apply_mla_rope_for_q/_kv)
    rope_fusion: bool = True
    # the LM loss in one pass over the logits forward and one backward, in their dtype, with no float32 copy of them
    # (Megatron's --cross-entropy-loss-fusion); under TP over each vocab shard, as the unfused path
    cross_entropy_fusion: bool = True
    # the router probabilities weight each expert row after the activation, before the second GEMM (Megatron's
    # weighted SwiGLU), so the combine only sums: it keeps no expert output for the probabilities' gradient (one
    # activation of T*K*D per layer less). False: the combine weights the outputs (the probabilities' gradient is
    # then a dot product with each kept output row). The combine sums only what the experts weighted
    # (DispatchState.probs_applied): a custom dispatcher that does not carry probs_M combines with the weights.
    probs_in_experts: bool = True
    # each expert's rows in the experts' input start on a multiple of this (zero rows between): 16 lets FP8 grouped
    # GEMMs use the layout as it is (Megatron's --moe-router-padding-for-fp8); 1: no padding
    expert_rows_align: int = 1

    extra: dict = field(default_factory=dict)  # free-form notes carried by presets

    def __post_init__(self) -> None:
        self._check_types()
        # remembered (not a field) so that replace() re-derives them instead of copying stale values
        object.__setattr__(self, "_derived", {n for n in ("num_kv_heads", "head_dim") if getattr(self, n) is None})
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.attention_type == "mla" and self.qk_nope_head_dim and self.qk_rope_head_dim:
                self.head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
            else:
                self.head_dim = self.hidden_size // max(self.num_attention_heads, 1)
        self.validate()

    # ------------------------------------------------------------------ validation
    def _check_types(self) -> None:
        for name, value in self.typed({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}).items():
            setattr(self, name, value)

    @classmethod
    def typed(cls, values: dict) -> dict:
        """``values`` with each field of its declared type. Strings are read as YAML first: the CLI hands
        ``--model.overrides.*`` over as text (``"8"``, ``"1e-3"``, ``"true"``, ``"null"``). A wrong type is one
        error naming the field."""
        import yaml
        hints, out = get_type_hints(cls), dict(values)
        for name, value in values.items():
            hint = hints[name]
            args = get_args(hint) if get_origin(hint) is Union else (hint,)
            if get_origin(hint) is Literal or name in ("dispatcher", "extra"):
                continue  # checked by value in validate()
            if isinstance(value, str) and str not in args:
                for parse in (yaml.safe_load, int, float):  # YAML 1.1 reads "1e-3" as text
                    try:
                        value = parse(value)
                    except (yaml.YAMLError, ValueError):
                        continue
                    if not isinstance(value, str):
                        break
            ok = [a for a in args if (a is type(None) and value is None) or (a is bool and isinstance(value, bool))
                  or (a is int and isinstance(value, int) and not isinstance(value, bool))
                  or (a is float and isinstance(value, (int, float)) and not isinstance(value, bool))
                  or (get_origin(a) is list and isinstance(value, list))]
            if not ok:
                names = " or ".join("None" if a is type(None) else getattr(a, "__name__", str(a)) for a in args)
                raise ValueError(f"ModelConfig.{name}: expected {names}, got {values[name]!r}")
            out[name] = float(value) if ok[0] is float else value
        return out

    def validate(self) -> None:
        def bad(name: str, msg: str) -> ValueError:
            return ValueError(f"ModelConfig.{name}: {msg}")

        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "seq_length", "num_experts",
                     "moe_ffn_hidden_size", "ffn_hidden_size", "topk"):
            if getattr(self, name) <= 0:
                raise bad(name, f"must be positive, got {getattr(self, name)}")
        for name in ("num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise bad(name, f"must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_kv_heads:
            raise bad("num_kv_heads", f"{self.num_kv_heads} must divide num_attention_heads={self.num_attention_heads}")
        if self.attention_type not in ATTENTION_TYPES:
            raise bad("attention_type", f"unknown {self.attention_type!r}; choose from {ATTENTION_TYPES}")
        if self.document_attention not in DOCUMENT_ATTENTION:
            raise bad("document_attention", f"unknown {self.document_attention!r}; choose from {DOCUMENT_ATTENTION}")
        if self.router_dtype not in ("fp32", "bf16"):
            raise bad("router_dtype", f"unknown {self.router_dtype!r}; choose from ('fp32', 'bf16')")
        if self.score_function not in SCORE_FUNCTIONS:
            raise bad("score_function", f"unknown {self.score_function!r}; choose from {SCORE_FUNCTIONS}")
        if self.load_balancing not in LOAD_BALANCING:
            raise bad("load_balancing", f"unknown {self.load_balancing!r}; choose from {LOAD_BALANCING}")
        if self.drop_policy not in DROP_POLICIES:
            raise bad("drop_policy", f"unknown {self.drop_policy!r}; choose from {DROP_POLICIES}")
        if self.topk > self.num_experts:
            raise bad("topk", f"topk={self.topk} exceeds num_experts={self.num_experts}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise bad("capacity_factor", f"must be > 0 or None (dropless), got {self.capacity_factor}")
        if self.expert_rows_align < 1:
            raise bad("expert_rows_align", f"must be >= 1, got {self.expert_rows_align}")
        if self.pad_to_capacity and self.capacity_factor is None:
            raise bad("pad_to_capacity", "needs capacity_factor to be set")
        if self.topk == 1 and self.score_function == "softmax" and not self.pre_softmax:
            raise bad("pre_softmax", "topk=1 with softmax scoring needs pre_softmax=True (a softmax over one logit is "
                                     "always 1, so the router would get no gradient), as Megatron requires")
        if self.pre_softmax and self.score_function != "softmax":
            raise bad("pre_softmax", "only applies to score_function='softmax'")
        if (self.num_groups is None) != (self.group_topk is None):
            raise bad("group_topk", "num_groups and group_topk must be set together")
        if self.num_groups is not None:
            if self.num_groups <= 0 or self.num_experts % self.num_groups:
                raise bad("num_groups", f"{self.num_groups} must divide num_experts={self.num_experts}")
            if not 0 < self.group_topk <= self.num_groups:
                raise bad("group_topk", f"{self.group_topk} must be in 1..num_groups={self.num_groups}")
            if self.topk % self.group_topk:
                raise bad("group_topk", f"group_topk={self.group_topk} must divide topk={self.topk}")
            if self.topk // self.group_topk > self.num_experts // self.num_groups:
                raise bad("group_topk", f"topk/group_topk={self.topk // self.group_topk} exceeds the "
                                        f"{self.num_experts // self.num_groups} experts per group")
        if self.expert_bias and self.score_function != "sigmoid":
            raise bad("expert_bias", "the aux-loss-free expert bias needs score_function='sigmoid' (as in Megatron)")
        if self.aux_loss_coeff < 0:
            raise bad("aux_loss_coeff", f"must be >= 0, got {self.aux_loss_coeff}")
        if self.z_loss_coeff is not None and self.z_loss_coeff < 0:
            raise bad("z_loss_coeff", f"must be >= 0, got {self.z_loss_coeff}")
        if self.bias_update_rate < 0:
            raise bad("bias_update_rate", f"must be >= 0, got {self.bias_update_rate}")
        if self.first_k_dense < 0 or self.first_k_dense > self.num_layers:
            raise bad("first_k_dense", f"must be in 0..num_layers={self.num_layers}, got {self.first_k_dense}")
        if isinstance(self.moe_layer_freq, list):
            if len(self.moe_layer_freq) != self.num_layers or any(v not in (0, 1) for v in self.moe_layer_freq):
                raise bad("moe_layer_freq", f"a list must hold num_layers={self.num_layers} entries of 0 or 1")
        elif self.moe_layer_freq <= 0:
            raise bad("moe_layer_freq", f"must be positive, got {self.moe_layer_freq}")
        if self.shared_expert_ffn_size < 0:
            raise bad("shared_expert_ffn_size", f"must be >= 0, got {self.shared_expert_ffn_size}")
        if self.shared_expert_overlap and not self.shared_expert_ffn_size:
            raise bad("shared_expert_overlap", "needs shared experts (shared_expert_ffn_size > 0)")
        if self.sync_free_dispatch and self.dispatcher != "deepep":
            raise bad("sync_free_dispatch", f"needs dispatcher='deepep' (got {self.dispatcher!r}): DeepEP's "
                                            "worst-case receive buffers keep the counts on the device")
        if "." not in self.dispatcher and self.dispatcher not in BUILTIN_DISPATCHERS:
            raise bad("dispatcher", f"unknown {self.dispatcher!r}; choose from {BUILTIN_DISPATCHERS} "
                                    "or give a class path 'package.module.ClassName'")

    # ------------------------------------------------------------------ derived
    def is_moe_layer(self, i: int) -> bool:
        if i < self.first_k_dense:
            return False
        if isinstance(self.moe_layer_freq, list):
            return bool(self.moe_layer_freq[i])
        return i % self.moe_layer_freq == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def replace(self, **overrides) -> "ModelConfig":
        return dataclasses.replace(self, **{**{n: None for n in self._derived}, **overrides})

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "ModelConfig":
        """A named preset with fields overridden, e.g. ``from_preset("qwen3-30b-a3b", num_layers=8, vocab_size=32768)``.

        Shrinking depth keeps ``first_k_dense`` no larger than the depth; a list ``moe_layer_freq`` is recomputed.
        """
        if name not in PRESETS:
            raise ValueError(f"ModelConfig.from_preset: unknown preset {name!r}; choose from {sorted(PRESETS)}")
        fields = dict(PRESETS[name])
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            hints = [f"{u!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(u, names, 1)) else
                     repr(u) for u in unknown]
            raise ValueError(f"ModelConfig: unknown fields {', '.join(hints)}")
        fields.update(cls.typed(overrides))
        if "num_layers" in overrides and "first_k_dense" not in overrides:
            fields["first_k_dense"] = min(fields.get("first_k_dense", 0), max(fields["num_layers"] - 1, 0))
        return cls(**fields)


PRESETS: dict[str, dict] = {
    # byte-level tiny model for CPU demos and tests
    "tiny": dict(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                 ffn_hidden_size=256, seq_length=128, num_experts=8, moe_ffn_hidden_size=128, topk=2,
                 aux_loss_coeff=1e-2, z_loss_coeff=1e-3),
    # mistralai/Mixtral-8x7B-v0.1 config.json
    "mixtral-8x7b": dict(vocab_size=32000, hidden_size=4096, num_layers=32, num_attention_heads=32, num_kv_heads=8,
                         ffn_hidden_size=14336, seq_length=4096, rope_theta=1e6, norm_eps=1e-5, num_experts=8,
                         moe_ffn_hidden_size=14336, topk=2, score_function="softmax", pre_softmax=False,
                         aux_loss_coeff=0.02),
    # Qwen/Qwen3-30B-A3B config.json (all 48 layers MoE, norm_topk_prob, qk-norm)
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, num_layers=48, num_attention_heads=32, num_kv_heads=4,
                          head_dim=128, ffn_hidden_size=6144, seq_length=4096, rope_theta=1e6, norm_eps=1e-6,
                          qk_norm=True, num_experts=128, moe_ffn_hidden_size=768, topk=8, score_function="softmax",
                          pre_softmax=False, aux_loss_coeff=1e-3),
    # deepseek-ai/DeepSeek-V3 config.json: 3 dense layers, 1 shared expert, sigmoid routing with the aux-loss-free
    # expert bias, 8 groups with top-4 groups, routed scaling 2.5, sequence-wise aux loss alpha=1e-4.
    "deepseek-v3": dict(vocab_size=129280, hidden_size=7168, num_layers=61, num_attention_heads=128,
                        ffn_hidden_size=18432, seq_length=4096, rope_theta=10000.0, norm_eps=1e-6,
                        attention_type="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, num_experts=256, moe_ffn_hidden_size=2048,
                        first_k_dense=3, shared_expert_ffn_size=2048, topk=8, score_function="sigmoid",
                        num_groups=8, group_topk=4, topk_scaling_factor=2.5, expert_bias=True,
                        bias_update_rate=1e-3, load_balancing="seq_aux_loss", aux_loss_coeff=1e-4),
}
