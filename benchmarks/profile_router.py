"""Where the router's time goes on one GPU: the CUDA kernels of a fused-router forward + backward at a preset's shape
(torch.profiler, top kernels by CUDA time), and the float32 router GEMM alone against the same GEMM in bf16 with TF32
off and on. Prints JSON.

    python benchmarks/profile_router.py --shape qwen3
"""

from __future__ import annotations

import argparse
import json

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
from common import time_fn as _time_fn

from lightning_moe.modules.config import ModelConfig
from lightning_moe.modules.router import TopKRouter, fp32_linear
from lightning_moe.strategy.parallel_context import ParallelContext

SHAPES = {"qwen3": dict(E=128, h=2048, k=8, T=16384, router=dict(aux_loss_coeff=1e-3)),
          "deepseek-v3": dict(E=256, h=7168, k=8, T=16384,
                              router=dict(score_function="sigmoid", expert_bias=True, num_groups=8, group_topk=4,
                                          topk_scaling_factor=2.5, load_balancing="seq_aux_loss",
                                          aux_loss_coeff=1e-4))}


def time_fn(fn, iters: int) -> float:
    return round(_time_fn(fn, torch.device("cuda"), iters=iters, warmup=5)["median_ms"], 4)


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--shape", default="qwen3", choices=list(SHAPES))
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    s = SHAPES[args.shape]
    cfg = ModelConfig(hidden_size=s["h"], num_experts=s["E"], topk=s["k"], **s["router"])
    router = TopKRouter(cfg, ParallelContext.single()).cuda().train()
    x = torch.randn(s["T"], s["h"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w_TK = torch.randn(s["T"], s["k"], device="cuda")

    def step():
        out = router(x, num_sequences=4)
        ((out.probs_TK * w_TK).sum() + out.aux_loss + out.z_loss).backward()

    out = {"shape": args.shape, **{k: v for k, v in s.items() if k != "router"}}
    out["router_ms"] = time_fn(step, iters=args.iters)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:15]
    out["kernels_us_per_step"] = {e.key[:90]: round(e.device_time_total / 5, 1) for e in rows}

    w = router.weight

    def gemm(fn):
        def run():
            logits = fn()
            logits.backward(torch.ones_like(logits))
        return run
    out["gemm_fp32_ms"] = time_fn(gemm(lambda: fp32_linear(x, w)), iters=args.iters)
    torch.backends.cuda.matmul.allow_tf32 = True
    out["gemm_fp32_tf32_ms"] = time_fn(gemm(lambda: fp32_linear(x, w)), iters=args.iters)
    torch.backends.cuda.matmul.allow_tf32 = False
    out["gemm_bf16_ms"] = time_fn(gemm(lambda: torch.nn.functional.linear(x, w.bfloat16()).float()), iters=args.iters)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
