"""The host's cost of the FP8 GEMMs' Python (one GPU): each GEMM's forward and backward at shapes small enough that the
GPU waits for the host, so the wall time per call is the host's. Rowwise recipe, as the models run it:

  experts  ``fp8_grouped_mm`` forward + backward through GradSync's main-grad fusion (and ``defer_wgrad``: the step's
           last backward runs the held micro-batches), two micro-batches per step
  dense    ``fp8_linear`` forward + backward
  bf16     the same GEMMs in bf16 (``grouped_linear`` into the main grads; ``wgrad_fusion.linear``), for comparison

Prints JSON: host microseconds per forward + backward of each, the CUDA kernel launches per forward + backward
(torch.profiler's launch calls), and cProfile's top functions by own time and by cumulative time (lightning_moe's
only) for the FP8 ones (``--top``).

    python benchmarks/profile_fp8_host.py --iters 200
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
from common import emit, env_info, log


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from lightning_moe.modules import wgrad_fusion
    from lightning_moe.modules.fp8_grouped import fp8_grouped_mm
    from lightning_moe.modules.fp8_linear import FP8Spec, fp8_linear
    from lightning_moe.strategy.grad_sync import GradSync
    from lightning_moe.strategy.parallel_context import ParallelContext
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU: a smoke run of the emulation
    sync_dev = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    L, K, N, M = 8, 256, 256, 2048
    w_e = torch.nn.Parameter(torch.randn(L, K, N, device=dev, dtype=torch.bfloat16) * 0.05)
    w_d = torch.nn.Parameter(torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.05)
    for w in (w_e, w_d):
        w.wgrad_fusable = True
    sync = GradSync([w_e, w_d], ParallelContext.single(), main_grads=True, fuse_wgrad=True)
    offs = torch.full((L,), M // L, device=dev).cumsum(0).to(torch.int32)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)

    def experts(spec):
        def step():
            for i in range(2):
                if i == 1:
                    sync.arm()
                fp8_grouped_mm(x.detach().requires_grad_(), w_e, offs, spec).backward(dy)
            sync.finish()
            sync.discard()
        return step

    def dense(spec):
        def step():
            sync.arm()
            fp8_linear(x.detach().requires_grad_(), w_d, spec).backward(dy)
            sync.finish()
            sync.discard()
        return step

    def bf16_experts():
        for i in range(2):
            if i == 1:
                sync.arm()
            wgrad_fusion.grouped_linear(x.detach().requires_grad_(), w_e, offs).backward(dy)
        sync.finish()
        sync.discard()

    def bf16_dense():
        sync.arm()
        wgrad_fusion.linear(x.detach().requires_grad_(), w_d).backward(dy)
        sync.finish()
        sync.discard()

    cases = {"experts_fp8": (experts(FP8Spec("rowwise", step=0)), 2),
             "experts_fp8_deferred": (experts(FP8Spec("rowwise", step=0, defer_wgrad=True)), 2),
             "experts_bf16": (bf16_experts, 2),
             "dense_fp8": (dense(FP8Spec("rowwise", step=0)), 1), "dense_bf16": (bf16_dense, 1),
             # the options of Qwen3's best FP8 step: the bf16 wgrad (deferred for the experts), fast accumulation
             "experts_fp8_bf16_wgrad": (experts(FP8Spec("rowwise", step=0, fp8_wgrad=False, fast_accum="all")), 2),
             "experts_fp8_bf16_wgrad_deferred": (experts(FP8Spec("rowwise", step=0, fp8_wgrad=False, fast_accum="all",
                                                                 defer_wgrad=True)), 2),
             "dense_fp8_bf16_wgrad": (dense(FP8Spec("rowwise", step=0, fp8_wgrad=False, fast_accum="all")), 1)}
    rec = {"shapes": {"L": L, "K": K, "N": N, "M": M}, "host_us_per_fwd_bwd": {}, "launches_per_fwd_bwd": {},
           "top": {}, "top_cumulative": {}}
    for name, (fn, calls) in cases.items():
        for _ in range(5):
            fn()
        sync_dev()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            fn()
        host = time.perf_counter() - t0  # the host's time to issue them (the GPU is behind)
        sync_dev()
        rec["host_us_per_fwd_bwd"][name] = round(host / args.iters / calls * 1e6, 1)
        if dev.type == "cuda":
            rec["launches_per_fwd_bwd"][name] = _launches(fn, 10) / 10 / calls
        if "fp8" in name:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.iters):
                fn()
            prof.disable()
            sync_dev()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
            lines = s.getvalue().splitlines()
            head = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
            rec["top"][name] = [line for line in lines[head:head + args.top + 1] if line.strip()]
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats("lightning_moe", args.top)
            rec["top_cumulative"][name] = [line for line in s.getvalue().splitlines() if "lightning_moe" in line]
        log(f"{name}: {rec['host_us_per_fwd_bwd'][name]} us")
    emit({"benchmark": "fp8_host", "env": env_info(dev), "records": [rec]}, args.out)


def _launches(fn, iters: int) -> int:
    """The CUDA kernel launches (driver or runtime launch calls) of ``iters`` calls of ``fn``."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages()
               if "LaunchKernel" in e.key or e.key == "cudaLaunchCooperativeKernel")


if __name__ == "__main__":
    main()
