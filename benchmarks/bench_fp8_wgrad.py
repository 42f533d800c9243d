"""The experts' FP8 wgrad, piece by piece, at the presets' expert shapes (one GPU), written into fp32 main grads:

  tiles      the blockwise tile pass over one operand (M x K): without the wgrad operand, with it in bf16 (P, K), with
             it in E4M3 transposed (K, P) plus scales (``wgrad_fp8``)
  bf16       ``F.grouped_mm(x^T, dy, offs)`` and ``triton_grouped_wgrad.wgrad_into`` (fp32 main, written)
  blockwise  ``triton_fp8_wgrad`` with per-128-token scales, over a few tile configs
  rowwise    per-expert-and-feature scales: ``torch._scaled_grouped_mm`` (CUTLASS, bf16 out) then copied into main,
             against ``triton_fp8_wgrad`` (per-expert scales) into main, each with and without fast accumulation,
             over the same tile configs; and its persistent kernel against the one-tile kernel, written and added

Balanced routing. Prints JSON: median ms and TFLOP/s of each, and the rowwise kernels' relative difference.

    python benchmarks/bench_fp8_wgrad.py --shapes mixtral,qwen3
"""

from __future__ import annotations

import argparse

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
import torch.nn.functional as F
from common import emit, env_info, log, time_fn

# name: (experts, routed rows, hidden, ffn) as bench_layer's blocks (mixtral T=8192 top-2, qwen3 and olmoe T=16384
# top-8, deepseek-v3-ep8 T=2048 top-8 over 32 local experts), and as bench_model's micro-batches (mixtral-b1: one
# sequence of 4,096 tokens, 1,024 per expert; qwen3-b2: two, 512 per expert)
SHAPES = {"mixtral": (8, 8192 * 2, 4096, 14336), "qwen3": (128, 16384 * 8, 2048, 768),
          "olmoe": (64, 16384 * 8, 2048, 1024), "deepseek-v3-ep8": (32, 2048 * 8, 7168, 2048),
          "mixtral-b1": (8, 4096 * 2, 4096, 14336), "qwen3-b2": (128, 8192 * 8, 2048, 768)}
# (BLOCK_K, BLOCK_N, warps, stages)
CONFIGS = [(128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 4), (128, 256, 8, 3), (256, 128, 8, 4),
           (128, 256, 16, 3), (128, 128, 4, 3)]


def parse_args(doc: str) -> argparse.Namespace:
    """The FP8 kernel benchmarks' options: shapes (of SHAPES), iterations, the JSON's path."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--shapes", default="mixtral,qwen3")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None)
    return p.parse_args()


def timed(fn, dev: torch.device, iters: int):
    """``fn``'s median ms, or why it failed: a config that does not compile or fit is reported, not fatal."""
    try:
        return time_fn(fn, dev, iters, 2)["median_ms"]
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:160]}"


# the persistent kernel's sweep: (config, programs per SM, output by TMA). 128 x 128 tiles leave room for one program
# per SM (its pipeline buffers and the epilogue's 64 KiB layout scratch); the narrower tiles for two, so that one
# program's MMAs run while the other's epilogue reads, adds and writes (sm_90 compiles on the CPU: 90-115 KiB of
# shared memory, no spills)
PERSISTENT_SWEEP = [(None, 1, False), (None, 1, True), ((128, 64, 4, 3), 2, False), ((128, 64, 8, 3), 2, False),
                    ((64, 128, 4, 3), 2, False), ((128, 64, 4, 4), 2, False)]


def persistent_rates(tw, main, a, b, offs, fast: bool, rate) -> dict:
    """The persistent rowwise kernel against the one-tile kernel, both written (``first``) and added into ``main``
    (the read-add-write of gradient accumulation), over ``PERSISTENT_SWEEP``: TFLOP/s, and whether the bits match."""
    sms = torch.cuda.get_device_properties(main.device).multi_processor_count
    tag, out = ("fast" if fast else "precise"), {}
    for first in (True, False):
        mode = "written" if first else "added"
        out[f"onetile_{tag}_{mode}"] = rate(lambda: tw.wgrad_into(main, a, b, offs, first, per_expert=True, fast=fast,
                                                                   persistent=False))
        for c, per_sm, tma_out in PERSISTENT_SWEEP:
            name = f"persistent_{tag}_{mode}_{'x'.join(map(str, c)) if c else 'default'}" + \
                (f"_{per_sm}per_sm" if per_sm > 1 else "") + ("_tma_out" if tma_out else "")
            out[name] = rate(lambda c=c, tma_out=tma_out, n=per_sm * sms: tw.wgrad_into(
                main, a, b, offs, first, per_expert=True, fast=fast, config=c, persistent=True, programs=n,
                tma_out=tma_out))
    start = main.clone()
    for first in (True, False):  # written, and added into the same start
        mode = "written" if first else "added"
        main.copy_(start)
        tw.wgrad_into(main, a, b, offs, first, per_expert=True, fast=fast, persistent=False)
        ref = main.clone()
        for c, per_sm, tma_out in PERSISTENT_SWEEP:
            key = f"persistent_{tag}_{mode}_{'x'.join(map(str, c)) if c else 'default'}" + \
                ("_tma_out" if tma_out else "") + "_bits_equal"
            try:
                main.copy_(start)
                tw.wgrad_into(main, a, b, offs, first, per_expert=True, fast=fast, config=c, persistent=True,
                              programs=per_sm * sms, tma_out=tma_out)
                out[key] = bool(torch.equal(main, ref))
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                out[key] = f"{type(e).__name__}: {str(e)[:160]}"
    return out


def main() -> None:
    args = parse_args(__doc__)
    from lightning_moe.modules import triton_fp8_blockwise as tb
    from lightning_moe.modules import triton_fp8_quant as tq
    from lightning_moe.modules import triton_fp8_wgrad as tw
    from lightning_moe.modules.fp8 import scale_of
    from lightning_moe.modules.fp8_grouped import expert_of_rows
    from lightning_moe.modules.triton_grouped_wgrad import wgrad_into as bf16_wgrad_into
    dev = torch.device("cuda")
    records = []

    def rate(v, flop):
        return (round(v, 4), round(flop / v / 1e9, 1)) if isinstance(v, float) else v

    def timed_(fn):
        return timed(fn, dev, args.iters)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    for name in args.shapes.split(","):
        E, M, D, Fh = SHAPES[name]
        offs = torch.full((E,), M // E, device=dev).cumsum(0).to(torch.int32)
        end = offs[-1:].clone()
        gid = expert_of_rows(M, offs, dev)
        for gemm, K, N in (("fc1", D, 2 * Fh), ("fc2", Fh, D)):
            torch.manual_seed(0)
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
            flop = 2 * M * K * N
            rec = {"shape": name, "gemm": gemm, "experts": E, "rows": M, "K": K, "N": N, "tiles_ms": {}}
            for what, kw in (("no_wgrad", dict(wgrad=False)), ("bf16_wgrad", dict(wgrad=True)),
                             ("fp8_wgrad", dict(wgrad=True, wgrad_fp8=True))):
                rec["tiles_ms"][what] = timed_(lambda kw=kw: tb.tiles(dy, None, end, "e4m3", P=M, **kw))
            main = torch.empty(E, K, N, device=dev)
            rec["bf16"] = {"grouped_mm": rate(timed_(lambda: F.grouped_mm(x.t(), dy, offs=offs)), flop),
                           "triton_into_main": rate(timed_(lambda: bf16_wgrad_into(main, x, dy, offs, True)), flop)}
            # blockwise: E4M3 operands with per-128-token scales
            _, _, (aT, sa) = tb.tiles(x, None, end, "e4m3", True, M, wgrad_fp8=True)
            _, _, (bT, sb) = tb.tiles(dy, None, end, "e4m3", True, M, wgrad_fp8=True)
            rec["blockwise"] = {"x".join(map(str, c)): rate(timed_(
                lambda c=c: tw.wgrad_into(main, (aT, sa), (bT, sb), offs, True, config=c)), flop) for c in CONFIGS}
            # rowwise: per expert and feature (the offsets are already on 128-row boundaries)
            sx = scale_of(tq.grouped_col_amax(x, offs, gid), "e4m3")
            sd = scale_of(tq.grouped_col_amax(dy, offs, gid), "e4m3")
            xT = tq.quant_t_padded(x, sx, offs, offs, gid, M)
            dyT = tq.quant_t_padded(dy, sd, offs, offs, gid, M)
            rw = {}
            for fast in (False, True):
                def cutlass(fast=fast):
                    g = torch._scaled_grouped_mm(xT, dyT.t(), sx.reciprocal().reshape(-1), sd.reciprocal().reshape(-1),
                                                 offs=offs, out_dtype=torch.bfloat16, use_fast_accum=fast)
                    main.copy_(g)

                def triton_(fast=fast):
                    tw.wgrad_into(main, (xT, sx.reciprocal()), (dyT, sd.reciprocal()), offs, True, per_expert=True,
                                  fast=fast, persistent=False)
                tag = "fast" if fast else "precise"
                rw[f"cutlass_{tag}_then_copy"] = rate(timed_(cutlass), flop)
                rw[f"triton_{tag}_into_main"] = rate(timed_(triton_), flop)
                cutlass()
                ref = main.clone()
                triton_()
                rw[f"rel_diff_{tag}"] = rel(main, ref)
                for c in CONFIGS[1:]:  # the other tiles: without the per-block promotion, larger ones may not spill
                    rw[f"triton_{tag}_" + "x".join(map(str, c))] = rate(timed_(lambda c=c, fast=fast: tw.wgrad_into(
                        main, (xT, sx.reciprocal()), (dyT, sd.reciprocal()), offs, True, per_expert=True, fast=fast,
                        config=c, persistent=False)), flop)
                rw.update(persistent_rates(tw, main, (xT, sx.reciprocal()), (dyT, sd.reciprocal()), offs, fast,
                                           lambda fn: rate(timed_(fn), flop)))
            rec["rowwise"] = rw
            log(f"{name} {gemm}: {rec}")
            records.append(rec)
            torch.cuda.empty_cache()
    emit({"benchmark": "fp8_wgrad", "env": env_info(dev), "records": records}, args.out)


if __name__ == "__main__":
    main()
