"""Where an FP8 expert block's time goes: the SwiGLU grouped-GEMM block of ``bench_layer.py`` at one shape, forward +
backward, in bf16 and in FP8 (``--precision``), profiled (``--fused-swiglu``: both with the Triton SwiGLU;
``--fp8-swiglu``: also the FP8 blocks with it fused with their quantization); prints each run's CUDA kernels by total
time as JSON, and its median time over ``--rounds`` rounds that time the variants in turn.

    python benchmarks/profile_fp8_block.py --shape qwen3 --precision fp8-rowwise,fp8-tensorwise
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
from bench_layer import SHAPES, bare_block, bare_fused_block, fp8_block, fp8_specs
from common import emit, env_info, pick_device, time_fn

from lightning_moe.modules.fp8_swiglu import Handoff


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3", choices=list(SHAPES))
    p.add_argument("--precision", default="fp8-rowwise,fp8-tensorwise")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--fused-swiglu", action="store_true", help="both blocks with the layer's Triton SwiGLU")
    p.add_argument("--fp8-swiglu", action="store_true",
                   help="also each FP8 block with its SwiGLU fused with the quantization (fp8_swiglu; implies "
                   "--fused-swiglu), as '<precision>+fp8_swiglu'")
    p.add_argument("--rounds", type=int, default=3, help="timing rounds, the variants in turn in each")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.fused_swiglu = args.fused_swiglu or args.fp8_swiglu
    device = pick_device(False)
    s = SHAPES[args.shape]
    E, h, f, M = s["E"], s["h"], s["f"], s["T"] * s["k"]
    offs = torch.full((E,), M // E, device=device).cumsum(0).to(torch.int32)
    x = torch.randn(M, h, device=device, dtype=torch.bfloat16, requires_grad=True)
    w13 = (torch.randn(E, h, 2 * f, device=device, dtype=torch.bfloat16) * 0.02).requires_grad_()
    w2 = (torch.randn(E, f, h, device=device, dtype=torch.bfloat16) * 0.02).requires_grad_()
    g = torch.randn(M, h, device=device, dtype=torch.bfloat16)
    result = {"benchmark": "fp8_block_profile", "env": env_info(device), "shape": args.shape,
              "fused_swiglu": args.fused_swiglu, "runs": {}}
    fp8 = [q for q in args.precision.split(",") if q]
    steps = {}
    for precision in ["bf16"] + fp8 + ([f"{q}+fp8_swiglu" for q in fp8] if args.fp8_swiglu else []):
        if precision == "bf16":
            def step():
                (bare_fused_block if args.fused_swiglu else bare_block)(x, w13, w2, offs).backward(g)
        else:
            s1, s2 = fp8_specs(precision.split("+")[0])
            if precision.endswith("+fp8_swiglu"):
                hand = Handoff()
                s1.handoff, s2.handoff = (hand, "fc1"), (hand, "fc2")

            def step(s1=s1, s2=s2):
                fp8_block(x, w13, w2, offs, s1, s2, args.fused_swiglu).backward(g)
        steps[precision] = step
    medians = defaultdict(list)
    for _ in range(args.rounds):  # the variants in turn, so that a drift of the clocks reaches all of them
        for precision, step in steps.items():
            medians[precision].append(time_fn(step, device, 10, 3, [x, w13, w2], "events")["median_ms"])
    for precision, step in steps.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                x.grad = w13.grad = w2.grad = None  # fresh gradients, as time_fn's runs: no accumulation adds
                step()
            torch.cuda.synchronize()
        per = defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name[:90]] += e.device_time_total / 3 / 1e3
        top = sorted(per.items(), key=lambda kv: -kv[1])[:args.top]
        result["runs"][precision] = {"median_ms": sorted(medians[precision])[len(medians[precision]) // 2],
                                     "round_medians_ms": medians[precision], "kernel_ms_total": sum(per.values()),
                                     "top_kernels_ms": {k: round(v, 3) for k, v in top}}
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
