"""The experts' FP8 forward and dgrad GEMMs (rows grouped by expert, rowwise scales) at the presets' expert shapes,
one GPU: ``torch._scaled_grouped_mm`` (CUTLASS) against ``triton_fp8_grouped_mm`` over a few tile configs, each with
and without fast accumulation, and their relative difference. Balanced routing, and one uneven routing (experts'
rows off the tiles' boundaries).

    python benchmarks/bench_fp8_grouped_mm.py --shapes mixtral,qwen3,olmoe
"""

from __future__ import annotations

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
from bench_fp8_wgrad import SHAPES, parse_args, timed
from common import emit, env_info, log

# (BLOCK_M, BLOCK_N, warps, stages)
CONFIGS = [(128, 128, 4, 3), (128, 128, 8, 3), (128, 128, 4, 4), (128, 256, 8, 3), (128, 256, 8, 4),
           (64, 128, 4, 4), (256, 128, 8, 3)]


def routings(E: int, M: int) -> dict:
    """Each expert's rows: balanced, and uneven (drawn from a multinomial, rows off the tiles' boundaries)."""
    g = torch.Generator().manual_seed(0)
    return {"balanced": torch.full((E,), M // E),
            "uneven": torch.distributions.Multinomial(M, torch.rand(E, generator=g) + 0.5).sample().long()}


def gemm_operands(name: str, dev: torch.device):
    """The shape's forward and dgrad expert GEMMs: (gemm, K, N, (a, b, sa, sb)), E4M3 operands with their rowwise
    dequantization scales, as ``triton_fp8_grouped_mm.grouped_mm`` takes them."""
    from lightning_moe.modules import triton_fp8_quant as tq
    E, M, D, Fh = SHAPES[name]
    for gemm, K, N in (("fc1", D, 2 * Fh), ("fc2", Fh, D), ("fc1_dgrad", 2 * Fh, D), ("fc2_dgrad", D, Fh)):
        torch.manual_seed(0)
        aq, sa = tq.rowwise_quant(torch.randn(M, K, device=dev, dtype=torch.bfloat16))
        bq, sb = tq.rowwise_quant(torch.randn(E * N, K, device=dev, dtype=torch.bfloat16) * 0.02)
        yield gemm, K, N, (aq, bq.view(E, N, K), sa.reciprocal().reshape(M), sb.reciprocal().reshape(E, N))


def main() -> None:
    args = parse_args(__doc__)
    from lightning_moe.modules import triton_fp8_grouped_mm as tg
    dev = torch.device("cuda")
    records = []

    def rate(fn, flop):
        v = timed(fn, dev, args.iters)
        return round(flop / v / 1e9, 1) if isinstance(v, float) else v

    for name in args.shapes.split(","):
        E, M, _, _ = SHAPES[name]
        for gemm, K, N, (aq, bq, sa, sb) in gemm_operands(name, dev):
            flop = 2 * M * K * N
            for routing, counts in routings(E, M).items():
                offs = counts.to(dev).cumsum(0).to(torch.int32)
                rec = {"shape": name, "gemm": gemm, "routing": routing, "experts": E, "rows": M, "K": K, "N": N}
                for fast in (False, True):
                    tag = "fast" if fast else "precise"

                    def cutlass(fast=fast):
                        return torch._scaled_grouped_mm(aq, bq.transpose(1, 2), sa, sb, offs=offs,
                                                        out_dtype=torch.bfloat16, use_fast_accum=fast)
                    rec[f"cutlass_{tag}"] = rate(cutlass, flop)
                    ref = cutlass()[:M].float()
                    for c in CONFIGS:
                        key = f"triton_{tag}_" + "x".join(map(str, c))
                        rec[key] = rate(lambda c=c, fast=fast: tg.grouped_mm(aq, bq, sa, sb, offs, fast, c), flop)
                        if c == CONFIGS[0]:
                            got = tg.grouped_mm(aq, bq, sa, sb, offs, fast, c).float()
                            rec[f"rel_diff_{tag}"] = ((got - ref).norm() / ref.norm()).item()
                log(f"{name} {gemm} {routing}: {rec}")
                records.append(rec)
            torch.cuda.empty_cache()
    emit({"benchmark": "fp8_grouped_mm", "env": env_info(dev), "records": records}, args.out)


if __name__ == "__main__":
    main()
