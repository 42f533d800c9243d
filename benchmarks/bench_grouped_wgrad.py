"""The experts' weight-gradient GEMM with its main-grad accumulation, two ways, at the presets' expert shapes:

  unfused  ``F.grouped_mm(x^T, dy, offs)`` (bf16 out, CUTLASS) then ``main.add_(g)`` (or ``copy_`` on the first
           micro-batch of a step): what GradSync's hook does with autograd's gradient
  fused    ``triton_grouped_wgrad.wgrad_into``: fp32 tiles added (or written) into main in the GEMM's epilogue

Balanced routing, bf16 operands, fp32 main grads. Prints JSON: median ms of each, the speed-up, and the GEMM's TFLOP/s.

With ``--segments S``, also a step of S micro-batches (each in tensors of its own) two ways:

  per micro-batch  S ``wgrad_into`` (the first writes, the others add): the main grad read and written S times
  deferred         one ``wgrad_segments_into`` over the S micro-batches (``MoEFoldStrategy(defer_expert_wgrad)``):
                   the main grad written once

    python benchmarks/bench_grouped_wgrad.py --shapes qwen3,olmoe,mixtral --segments 8
"""

from __future__ import annotations

import argparse

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
import torch.nn.functional as F
from common import emit, env_info, log, time_fn

# name: (experts, routed rows, K, N) of fc1 (K = hidden, N = 2 x ffn) and fc2 (K = ffn, N = hidden), micro-batch of
# the model benchmarks (qwen3 and olmoe 2 x 4096 tokens, mixtral 1 x 4096)
SHAPES = {"qwen3": (128, 8192 * 8, 2048, 768), "olmoe": (64, 8192 * 8, 2048, 1024),
          "mixtral": (8, 4096 * 2, 4096, 14336)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3,olmoe,mixtral")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--segments", type=int, default=0, help="also time S micro-batches per step, deferred or not")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from lightning_moe.modules.triton_grouped_wgrad import wgrad_into, wgrad_segments_into
    dev = torch.device("cuda")
    records = []
    for name in args.shapes.split(","):
        E, M, D, Fh = SHAPES[name]
        offs = torch.full((E,), M // E, device=dev).cumsum(0).to(torch.int32)
        for gemm, K, N in (("fc1", D, 2 * Fh), ("fc2", Fh, D)):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
            main = torch.zeros(E, K, N, device=dev)
            rec = {"shape": name, "gemm": gemm, "experts": E, "rows": M, "K": K, "N": N}
            flop = 2 * M * K * N
            for first in (False, True):
                def unfused():
                    g = F.grouped_mm(x.t(), dy, offs=offs)
                    main.copy_(g) if first else main.add_(g)

                def fused():
                    wgrad_into(main, x, dy, offs, first)
                t_u, t_f, gemm_only = (time_fn(fn, dev, args.iters, 3)["median_ms"] for fn in (
                    unfused, fused, lambda: F.grouped_mm(x.t(), dy, offs=offs)))
                key = "first" if first else "accumulate"
                rec[key] = {"unfused_ms": t_u, "fused_ms": t_f, "speedup": t_u / t_f, "grouped_mm_ms": gemm_only,
                            "fused_tflops": flop / t_f / 1e9, "grouped_mm_tflops": flop / gemm_only / 1e9}
            log(f"{name} {gemm}: accumulate {rec['accumulate']['unfused_ms']:.3f} -> {rec['accumulate']['fused_ms']:.3f}"
                f" ms (x{rec['accumulate']['speedup']:.2f}), first {rec['first']['unfused_ms']:.3f} -> "
                f"{rec['first']['fused_ms']:.3f} ms (x{rec['first']['speedup']:.2f}); grouped_mm alone "
                f"{rec['first']['grouped_mm_ms']:.3f} ms")
            if args.segments > 1:
                S = args.segments
                segs = [(x, dy, offs)] + [(torch.randn_like(x), torch.randn_like(dy), offs) for _ in range(S - 1)]

                def per_micro_batch():
                    for i, (xs, dys, o) in enumerate(segs):
                        wgrad_into(main, xs, dys, o, i == 0)

                def deferred():
                    wgrad_segments_into(main, segs, True)
                t_p, t_d = (time_fn(fn, dev, args.iters, 3)["median_ms"] for fn in (per_micro_batch, deferred))
                rec["segments"] = {"S": S, "per_micro_batch_ms": t_p, "deferred_ms": t_d, "speedup": t_p / t_d,
                                   "per_micro_batch_tflops": S * flop / t_p / 1e9,
                                   "deferred_tflops": S * flop / t_d / 1e9}
                log(f"{name} {gemm}: {S} micro-batches {t_p:.3f} ms, deferred {t_d:.3f} ms (x{t_p / t_d:.2f})")
                del segs
            records.append(rec)
            del x, dy, main
    emit({"benchmark": "bench_grouped_wgrad", "env": env_info(dev), "records": records}, args.out)


if __name__ == "__main__":
    main()
