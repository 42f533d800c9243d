"""The experts' FP8 grouped GEMM with the precise accumulation: the shipped Triton kernel against the Gluon experiment
(``gluon_fp8_grouped_mm.py``: the promotion of one block's partial sum overlapping the next block's MMA), with each
one's fast accumulation for reference, at the presets' expert shapes (forward and dgrad GEMMs, balanced and uneven
routing). Prints JSON: TFLOP/s per kernel and config, and whether each Gluon output equals the Triton one bit for bit.

    python benchmarks/bench_gluon_precise.py --shapes mixtral,qwen3,mixtral-b1,qwen3-b2
"""

from __future__ import annotations

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
from bench_fp8_grouped_mm import gemm_operands, routings
from bench_fp8_wgrad import SHAPES, parse_args, timed
from common import emit, env_info, log

# (BLOCK_M, BLOCK_N, warps, stages), blocks of K per iteration
PRECISE = [((128, 128, 8, 4), 2), ((128, 128, 8, 3), 2), ((64, 128, 4, 4), 2), ((64, 128, 4, 3), 2)]
FAST = [((128, 256, 8, 4), 1), ((128, 128, 8, 4), 1)]


def main() -> None:
    args = parse_args(__doc__)
    import gluon_fp8_grouped_mm as gm
    from lightning_moe.modules import triton_fp8_grouped_mm as tg
    dev = torch.device("cuda")
    records = []
    for name in args.shapes.split(","):
        E, M, _, _ = SHAPES[name]
        for gemm, K, N, (aq, bq, sa, sb) in gemm_operands(name, dev):
            flop = 2 * M * K * N

            def rate(fn):
                v = timed(fn, dev, args.iters)
                return round(flop / v / 1e9, 1) if isinstance(v, float) else v

            for routing, counts in routings(E, M).items():
                offs = counts.to(dev).cumsum(0).to(torch.int32)
                rec = {"shape": name, "gemm": gemm, "routing": routing, "experts": E, "rows": M, "K": K, "N": N}
                for fast in (False, True):
                    tag = "fast" if fast else "precise"
                    ref = tg.grouped_mm(aq, bq, sa, sb, offs, fast)
                    rec[f"triton_{tag}"] = rate(lambda fast=fast: tg.grouped_mm(aq, bq, sa, sb, offs, fast))
                    for cfg, u in FAST if fast else PRECISE:
                        key = f"gluon_{tag}_" + "x".join(map(str, cfg)) + f"_u{u}"
                        try:
                            rec[key + "_bits_equal"] = bool(torch.equal(
                                gm.grouped_mm(aq, bq, sa, sb, offs, fast, cfg, u), ref))
                        except Exception as e:  # noqa: BLE001 - reported, not fatal
                            rec[key + "_bits_equal"] = f"{type(e).__name__}: {str(e)[:160]}"
                            continue
                        rec[key] = rate(lambda cfg=cfg, u=u, fast=fast: gm.grouped_mm(aq, bq, sa, sb, offs, fast,
                                                                                      cfg, u))
                log(f"{name} {gemm} {routing}: {rec}")
                records.append(rec)
    emit({"benchmark": "gluon_precise", "env": env_info(dev), "records": records}, args.out)


if __name__ == "__main__":
    main()
