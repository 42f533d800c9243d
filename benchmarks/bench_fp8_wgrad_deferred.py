"""The experts' FP8 wgrad of an optimizer step's micro-batches (one GPU, rowwise scales, fp32 main grads):

  per_micro_batch  one ``triton_fp8_wgrad.wgrad_into`` per micro-batch with the default kernels: the first writes the
                   main grad, the others read, add and write it (gradient accumulation)
  deferred         ``FP8Training(defer_expert_wgrad=True)``'s path, which writes the main grad once with one
                   ``wgrad_segments_into`` over every micro-batch's operands: ``_concatenated`` where they are separate
                   tensors (the first step), ``_in_arena`` where they were quantized side by side into the arenas (the
                   later steps)
  segments_only    the kernel alone, over each config of the sweep

at bench_model's micro-batch shapes (``bench_fp8_wgrad.SHAPES``: mixtral-b1, 1,024 tokens per expert, and qwen3-b2,
512), balanced routing, S micro-batches each with its own scales. Prints JSON: median ms, TFLOP/s (2 S M K N FLOPs),
and whether the deferred bits equal the per-micro-batch ones.

    python benchmarks/bench_fp8_wgrad_deferred.py --shapes mixtral-b1:4,qwen3-b2:2
"""

from __future__ import annotations

import argparse

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
import torch.nn.functional as F
from bench_fp8_wgrad import SHAPES, timed
from common import emit, env_info, log

SWEEP = [None, (128, 128, 8, 3), (64, 128, 4, 3), (64, 128, 4, 4), (128, 64, 4, 4)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="mixtral-b1:4,qwen3-b2:2", help="SHAPE:MICRO_BATCHES, comma-separated")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from lightning_moe.modules import triton_fp8_quant as tq
    from lightning_moe.modules import triton_fp8_wgrad as tw
    from lightning_moe.modules.fp8 import scale_of
    from lightning_moe.modules.fp8_grouped import expert_of_rows
    from lightning_moe.modules.fp8_grouped_kernels import _wgrad_of_micro_batches
    from lightning_moe.modules.fp8_linear import FP8Spec
    dev = torch.device("cuda")
    records = []
    for item in args.shapes.split(","):
        name, S = item.split(":")
        S = int(S)
        E, M, D, Fh = SHAPES[name]
        offs = torch.full((E,), M // E, device=dev).cumsum(0).to(torch.int32)
        gid = expert_of_rows(M, offs, dev)
        for gemm, K, N in (("fc1", D, 2 * Fh), ("fc2", Fh, D)):
            torch.manual_seed(0)
            helds = []
            for _ in range(S):  # each micro-batch's operands and scales, as the backward quantizes them
                x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16) * (1 + torch.rand((), device=dev))
                sx = scale_of(tq.grouped_col_amax(x, offs, gid), "e4m3")
                sd = scale_of(tq.grouped_col_amax(dy, offs, gid), "e4m3")
                helds.append(((tq.quant_t_padded(x, sx, offs, offs, gid, M), sx.reciprocal()),
                              (tq.quant_t_padded(dy, sd, offs, offs, gid, M), sd.reciprocal()), offs))
                del x, dy
            flop = 2 * S * M * K * N
            main = torch.empty(E, K, N, device=dev)
            starts = torch.stack([F.pad(offs[:-1], (1, 0)) + s * M for s in range(S)])
            ends = torch.stack([offs + s * M for s in range(S)])
            a = (torch.cat([h[0][0] for h in helds], 1), torch.stack([h[0][1] for h in helds]))
            b = (torch.cat([h[1][0] for h in helds], 1), torch.stack([h[1][1] for h in helds]))
            # the same operands as column slices of the arenas, as the steps after the first hold them
            in_arena = [((a[0][:, s * M:(s + 1) * M], h[0][1]), (b[0][:, s * M:(s + 1) * M], h[1][1]), o)
                        for s, (h, o) in enumerate(zip(helds, [offs] * S))]

            def rate(v):
                return (round(v, 4), round(flop / v / 1e9, 1)) if isinstance(v, float) else v

            rec = {"shape": name, "gemm": gemm, "micro_batches": S, "experts": E, "rows": M, "K": K, "N": N}
            for fast in (False, True):
                tag = "fast" if fast else "precise"

                def per_micro_batch(fast=fast):
                    for i, (ha, hb, o) in enumerate(helds):
                        tw.wgrad_into(main, ha, hb, o, i == 0, per_expert=True, fast=fast)

                rec[f"per_micro_batch_{tag}"] = rate(timed(per_micro_batch, dev, args.iters))
                rec[f"deferred_concatenated_{tag}"] = rate(timed(lambda fast=fast: _wgrad_of_micro_batches(
                    tw, main, True, list(helds), fast, FP8Spec("rowwise")), dev, args.iters))
                rec[f"deferred_in_arena_{tag}"] = rate(timed(lambda fast=fast: _wgrad_of_micro_batches(
                    tw, main, True, list(in_arena), fast, FP8Spec("rowwise")), dev, args.iters))
                per_micro_batch()
                ref = main.clone()
                for c in SWEEP:
                    key = f"segments_only_{tag}_{'x'.join(map(str, c)) if c else 'default'}"
                    rec[key] = rate(timed(lambda c=c, fast=fast: tw.wgrad_segments_into(
                        main, a, b, starts, ends, True, fast=fast, config=c), dev, args.iters))
                    main.zero_()
                    try:
                        tw.wgrad_segments_into(main, a, b, starts, ends, True, fast=fast, config=c)
                        rec[key + "_bits_equal"] = bool(torch.equal(main, ref))
                    except Exception as e:  # noqa: BLE001 - reported, not fatal
                        rec[key + "_bits_equal"] = f"{type(e).__name__}: {str(e)[:160]}"
            log(f"{name} {gemm}: {rec}")
            records.append(rec)
            helds = in_arena = a = b = main = None  # freed before the next GEMM's operands
            torch.cuda.empty_cache()
    emit({"benchmark": "fp8_wgrad_deferred", "env": env_info(dev), "records": records}, args.out)


if __name__ == "__main__":
    main()
