"""Full training steps through ``lightning.Trainer(strategy=MoEFoldStrategy())`` on one GPU.

Precision: ``bf16-true`` with the strategy's fp32 main params (default; Megatron's ``--bf16``: bf16 weights, fp32 main
grads, fp32 main weights and Adam moments in the optimizer = 18 bytes per parameter) or ``bf16-mixed`` (autocast over
fp32 weights = 16 bytes per parameter, plus bf16 weight copies re-cast in every micro-batch). Presets are shrunk in
depth and vocabulary to fit one 80 GB GPU:

  preset          layers vocab  batch  params  18 B/param  notes
  mixtral-8x7b    2      32000  1      3.17 B  53 GiB
  qwen3-30b-a3b   4      32768  2      2.63 B  44 GiB      8 layers are 5.1 B params = 86 GiB of weights, grads
                                                           and optimizer state alone: does not fit 80 GB
                                                           without --offload (0.5 fits; docs/PERFORMANCE.md)

Data are random uint16 tokens written with ``lightning_moe.data.write_tokens`` to a temp dir and read through
``TokenDataModule``, so the router sees no structure (near-uniform load). Step time: CUDA events at every
``on_train_batch_end`` (per-step GPU times, no sync) and a host clock synchronised at the two ends of the measured
window (steps after ``--warmup-steps``). TFLOPS/GPU uses Megatron's formula (``lightning_moe.flops`` when present,
else the local copy below); MFU is against the dense bf16 peak of 989.4 TFLOPS (H100/H200 SXM).

    python benchmarks/bench_model.py                       # both presets, each in its own subprocess
    python benchmarks/bench_model.py --preset qwen3-30b-a3b --batch 2 --steps 20 --out qwen3.json
    python benchmarks/bench_model.py --smoke               # tiny CPU float32 run, used by the CPU test
    python benchmarks/bench_model.py --preset qwen3-30b-a3b --devices 2 --ep 2 --fp8 rowwise --fp8-dispatch
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import common  # noqa: F401  (puts the repo root on sys.path)
import numpy as np
import torch
from gaps import profiler_gaps
from common import (DENSE_BF16_PEAK_TFLOPS, elapsed_ms, emit, env_info, kernel_breakdown, log, pick_device,
                    profiler_kernels, stamp, stdout_to_stderr, sync)

import lightning as L
from lightning_moe import MoEFoldStrategy, MoELanguageModel, ModelConfig, TokenDataModule
from lightning_moe.data import write_tokens
from lightning_moe.modules.transformer import MoETransformer

# defaults per preset: (layers, vocab, micro-batch); see the module docstring for the memory arithmetic
PRESET_DEFAULTS = {
    "mixtral-8x7b": dict(layers=2, vocab=32000, batch=1),
    "qwen3-30b-a3b": dict(layers=4, vocab=32768, batch=2),
    "tiny": dict(layers=2, vocab=256, batch=2),
}
DEFAULT_PRESETS = "mixtral-8x7b,qwen3-30b-a3b"


# ------------------------------------------------------------------------------------------------ FLOPs
def megatron_flops_per_token(cfg: ModelConfig, s: int) -> float:
    """Megatron's ``num_floating_point_operations`` per token (GQA attention; DESIGN.md "Performance method"):
    6·h·g·(f·L_dense + (f_moe·k + f_shared)·L_moe) + 6·L·(h·(q+2kv) + q·h) + 6·L·s·q + 6·h·V, g = 3 (SwiGLU)."""
    if cfg.attention_type != "gqa":
        raise ValueError("the local FLOPs formula covers GQA attention only; MLA needs lightning_moe.flops")
    h, L_, V, g = cfg.hidden_size, cfg.num_layers, cfg.vocab_size, 3
    L_moe = cfg.num_moe_layers
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    mlp = 6 * h * g * (cfg.ffn_hidden_size * (L_ - L_moe)
                       + (cfg.moe_ffn_hidden_size * cfg.topk + cfg.shared_expert_ffn_size) * L_moe)
    attn = 6 * L_ * (h * (q + 2 * kv) + q * h) + 6 * L_ * s * q
    return float(mlp + attn + 6 * h * V)


def flops_per_token(cfg: ModelConfig, s: int) -> tuple[float, str, dict]:
    local = megatron_flops_per_token(cfg, s) if cfg.attention_type == "gqa" else None
    try:
        from lightning_moe.flops import training_flops_per_token
    except ImportError:
        training_flops_per_token = None
    if training_flops_per_token is not None:
        pkg = float(training_flops_per_token(cfg, s))
        return pkg, "lightning_moe.flops.training_flops_per_token", {"local_formula": local, "package": pkg}
    if local is None:
        raise ImportError("lightning_moe.flops is missing and the local formula covers GQA only")
    return local, "benchmarks/bench_model.py megatron_flops_per_token", {"local_formula": local, "package": None}


def count_params(cfg: ModelConfig) -> dict:
    """Parameter counts from a model built on the meta device (no memory)."""
    with torch.device("meta"):
        model = MoETransformer(cfg)
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for p in model.parameters() if getattr(p, "is_expert", False))
    active = total - expert + expert * cfg.topk // cfg.num_experts
    return {"params": total, "expert_params": expert, "active_params": active,
            "est_weights_grads_adam_gib": total * 16 / 2**30}


# ------------------------------------------------------------------------------------------------ timing callback
class ProfileSteps(L.Callback):
    """torch.profiler over two optimizer steps after the timed ones; writes the kernel table (top 60 by CUDA time) and
    keeps this rank's time breakdown (``common.kernel_breakdown``)."""

    def __init__(self, path: str, start_step: int, gaps: bool = False):
        self.path, self.start, self.prof, self.gaps = path, start_step, None, gaps

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.prof is None and trainer.global_step == self.start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            activities += [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []
            self.prof = torch.profiler.profile(activities=activities, with_stack=self.gaps)
            self.prof.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.prof is not None and trainer.global_step == self.start + 2 and not getattr(self, "done", False):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            self.done = True
            path = self.path if trainer.global_rank == 0 else f"{self.path}.rank{trainer.global_rank}"
            with open(path, "w") as f:
                f.write(self.prof.key_averages().table(sort_by="cuda_time_total", row_limit=60,
                                                       max_name_column_width=70))
            # where the time went on this rank (compute, exposed communication, idle): gathered into the record
            self.breakdown = kernel_breakdown(profiler_kernels(self.prof))
            if self.gaps:  # who launched the kernel after each idle gap (with_stack names the code)
                self.breakdown["idle_gaps"] = profiler_gaps(self.prof)


class OptimizerTimer(L.Callback):
    """The optimizer's share of each step: CUDA events at ``on_before_optimizer_step`` (after the last backward and
    the gradient sync) and after the step; a host wait on the CPU (offloaded slices) shows as GPU-timeline time.
    ``static_bytes``: memory allocated after the last step (weights, gradient buffers, optimizer state)."""

    def __init__(self, device: torch.device, warmup_steps: int, max_steps: int):
        self.device, self.warmup_steps, self.max_steps = device, warmup_steps, max_steps
        self.spans, self._start, self.static_bytes = [], None, None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._start = stamp(self.device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._start is None:
            return
        if self.warmup_steps <= trainer.global_step <= self.max_steps:
            self.spans.append((self._start, stamp(self.device)))
        self._start = None
        if self.device.type == "cuda" and trainer.global_step <= self.max_steps:
            self.static_bytes = torch.cuda.memory_allocated(self.device)

    def summary(self) -> dict:
        sync(self.device)
        ms = [elapsed_ms(a, b) for a, b in self.spans]
        return {"optimizer_step_ms_median": statistics.median(ms) if ms else None,
                "static_mem_gib": self.static_bytes / 2**30 if self.static_bytes is not None else None}


def optimizer_memory(model, strategy) -> dict:
    """Predicted bytes of weights, gradients and optimizer state on this GPU (``lightning_moe.strategy.memory``)."""
    from lightning_moe.strategy.memory import optimizer_bytes_per_param
    o, ctx = strategy.optimizer_options, strategy.parallel_context
    kw = dict(fp32_main_params=o.main_params_fp32, exp_avg_dtype=o.exp_avg_dtype, exp_avg_sq_dtype=o.exp_avg_sq_dtype,
              distributed_optimizer=o.distributed, optimizer_cpu_offload=o.cpu_offload)
    device = host = 0.0
    params = list(model.parameters())
    for p in params:
        shard = ctx.size("edp") if getattr(p, "is_expert", False) else ctx.size("dp_cp")
        b = optimizer_bytes_per_param(weight_bytes=p.element_size(), shard=shard, **kw)
        device += b["device"] * p.numel()
        host += b["host"] * p.numel()
    n = sum(p.numel() for p in params)
    return {"predicted_static_gib": device / 2**30, "predicted_host_gib": host / 2**30,
            "device_bytes_per_param": device / n, "host_bytes_per_param": host / n}


class StepTimer(L.Callback):
    """A stamp after every optimizer step (CUDA events: no sync); host clock synced at the window's two ends."""

    def __init__(self, device: torch.device, warmup_steps: int, max_steps: int):
        self.device, self.warmup_steps, self.max_steps = device, warmup_steps, max_steps
        self.stamps, self.losses, self.wall, self.pipeline = [], [], {}, {}
        self.gc = {g: [0, 0.0] for g in range(3)}  # Python's collections in the timed window: count, host seconds
        self._gc_t0 = 0.0

    def _gc_callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            entry = self.gc[info["generation"]]
            entry[0] += 1
            entry[1] += time.perf_counter() - self._gc_t0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches or len(self.stamps) >= self.max_steps:
            return  # mid-accumulation (not an optimizer step), or a profiled step after the timed window
        self.stamps.append(stamp(self.device))
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None:
            self.losses.append(loss.detach())
        step = len(self.stamps)  # optimizer steps done
        if step in (self.warmup_steps, self.max_steps):
            sync(self.device)
            self.wall[step] = time.perf_counter()
            if step == self.warmup_steps:
                gc.callbacks.append(self._gc_callback)
            elif self._gc_callback in gc.callbacks:
                gc.callbacks.remove(self._gc_callback)
        if step == self.max_steps:  # the last timed step's schedule, before any profiled step
            self.pipeline = trainer.strategy.pipeline_timing()

    def summary(self) -> dict:
        sync(self.device)
        w, n = self.warmup_steps, len(self.stamps)
        per_step = [elapsed_ms(self.stamps[i - 1], self.stamps[i]) / 1e3 for i in range(max(w, 1), n)]
        out = {"steps_run": n, "measured_steps": n - w, "step_times_s": [round(t, 5) for t in per_step],
               "step_time_s": (self.wall[n] - self.wall[w]) / (n - w) if n in self.wall and w in self.wall else None,
               "step_time_median_s": statistics.median(per_step) if per_step else None,
               "step_time_min_s": min(per_step) if per_step else None,
               "step_time_max_s": max(per_step) if per_step else None}
        if self._gc_callback in gc.callbacks:
            gc.callbacks.remove(self._gc_callback)
        out["gc_in_timed_steps"] = {f"gen{g}": {"collections": n, "host_s": round(t, 4)}
                                    for g, (n, t) in self.gc.items()}
        losses = [float(x) for x in self.losses]
        out.update(loss_first=losses[0] if losses else None, loss_last=losses[-1] if losses else None,
                   losses_finite=all(math.isfinite(x) for x in losses))
        return out


class CPSizesPerStep(L.Callback):
    """The CP sizes DynamicContextParallel chose in each optimizer step (after it, in the callback order; steps
    counted as StepTimer counts them)."""

    def __init__(self, dynamic_cp):
        self.dynamic_cp, self.seen, self.steps = dynamic_cp, {}, []
        self.pending: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = dict(self.dynamic_cp.choices)
        self.pending += [size for size, k in now.items() for _ in range(k - self.seen.get(size, 0))]
        self.seen = now
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.steps.append(sorted(self.pending))
            self.pending = []


def warm_step_times(step_times: list, sizes_per_step: list, warmup: int) -> list:
    """The timed steps (``step_times[i]`` ends step ``warmup + i + 1``) whose CP sizes all ran in an earlier step:
    a size's first micro-batch compiles its attention and block-mask kernels (new shapes), a one-time cost."""
    out = []
    for i, t in enumerate(step_times):
        step = max(warmup, 1) + i  # 0-based index of the step this time ends
        earlier = {c for s in sizes_per_step[:step] for c in s}
        if step < len(sizes_per_step) and set(sizes_per_step[step]) <= earlier:
            out.append(t)
    return out


# ------------------------------------------------------------------------------------------------ one run
def strategy_kwargs(args) -> dict:
    kw = dict(expert_parallel_size=args.ep, expert_tensor_parallel_size=args.etp, tensor_parallel_size=args.tp,
              context_parallel_size=args.cp)
    if args.distributed_optimizer:
        kw["distributed_optimizer"] = True
    if args.offload:
        kw["optimizer_cpu_offload"] = args.offload
    for name in ("exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype"):
        if getattr(args, name):
            kw[name] = getattr(args, name)
    if args.sp is not None:
        kw["sequence_parallel"] = bool(args.sp)
    if args.cuda_graphs:
        kw["cuda_graphs"] = True
    if args.no_wgrad_fusion:
        kw["gradient_accumulation_fusion"] = False
    if args.no_fused_optimizer:
        kw["fused_optimizer_writeback"] = False
    if args.defer_expert_wgrad:
        kw["defer_expert_wgrad"] = args.defer_expert_wgrad
    if args.manual_gc is not None:
        kw["manual_gc"] = args.manual_gc
    if args.pp > 1 or args.microbatches > 1:
        kw.update(pipeline_parallel_size=args.pp, num_microbatches=args.microbatches)
        if args.vpp:
            kw["virtual_pipeline_size"] = args.vpp
        if args.schedule:
            kw["pipeline_schedule"] = args.schedule
        if args.overlap_p2p is not None:
            kw["overlap_p2p_comm"] = bool(args.overlap_p2p)
        if args.overlap_moe_comm:
            kw["overlap_moe_comm"] = True
    return kw


def run_one(args, preset: str) -> dict:
    device = pick_device(args.smoke)
    d = PRESET_DEFAULTS.get(preset, {})
    layers = args.layers or d.get("layers")
    vocab = args.vocab or d.get("vocab")
    batch = args.batch or d.get("batch", 1)
    seq = args.seq or (64 if args.smoke else 4096)
    steps = args.steps or (3 if args.smoke else 20)
    warmup = args.warmup_steps if args.warmup_steps is not None else (1 if args.smoke else 5)
    if not 1 <= warmup < steps:
        raise SystemExit(f"error: need 1 <= --warmup-steps ({warmup}) < --steps ({steps})")
    overrides = {"seq_length": seq}
    if layers:
        overrides["num_layers"] = layers
    if vocab:
        overrides["vocab_size"] = vocab
    if getattr(args, "compile_router", False):
        overrides["compile_router"] = True
    if args.dispatcher:
        overrides["dispatcher"] = args.dispatcher
    if getattr(args, "sync_free_dispatch", False):
        overrides["sync_free_dispatch"] = True
    if args.experts:  # weak scaling in experts: the same experts per GPU as EP grows
        overrides["num_experts"] = args.experts
    if args.first_k_dense is not None:
        overrides["first_k_dense"] = args.first_k_dense
    if args.probs_in_combine:
        overrides["probs_in_experts"] = False
    if args.no_swiglu_fusion:
        overrides["swiglu_fusion"] = False
    if args.expert_rows_align > 1:
        overrides["expert_rows_align"] = args.expert_rows_align
    if args.no_rope_fusion:
        overrides["rope_fusion"] = False
    if args.no_cross_entropy_fusion:
        overrides["cross_entropy_fusion"] = False
    cfg = ModelConfig.from_preset(preset, **overrides)
    if cfg.vocab_size > 65535:
        raise SystemExit(f"error: vocab {cfg.vocab_size} does not fit the uint16 token file; pass --vocab")
    fpt, fsrc, fboth = flops_per_token(cfg, seq)
    counts = count_params(cfg)
    if device.type == "cuda":
        total_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
        if counts["est_weights_grads_adam_gib"] > 0.9 * total_gib:
            log(f"warning: weights + grads + AdamW states alone need ~{counts['est_weights_grads_adam_gib']:.1f} "
                f"GiB of the {total_gib:.1f} GiB on this GPU; expect out-of-memory (use --layers to shrink)")
    precision = "32-true" if args.smoke else args.precision
    log(f"{preset}: layers={cfg.num_layers} vocab={cfg.vocab_size} seq={seq} batch={batch} steps={steps} "
        f"params={counts['params'] / 1e9:.2f}B precision={precision}")

    L.seed_everything(args.seed, workers=True, verbose=False)
    with tempfile.TemporaryDirectory(prefix="lmoe_bench_") as tmp:
        rng = np.random.default_rng(args.seed)
        n_tokens = max(2 * (seq + 1), min(4_000_000, 64 * batch * (seq + 1)))
        ids = rng.integers(0, cfg.vocab_size - 1, n_tokens)
        packing = {}
        if args.pack_documents:  # documents of lognormal lengths, each ended by the last vocabulary id
            ends = np.cumsum(np.maximum(16, rng.lognormal(np.log(args.doc_median), 1.0, n_tokens // 16).astype(int)))
            ids[ends[ends < n_tokens]] = cfg.vocab_size - 1
            packing = dict(pack_documents=True, eod_token_id=cfg.vocab_size - 1)
            if args.cp > 1:  # packed CP splits every document into 2 * cp zig-zag chunks
                packing["document_multiple"] = 2 * args.cp
        path = write_tokens(os.path.join(tmp, "tokens.bin"), ids, "uint16")
        data = TokenDataModule(path=path, seq_length=seq, batch_size=batch, val_batches=0, num_workers=0,
                               seed=args.seed, **packing)
        model = MoELanguageModel(config=cfg, lr=args.lr, warmup_steps=min(10, steps), max_steps=steps,
                                 log_expert_load=False, seed=args.seed)
        if args.no_expert_wgrad_fusion:  # the dense linears' fusion only (the earlier default), for comparisons
            from lightning_moe.modules.experts import GroupedExperts
            configure = model.configure_model

            def configure_dense_only():
                configure()
                for m in model.modules():
                    if isinstance(m, GroupedExperts):
                        m.w13.wgrad_fusable = m.w2.wgrad_fusable = False
            model.configure_model = configure_dense_only
        timer = StepTimer(device, warmup, steps)
        opt_timer = OptimizerTimer(device, warmup, steps)
        memory_callbacks = []
        if args.recompute:
            from lightning_moe import Recompute
            memory_callbacks.append(Recompute(args.recompute.split(",")))
        if args.offload_activations:
            from lightning_moe import ActivationOffload
            memory_callbacks.append(ActivationOffload(args.offload_activations.split(",")))
        if args.fp8:  # FLOPs stay counted as in bf16 (as Megatron counts them): MFU stays comparable
            from lightning_moe import FP8Training
            memory_callbacks.append(FP8Training(args.fp8, fp8_format=args.fp8_format, fp8_dispatch=args.fp8_dispatch,
                                                fast_accum=args.fp8_fast_accum,
                                                cache_weights=not args.fp8_no_weight_cache,
                                                fp8_param_gather=args.fp8_param_gather,
                                                fp8_wgrad=not args.fp8_no_fp8_wgrad,
                                                defer_expert_wgrad=args.fp8_defer_wgrad,
                                                include_head=args.fp8_include_head,
                                                exclude=[s for s in args.fp8_exclude.split(",") if s]))
        if args.nvfp4:
            from lightning_moe import NVFP4Training
            memory_callbacks.append(NVFP4Training())
        dynamic_cp = cp_sizes = None
        if args.dynamic_cp:
            from lightning_moe import DynamicContextParallel
            dynamic_cp = DynamicContextParallel()
            cp_sizes = CPSizesPerStep(dynamic_cp)
            memory_callbacks += [dynamic_cp, cp_sizes]
        trainer = L.Trainer(accelerator="cpu" if device.type == "cpu" else "gpu", devices=args.devices,
                            strategy=MoEFoldStrategy(**strategy_kwargs(args)), precision=precision,
                            max_steps=steps + (2 if args.profile else 0),  # profiled after the timed window
                            accumulate_grad_batches=args.accumulate,
                            limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[timer, opt_timer, *memory_callbacks],
                            default_root_dir=tmp)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        prof_cb = [ProfileSteps(args.profile, steps, args.gaps)] if args.profile else []
        trainer.callbacks.extend(prof_cb)
        with stdout_to_stderr():
            trainer.fit(model, datamodule=data)
        rec = {**timer.summary(), **opt_timer.summary(), **optimizer_memory(model, trainer.strategy)}
        if dynamic_cp is not None:  # the steady state: steps without a CP size's first (compiling) micro-batch
            sizes = cp_sizes.steps
            if args.devices > 1:  # every rank's sizes: a step is warm only where no data-parallel replica compiled
                import torch.distributed as dist
                per_rank = [None] * dist.get_world_size()
                dist.all_gather_object(per_rank, sizes)
                sizes = [sorted({c for r in per_rank for c in r[i]}) for i in range(len(sizes))]
            warm = warm_step_times(rec["step_times_s"], sizes, warmup)
            rec.update(dynamic_cp_sizes_per_step=sizes, warm_steps=len(warm),
                       step_time_median_warm_s=statistics.median(warm) if warm else None)
        pipe = timer.pipeline  # the last timed step's schedule on each pipeline rank
        if pipe:
            import torch.distributed as dist
            per_rank = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, pipe)
            rec["pipeline"] = {"ideal_bubble_fraction": pipe["ideal_bubble_fraction"],
                               "plan_bubble_fraction": pipe.get("plan_bubble_fraction"),
                               "overlap_p2p": pipe.get("overlap_p2p"),
                               "bubble_fraction_per_rank": [r.get("bubble_fraction") for r in per_rank],
                               "busy_s_per_rank": [r.get("busy_s") for r in per_rank],
                               "wall_s_per_rank": [r.get("wall_s") for r in per_rank]}
        if prof_cb and getattr(prof_cb[0], "breakdown", None) is not None:
            mine = prof_cb[0].breakdown
            if args.devices > 1:
                import torch.distributed as dist
                per_rank = [None] * dist.get_world_size()
                dist.all_gather_object(per_rank, mine)
            else:
                per_rank = [mine]
            rec["time_breakdown_per_rank"] = per_rank
            # the time some kernel ran, per profiled optimizer step (2): what the step would take if the host never
            # made the GPU wait, for comparing runs on hosts of different speeds
            rec["gpu_busy_ms_per_step"] = [round(r["window_ms"] * (1 - r["idle_frac"]) / 2, 2) if r else None
                                           for r in per_rank]
        if device.type == "cuda":
            rec["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            rec["peak_mem_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
        else:
            rec["peak_mem_gib"] = rec["peak_mem_reserved_gib"] = None

    dp = args.devices // (args.tp * args.cp * args.pp)  # TP, CP and PP ranks share their dp rank's samples
    tokens_per_step = batch * seq * args.accumulate * dp  # global
    st = rec["step_time_s"]
    tps = tokens_per_step / st if st else None
    tfl = fpt * tps / 1e12 / args.devices if tps else None  # per GPU
    rec = {"preset": preset, "num_layers": cfg.num_layers, "num_moe_layers": cfg.num_moe_layers,
           "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_experts": cfg.num_experts,
           "topk": cfg.topk, "moe_ffn_hidden_size": cfg.moe_ffn_hidden_size, "seq_length": seq,
           "micro_batch_size": batch, "accumulate_grad_batches": args.accumulate, "tokens_per_step": tokens_per_step, "steps": steps, "warmup_steps": warmup,
           "dispatcher": cfg.dispatcher + ("_sync_free" if cfg.sync_free_dispatch else ""), "precision": precision, "fp32_main_params": trainer.strategy._main_params is not None or bool(
               getattr(trainer.strategy.sharded_optimizer, "main_fp32", False)),
           "devices": args.devices, "recompute": args.recompute, "pack_documents": args.pack_documents,
           "dynamic_cp_choices": dict(dynamic_cp.choices) if dynamic_cp is not None else None,
           "offload_activations": args.offload_activations, "fp8": args.fp8, "fp8_format": args.fp8_format,
           "fp8_dispatch": args.fp8_dispatch, "fp8_fast_accum": args.fp8_fast_accum,
           "expert_rows_align": args.expert_rows_align, "fp8_param_gather": args.fp8_param_gather,
           "fp8_exclude": args.fp8_exclude, "fp8_wgrad": not args.fp8_no_fp8_wgrad,
           "fp8_defer_wgrad": args.fp8_defer_wgrad,
           "fp8_include_head": args.fp8_include_head,
           "wgrad_fusion": ("none" if args.no_wgrad_fusion else "dense" if args.no_expert_wgrad_fusion
                            else "dense+experts"),
           "fused_optimizer_writeback": getattr(trainer.optimizers[0].step, "__qualname__", "").startswith("FusedAdam")
           or bool(getattr(trainer.strategy.sharded_optimizer, "fuse_writeback", False)),
           "rope_fusion": cfg.rope_fusion, "cross_entropy_fusion": cfg.cross_entropy_fusion, "nvfp4": args.nvfp4,
           "strategy": "MoEFoldStrategy(" + ", ".join(f"{k}={v}" for k, v in strategy_kwargs(args).items()) + ")",
           **counts,
           **rec, "tokens_per_sec": tps, "flops_per_token": fpt, "flops_source": fsrc,
           "flops_per_token_check": fboth, "tflops_per_gpu": tfl,
           "mfu": tfl / DENSE_BF16_PEAK_TFLOPS if tfl else None, "mfu_peak_tflops": DENSE_BF16_PEAK_TFLOPS}
    if rec["step_time_median_s"]:
        rec["tokens_per_sec_median_step"] = tokens_per_step / rec["step_time_median_s"]
    if rec.get("step_time_median_warm_s"):
        rec["tokens_per_sec_median_warm_step"] = tokens_per_step / rec["step_time_median_warm_s"]
    return rec


def run_in_subprocess(args, preset: str) -> dict:
    """One preset per process, so that each run starts with an empty GPU and a fresh process group."""
    with tempfile.TemporaryDirectory(prefix="lmoe_bench_") as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--preset", preset, "--seed", str(args.seed),
               "--lr", str(args.lr), "--out", out]
        for flag, value in (("--layers", args.layers), ("--vocab", args.vocab), ("--seq", args.seq),
                            ("--batch", args.batch), ("--steps", args.steps), ("--warmup-steps", args.warmup_steps),
                            ("--accumulate", args.accumulate), ("--devices", args.devices), ("--ep", args.ep),
                            ("--etp", args.etp), ("--tp", args.tp), ("--cp", args.cp), ("--sp", args.sp),
                            ("--pp", args.pp), ("--vpp", args.vpp), ("--microbatches", args.microbatches),
                            ("--schedule", args.schedule),
                            ("--precision", args.precision), ("--dispatcher", args.dispatcher),
                            ("--experts", args.experts), ("--first-k-dense", args.first_k_dense),
                            ("--offload", args.offload), ("--exp-avg-dtype", args.exp_avg_dtype),
                            ("--exp-avg-sq-dtype", args.exp_avg_sq_dtype),
                            ("--main-params-dtype", args.main_params_dtype), ("--recompute", args.recompute),
                            ("--offload-activations", args.offload_activations), ("--fp8", args.fp8),
                            ("--fp8-format", args.fp8_format)):
            if value is not None:
                cmd += [flag, str(value)]
        cmd += ["--cuda-graphs"] if args.cuda_graphs else []
        cmd += ["--no-wgrad-fusion"] if args.no_wgrad_fusion else []
        cmd += ["--no-fused-optimizer"] if args.no_fused_optimizer else []
        cmd += ["--no-expert-wgrad-fusion"] if args.no_expert_wgrad_fusion else []
        cmd += (["--defer-expert-wgrad"] + ([] if args.defer_expert_wgrad is True else [str(args.defer_expert_wgrad)])
                if args.defer_expert_wgrad else [])
        cmd += ["--pack-documents", "--doc-median", str(args.doc_median)] if args.pack_documents else []
        cmd += ["--dynamic-cp"] if args.dynamic_cp else []
        cmd += ["--distributed-optimizer"] if args.distributed_optimizer else []
        cmd += ["--fp8-dispatch"] if args.fp8_dispatch else []
        cmd += ["--fp8-param-gather"] if args.fp8_param_gather else []
        cmd += ["--fp8-no-weight-cache"] if args.fp8_no_weight_cache else []
        cmd += ["--fp8-no-fp8-wgrad"] if args.fp8_no_fp8_wgrad else []
        cmd += (["--fp8-defer-wgrad"] + ([] if args.fp8_defer_wgrad is True else [str(args.fp8_defer_wgrad)])
                if args.fp8_defer_wgrad else [])
        cmd += ["--fp8-include-head"] if args.fp8_include_head else []
        cmd += ["--fp8-fast-accum", args.fp8_fast_accum, "--fp8-exclude", args.fp8_exclude]
        cmd += ["--sync-free-dispatch"] if args.sync_free_dispatch else []
        cmd += ["--overlap-moe-comm"] if args.overlap_moe_comm else []
        cmd += ["--probs-in-combine"] if args.probs_in_combine else []
        cmd += ["--no-swiglu-fusion"] if args.no_swiglu_fusion else []
        cmd += ["--expert-rows-align", str(args.expert_rows_align)]
        cmd += ["--no-rope-fusion"] if args.no_rope_fusion else []
        cmd += ["--no-cross-entropy-fusion"] if args.no_cross_entropy_fusion else []
        cmd += ["--nvfp4"] if args.nvfp4 else []
        cmd += ["--smoke"] if args.smoke else []
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL)  # stderr passes through
        if proc.returncode != 0 or not os.path.isfile(out):
            return {"preset": preset, "error": f"subprocess exited with {proc.returncode}"}
        with open(out) as f:
            return json.load(f)["records"][0]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--preset", default=None,
                   help=f"comma-separated preset names (default {DEFAULT_PRESETS}; 'tiny' with --smoke); "
                        "several run one after another, each in a subprocess")
    p.add_argument("--layers", type=int, default=None, help="num_layers (default per preset)")
    p.add_argument("--vocab", type=int, default=None, help="vocab_size (default per preset; must fit uint16)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 4096; 64 with --smoke)")
    p.add_argument("--batch", type=int, default=None, help="micro-batch size (default per preset)")
    p.add_argument("--pack-documents", action="store_true",
                   help="TokenDataModule(pack_documents=True): lognormal documents packed into rows, attention masked "
                        "to each document (MFU still counts causal attention over the whole row)")
    p.add_argument("--dynamic-cp", action="store_true",
                   help="lightning_moe.DynamicContextParallel(): the CP size per micro-batch (needs --pack-documents)")
    p.add_argument("--doc-median", type=float, default=4096.0, help="median document length with --pack-documents")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 20; 3 with --smoke)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="first steps left out of the timing (default 5; 1 with --smoke)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--precision", default="bf16-true", choices=["bf16-true", "bf16-mixed"],
                   help="bf16-true: bf16 weights with fp32 main grads/params (MoEFoldStrategy's default for bf16 "
                        "weights); bf16-mixed: autocast over fp32 weights")
    p.add_argument("--profile", default=None,
                   help="write a torch.profiler kernel table of 2 steps to this path; the JSON then also has "
                        "gpu_busy_ms_per_step (the time kernels ran, host waits left out)")
    p.add_argument("--gaps", action="store_true",
                   help="with --profile: record Python stacks and charge each idle gap to the code that launched the "
                        "next kernel (benchmarks/gaps.py); the stacks slow the host, so the breakdown is pessimistic")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="MoEFoldStrategy(cuda_graphs=True): each block's forward and backward as CUDA graphs")
    p.add_argument("--compile-router", action="store_true", help="ModelConfig.compile_router=True")
    p.add_argument("--no-fused-optimizer", action="store_true",
                   help="MoEFoldStrategy(fused_optimizer_writeback=False): torch's AdamW, then the bf16 copy")
    p.add_argument("--no-wgrad-fusion", action="store_true",
                   help="MoEFoldStrategy(gradient_accumulation_fusion=False): the unfused baseline")
    p.add_argument("--defer-expert-wgrad", nargs="?", const=True, default=False, type=int, metavar="N",
                   help="MoEFoldStrategy(defer_expert_wgrad=True): the experts' bf16 wgrad once per optimizer step "
                        "(with N: once per N micro-batches)")
    p.add_argument("--no-expert-wgrad-fusion", action="store_true",
                   help="the experts' wgrad GEMMs write bf16 gradients for the hook to add (the dense linears still fuse)")
    p.add_argument("--manual-gc", type=int, default=None, metavar="N",
                   help="MoEFoldStrategy(manual_gc=N): Python's garbage collector off, a full collection every N steps")
    p.add_argument("--distributed-optimizer", action="store_true", help="MoEFoldStrategy(distributed_optimizer=True)")
    p.add_argument("--recompute", default=None, help="lightning_moe.Recompute(modules): comma-separated names")
    p.add_argument("--offload-activations", default=None,
                   help="lightning_moe.ActivationOffload(modules): comma-separated names")
    p.add_argument("--offload", type=float, default=None, help="MoEFoldStrategy(optimizer_cpu_offload=F)")
    p.add_argument("--exp-avg-dtype", default=None, help="MoEFoldStrategy(exp_avg_dtype=...): fp32 or bf16")
    p.add_argument("--exp-avg-sq-dtype", default=None, help="MoEFoldStrategy(exp_avg_sq_dtype=...): fp32 or bf16")
    p.add_argument("--main-params-dtype", default=None, help="MoEFoldStrategy(main_params_dtype=...): fp32 or bf16")
    p.add_argument("--devices", type=int, default=1, help="GPUs (data-parallel ranks; Lightning launches them)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size, folded over the data-parallel ranks")
    p.add_argument("--etp", type=int, default=1, help="expert-tensor-parallel size")
    p.add_argument("--tp", type=int, default=1, help="attention tensor-parallel size")
    p.add_argument("--cp", type=int, default=1, help="attention context-parallel size")
    p.add_argument("--sp", type=int, default=None, choices=[0, 1], help="sequence parallelism (default: on with TP)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline chunks per rank (interleaved 1F1B)")
    p.add_argument("--microbatches", type=int, default=1,
                   help="num_microbatches: --batch (per dp rank) is split into this many inside each step")
    p.add_argument("--schedule", default=None, help="pipeline schedule: 1f1b, interleaved_1f1b, afab")
    p.add_argument("--overlap-p2p", type=int, default=None, choices=[0, 1],
                   help="MoEFoldStrategy(overlap_p2p_comm=...): pipeline transfers during compute (default: on)")
    p.add_argument("--probs-in-combine", action="store_true",
                   help="ModelConfig.probs_in_experts=False: the combine weights the expert outputs (the old way)")
    p.add_argument("--no-swiglu-fusion", action="store_true", help="ModelConfig.swiglu_fusion=False (torch SwiGLU)")
    p.add_argument("--expert-rows-align", type=int, default=1,
                   help="ModelConfig.expert_rows_align (Megatron's --moe-router-padding-for-fp8): 128 lets the "
                        "blockwise recipe's DeepGEMM GEMMs read the experts' input as laid out")
    p.add_argument("--no-rope-fusion", action="store_true",
                   help="ModelConfig.rope_fusion=False (torch RoPE and q/k norms)")
    p.add_argument("--no-cross-entropy-fusion", action="store_true",
                   help="ModelConfig.cross_entropy_fusion=False (F.cross_entropy of the float32 logits)")
    p.add_argument("--overlap-moe-comm", action="store_true",
                   help="MoEFoldStrategy(overlap_moe_comm=True): merged forward-backward of micro-batches (needs "
                        "--microbatches >= 2 and EP or ETP)")
    p.add_argument("--experts", type=int, default=None, help="num_experts (default per preset)")
    p.add_argument("--first-k-dense", type=int, default=None, help="dense layers first (default per preset)")
    p.add_argument("--dispatcher", default=None, help="token dispatcher (default: the preset's, alltoall)")
    p.add_argument("--sync-free-dispatch", action="store_true",
                   help="ModelConfig.sync_free_dispatch=True (deepep: worst-case receive buffers, no host sync)")
    p.add_argument("--fp8", default=None, help="lightning_moe.FP8Training(recipe): tensorwise, delayed, rowwise, "
                   "blockwise")
    p.add_argument("--fp8-format", default=None, help="FP8Training(fp8_format=...): hybrid or e4m3")
    p.add_argument("--fp8-fast-accum", default="fprop", help="FP8Training(fast_accum=...): fprop, all or none")
    p.add_argument("--fp8-exclude", default="",
                   help="FP8Training(exclude=...): comma-separated module names (patterns) kept in bf16, e.g. "
                        "'attention' for FP8 experts only")
    p.add_argument("--fp8-no-weight-cache", action="store_true",
                   help="FP8Training(cache_weights=False): quantize the weights at every micro-batch")
    p.add_argument("--fp8-no-fp8-wgrad", action="store_true",
                   help="with --fp8: FP8Training(fp8_wgrad=False), weight gradients from the unquantized operands")
    p.add_argument("--fp8-defer-wgrad", nargs="?", const=True, default=False, type=int, metavar="N",
                   help="with --fp8: FP8Training(defer_expert_wgrad=True), the experts' wgrad once per optimizer step "
                        "(with N: once per N micro-batches)")
    p.add_argument("--fp8-include-head", action="store_true",
                   help="with --fp8: FP8Training(include_head=True), the output head's GEMMs in FP8 too")
    p.add_argument("--fp8-dispatch", action="store_true",
                   help="with --fp8: FP8Training(fp8_dispatch=True), the token all-to-all in FP8 (alltoall dispatcher)")
    p.add_argument("--fp8-param-gather", action="store_true",
                   help="with --fp8 and --distributed-optimizer: FP8Training(fp8_param_gather=True)")
    p.add_argument("--nvfp4", action="store_true", help="lightning_moe.NVFP4Training() (emulated on Hopper)")
    p.add_argument("--smoke", action="store_true", help="tiny preset on CPU, float32, 3 steps")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.gaps and not args.profile:
        p.error("--gaps needs --profile PATH (it analyses the profiled steps)")
    if args.fp8_dispatch and not args.fp8:
        p.error("--fp8-dispatch needs --fp8 RECIPE (it is an option of FP8Training)")
    if args.fp8_param_gather and not (args.fp8 and args.distributed_optimizer):
        p.error("--fp8-param-gather needs --fp8 RECIPE and --distributed-optimizer")
    presets = [s.strip() for s in (args.preset or ("tiny" if args.smoke else DEFAULT_PRESETS)).split(",")
               if s.strip()]
    device = pick_device(args.smoke)
    if len(presets) == 1:
        try:
            records = [run_one(args, presets[0])]
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: still print a JSON record saying so
            traceback.print_exc(file=sys.stderr)
            records = [{"preset": presets[0], "error": f"{type(e).__name__}: {str(e)[:500]}"}]
    else:
        records = [run_in_subprocess(args, name) for name in presets]
    result = {"benchmark": "moe_model_training", "env": env_info(device), "smoke": args.smoke,
              "config": {"mfu_peak_tflops": DENSE_BF16_PEAK_TFLOPS, "data": "random uint16 tokens",
                         "timing": "host clock synced at the ends of the window after warmup_steps; "
                                   "per-step CUDA events for median/min/max"},
              "records": records}
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return result  # the other ranks Lightning launched: rank 0 reports
    emit(result, args.out)
    if any("error" in r for r in records):
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
