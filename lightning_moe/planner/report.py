"""What ``lightning-moe plan`` prints and writes: the ranked table, its JSON, and the top choice as a ``fit`` config."""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

import yaml

from lightning_moe.modules.config import ModelConfig
from lightning_moe.planner.choice import Choice
from lightning_moe.planner.gpus import GPU
from lightning_moe.planner.params import model_params

_HEAD = (" #  tp cp pp vpp  ep etp   dp  edp  mb    m | weights grads optim   act  total GiB | step s  TFLOPS "
         "| dominant          | memory settings")


def table(choices: list[Choice], cfg: ModelConfig, name: str, gpus: int, gpu: GPU, seq: int, gbs: int) -> str:
    p = model_params(cfg)
    lines = [f"{name}: {sum(p) / 1e9:.1f} B parameters ({p.expert / 1e9:.1f} B in experts) on {gpus} x {gpu.name}, "
             f"sequence {seq}, global batch {gbs} ({gbs * seq:,} tokens per step); memory per GPU on the fullest "
             "pipeline rank", _HEAD]
    for i, ch in enumerate(choices, 1):
        c, m = ch.layout, ch.memory
        lines.append(f"{i:2d} {c.tp:3d} {c.cp:2d} {c.pp:2d} {c.vpp or '-':>3} {c.ep:3d} {c.etp:3d} {c.dp:4d} {c.edp:4d} "
                     f"{c.mb:3d} {c.m:4d} | {m.weights:7.1f} {m.grads:5.1f} {m.optimizer:5.1f} {m.activations:5.1f} "
                     f"{m.total:6.1f}     | {ch.time.seconds:6.2f} {ch.tflops_per_gpu:7.1f} | "
                     f"{ch.time.dominant:17s} | {ch.settings.describe()}")
    return "\n".join(lines)


def as_json(choices: list[Choice]) -> str:
    return json.dumps([ch.as_dict() for ch in choices], indent=1)


def model_section(cfg: ModelConfig, preset: Optional[str]) -> dict:
    """``model:`` for the fit config: the preset and the fields that differ from it (that rebuild ``cfg``)."""
    preset = preset or "tiny"
    base = ModelConfig.from_preset(preset)
    overrides = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                 if f.name != "extra" and getattr(cfg, f.name) != getattr(base, f.name)}
    return {"preset": preset, "overrides": overrides}


def fit_config(choice: Choice, cfg: ModelConfig, preset: Optional[str], gpu: GPU, seq: int) -> dict:
    """The top choice as a ``lightning-moe fit`` config: the strategy's sizes and options, the callbacks of its memory
    settings, micro-batching (accumulation, or the pipeline's micro-batches) and the model at this sequence length."""
    c, s = choice.layout, choice.settings
    sizes = {"tensor_parallel_size": c.tp, "context_parallel_size": c.cp, "pipeline_parallel_size": c.pp,
             "virtual_pipeline_size": c.vpp, "expert_parallel_size": c.ep, "expert_tensor_parallel_size": c.etp,
             "num_microbatches": c.m if c.pp > 1 else 1, "pipeline_first_stage_layers": c.first,
             "pipeline_last_stage_layers": c.last, "distributed_optimizer": s.distributed_optimizer,
             "exp_avg_dtype": s.moments_dtype, "exp_avg_sq_dtype": s.moments_dtype,
             "optimizer_cpu_offload": s.optimizer_cpu_offload}
    defaults = {"num_microbatches": 1, "distributed_optimizer": False, "optimizer_cpu_offload": 0.0}
    init_args = {k: v for k, v in sizes.items() if v is not None and v != defaults.get(k, 1 if "size" in k else None)}
    callbacks = [{"class_path": "lightning_moe.MoEThroughput"}]
    if s.recompute:
        callbacks.append({"class_path": "lightning_moe.Recompute", "init_args": {"modules": list(s.recompute)}})
    if s.offload:
        callbacks.append({"class_path": "lightning_moe.ActivationOffload", "init_args": {"modules": list(s.offload)}})
    per_node = min(c.gpus, gpu.gpus_per_node)
    trainer = {"accelerator": "gpu", "devices": per_node, "num_nodes": c.gpus // per_node,
               "strategy": {"class_path": "lightning_moe.MoEFoldStrategy", "init_args": init_args},
               "precision": s.precision, "accumulate_grad_batches": 1 if c.pp > 1 else c.m,
               "gradient_clip_val": 1.0, "callbacks": callbacks}
    model = model_section(cfg.replace(seq_length=seq), preset)
    # under PP the data batch is the data-parallel rank's whole step, which the schedule splits into micro-batches
    data = {"seq_length": seq, "batch_size": c.mb * (c.m if c.pp > 1 else 1),
            "dtype": "uint16" if cfg.vocab_size <= 65536 else "uint32"}
    return {"seed_everything": 1234, "trainer": trainer, "model": model, "data": data}


def write_fit_config(path: str, choice: Choice, cfg: ModelConfig, preset: Optional[str], gpu: GPU, seq: int,
                     command: str) -> None:
    c = choice.layout
    header = (f"# Written by: {command}\n# Predicted: {choice.tflops_per_gpu:.0f} TFLOPS/GPU, {choice.memory.total:.1f} "
              f"GiB peak per GPU, step {choice.time.seconds:.2f} s (dominant: {choice.time.dominant}); layout tp={c.tp} "
              f"cp={c.cp} pp={c.pp} vpp={c.vpp} ep={c.ep} etp={c.etp} (dp={c.dp}, edp={c.edp}).\n"
              "# Set data.path to your token file (uint16/uint32, lightning_moe.tokenize_documents writes one).\n")
    with open(path, "w") as f:
        f.write(header + yaml.safe_dump(fit_config(choice, cfg, preset, gpu, seq), sort_keys=False))
