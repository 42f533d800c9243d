"""The warp-specialized Gluon FP8 wgrad (``gluon_fp8_wgrad``) against the triton kernels, fast accumulation, written:

  triton        ``triton_fp8_wgrad.wgrad_into(..., per_expert=True, fast=True, first=True)``: the one-tile kernel
                (its shipped config) and the persistent one
  gluon         the same product on ``gluon_fp8_wgrad`` over a few (BLOCK_K, BLOCK_N, warps, stages) configs
  bf16          ``F.grouped_mm(x^T, dy, offs)`` (the bf16 block's wgrad), for scale

into a bf16 gradient (the expert block's) and an fp32 main grad (a model's first micro-batch), at the expert shapes of
``bench_fp8_wgrad.py``, balanced and uneven routing (expert sizes drawn from a multinomial, on 128-token boundaries).
Each record has each kernel's median ms and TFLOP/s and whether its bits equal the triton one-tile kernel's.

    python benchmarks/bench_gluon_wgrad.py --shapes mixtral,qwen3
"""

from __future__ import annotations

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
import torch.nn.functional as F
from bench_fp8_wgrad import SHAPES, parse_args, timed
from common import emit, env_info, log

CONFIGS = [(128, 256, 8, 4), (128, 256, 8, 3), (128, 128, 4, 5, 2), (128, 128, 4, 4, 2), (64, 256, 4, 4, 2)]


def counts(E: int, M: int, uneven: bool, dev) -> torch.Tensor:
    """Tokens per expert on 128-token boundaries, summing to at most M."""
    if not uneven:
        return torch.full((E,), M // E, device=dev)
    g = torch.Generator().manual_seed(1)
    c = torch.multinomial(torch.ones(E), M // 128, replacement=True, generator=g).bincount(minlength=E) * 128
    c[0] = 0  # one expert without tokens
    return c.to(dev)


def main() -> None:
    args = parse_args(__doc__)
    from lightning_moe.modules import gluon_fp8_wgrad as gw
    from lightning_moe.modules import triton_fp8_wgrad as tw
    dev = torch.device("cuda")
    records = []

    def rate(v, flop):
        return (round(v, 4), round(flop / v / 1e9, 1)) if isinstance(v, float) else v

    for name in args.shapes.split(","):
        E, M, D, Fh = SHAPES[name]
        for uneven in (False, True):
            offs = counts(E, M, uneven, dev).cumsum(0).to(torch.int32)
            for gemm, K, N in (("fc1", D, 2 * Fh), ("fc2", Fh, D)):
                torch.manual_seed(0)
                aT = (torch.randn(K, M, device=dev) * 8).to(torch.float8_e4m3fn)
                bT = (torch.randn(N, M, device=dev) * 8).to(torch.float8_e4m3fn)
                sa, sb = torch.rand(E, K, device=dev) + 0.5, torch.rand(E, N, device=dev) + 0.5
                flop = 2 * int(offs[-1]) * K * N
                rec = {"shape": name, "routing": "uneven" if uneven else "balanced", "gemm": gemm, "K": K, "N": N,
                       "tokens": int(offs[-1])}
                x, dy = aT.t().to(torch.bfloat16), bT.t().to(torch.bfloat16)
                rec["bf16_grouped_mm"] = rate(timed(lambda x=x, dy=dy: F.grouped_mm(x.t(), dy, offs=offs), dev,
                                                    args.iters), flop)
                for dtype in (torch.bfloat16, torch.float32):
                    out = torch.empty(E, K, N, device=dev, dtype=dtype)
                    tag = "bf16" if dtype == torch.bfloat16 else "fp32"

                    def triton_(persistent=False, out=out):
                        tw.wgrad_into(out, (aT, sa), (bT, sb), offs, True, per_expert=True, fast=True,
                                      persistent=persistent)
                    triton_()
                    ref = out.clone()
                    rec[f"{tag}_triton"] = rate(timed(triton_, dev, args.iters), flop)
                    rec[f"{tag}_triton_persistent"] = rate(timed(lambda: triton_(True), dev, args.iters), flop)
                    for c in CONFIGS:
                        key = f"{tag}_gluon_" + "x".join(map(str, c))

                        def gluon_(c=c, out=out):
                            gw.wgrad(out, aT, sa, bT, sb, offs, config=c)
                        out.fill_(float("nan"))
                        try:
                            gluon_()
                        except Exception as e:  # noqa: BLE001  (a config that does not compile or fit)
                            rec[key] = f"{type(e).__name__}: {str(e)[:160]}"
                            continue
                        rec[key] = rate(timed(gluon_, dev, args.iters), flop)
                        rec[key + "_bits_equal"] = bool(torch.equal(out, ref))
                    del out, ref
                log(f"{rec}")
                records.append(rec)
                torch.cuda.empty_cache()
    emit({"benchmark": "gluon_wgrad", "env": env_info(dev), "records": records}, args.out)


if __name__ == "__main__":
    main()
