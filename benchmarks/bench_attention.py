"""Causal GQA attention on torch's SDPA backends at the presets' shapes: forward and forward + backward, TFLOP/s,
and each backend's output and gradients against the flash backend's.

q, k and v are transposed views of (B, S, heads, Dh) memory, as ``attention.py`` hands them over. FLOPs count the
causal half: forward 4·B·H·S²·Dh / 2, backward 2.5 times that (DESIGN.md's attention term).

    python benchmarks/bench_attention.py --shapes qwen3,mixtral --out attn.json
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from common import emit, env_info, log, pick_device, tflops, time_fn

SHAPES = {  # B, S, H, G, Dh: bench_model's micro-batches
    "qwen3": (2, 4096, 32, 4, 128),
    "mixtral": (1, 4096, 32, 8, 128),
    "deepseek-16k": (1, 16384, 32, 32, 128),
}
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def _inputs(B, S, H, G, Dh, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    def t(heads):
        return torch.randn(B, S, heads, Dh, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    q, k, v = t(H), t(G), t(G)
    do = torch.randn(B, S, H, Dh, device=device, dtype=torch.bfloat16, generator=g)
    return q, k, v, do


def _attend(q, k, v, backend, expand: bool):
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    H, G = qh.shape[1], kh.shape[1]
    if expand and G != H:
        kh, vh = kh.repeat_interleave(H // G, 1), vh.repeat_interleave(H // G, 1)
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=not expand and G != H)


def run_shape(name, shape, backends, device, iters, warmup):
    B, S, H, G, Dh = shape
    q, k, v, do = _inputs(*shape, device)
    fwd_flops = 4 * B * H * S * S * Dh / 2
    ref = None
    rows = []
    for bname in backends:
        for expand in (False, True):
            row = {"shape": name, "backend": bname, "kv": "expanded" if expand else "gqa"}
            try:
                o = _attend(q, k, v, BACKENDS[bname], expand)
                gq, gk, gv = torch.autograd.grad(o.transpose(1, 2), (q, k, v), do)
            except RuntimeError as e:
                row["error"] = str(e).splitlines()[0][:200]
                rows.append(row)
                log(f"{name} {bname} {row['kv']}: {row['error']}")
                continue
            got = [o.transpose(1, 2).float(), gq.float(), gk.float(), gv.float()]
            if ref is None:
                ref = got
            row["max_abs_diff"] = {n: (a - b).abs().max().item() for n, a, b in zip(("o", "dq", "dk", "dv"), got, ref)}
            with torch.no_grad():
                f = time_fn(lambda: _attend(q, k, v, BACKENDS[bname], expand), device, iters, warmup)
            def fb():
                o = _attend(q, k, v, BACKENDS[bname], expand)
                torch.autograd.grad(o.transpose(1, 2), (q, k, v), do)
            fbt = time_fn(fb, device, iters, warmup)
            row.update(fwd_ms=f["median_ms"], fwd_bwd_ms=fbt["median_ms"], fwd_tflops=tflops(fwd_flops, f["median_ms"]),
                       fwd_bwd_tflops=tflops(3.5 * fwd_flops, fbt["median_ms"]))
            rows.append(row)
            log(f"{name} {bname} {row['kv']}: fwd {row['fwd_ms']:.3f} ms ({row['fwd_tflops']:.0f} TFLOP/s), "
                f"fwd+bwd {row['fwd_bwd_ms']:.3f} ms ({row['fwd_bwd_tflops']:.0f}), diff {row['max_abs_diff']}")
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen3,mixtral")
    p.add_argument("--backends", default="flash,cudnn,efficient")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = pick_device(False)
    rows = []
    for name in args.shapes.split(","):
        rows += run_shape(name, SHAPES[name], args.backends.split(","), device, args.iters, args.warmup)
    emit({"env": env_info(device), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
