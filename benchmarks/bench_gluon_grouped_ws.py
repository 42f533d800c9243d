"""The experts' FP8 forward and dgrad GEMMs with fast accumulation: ``triton_fp8_grouped_mm`` (its shipped config)
against the warp-specialized persistent Gluon kernel (``gluon_fp8_grouped_ws``) over a few configs, at the presets'
expert shapes, balanced and uneven routing (``bench_fp8_grouped_mm.py``'s operands). Prints JSON: TFLOP/s, and
whether each Gluon config's rows equal triton's bit for bit.

    python benchmarks/bench_gluon_grouped_ws.py --shapes mixtral,qwen3
"""

from __future__ import annotations

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
from bench_fp8_grouped_mm import gemm_operands, routings
from bench_fp8_wgrad import SHAPES, parse_args, timed
from common import emit, env_info, log

CONFIGS = [(128, 256, 8, 4), (128, 256, 8, 4, 1, 1), (128, 128, 4, 4, 2), (128, 128, 4, 4, 2, 1)]


def main() -> None:
    args = parse_args(__doc__)
    from lightning_moe.modules import gluon_fp8_grouped_ws as gw
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
                rec = {"shape": name, "gemm": gemm, "routing": routing, "K": K, "N": N}
                ref = tg.grouped_mm(aq, bq, sa, sb, offs, True)
                rec["triton_fast"] = rate(lambda: tg.grouped_mm(aq, bq, sa, sb, offs, True), flop)
                for c in CONFIGS:
                    key = "gluon_" + "x".join(map(str, c))
                    try:
                        got = gw.grouped_mm(aq, bq, sa, sb, offs, c)
                    except Exception as e:  # noqa: BLE001  (a config that does not compile or fit)
                        rec[key] = f"{type(e).__name__}: {str(e)[:160]}"
                        continue
                    rec[key + "_bits_equal"] = bool(torch.equal(got, ref))
                    rec[key] = rate(lambda c=c: gw.grouped_mm(aq, bq, sa, sb, offs, c), flop)
                log(f"{rec}")
                records.append(rec)
            torch.cuda.empty_cache()
    emit({"benchmark": "gluon_grouped_ws", "env": env_info(dev), "records": records}, args.out)


if __name__ == "__main__":
    main()
