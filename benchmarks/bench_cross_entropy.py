"""The LM loss over bf16 logits, forward + backward: the Triton kernels (``ModelConfig.cross_entropy_fusion``,
``triton_cross_entropy.py``) against ``F.cross_entropy(logits.float())`` (the unfused path), with the peak memory
each adds over the logits.

The limit is the bytes the fused passes must move (forward: read the logits; backward: read them, write their
gradient) at the bandwidth of a device-to-device copy measured in the same run. Prints JSON.

    python benchmarks/bench_cross_entropy.py --shapes qwen3,mixtral
"""

from __future__ import annotations

import argparse

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
from common import copy_bandwidth_tb_s, emit, env_info, log, time_fn

# name: (tokens of the model benchmarks' micro-batch, vocabulary)
SHAPES = {"qwen3": (8192, 151936), "mixtral": (4096, 32000), "qwen3-v32k": (8192, 32768)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3,mixtral,qwen3-v32k")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from lightning_moe.modules.tensor_parallel import vocab_parallel_cross_entropy
    from lightning_moe.strategy.parallel_context import ParallelContext
    dev, ctx = torch.device("cuda"), ParallelContext.single()
    copy_bw = copy_bandwidth_tb_s(dev, args.iters)
    records = []
    for name in args.shapes.split(","):
        N, V = SHAPES[name]
        logits = (torch.randn(N, V, device=dev) * 3).to(torch.bfloat16).requires_grad_()
        target = torch.randint(0, V, (N,), device=dev)

        def step(fused):
            vocab_parallel_cross_entropy(logits, target, ctx, fused=fused).backward()

        rec = {"shape": name, "tokens": N, "vocab": V}
        for fused in (False, True):
            t = time_fn(lambda: step(fused), dev, args.iters, 3, grad_to_none=[logits])["median_ms"]
            logits.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step(fused)
            torch.cuda.synchronize()
            extra = (torch.cuda.max_memory_allocated() - base) / 2**30
            logits.grad = None
            rec["fused" if fused else "torch"] = {"ms": t, "peak_extra_gib": extra}
        limit_ms = 3 * logits.numel() * 2 / copy_bw / 1e9
        rec.update(speedup=rec["torch"]["ms"] / rec["fused"]["ms"], limit_ms=limit_ms,
                   fused_over_limit=rec["fused"]["ms"] / limit_ms, copy_tb_s=copy_bw)
        log(f"{name}: torch {rec['torch']['ms']:.3f} ms (+{rec['torch']['peak_extra_gib']:.2f} GiB) -> fused "
            f"{rec['fused']['ms']:.3f} ms (+{rec['fused']['peak_extra_gib']:.2f} GiB), x{rec['speedup']:.2f}; "
            f"copy-bandwidth limit {limit_ms:.3f} ms")
        records.append(rec)
        del logits, target
    emit({"benchmark": "bench_cross_entropy", "env": env_info(dev), "records": records}, args.out)


if __name__ == "__main__":
    main()
