"""The one-pass FP8 quantizations into both layouts (``triton_fp8_both``: the tensorwise/delayed recipes' experts), each
at its shipped config and the other form of its loop, at bench_layer's expert shapes (one GPU):

  x           ``quant_both``: x's rows by their expert's delayed scale, row-major and in the wgrad's padded
              transposed layout (reads 2 bytes an element, writes 1 + 1)
  swiglu      ``swiglu_both``: the SwiGLU of h (reads 4 bytes an output element, writes 1 + 1)
  swiglu_bwd  ``swiglu_backward_both``: its input gradient from g and h (reads 2 + 4 bytes a column pair, writes 2 + 2)

Configs are ``(BLOCK_P, BLOCK_X, warps, LOOP, STAGES)``: LOOP 0 is straight-line code, LOOP >= 1 a loop over that many
column blocks a program (``triton_fp8_both.config``). Routing: balanced (T*k/E rows per expert) and uneven (squared
uniform weights, seed 0), 128-row alignment as the wgrad's. Prints JSON: median ms (``repeats`` medians of
triton's ``do_bench``), the GB/s of the bytes moved and their ratio to a device copy's in the same run, and whether
each config's row-major bytes equal the shipped config's (the transposed copy's padded tail is not compared: the
positions past the last expert's padded end are left unwritten).

    python benchmarks/bench_fp8_both.py --shapes qwen3,olmoe
"""

from __future__ import annotations

import argparse

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
from bench_layer import SHAPES
from common import copy_bandwidth_tb_s, emit, env_info, log

PASSES = ("x", "swiglu", "swiglu_bwd")


def counts_of(E: int, M: int, uneven: bool) -> list[int]:
    if not uneven:
        return [M // E] * E
    w = torch.rand(E, generator=torch.Generator().manual_seed(0)) ** 2 + 0.05
    c = (w / w.sum() * M).floor().long()
    c[0] += M - int(c.sum())
    return c.tolist()


def other_form(cfg: tuple) -> tuple:
    """The same block in the other form: straight-line code for a loop (of any length), a one-block loop for
    straight-line code."""
    bp, bx, warps, loop, stages = cfg
    return (bp, bx, warps, 0, 1) if loop >= 1 else (bp, bx, warps, 1, 1)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3,olmoe")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from triton.testing import do_bench
    from lightning_moe.modules import triton_fp8_both as tb
    from lightning_moe.modules.expert_padding import fp8_rows_layout
    device = torch.device("cuda")
    result = {"benchmark": "fp8_both", "env": env_info(device), "copy_tb_s": copy_bandwidth_tb_s(device),
              "records": []}
    for name in args.shapes.split(","):
        s = SHAPES[name]
        E, H, F, M = s["E"], s["h"], s["f"], s["T"] * s["k"]
        for uneven in (False, True):
            offs = torch.tensor(counts_of(E, M, uneven), device=device).cumsum(0).to(torch.int32)
            _, poffs, P, gid_P = fp8_rows_layout(offs, M, 128)
            x = torch.randn(M, H, device=device, dtype=torch.bfloat16)
            h = torch.randn(M, 2 * F, device=device, dtype=torch.bfloat16)
            g = torch.randn(M, F, device=device, dtype=torch.bfloat16) * 1e-2
            pr = torch.rand(M, device=device)
            hist = torch.rand(16, E, device=device) * 10 + 1  # a delayed history
            runs = {
                "x": (H, M * H * 4, lambda c: tb.quant_both(x, hist, offs, poffs, gid_P, P, align=128, cfg=c)),
                "swiglu": (F, M * F * 6, lambda c: tb.swiglu_both(h, pr, hist, offs, poffs, gid_P, P, align=128,
                                                                   cfg=c)),
                "swiglu_bwd": (F, M * F * 10, lambda c: tb.swiglu_backward_both(g, h, pr, hist, offs, poffs, gid_P,
                                                                                 P, align=128, cfg=c))}
            for src, pas in enumerate(PASSES):
                W, nbytes, fn = runs[pas]
                shipped = tb.config(W, src)
                ref = fn(shipped)[0].view(torch.uint8)
                rec = {"shape": name, "routing": "uneven" if uneven else "balanced", "pass": pas, "M": M, "W": W,
                       "configs": []}
                for cfg in (shipped, other_form(shipped)):
                    same = bool(torch.equal(fn(cfg)[0].view(torch.uint8), ref))
                    ms = [do_bench(lambda: fn(cfg), warmup=20, rep=60, return_mode="median")
                          for _ in range(args.repeats)]
                    gb_s = nbytes / min(ms) / 1e6
                    rec["configs"].append({"config": list(cfg), "shipped": cfg == shipped, "ms": ms, "gb_s": gb_s,
                                           "of_copy": gb_s / (result["copy_tb_s"] * 1e3), "same_bytes": same})
                log(f"[fp8_both] {name} {rec['routing']} {pas}: " + ", ".join(
                    f"{c['config']} {min(c['ms']):.4f} ms" for c in rec["configs"]))
                result["records"].append(rec)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
