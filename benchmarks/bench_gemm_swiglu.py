"""fc1's FP8 GEMM with the SwiGLU's per-expert FP8 copies in its epilogue (``gluon_fp8_fc1_swiglu.fc1_swiglu``, the
delayed recipe) against the same GEMM followed by the separate pass (``gluon_fp8_grouped_ws.grouped_mm`` +
``triton_fp8_both.swiglu_both``), at the presets' fine-grained expert shapes, balanced and uneven routing, rows
weighted by the router's probabilities. Prints JSON: ms of each and of the GEMM alone, and whether the fused copies
equal the separate ones bit for bit.

    python benchmarks/bench_gemm_swiglu.py --shapes qwen3,olmoe
"""

from __future__ import annotations

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
from bench_fp8_grouped_mm import routings
from bench_fp8_wgrad import SHAPES, parse_args, timed
from common import emit, env_info, log


def operands(E: int, M: int, K: int, N: int, dev, seed: int = 0) -> tuple:
    """E4M3 operands (M, K) and (E, N, K) with per-row and per-expert-column dequantization scales."""
    g = torch.Generator(dev).manual_seed(seed)
    a = (torch.randn(M, K, device=dev, generator=g) * 8).to(torch.float8_e4m3fn)
    b = (torch.randn(E, N, K, device=dev, generator=g) * 8).to(torch.float8_e4m3fn)
    return a, b, torch.rand(M, device=dev, generator=g) * 1e-3 + 1e-4, torch.rand(E, N, device=dev, generator=g) * 1e-3


def main() -> None:
    args = parse_args(__doc__)
    from lightning_moe.modules import gluon_fp8_fc1_swiglu as fk
    from lightning_moe.modules import gluon_fp8_grouped_ws as ws
    from lightning_moe.modules import triton_fp8_both as tb
    from lightning_moe.modules.expert_padding import fp8_rows_layout
    dev = torch.device("cuda")
    records = []
    for name in args.shapes.split(","):
        E, M, D, F = SHAPES[name]
        if not fk.fits(M, D, F, E):  # coarse experts: the epilogue is not used there
            log(f"{name}: fc1_swiglu does not take M={M} over {E} experts (F={F})")
            records.append({"shape": name, "fits": False})
            continue
        p = torch.rand(M, device=dev)
        hist = torch.rand(16, E, device=dev) * 4 + 1
        for routing, counts in routings(E, M).items():
            offs = counts.to(dev).cumsum(0).to(torch.int32)
            _, poffs, P, gid = fp8_rows_layout(offs, M, 128)
            end, pend = int(offs[-1]), int(poffs[-1])
            rec = {"shape": name, "routing": routing, "M": M, "D": D, "F": F}
            x, w13, sx, sw13 = operands(E, M, D, 2 * F, dev)

            def fc1_sep():
                return tb.swiglu_both(ws.grouped_mm(x, w13, sx, sw13, offs), p, hist, offs, poffs, gid, P, align=128)

            fused = fk.fc1_swiglu(x, w13, sx, sw13, offs, p, hist, P)
            sep = fc1_sep()
            rec["fc1_bits_equal"] = bool(torch.equal(fused[1][:end].view(torch.uint8), sep[0][:end].view(torch.uint8))
                                         and torch.equal(fused[2][:, :pend].view(torch.uint8),
                                                         sep[1][:, :pend].view(torch.uint8)))
            rec["fc1_gemm_ms"] = timed(lambda: ws.grouped_mm(x, w13, sx, sw13, offs), dev, args.iters)
            rec["fc1_separate_ms"] = timed(fc1_sep, dev, args.iters)
            rec["fc1_fused_ms"] = timed(lambda: fk.fc1_swiglu(x, w13, sx, sw13, offs, p, hist, P), dev, args.iters)
            log(f"{rec}")
            records.append(rec)
        torch.cuda.empty_cache()
    emit({"benchmark": "gemm_swiglu", "env": env_info(dev), "records": records}, args.out)


if __name__ == "__main__":
    main()
