"""Probe: does inductor compile a preset's blocks (``nn.Module.compile`` of each, forward + backward), and what does
it pay per training step of the bare model (no Trainer)? Prints one JSON line for eager and one per compile variant
(``--knobs``). On the H100 with torch 2.11 every variant failed in the compiled backward (docs/PERFORMANCE.md).

    python benchmarks/probe_compile.py --preset qwen3-30b-a3b --layers 2 --seq 4096 --batch 2
"""

from __future__ import annotations

import argparse
import json
import traceback

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
import torch.nn.functional as F

from lightning_moe import ModelConfig
from lightning_moe.modules.transformer import MoETransformer
from lightning_moe.strategy.parallel_context import ParallelContext


def run(args, compiled: bool, knob: str = "", **over) -> dict:
    torch.manual_seed(0)
    torch._functorch.config.donated_buffer = knob != "no_donated_buffer"
    torch._inductor.config.assume_aligned_inputs = knob == "assume_aligned"
    base = dict(backend="inductor", fullgraph=False, dynamic=False if knob == "static" else None)
    cfg = ModelConfig.from_preset(args.preset, num_layers=args.layers, seq_length=args.seq, **over)
    model = MoETransformer(cfg, ParallelContext.single())
    model.init_weights(0)
    model = model.cuda().to(torch.bfloat16)
    if compiled:
        for blk in model.layers:  # as torchtitan compiles each block
            blk.compile(**base)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device="cuda")

    def step():
        logits, aux = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()) + aux
        loss.backward()
        return loss

    out = {"compiled": compiled, "knob": knob, **over}
    try:
        for _ in range(3):
            loss = step()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(args.iters):
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        out.update(ok=True, loss=loss.item(), median_ms=sorted(times)[len(times) // 2])
    except Exception as e:  # noqa: BLE001 - the probe reports every variant
        out.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}", where=traceback.format_exc()[-1500:])
    del model
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--knobs", default="static,no_donated_buffer,assume_aligned", help="compile variants to try")
    args = p.parse_args()
    print(json.dumps(run(args, False)), flush=True)
    for knob in args.knobs.split(","):
        print(json.dumps(run(args, True, knob)), flush=True)


if __name__ == "__main__":
    main()
