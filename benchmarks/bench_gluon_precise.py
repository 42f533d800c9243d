"""The experts' FP8 forward and dgrad GEMMs with the precise accumulation: triton's kernel
(``triton_fp8_grouped_mm``) against Gluon's (``gluon_fp8_grouped_mm``: a block's promotion overlapping the next
block's MMAs) over a few tile configs, with triton's fast accumulation for reference, at the presets' expert shapes
(balanced and uneven routing). Prints JSON: TFLOP/s per kernel and config, and whether each Gluon output equals the
triton one bit for bit.

    python benchmarks/bench_gluon_precise.py --shapes mixtral,qwen3,mixtral-b1,qwen3-b2
"""

from __future__ import annotations

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
from bench_fp8_grouped_mm import gemm_operands, routings
from bench_fp8_wgrad import SHAPES, parse_args, timed
from common import emit, env_info, log

# (BLOCK_M, BLOCK_N, warps, stages); None: the module's CONFIG
CONFIGS = [None, (128, 128, 8, 3), (64, 128, 4, 4), (64, 128, 4, 3)]


def main() -> None:
    args = parse_args(__doc__)
    from lightning_moe.modules import gluon_fp8_grouped_mm as gm
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
                ref = tg.grouped_mm(aq, bq, sa, sb, offs, False)
                rec["triton_precise"] = rate(lambda: tg.grouped_mm(aq, bq, sa, sb, offs, False))
                rec["triton_fast"] = rate(lambda: tg.grouped_mm(aq, bq, sa, sb, offs, True))
                for c in CONFIGS:
                    key = "gluon_precise_" + ("x".join(map(str, c)) if c else "default")
                    try:
                        rec[key + "_bits_equal"] = bool(torch.equal(gm.grouped_mm(aq, bq, sa, sb, offs, c), ref))
                    except Exception as e:  # noqa: BLE001 - reported, not fatal
                        rec[key + "_bits_equal"] = f"{type(e).__name__}: {str(e)[:160]}"
                        continue
                    rec[key] = rate(lambda c=c: gm.grouped_mm(aq, bq, sa, sb, offs, c))
                log(f"{name} {gemm} {routing}: {rec}")
                records.append(rec)
    emit({"benchmark": "gluon_precise", "env": env_info(dev), "records": records}, args.out)


if __name__ == "__main__":
    main()
