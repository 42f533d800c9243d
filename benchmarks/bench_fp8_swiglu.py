"""The experts' SwiGLU fused with the rowwise FP8 quantization (``triton_fp8_swiglu``) against the two kernels it
replaces, at bench_layer's expert shapes (one GPU, balanced routing, the layer's weighted SwiGLU):

  unfused    forward: ``triton_swiglu.forward`` then ``rowwise_quant_col_amax(a)``; backward:
             ``triton_swiglu.backward`` then ``rowwise_quant_col_amax(dh)``
  fused      ``swiglu_quant`` / ``swiglu_backward_quant`` over ``config``'s and its neighbours (CHUNK, BLOCK_M,
             BLOCK_K, warps, stages, keep, acc_bf16, maxnreg); ``exact``: the unfused outputs' bytes

Prints JSON: median ms, the GB/s of the bytes each must move (the fused kernel's: forward reads h, writes a and its
E4M3 copy; backward reads g and h, writes dh and its E4M3 copy) and their ratio to a copy's GB/s in the same run.

    python benchmarks/bench_fp8_swiglu.py --shapes mixtral,qwen3
"""

from __future__ import annotations

import argparse

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
from bench_layer import SHAPES
from common import copy_bandwidth_tb_s, emit, env_info, log, time_fn


def candidates(tsw, M: int, F: int, backward: bool) -> list:
    """``config``'s and its neighbours: fp32 column maxes, half and twice the warps, with and without a register cap,
    half and twice the rows per block and the chunk, and rows read back instead of kept."""
    c = tsw.config(M, F, backward)
    CHUNK, BM, BK, w, st, keep, acc, cap = c
    out = [c, (CHUNK, BM, BK, w, st, keep, False, cap), (CHUNK, BM, BK, w, st, keep, acc, None),
           (CHUNK, BM, BK, w, st, keep, acc, 128 if w <= 8 else 64),
           (CHUNK, BM, BK, max(4, w // 2), st, keep, acc, None),
           (CHUNK, BM, BK, w * 2, st, keep, acc, None), (CHUNK, BM, BK, w * 2, st, keep, acc, 64),
           (max(CHUNK, 2 * BM), 2 * BM, BK, w, st, keep, acc, cap), (CHUNK * 2, BM, BK, w, st, keep, acc, cap),
           (max(BM, CHUNK // 2), BM, BK, w, st, keep, acc, cap), (CHUNK, BM, BK, 16, 1, False, acc, None)]
    if BM > 1:
        out.append((CHUNK, BM // 2, BK, w, st, keep, acc, cap))
    return list(dict.fromkeys(out))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="mixtral,qwen3")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--unweighted", action="store_true", help="the bare block's SwiGLU, without row weights")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from lightning_moe.modules import triton_fp8_quant as tq
    from lightning_moe.modules import triton_fp8_swiglu as tsw
    from lightning_moe.modules import triton_swiglu
    from lightning_moe.modules.fp8_grouped import expert_of_rows
    device = torch.device("cuda")
    result = {"benchmark": "fp8_swiglu", "env": env_info(device), "copy_tb_s": copy_bandwidth_tb_s(device),
              "records": []}
    for name in args.shapes.split(","):
        s = SHAPES[name]
        E, F, M = s["E"], s["f"], s["T"] * s["k"]
        offs = torch.full((E,), M // E, device=device).cumsum(0).to(torch.int32)
        gid = expert_of_rows(M, offs, device, int32=True)
        h = torch.randn(M, 2 * F, device=device, dtype=torch.bfloat16)
        g = torch.randn(M, F, device=device, dtype=torch.bfloat16) * 1e-2
        pr = None if args.unweighted else torch.rand(M, device=device)
        for backward in (False, True):
            nbytes = M * F * (4 + 2 + 1) if not backward else M * F * (2 + 4 + 4 + 2)

            def unfused():
                if backward:
                    dh, _ = triton_swiglu.backward(g, h, pr)
                    return (dh, *tq.rowwise_quant_col_amax(dh, offs, gid, inverse=True))
                a = triton_swiglu.forward(h, pr)
                return (a, *tq.rowwise_quant_col_amax(a, offs, gid, inverse=True))

            def fused(cfg):
                if backward:
                    dh, _, q, sc, amax = tsw.swiglu_backward_quant(g, h, pr, offs, gid, cfg=cfg)
                    return dh, q, sc, amax
                return tsw.swiglu_quant(h, pr, offs, gid, cfg=cfg)

            ref = unfused()
            t = time_fn(unfused, device, args.iters, 3)["median_ms"]
            rec = {"shape": name, "M": M, "F": F, "pass": "backward" if backward else "forward",
                   "weighted": pr is not None,
                   "unfused_ms": t, "unfused_gb_s": nbytes / t / 1e6, "fused": []}
            for cfg in candidates(tsw, M, F, backward):
                try:
                    out = fused(cfg)
                    exact = all(_same(a, b) for a, b in zip(out, ref))
                    ms = time_fn(lambda: fused(cfg), device, args.iters, 3)["median_ms"]
                    rec["fused"].append({"config": list(cfg), "ms": ms, "gb_s": nbytes / ms / 1e6, "exact": exact,
                                         "speedup": t / ms, "of_copy": nbytes / ms / 1e6 / (result["copy_tb_s"] * 1e3)})
                except Exception as e:  # a config that does not compile here: recorded, the sweep goes on
                    rec["fused"].append({"config": list(cfg), "error": f"{type(e).__name__}: {str(e)[:200]}"})
            best = min((r for r in rec["fused"] if "ms" in r), key=lambda r: r["ms"], default=None)
            log(f"[fp8_swiglu] {name} {rec['pass']}: unfused {t:.3f} ms, default {rec['fused'][0].get('ms')}, best "
                f"{best and (best['ms'], best['config'])}")
            result["records"].append(rec)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
