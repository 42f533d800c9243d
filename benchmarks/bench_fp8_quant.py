"""The rowwise FP8 recipe's quantization passes (``triton_fp8_quant``) against the GPU's copy bandwidth, at the
experts' operand shapes of bench_layer's blocks (one GPU, balanced routing): x and dy (hidden wide), a (ffn) and dh
(2 x ffn).

  copy             ``y.copy_(x)`` of the bf16 operand: the bandwidth limit, measured in the same run
  rowwise          ``rowwise_quant``: row scales, E4M3 rows
  col_amax         ``grouped_col_amax``: the wgrad operand's per-expert column amaxes, over a few (CHUNK, BLOCK_M,
                   BLOCK_X, warps)
  quant_t          ``quant_t_padded``: E4M3, transposed into the wgrad layout, over a few (BLOCK_P, BLOCK_X, warps)
  quant_t_128      ``quant_t_padded`` into the Triton wgrad's 128-row padded layout, each position's expert, ends and
                   scales gathered (``gathered``) against read once per block (``align=128``, ``block_expert``);
                   ``exact``: the same bytes
  two_passes       ``rowwise_quant`` then ``grouped_col_amax`` (default configs) on the same operand, as the layer runs
                   them (5 bytes per value: read, write, read)
  fused            ``rowwise_quant_col_amax``: both from one read (3 bytes per value), over ``fused_config``'s and a
                   few variants of (CHUNK, BLOCK_M, BLOCK_K, warps, stages, keep); ``exact``: its outputs equal the
                   two passes' (NaN-aware for the amaxes); ``speedup``: the two passes' ms over the fused call's

Prints JSON: each pass's median ms, GB/s (bytes it must move) and the ratio of that to the copy's GB/s.

    python benchmarks/bench_fp8_quant.py --shapes mixtral,qwen3 [--fused-only | --quant-t-only]
"""

from __future__ import annotations

import sys

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
from bench_fp8_wgrad import SHAPES, parse_args
from common import emit, env_info, log, time_fn

COL_AMAX_CONFIGS = [(256, 32, 128, 4), (256, 64, 128, 4), (256, 64, 128, 8), (512, 64, 128, 8), (256, 32, 256, 4),
                    (256, 128, 64, 8), (128, 32, 128, 4), (512, 32, 128, 4)]
QUANT_T_CONFIGS = [(128, 64, 4), (64, 64, 4), (128, 128, 8), (64, 128, 4), (256, 64, 8), (128, 32, 4)]


def fused_configs(tq, M: int, X: int) -> list:
    """``fused_config``'s and its neighbours: stages, chunks, warps, taller row blocks, the other kind of wide row
    (kept in registers or read twice) and, for X not a power of two, whole rows padded to one."""
    import triton
    c = tq.fused_config(M, X)
    CHUNK, BM, BK, w, st, keep = c
    full = triton.next_power_of_2(X)
    out = [c, (CHUNK, BM, BK, w, 1 if st > 1 else 2, keep), (CHUNK, BM, BK, w, 3, keep),
           (max(BM, CHUNK // 2), BM, BK, w, st, keep), (CHUNK * 2, BM, BK, w, st, keep),
           (CHUNK, BM, BK, max(4, w // 2), st, keep), (CHUNK, BM, BK, min(32, w * 2), st, keep),
           (max(CHUNK, 2 * BM), 2 * BM, BK, min(32, w * 2), st, keep)]
    if BK < X:
        out.append((CHUNK, BM, BK, w, st, 1 - keep))
    if full != X and full <= 16384:
        bm = max(1, 4096 // full)
        out.append((max(CHUNK, bm), bm, full, min(32, max(4, bm * full // 512)), st, 1))
    for warps in (4, 8, 16):  # fewer warps and deeper pipelines: the first sweep's better neighbours, combined
        for stages in (1, 2, 3):
            out.append((CHUNK, BM, BK, warps, stages, keep))
    return list(dict.fromkeys(out))


def main() -> None:
    # --fused-only (stripped before the shared parser sees it): copy, rowwise, two passes and the fused sweep alone
    fused_only, quant_t_only = "--fused-only" in sys.argv, "--quant-t-only" in sys.argv
    for flag in ("--fused-only", "--quant-t-only"):
        if flag in sys.argv:
            sys.argv.remove(flag)
    args = parse_args(__doc__)
    from lightning_moe.modules import triton_fp8_quant as tq
    from lightning_moe.modules.fp8 import scale_of
    from lightning_moe.modules.expert_padding import fp8_rows_layout
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
            rec = {"shape": name, "operand": operand, "rows": M, "features": X, "copy": copy}
            gid32, poffs, P, gid_P = fp8_rows_layout(offs, M, 128)
            ways = {"gathered": 1, "block_expert": 128}
            rec["quant_t_128"] = {k: timed(lambda a=a: tq.quant_t_padded(x, sx, offs, poffs, gid_P, P, align=a), 3 * n,
                                           limit) for k, a in ways.items()}
            outs = [tq.quant_t_padded(x, sx, offs, poffs, gid_P, P, align=a).view(torch.uint8) for a in ways.values()]
            rec["quant_t_128"]["exact"] = bool(torch.equal(*outs))
            if quant_t_only:
                log(f"{name} {operand}: {rec}")
                records.append(rec)
                continue
            rec["rowwise"] = timed(lambda: tq.rowwise_quant(x), 3 * n, limit)
            if not fused_only:
                rec["col_amax"] = {"x".join(map(str, c)): timed(
                    lambda c=c: tq.grouped_col_amax(x, offs, gid, config=c), 2 * n, limit) for c in COL_AMAX_CONFIGS}
                rec["quant_t"] = {"x".join(map(str, c)): timed(
                    lambda c=c: tq.quant_t_padded(x, sx, offs, offs, gid, M, config=c), 3 * n, limit)
                    for c in QUANT_T_CONFIGS}
            two = timed(lambda: (tq.rowwise_quant(x), tq.grouped_col_amax(x, offs, gid)), 5 * n, limit)
            rec["two_passes"] = two
            ref = (*tq.rowwise_quant(x), tq.grouped_col_amax(x, offs, gid))
            rec["fused"] = {}
            for c in fused_configs(tq, M, X):
                r = timed(lambda c=c: tq.rowwise_quant_col_amax(x, offs, gid, config=c), 3 * n, limit)
                if isinstance(r, dict):
                    q, sc, amax = tq.rowwise_quant_col_amax(x, offs, gid, config=c)
                    r["exact"] = bool(torch.equal(q.view(torch.uint8), ref[0].view(torch.uint8))
                                      and torch.equal(sc, ref[1]) and torch.equal(amax.isnan(), ref[2].isnan())
                                      and torch.equal(amax.nan_to_num(), ref[2].nan_to_num()))
                    if isinstance(two, dict):
                        r["speedup"] = round(two["ms"] / r["ms"], 3)
                rec["fused"]["x".join(map(str, c))] = r
            log(f"{name} {operand}: {rec}")
            records.append(rec)
    emit({"benchmark": "fp8_quant", "env": env_info(dev), "records": records}, args.out)


if __name__ == "__main__":
    main()
