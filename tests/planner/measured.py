"""Every full-model layout measured in docs/PERFORMANCE.md, as data for the planner's calibration tests.

One row per measured run: the model, GPU kind and count, the folded layout, micro-batch size and micro-batches per
optimizer step (accumulation, or the pipeline's micro-batches), the options that change memory or time, and what was
measured (TFLOPS/GPU by Megatron's formula, peak memory allocated on rank 0; None where the doc gives none).
``session`` groups the runs measured together: throughput is compared (ranked) only inside one session and model.
Each layout appears in one row per session that measured it.

    python -m tests.planner.measured      # the calibration table of docs/PERFORMANCE.md
"""

from __future__ import annotations

from typing import NamedTuple, Optional

# every run before the fourth session of 2026-11-25 predates ModelConfig.cross_entropy_fusion and rope_fusion: the
# loss made float32 copies of the logits, and RoPE ran as torch's ops
UNFUSED_LOSS = dict(cross_entropy_fusion=False, rope_fusion=False)
# every run below predates ModelConfig.probs_in_experts: the combine weighted the expert outputs and kept them
BEFORE = dict(probs_in_experts=False, **UNFUSED_LOSS)
QWEN4 = ("qwen3-30b-a3b", dict(num_layers=4, vocab_size=32768, **BEFORE))
QWEN8 = ("qwen3-30b-a3b", dict(num_layers=8, vocab_size=32768, **BEFORE))
MIX2 = ("mixtral-8x7b", dict(num_layers=2, vocab_size=32000, **BEFORE))
MIX4 = ("mixtral-8x7b", dict(num_layers=4, vocab_size=32000, **BEFORE))
NOW_QWEN4 = ("qwen3-30b-a3b", dict(num_layers=4, vocab_size=32768, **UNFUSED_LOSS))
NOW_MIX2 = ("mixtral-8x7b", dict(num_layers=2, vocab_size=32000, **UNFUSED_LOSS))
NOW_DS2 = ("deepseek-v3", dict(num_layers=2, vocab_size=32768, first_k_dense=1, num_experts=32, **UNFUSED_LOSS))
FUSED_QWEN4 = ("qwen3-30b-a3b", dict(num_layers=4, vocab_size=32768))  # ModelConfig's fusions all on
FUSED_MIX2 = ("mixtral-8x7b", dict(num_layers=2, vocab_size=32000))
NEITHER_QWEN4 = ("qwen3-30b-a3b", dict(num_layers=4, vocab_size=32768, **UNFUSED_LOSS))
NEITHER_MIX2 = ("mixtral-8x7b", dict(num_layers=2, vocab_size=32000, **UNFUSED_LOSS))
FUSED = dict(expert_wgrad_fusion=True)  # rows without it predate the experts' fused wgrad (see predict)
# the fifth session of 2026-11-25: AdamW and the bf16 write-back in one pass (rows without it predate it), and MLA's
# fused rope heads (deepseek rows before it pin rope_fusion=False)
FUSED_OPT = dict(FUSED, fused_optimizer_writeback=True)
FUSED_DS2 = ("deepseek-v3", dict(num_layers=2, vocab_size=32768, first_k_dense=1, num_experts=32))
NOROPE_DS2 = ("deepseek-v3", dict(num_layers=2, vocab_size=32768, first_k_dense=1, num_experts=32, rope_fusion=False))


def deepseek2(experts: int) -> tuple:
    """The weak-scaling DeepSeek-V3: 1 dense + 1 MoE layer, 32 experts per GPU."""
    return "deepseek-v3", dict(num_layers=2, vocab_size=32768, first_k_dense=1, num_experts=experts, **BEFORE)


class Run(NamedTuple):
    session: str
    name: str  # the model as the doc names it
    model: tuple  # (preset, overrides)
    gpu: str
    gpus: int
    layout: str  # "tp2 cp1 pp1 vpp- ep4 etp1" style: only the sizes > 1 are written
    mb: int  # micro-batch per data-parallel rank
    m: int  # micro-batches per optimizer step (accumulation, or the pipeline's num_microbatches)
    tflops: float
    peak_gib: Optional[float]
    options: dict = {}  # planner settings: precision, recompute, offload, distributed_optimizer, ...
    seq: int = 4096

    def sizes(self) -> dict:
        out = dict(tp=1, cp=1, pp=1, vpp=None, ep=1, etp=1)
        for part in self.layout.split():
            key = part.rstrip("0123456789")
            out[key] = int(part[len(key):])
        return out


H1, H2, H4, H8 = "h100-80gb", "h200-141gb", "h200-141gb", "h200-141gb"
RUNS = [
    # One GPU, commit b2652db (H100 rows from one session; the H200 row from the 2xH200 session below)
    Run("h100-b2652db", "mixtral 2L", MIX2, H1, 1, "", 1, 4, 267.7, 57.2, dict(precision="bf16-mixed")),
    Run("h100-b2652db", "mixtral 2L", MIX2, H1, 1, "", 1, 4, 318.2, 57.1),
    Run("h100-b2652db", "mixtral 2L", MIX2, H1, 1, "", 2, 4, 395.6, 61.1),
    Run("h100-b2652db", "qwen3 4L", QWEN4, H1, 1, "", 2, 4, 213.7, 52.4),
    # Two H200s, commit b2652db
    Run("h200x2-b2652db", "qwen3 4L", QWEN4, H2, 1, "", 2, 4, 245.7, 52.4),
    Run("h200x2-b2652db", "qwen3 4L", QWEN4, H2, 2, "ep2", 2, 4, 206.5, 32.7),
    Run("h200x2-b2652db", "qwen3 4L", QWEN4, H2, 2, "ep2", 2, 4, 210.3, 33.2, dict(dispatcher="alltoall_dedup")),
    # Four H200s, folded TP / CP / EP, commit b591fbc
    Run("h200x4-b591fbc", "qwen3 4L", QWEN4, H4, 1, "", 2, 4, 244.4, 52.4),
    Run("h200x4-b591fbc", "qwen3 4L", QWEN4, H4, 4, "ep4", 2, 4, 170.8, 22.2),
    Run("h200x4-b591fbc", "qwen3 4L", QWEN4, H4, 4, "tp2 ep4", 2, 4, 117.9, 16.9),
    Run("h200x4-b591fbc", "qwen3 4L", QWEN4, H4, 4, "tp2 ep4", 4, 4, 157.8, 21.8),
    Run("h200x4-b591fbc", "qwen3 4L", QWEN4, H4, 4, "tp2 cp2 ep2 etp2", 2, 4, 59.7, 15.0),
    Run("h200x4-b591fbc", "mixtral 2L", MIX2, H4, 1, "", 1, 4, 352.3, 57.1),
    Run("h200x4-b591fbc", "mixtral 2L", MIX2, H4, 4, "ep4", 1, 4, 289.4, 21.9),
    Run("h200x4-b591fbc", "mixtral 2L", MIX2, H4, 4, "tp2 ep4", 2, 4, 276.0, 19.6),
    # Four H200s, pipeline layouts, commit 09e1a49
    Run("h200x4-09e1a49", "qwen3 4L", QWEN4, H4, 1, "", 2, 4, 234.5, 52.4),
    Run("h200x4-09e1a49", "qwen3 4L", QWEN4, H4, 4, "pp2 ep2", 2, 4, 87.4, 18.2),
    Run("h200x4-09e1a49", "qwen3 8L", QWEN8, H4, 4, "pp4", 2, 8, 93.9, 33.3),
    # Four H200s, issue 8, library 8d10245
    Run("h200x4-8d10245", "qwen3 4L", QWEN4, H4, 1, "", 2, 4, 238.9, 52.4),
    Run("h200x4-8d10245", "qwen3 4L", QWEN4, H4, 4, "ep4", 2, 4, 166.3, 22.5),
    Run("h200x4-8d10245", "qwen3 4L", QWEN4, H4, 4, "tp2 ep4", 4, 4, 151.3, 22.4),
    Run("h200x4-8d10245", "qwen3 4L", QWEN4, H4, 4, "pp2 ep2", 2, 4, 87.8, 18.2),
    Run("h200x4-8d10245", "qwen3 4L", QWEN4, H4, 4, "tp2 pp2 ep2", 2, 8, 66.1, 14.6),
    Run("h200x4-8d10245", "mixtral 2L", MIX2, H4, 1, "", 1, 4, 336.8, 57.1),
    Run("h200x4-8d10245", "mixtral 2L", MIX2, H4, 4, "ep4", 1, 4, 272.7, 22.2),
    Run("h200x4-8d10245", "mixtral 2L", MIX2, H4, 4, "tp2 ep4", 2, 4, 266.4, 19.6),
    Run("h200x4-8d10245", "mixtral 4L", MIX4, H4, 4, "pp2 ep2", 1, 4, 161.8, 33.5),
    # Eight H200s, weak scaling (EP = GPUs), issue 9, library 8d10245
    Run("h200x8-8d10245", "qwen3 4L", QWEN4, H8, 1, "", 2, 4, 237.1, 52.4),
    Run("h200x8-8d10245", "qwen3 4L", QWEN4, H8, 2, "ep2", 2, 4, 182.0, 32.4),
    Run("h200x8-8d10245", "qwen3 4L", QWEN4, H8, 4, "ep4", 2, 4, 159.6, 22.2),
    Run("h200x8-8d10245", "qwen3 4L", QWEN4, H8, 8, "ep8", 2, 4, 104.8, 17.1),
    Run("h200x8-8d10245", "deepseek-v3 2L, 32 experts/GPU", deepseek2(32), H8, 1, "", 1, 4, 399.2, 51.2),
    Run("h200x8-8d10245", "deepseek-v3 2L, 32 experts/GPU", deepseek2(64), H8, 2, "ep2", 1, 4, 329.6, 51.3),
    Run("h200x8-8d10245", "deepseek-v3 2L, 32 experts/GPU", deepseek2(128), H8, 4, "ep4", 1, 4, 288.4, 51.4),
    # Four H200s, weak scaling re-measured without host syncs (library 25e6b4e; no memory figures)
    Run("h200x4-25e6b4e", "qwen3 4L", QWEN4, H4, 1, "", 2, 4, 255.1, None),
    Run("h200x4-25e6b4e", "qwen3 4L", QWEN4, H4, 2, "ep2", 2, 4, 205.8, None),
    Run("h200x4-25e6b4e", "qwen3 4L", QWEN4, H4, 4, "ep4", 2, 4, 171.5, None),
    Run("h200x4-25e6b4e", "deepseek-v3 2L, 32 experts/GPU", deepseek2(32), H4, 1, "", 1, 4, 411.1, None),
    Run("h200x4-25e6b4e", "deepseek-v3 2L, 32 experts/GPU", deepseek2(64), H4, 2, "ep2", 1, 4, 348.2, None),
    Run("h200x4-25e6b4e", "deepseek-v3 2L, 32 experts/GPU", deepseek2(128), H4, 4, "ep4", 1, 4, 300.3, None),
    # One H100, CUDA-graph section, eager rows (library 98ac4bd)
    Run("h100-98ac4bd", "qwen3 4L", QWEN4, H1, 1, "", 2, 4, 230.2, 52.4),
    Run("h100-98ac4bd", "qwen3 4L", QWEN4, H1, 1, "", 2, 4, 98.4, 46.2, seq=1024),
    Run("h100-98ac4bd", "deepseek-v3 2L, 32 experts", deepseek2(32), H1, 1, "", 1, 4, 389.1, 51.2),
    # One H100, optimizer options (issue 17, library 83c03c0); micro-batch x accumulation as in the doc
    Run("h100-83c03c0", "qwen3 4L", QWEN4, H1, 1, "", 2, 2, 209.9, 52.44),
    Run("h100-83c03c0", "qwen3 4L", QWEN4, H1, 1, "", 2, 2, 180.5, 42.65,
        dict(distributed_optimizer=True, moments_dtype="bf16")),
    Run("h100-83c03c0", "qwen3 4L", QWEN4, H1, 1, "", 2, 2, 51.9, 37.76,
        dict(distributed_optimizer=True, optimizer_cpu_offload=0.5)),
    Run("h100-83c03c0", "qwen3 4L", QWEN4, H1, 1, "", 2, 2, 28.0, 23.08,
        dict(distributed_optimizer=True, optimizer_cpu_offload=1.0)),
    Run("h100-83c03c0", "qwen3 8L", QWEN8, H1, 1, "", 1, 2, 13.5, 35.51,
        dict(distributed_optimizer=True, optimizer_cpu_offload=1.0)),
    Run("h100-83c03c0", "qwen3 8L", QWEN8, H1, 1, "", 1, 128, 181.5, 64.12,
        dict(distributed_optimizer=True, optimizer_cpu_offload=0.5)),
    Run("h100-83c03c0", "qwen3 8L", QWEN8, H1, 1, "", 2, 64, 218.2, 65.18,
        dict(distributed_optimizer=True, optimizer_cpu_offload=0.6)),
    Run("h100-83c03c0", "qwen3 8L", QWEN8, H1, 1, "", 2, 64, 190.9, 68.99,
        dict(distributed_optimizer=True, optimizer_cpu_offload=0.3, moments_dtype="bf16")),
    # One H100, recomputation and activation offload (issue 18)
    Run("h100-issue18", "qwen3 4L", QWEN4, H1, 1, "", 2, 2, 207.0, 52.44),
    Run("h100-issue18", "qwen3 4L", QWEN4, H1, 1, "", 2, 2, 190.7, 51.94, dict(recompute=("moe_act", "layernorm"))),
    Run("h100-issue18", "qwen3 4L", QWEN4, H1, 1, "", 2, 2, 194.2, 51.44, dict(offload=("expert_fc1",))),
    # One H100, the experts' wgrad fused into the main grads against the dense linears only (third session of
    # 2026-11-25: the weighted Triton SwiGLU, ModelConfig's defaults now)
    Run("h100-wgrad", "qwen3 4L", NOW_QWEN4, H1, 1, "", 2, 2, 239.1, 50.69, FUSED),
    Run("h100-wgrad", "qwen3 4L", NOW_QWEN4, H1, 1, "", 2, 2, 220.6, 50.69),
    Run("h100-wgrad", "mixtral 2L", NOW_MIX2, H1, 1, "", 1, 4, 375.2, 56.60, FUSED),
    Run("h100-wgrad", "mixtral 2L", NOW_MIX2, H1, 1, "", 1, 4, 355.4, 56.60),
    Run("h100-wgrad", "deepseek-v3 2L, 32 experts", NOW_DS2, H1, 1, "", 1, 4, 424.6, 50.64, FUSED),
    Run("h100-wgrad", "deepseek-v3 2L, 32 experts", NOW_DS2, H1, 1, "", 1, 4, 417.4, 50.64),
    # One H100, the fused RoPE (+ q/k norms) and loss against neither (fourth session of 2026-11-25)
    Run("h100-fusions", "qwen3 4L, RoPE and loss fused", FUSED_QWEN4, H1, 1, "", 2, 2, 269.5, 48.69, FUSED),
    Run("h100-fusions", "qwen3 4L, neither fused", NEITHER_QWEN4, H1, 1, "", 2, 2, 235.8, 50.69, FUSED),
    Run("h100-fusions", "mixtral 2L, RoPE and loss fused", FUSED_MIX2, H1, 1, "", 1, 4, 386.2, 56.68, FUSED),
    Run("h100-fusions", "mixtral 2L, neither fused", NEITHER_MIX2, H1, 1, "", 1, 4, 362.0, 56.60, FUSED),
    Run("h100-optimizer", "qwen3 4L, AdamW + write-back fused", FUSED_QWEN4, H1, 1, "", 2, 2, 299.1, 48.69, FUSED_OPT),
    Run("h100-optimizer", "qwen3 4L, AdamW then the copy", FUSED_QWEN4, H1, 1, "", 2, 2, 281.7, 48.69, FUSED),
    Run("h100-optimizer", "mixtral 2L, AdamW + write-back fused", FUSED_MIX2, H1, 1, "", 1, 4, 407.9, 56.60, FUSED_OPT),
    Run("h100-optimizer", "mixtral 2L, AdamW then the copy", FUSED_MIX2, H1, 1, "", 1, 4, 395.0, 56.60, FUSED),
    Run("h100-optimizer", "deepseek-v3 2L (32 experts), MLA rope fused", FUSED_DS2, H1, 1, "", 1, 4, 462.7, 50.64,
        FUSED_OPT),
    Run("h100-optimizer", "deepseek-v3 2L (32 experts), MLA rope unfused", NOROPE_DS2, H1, 1, "", 1, 4, 436.9, 50.64,
        FUSED_OPT),
]


def predict(run: Run) -> tuple[float, float, str]:
    """The planner's (peak GiB on rank 0, TFLOPS/GPU, dominant cost) for a measured run."""
    from lightning_moe.flops import training_flops_per_token
    from lightning_moe.modules.config import ModelConfig
    from lightning_moe.planner.candidate import Candidate
    from lightning_moe.planner.cost import step_time
    from lightning_moe.planner.gpus import gpu_kind
    from lightning_moe.planner.memory import rank_memory
    from lightning_moe.planner.settings import Settings
    from lightning_moe.planner.shape import ModelShape

    preset, overrides = run.model
    cfg = ModelConfig.from_preset(preset, **overrides, seq_length=run.seq)
    model, s = ModelShape(cfg, run.seq), run.sizes()
    c = Candidate(run.gpus, s["tp"], s["cp"], s["pp"], s["vpp"], s["ep"], s["etp"], run.mb, run.m)
    # the dispatcher is not part of the cost model
    # rows without the option predate the experts' fused wgrad (the sessions of 2026-11-23 to the second of 11-25)
    # and the fused optimizer write-back (every session before the fifth of 11-25)
    settings = Settings(**{"expert_wgrad_fusion": False, "fused_optimizer_writeback": False,
                           **{k: v for k, v in run.options.items() if k != "dispatcher"}})
    t = step_time(model, c, settings, gpu_kind(run.gpu))
    tokens = run.mb * run.m * c.dp * run.seq
    tflops = training_flops_per_token(cfg, run.seq) * tokens / t.seconds / run.gpus / 1e12
    return rank_memory(model, c, settings, 0).total, tflops, t.dominant


def markdown_table() -> str:
    """The calibration table of docs/PERFORMANCE.md."""
    rows = ["| session | model | GPUs | layout (attention / MoE) | micro-batch × count | options | peak GiB measured → "
            "predicted (error) | TFLOPS/GPU measured → predicted (error) |", "| --- | --- | --- | --- | --- | --- | "
            "--- | --- |"]
    for run in RUNS:
        mem, tflops, _ = predict(run)
        s = run.sizes()
        att = "·".join(f"{k.upper()}{s[k]}" for k in ("tp", "cp", "pp") if s[k] > 1)
        dp = run.gpus // (s["tp"] * s["cp"] * s["pp"])
        att = "·".join(x for x in (att, f"DP{dp}" if dp > 1 else "") if x) or "—"
        moe = "·".join(f"{k.upper()}{s[k]}" for k in ("ep", "etp") if s[k] > 1) or "—"
        opts = ", ".join(f"{k}={'+'.join(v) if isinstance(v, tuple) else v}" for k, v in run.options.items()) or "—"
        peak = (f"{run.peak_gib:.1f} → {mem:.1f} ({100 * (mem / run.peak_gib - 1):+.1f} %)" if run.peak_gib
                else f"— → {mem:.1f}")
        gpu = run.gpu.split("-")[0].upper()
        rows.append(f"| {run.session} | {run.name}{f', seq {run.seq}' if run.seq != 4096 else ''} | {run.gpus}× {gpu} "
                    f"| {att} / {moe} | {run.mb} × {run.m} | {opts} | {peak} | {run.tflops:.1f} → {tflops:.1f} "
                    f"({100 * (tflops / run.tflops - 1):+.1f} %) |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
