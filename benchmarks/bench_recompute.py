"""Recompute / ActivationOffload settings, one GPU: the activation memory each saves and what it costs in step time.

One process builds a preset shrunk in depth (bf16 weights and activations, as ``precision="bf16-true"``) and, for
each setting, attaches the callbacks (as a Trainer's ``on_fit_start`` would), runs warm-up and timed forward+backward
passes of one micro-batch, and detaches them. All settings run in the same process on the same weights and data, so
the ratios compare like with like:

* ``peak_gib``: ``max_memory_allocated`` over the timed passes, weights and gradients included;
* ``activations_gib``: the peak minus the memory held before the forward (weights, gradient buffers);
* ``saved_gib`` / ``saved_share``: the activations below the run without callbacks, absolute and as a share;
* ``time_ratio``: the median forward+backward time against the run without callbacks (CUDA events).

The optimizer step is left out: it is the same for every setting. Prints one JSON object.

    python benchmarks/bench_recompute.py --preset qwen3-30b-a3b --layers 4 --seq 4096 --batch 2
    python benchmarks/bench_recompute.py --preset deepseek-v3 --layers 4 --seq 16384 \
        --overrides '{"num_experts": 32, "first_k_dense": 1}'
    python benchmarks/bench_recompute.py --preset tiny --seq 64 --steps 1 --device cpu    # smoke (recompute only)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# name -> (recompute modules, offload modules); the empty setting is the reference
SETTINGS = {
    "none": ([], []),
    "recompute layernorm": (["layernorm"], []),
    "recompute moe_act": (["moe_act"], []),
    "recompute moe_act+layernorm": (["moe_act", "layernorm"], []),
    "recompute core_attn": (["core_attn"], []),
    "recompute mla_up_proj": (["mla_up_proj"], []),
    "recompute shared_experts": (["shared_experts"], []),
    "recompute mlp": (["mlp"], []),
    "recompute moe": (["moe"], []),
    "recompute full": (["full"], []),
    "offload expert_fc1": ([], ["expert_fc1"]),
    "offload moe_act": ([], ["moe_act"]),
    "offload core_attn": ([], ["core_attn"]),
    "offload attn_norm+mlp_norm": ([], ["attn_norm", "mlp_norm"]),
    "recompute moe_act+layernorm, offload expert_fc1": (["moe_act", "layernorm"], ["expert_fc1"]),
    "recompute moe_act+layernorm+core_attn, offload expert_fc1": (["moe_act", "layernorm", "core_attn"],
                                                                  ["expert_fc1"]),
}


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--overrides", default="{}", help="JSON ModelConfig overrides")
    p.add_argument("--settings", default="all", help="names from SETTINGS separated by semicolons, or all")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()

    from lightning_moe import ActivationOffload, MoELanguageModel, Recompute

    overrides = dict(num_layers=args.layers, vocab_size=args.vocab, seq_length=args.seq, **json.loads(args.overrides))
    torch.manual_seed(0)
    lm = MoELanguageModel(preset=args.preset, overrides=overrides, seed=0)
    lm.configure_model()
    dev = torch.device(args.device)
    lm = lm.to(dev)
    if dev.type == "cuda":
        lm = lm.bfloat16()
    cfg = lm.model.cfg
    stub = SimpleNamespace(strategy=SimpleNamespace(root_device=dev, cuda_graphs=False))
    g = torch.Generator(dev).manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device=dev, generator=g)
    for q in lm.parameters():  # gradient buffers exist before the measured passes, as in training
        q.grad = torch.zeros_like(q)

    def step():
        lm_loss, aux = lm.model.loss(tokens[:, :-1], tokens[:, 1:])
        (lm_loss + aux).backward()

    def timed(callbacks) -> dict:
        def end_batch():  # as the Trainer does after each micro-batch: ActivationOffload frees its host copies here
            for cb in callbacks:
                cb.on_train_batch_end(stub, lm, None, None, 0)

        for cb in callbacks:
            cb.on_fit_start(stub, lm)
        try:
            for _ in range(args.warmup):
                step()
                end_batch()
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
            ms = []
            for _ in range(args.steps):
                for cb in callbacks:
                    cb.on_train_batch_start(stub, lm, None, 0)
                if dev.type == "cuda":
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    step()
                    b.record()
                    b.synchronize()
                    ms.append(a.elapsed_time(b))
                else:
                    import time
                    t0 = time.perf_counter()
                    step()
                    ms.append(1e3 * (time.perf_counter() - t0))
                end_batch()
            peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else 0
            return {"ms": statistics.median(ms), "peak_gib": peak / 2**30, "activations_gib": (peak - base) / 2**30}
        finally:
            for cb in callbacks:
                cb.teardown(stub, lm, "fit")

    names = list(SETTINGS) if args.settings == "all" else [s.strip() for s in args.settings.split(";")]
    rows, ref = {}, None
    for name in names:
        rec, off = SETTINGS[name]
        if off and dev.type != "cuda":
            continue
        callbacks = ([Recompute(rec)] if rec else []) + ([ActivationOffload(off)] if off else [])
        try:
            row = timed(callbacks)
        except ValueError as e:  # a module this model does not have (e.g. mla_up_proj on GQA)
            rows[name] = {"skipped": str(e)[:160]}
            continue
        except torch.OutOfMemoryError:
            rows[name] = {"oom": True}
            torch.cuda.empty_cache()
            continue
        if ref is None:
            ref = row
        row["time_ratio"] = row["ms"] / ref["ms"]
        row["saved_gib"] = ref["activations_gib"] - row["activations_gib"]
        row["saved_share"] = row["saved_gib"] / ref["activations_gib"] if ref["activations_gib"] else None
        rows[name] = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
        print(f"[bench_recompute] {name}: {rows[name]}", file=sys.stderr, flush=True)
    out = {"preset": args.preset, "layers": args.layers, "seq": args.seq, "batch": args.batch,
           "overrides": json.loads(args.overrides), "device": torch.cuda.get_device_name() if dev.type == "cuda"
           else "cpu", "torch": torch.__version__, "settings": rows}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
