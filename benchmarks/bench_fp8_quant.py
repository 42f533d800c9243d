"""The rowwise FP8 recipe's quantization passes (``triton_fp8_quant``) against the GPU's copy bandwidth, at the
experts' operand shapes of bench_layer's blocks (one GPU, balanced routing): x and dy (hidden wide), a (ffn) and dh
(2 x ffn).

  copy             ``y.copy_(x)`` of the bf16 operand: the bandwidth limit, measured in the same run
  rowwise          ``rowwise_quant``: row scales, E4M3 rows
  col_amax         ``grouped_col_amax``: the wgrad operand's per-expert column amaxes, over a few (CHUNK, BLOCK_M,
                   BLOCK_X, warps)
  quant_t          ``quant_t_padded``: E4M3, transposed into the wgrad layout, over a few (BLOCK_P, BLOCK_X, warps)

Prints JSON: each pass's median ms, GB/s (bytes it must move) and the ratio of that to the copy's GB/s.

    python benchmarks/bench_fp8_quant.py --shapes mixtral,qwen3
"""

from __future__ import annotations

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
from bench_fp8_wgrad import SHAPES, parse_args
from common import emit, env_info, log, time_fn

COL_AMAX_CONFIGS = [(256, 32, 128, 4), (256, 64, 128, 4), (256, 64, 128, 8), (512, 64, 128, 8), (256, 32, 256, 4),
                    (256, 128, 64, 8), (128, 32, 128, 4), (512, 32, 128, 4)]
QUANT_T_CONFIGS = [(128, 64, 4), (64, 64, 4), (128, 128, 8), (64, 128, 4), (256, 64, 8), (128, 32, 4)]


def main() -> None:
    args = parse_args(__doc__)
    from lightning_moe.modules import triton_fp8_quant as tq
    from lightning_moe.modules.fp8 import scale_of
    from lightning_moe.modules.fp8_grouped import expert_of_rows
    dev = torch.device("cuda")
    records = []

    def timed(fn, moved: int, limit: float = 0.0):
        try:
            ms = time_fn(fn, dev, args.iters, 2)["median_ms"]
        except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
            return f"{type(e).__name__}: {str(e)[:160]}"
        gbs = moved / ms / 1e6
        return {"ms": round(ms, 4), "GB/s": round(gbs, 1), **({"of_copy": round(gbs / limit, 3)} if limit else {})}

    for name in args.shapes.split(","):
        E, M, D, Fh = SHAPES[name]
        offs = torch.full((E,), M // E, device=dev).cumsum(0).to(torch.int32)
        gid = expert_of_rows(M, offs, dev)
        for operand, X in (("x_dy", D), ("a", Fh), ("dh", 2 * Fh)):
            torch.manual_seed(0)
            x = torch.randn(M, X, device=dev, dtype=torch.bfloat16)
            y = torch.empty_like(x)
            n = M * X
            copy = timed(lambda: y.copy_(x), 4 * n)
            limit = copy["GB/s"]
            sx = scale_of(tq.grouped_col_amax(x, offs, gid), "e4m3")
            rec = {"shape": name, "operand": operand, "rows": M, "features": X, "copy": copy,
                   "rowwise": timed(lambda: tq.rowwise_quant(x), 3 * n, limit),
                   "col_amax": {"x".join(map(str, c)): timed(
                       lambda c=c: tq.grouped_col_amax(x, offs, gid, config=c), 2 * n, limit)
                       for c in COL_AMAX_CONFIGS},
                   "quant_t": {"x".join(map(str, c)): timed(
                       lambda c=c: tq.quant_t_padded(x, sx, offs, offs, gid, M, config=c), 3 * n, limit)
                       for c in QUANT_T_CONFIGS}}
            log(f"{name} {operand}: {rec}")
            records.append(rec)
    emit({"benchmark": "fp8_quant", "env": env_info(dev), "records": records}, args.out)


if __name__ == "__main__":
    main()
