"""Attention forward + backward over one packed row, for packed documents' FlexAttention path (issue 22).

For each row length S (B rows, H query heads over G kv heads, head dim D, bf16), in one process:
  ``sdpa_causal``        causal SDPA over the whole row, flash kernel (the one-GPU reference);
  ``flex_causal``        flex_attention under a causal BlockMask (the row as one document);
  ``flex_document``      flex_attention under packed documents' BlockMask: the model's path on CUDA
                         (``modules/document_mask.py``: compiled mask builder and compiled flex_attention);
  ``flash_per_document`` causal flash SDPA on each document in turn (what a varlen kernel would do at best, plus a
                         launch per document and the copies of splitting and concatenating);
  ``dense_mask``         the old path: masked SDPA with a (B, 1, S, S) boolean mask and K/V repeated to every head,
                         only up to ``--dense-max`` (its mask takes S² bytes per row).
Document lengths are lognormal (median ``--doc-median``, sigma ``--doc-sigma``, fixed ``--seed``), drawn until the row
is full (the last one cut).

FLOPs count only the (query, key) pairs each mask allows: P pairs per row and head (S(S+1)/2 causal, the sum of
n(n+1)/2 over the documents), forward 4·P·D per head (QKᵀ and PV), backward 2.5x that, so fwd+bwd = 14·B·H·P·D.
``ratio_vs_flash`` is flex_document's TFLOP/s over sdpa_causal's (the issue's target at 32k: >= 0.7).
``mask_build_ms``: building the document BlockMask once (per micro-batch, for all layers). Time: median of CUDA-event
timed runs after warm-up (the compiles happen there). Prints one JSON object.

    python benchmarks/bench_document_attention.py --out doc_attn.json
    python benchmarks/bench_document_attention.py --smoke   # tiny CPU float32 run, forward only (no CPU flex backward)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import warnings

import common  # noqa: F401  (puts the repo root on sys.path)
import numpy as np
import torch
import torch.nn.functional as F
from common import emit, env_info, log, peak_memory, pick_device, stdout_to_stderr, time_fn, tflops

from lightning_moe.modules.document_mask import build_document_mask, document_attention, document_mask

FLOPS_FORMULA = ("fwd+bwd FLOPs = 14 * B * H * P * D, P = allowed (query, key) pairs per row and head: S(S+1)/2 "
                 "causal, sum over documents of n(n+1)/2 (fwd 4*P*D per head: QK^T and PV; bwd 2.5x fwd); "
                 "forward only (--smoke): 4 * B * H * P * D")


def lognormal_lengths(S: int, median: float, sigma: float, seed: int) -> list[int]:
    rng, lengths = np.random.default_rng(seed), []
    while sum(lengths) < S:
        lengths.append(max(1, int(round(rng.lognormal(np.log(median), sigma)))))
    lengths[-1] -= sum(lengths) - S
    return lengths


def flash_ctx(device):
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="8192,32768")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--doc-median", type=float, default=1024.0)
    p.add_argument("--doc-sigma", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dense-max", type=int, default=8192, help="run dense_mask up to this S")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, float32, CPU, forward only")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = pick_device(args.smoke)
    if args.smoke:
        args.seqs, args.heads, args.kv_heads, args.head_dim, args.doc_median = "256", 4, 2, 16, 48.0
        args.iters, args.warmup, args.dense_max = 3, 1, 256
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    dtype, backward = (torch.float32, False) if args.smoke else (torch.bfloat16, True)
    B, H, G, D = args.batch, args.heads, args.kv_heads, args.head_dim
    results = []
    for S in (int(s) for s in args.seqs.split(",")):
        lengths = lognormal_lengths(S, args.doc_median, args.doc_sigma, args.seed)
        doc_BS = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).to(device).expand(B, S).contiguous()
        g = torch.Generator(device).manual_seed(args.seed)
        q, k, v = (torch.randn(B, n, S, D, device=device, dtype=dtype, generator=g).requires_grad_(backward)
                   for n in (H, G, G))
        do = torch.randn(B, H, S, D, device=device, dtype=dtype, generator=g)
        _, causal_mask = build_document_mask(torch.zeros_like(doc_BS), flex=True)
        build_doc = lambda: build_document_mask(doc_BS, flex=True)[1]  # noqa: E731
        doc_mask = build_doc()
        pairs_causal, pairs_doc = S * (S + 1) // 2, sum(n * (n + 1) // 2 for n in lengths)

        def sdpa_causal(q, k, v):
            with flash_ctx(device):
                if not repeat_kv:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=G != H)
                k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        repeat_kv = False
        try:  # flash takes GQA as it is on the torch versions we know; else K/V repeated (timed with it)
            with torch.no_grad():
                sdpa_causal(q[:, :, :128], k[:, :, :128], v[:, :, :128])
        except RuntimeError as e:
            log(f"flash with enable_gqa failed ({e}); repeating K/V")
            repeat_kv = True

        def per_document(q, k, v):
            # split(): one backward node concatenates the documents' gradients (slices would each add a full copy)
            with flash_ctx(device):
                outs = [F.scaled_dot_product_attention(q_d, k_d, v_d, is_causal=True, enable_gqa=G != H)
                        for q_d, k_d, v_d in zip(*(t.split(lengths, 2) for t in (q, k, v)))]
            return torch.cat(outs, 2)

        cases = {"sdpa_causal": (sdpa_causal, pairs_causal),
                 "flex_causal": (lambda q, k, v: document_attention(q, k, v, causal_mask), pairs_causal),
                 "flex_document": (lambda q, k, v: document_attention(q, k, v, doc_mask), pairs_doc),
                 "flash_per_document": (per_document, pairs_doc)}
        if S <= args.dense_max:
            dense = document_mask(doc_BS)
            cases["dense_mask"] = (lambda q, k, v: document_attention(q, k, v, dense), pairs_doc)
        row = dict(S=S, B=B, H=H, G=G, D=D, num_documents=len(lengths), document_lengths=lengths,
                   pairs_causal=pairs_causal, pairs_document=pairs_doc, sdpa_kv_repeated=repeat_kv, cases={})
        for name, (fn, pairs) in cases.items():
            def step(fn=fn):
                o = fn(q, k, v)
                if backward:
                    o.backward(do)
            log(f"S={S} {name}")
            try:
                with stdout_to_stderr():
                    t = time_fn(step, device, args.iters, args.warmup, grad_to_none=[q, k, v])
                mem = peak_memory(step, device, [q, k, v])
            except Exception as e:  # noqa: BLE001 - one failing case must not hide the others
                row["cases"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
                continue
            flops = (14 if backward else 4) * B * H * pairs * D
            row["cases"][name] = dict(median_ms=t["median_ms"], tflops=tflops(flops, t["median_ms"]),
                                      flops=flops, **mem)
        t = time_fn(build_doc, device, args.iters, args.warmup)
        row["mask_build_ms"] = t["median_ms"]
        cs = row["cases"]
        if "tflops" in cs.get("flex_document", {}) and "tflops" in cs.get("sdpa_causal", {}):
            row["ratio_vs_flash"] = cs["flex_document"]["tflops"] / cs["sdpa_causal"]["tflops"]
            row["meets_70pct"] = row["ratio_vs_flash"] >= 0.7
        results.append(row)
        del q, k, v, do, doc_mask, causal_mask, cases
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = dict(benchmark="bench_document_attention", smoke=args.smoke, dtype=str(dtype),
               passes="fwd+bwd" if backward else "fwd", flops_formula=FLOPS_FORMULA,
               documents=dict(distribution="lognormal", median=args.doc_median, sigma=args.doc_sigma, seed=args.seed),
               env=env_info(device), results=results)
    emit(out, args.out)


if __name__ == "__main__":
    main()
