"""The grouped GEMM kernels alone, FP8 against bf16, at the expert shapes of ``bench_layer.py`` (balanced rows): the
ceiling an FP8 expert block can reach before any quantization cost. For each shape, in one process:
  fprop  y = x W (2d x 3d, groups over rows): bf16 ``F.grouped_mm``; E4M3 ``torch._scaled_grouped_mm`` with and
         without fast accumulation;
  wgrad  dW = x^T dy (2d x 2d, groups over the tokens): bf16 and E4M3 (no fast accumulation).
Prints TFLOP/s per kernel and the FP8/bf16 ratios as JSON.

    python benchmarks/bench_fp8_gemm.py --shapes mixtral,qwen3,olmoe
"""

from __future__ import annotations

import argparse

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
import torch.nn.functional as F
from bench_layer import SHAPES
from common import emit, env_info, log, pick_device, tflops, time_fn


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="mixtral,qwen3,olmoe")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = pick_device(False)
    e4m3 = torch.float8_e4m3fn
    records = []
    for name in args.shapes.split(","):
        s = SHAPES[name]
        E, K, N, M = s["E"], s["h"], 2 * s["f"], s["T"] * s["k"]  # fc1: h -> 2f
        offs = torch.full((E,), M // E, device=device).cumsum(0).to(torch.int32)
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        w = torch.randn(E, K, N, device=device, dtype=torch.bfloat16) * 0.02
        dy = torch.randn(M, N, device=device, dtype=torch.bfloat16)
        xq, dyq = x.to(e4m3), dy.to(e4m3)
        w_cm = w.transpose(1, 2).contiguous().to(e4m3).transpose(1, 2)
        xT, dyT = xq.t().contiguous(), dyq.t().contiguous()
        ones_M, ones_EN = torch.ones(M, device=device), torch.ones(E, N, device=device)
        ones_EK, ones_EN1 = torch.ones(E * K, device=device), torch.ones(E * N, device=device)
        runs = {
            "fprop_bf16": lambda: F.grouped_mm(x, w, offs=offs),
            "fprop_fp8_fast_accum": lambda: torch._scaled_grouped_mm(xq, w_cm, ones_M, ones_EN, offs=offs,
                                                                     out_dtype=torch.bfloat16, use_fast_accum=True),
            "fprop_fp8": lambda: torch._scaled_grouped_mm(xq, w_cm, ones_M, ones_EN, offs=offs,
                                                          out_dtype=torch.bfloat16, use_fast_accum=False),
            "wgrad_bf16": lambda: F.grouped_mm(x.t(), dy, offs=offs),
            "wgrad_fp8": lambda: torch._scaled_grouped_mm(xT, dyT.t(), ones_EK, ones_EN1, offs=offs,
                                                          out_dtype=torch.bfloat16, use_fast_accum=False),
        }
        flops = 2.0 * M * K * N
        rec = {"shape": name, "E": E, "M": M, "K": K, "N": N}
        for key, fn in runs.items():
            t = time_fn(fn, device, args.iters, 5, [], "events")
            rec[key] = {"median_ms": t["median_ms"], "tflops": tflops(flops, t["median_ms"])}
        rec["fprop_fp8_over_bf16"] = rec["fprop_bf16"]["median_ms"] / rec["fprop_fp8_fast_accum"]["median_ms"]
        rec["wgrad_fp8_over_bf16"] = rec["wgrad_bf16"]["median_ms"] / rec["wgrad_fp8"]["median_ms"]
        log(f"{name}: " + ", ".join(f"{k} {rec[k]['tflops']:.0f}" for k in runs))
        records.append(rec)
    result = {"benchmark": "fp8_grouped_gemm", "env": env_info(device), "records": records}
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
