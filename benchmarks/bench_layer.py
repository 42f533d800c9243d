"""One MoE layer, forward + backward, against the bare grouped-GEMM SwiGLU block at the same per-expert loads.

For each named shape this times, in one process:
  (a) ``layer``: our ``MoELayer`` (router -> dispatch/permute -> grouped experts -> combine) on one rank
      (``ParallelContext.single()``), forward + backward, inputs and outputs with gradients;
  (b) ``bare``: ``F.grouped_mm(x, w13) -> silu(gate) * up -> F.grouped_mm(., w2)``, forward + backward, with the
      per-expert row counts the layer produced;
  (c) ``loop`` (``--with-loop``, qwen3 shape only): the same block as a Python loop over experts;
  (d) ``--precision fp8-<recipe>[,...]``: (a) and (b) again with the experts' grouped GEMMs in FP8 (``FP8Training``'s
      ``fp8_grouped_mm``; ``fp8-<recipe>-hybrid`` keeps E5M2 gradients), with their speed-up over bf16 from this run.
      FLOPs are counted as in bf16, as Megatron counts them. The FP8 layer fuses its SwiGLU with the quantization
      where ``FP8Training`` does (``fp8_swiglu.attach``; its permutes quantize x and dy for the GEMMs unless
      ``LMOE_FP8_FUSED_PERMUTE=0``); the bare FP8 block is timed with torch's SwiGLU, the Triton
      one, and (``bare_fp8_swiglu``) the fused one, each against bf16's with the same SwiGLU kernel family.
Throughput counts the expert GEMMs only: ``18 * rows * h * f`` FLOPs (fwd 6·rows·h·f, x3 for fwd+bwd), rows = T*k,
so ``ratio = bare_ms / layer_ms`` is the layer's throughput as a fraction of the kernel limit.

Routing (``--routing``): ``balanced`` (default) runs the real router (its GEMM, scores, top-k and aux loss are all
timed) but replaces its expert choice by a perfectly balanced one: token t's j-th copy goes to expert
``(perm[t]*k + j) % E`` with a random token permutation, so every expert gets exactly T*k/E rows, each token k
distinct experts, and the rows of one expert come from scattered tokens. ``router`` keeps the router's own choice
(random weights, random inputs) and reports the imbalance it produced.

The time split (router / dispatch / experts / combine, forward and backward) comes from a separate instrumented pass
with CUDA events between the stages and identity autograd nodes that stamp the backward boundaries; ``split_ok``
says whether the backward ran in the expected order (combine, experts, dispatch, router) so the split is valid.

    python benchmarks/bench_layer.py --shapes mixtral,qwen3,olmoe,deepseek-v3-ep8 --out layer.json
    python benchmarks/bench_layer.py --smoke          # tiny CPU float32 run, used by the CPU test
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import statistics
import sys
import traceback
import warnings

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
import torch.nn.functional as F
from common import elapsed_ms, emit, env_info, log, peak_memory, pick_device, stamp, sync, tflops, time_fn
from torch import nn

from lightning_moe.modules.config import ModelConfig
from lightning_moe.modules.experts import swiglu
from lightning_moe.modules.fp8 import RECIPES
from lightning_moe.modules import fp8_swiglu as fp8_swiglu_mod
from lightning_moe.modules.fp8_grouped import fp8_grouped_mm
from lightning_moe.modules.fp8_swiglu import fp8_swiglu
from lightning_moe.modules.fp8_linear import FP8Spec
from lightning_moe.modules.moe_layer import MoELayer
from lightning_moe.strategy.parallel_context import ParallelContext

# T = tokens per step. Router settings follow each model's published config, softmax top-k unless stated.
SHAPES: dict[str, dict] = {
    # Mixtral-8x7B: T=8192 rather than 16384 so that activations stay small next to the 2.8 GB of bf16 weights
    "mixtral": dict(E=8, h=4096, f=14336, k=2, T=8192, router=dict(aux_loss_coeff=0.02)),
    "qwen3": dict(E=128, h=2048, f=768, k=8, T=16384, router=dict(aux_loss_coeff=1e-3)),
    "olmoe": dict(E=64, h=2048, f=1024, k=8, T=16384, router=dict(aux_loss_coeff=1e-2, z_loss_coeff=1e-3)),
    # DeepSeek-V3 per-rank work under EP8: 256 experts / 8 ranks = 32 local experts (h7168, f2048). With T tokens
    # per rank and top-8, balanced EP sends each rank T*8 copies, i.e. exactly what a local layer with E=32, k=8 and
    # T tokens computes. T=2048 gives 16384 routed rows (512 per local expert). The router here is DeepSeek-style
    # (sigmoid, scaling 2.5, expert bias, sequence aux loss) over the 32 local experts; group-limited routing over
    # 256 experts and the all-to-all are not part of this single-rank number.
    "deepseek-v3-ep8": dict(E=32, h=7168, f=2048, k=8, T=2048,
                            router=dict(score_function="sigmoid", topk_scaling_factor=2.5, expert_bias=True,
                                        load_balancing="seq_aux_loss", aux_loss_coeff=1e-4)),
}
SEQ = 4096  # tokens per sequence (only the sequence aux loss sees the split into sequences)


def smoke_shape(shape: dict) -> dict:
    E = min(shape["E"], 8)
    return dict(shape, E=E, h=64, f=32, k=min(shape["k"], E // 2), T=64)


# ------------------------------------------------------------------------------------------------ routing override
class ForcedRouting(nn.Module):
    """Runs the wrapped router unchanged (so its cost is timed) and swaps in a fixed expert assignment."""

    def __init__(self, router: nn.Module, experts_TK: torch.Tensor):
        super().__init__()
        self.inner = router
        self.register_buffer("experts_TK", experts_TK, persistent=False)
        counts_E = torch.bincount(experts_TK.reshape(-1), minlength=router.cfg.num_experts).float()
        self.register_buffer("counts_E", counts_E, persistent=False)

    def forward(self, x_TD: torch.Tensor, num_sequences: int):
        route = self.inner(x_TD, num_sequences=num_sequences)
        route.experts_TK = self.experts_TK
        route.tokens_per_expert_E = self.counts_E
        return route


def balanced_assignment(T: int, E: int, k: int, device, generator: torch.Generator) -> torch.Tensor:
    """experts_TK[t, j] = (perm[t]*k + j) % E: exactly T*k/E copies per expert when E divides T*k, k distinct
    experts per token (k <= E)."""
    perm_T = torch.randperm(T, generator=generator).to(device)
    return (perm_T.unsqueeze(1) * k + torch.arange(k, device=device)) % E


# ------------------------------------------------------------------------------------------------ instrumentation
class _Stamp(torch.autograd.Function):
    """Identity; its backward records a stamp when the gradient reaches this point."""

    @staticmethod
    def forward(ctx, x, log_, key, device):
        ctx.log_, ctx.key, ctx.device = log_, key, device
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.log_[ctx.key] = stamp(ctx.device)
        return g, None, None, None


def instrumented_step(layer: MoELayer, x_BSD: torch.Tensor, g_BSD: torch.Tensor, amp, device) -> dict:
    """MoELayer.forward spelled out with stamps between the stages; returns stage times in ms."""
    s: dict = {}
    B, S, D = x_BSD.shape
    with amp():
        s["f0"] = stamp(device)
        x_TD = x_BSD.reshape(B * S, D)
        route = layer.router(_Stamp.apply(x_TD, s, "b_router", device), num_sequences=B)
        s["f_router"] = stamp(device)
        x_MD, tpl_L, st = layer.dispatcher.dispatch(_Stamp.apply(x_TD, s, "b_dispatch", device), route)
        x_MD = _Stamp.apply(x_MD, s, "b_experts", device)
        s["f_dispatch"] = stamp(device)
        y_MD = layer.experts(x_MD, tpl_L, has_tail=st.has_tail, probs_M=st.probs_M)  # as MoELayer.compute
        st.probs_applied = st.probs_M is not None
        y_MD = _Stamp.apply(y_MD, s, "b_combine", device)
        s["f_experts"] = stamp(device)
        y_TD = layer.dispatcher.combine(y_MD, st).to(x_BSD.dtype)
        if layer.shared_experts is not None:
            y_TD = y_TD + layer.shared_experts(x_TD)
        aux = route.aux_loss + route.z_loss
        s["f_combine"] = stamp(device)
    roots, grads = [y_TD.view(B, S, D)], [g_BSD]
    if aux.requires_grad:
        roots, grads = roots + [aux], grads + [torch.ones_like(aux)]
    torch.autograd.backward(roots, grads)
    s["b_end"] = stamp(device)
    sync(device)
    order = ["f0", "f_router", "f_dispatch", "f_experts", "f_combine", "b_combine", "b_experts", "b_dispatch",
             "b_router", "b_end"]
    gaps = {f"{a}->{b}": elapsed_ms(s[a], s[b]) for a, b in zip(order, order[1:])}
    return gaps


def split_summary(runs: list[dict]) -> dict:
    med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    fwd = {"router": med["f0->f_router"], "dispatch": med["f_router->f_dispatch"],
           "experts": med["f_dispatch->f_experts"], "combine": med["f_experts->f_combine"]}
    bwd = {"combine": med["f_combine->b_combine"], "experts": med["b_combine->b_experts"],
           "dispatch": med["b_experts->b_dispatch"], "router": med["b_dispatch->b_router"],
           "other": med["b_router->b_end"]}  # the input-gradient sum of the two branches
    total = {k: fwd.get(k, 0.0) + bwd.get(k, 0.0) for k in ("router", "dispatch", "experts", "combine", "other")}
    whole = sum(total.values())
    # the stamps are valid only if every gap is non-negative (backward ran combine, experts, dispatch, router)
    ok = all(r[key] >= -1e-3 for r in runs for key in r)
    return {"split_ms": total, "split_fraction": {k: v / whole for k, v in total.items()} if whole > 0 else None,
            "split_fwd_ms": fwd, "split_bwd_ms": bwd, "split_total_ms": whole, "split_ok": ok}


# ------------------------------------------------------------------------------------------------ the three blocks
def bare_block(x_MD, w13_EDF2, w2_EFD, offs_E):
    h_M2F = F.grouped_mm(x_MD, w13_EDF2, offs=offs_E)
    gate_MF, up_MF = h_M2F.chunk(2, dim=-1)
    return F.grouped_mm(F.silu(gate_MF) * up_MF, w2_EFD, offs=offs_E)


def bare_fused_block(x_MD, w13_EDF2, w2_EFD, offs_E):
    """The bare block with the layer's one-pass Triton SwiGLU (the stricter limit: the same activation kernel)."""
    h_M2F = F.grouped_mm(x_MD, w13_EDF2, offs=offs_E)
    return F.grouped_mm(swiglu(h_M2F, fused=True), w2_EFD, offs=offs_E)


ALIGN = 128  # -aligned: DeepGEMM's expert boundaries


def padded_rows(counts: list[int], h: int, device, dtype) -> tuple:
    """The bare block's input with each expert's rows rounded up to ALIGN (zero rows between): x, offs, output grad."""
    sizes = [-(-c // ALIGN) * ALIGN for c in counts]
    starts = [sum(sizes[:e]) for e in range(len(sizes))]
    keep = torch.cat([torch.arange(s0, s0 + c, device=device) for s0, c in zip(starts, counts)])
    P = sum(sizes)
    x = torch.zeros(P, h, device=device, dtype=dtype)
    x[keep] = torch.randn(len(keep), h, device=device, dtype=dtype)
    g = torch.zeros(P, h, device=device, dtype=dtype)
    g[keep] = torch.randn(len(keep), h, device=device, dtype=dtype)
    return x.requires_grad_(), torch.tensor(sizes, device=device).cumsum(0).to(torch.int32), g


def fp8_block(x_MD, w13_EDF2, w2_EFD, offs_E, spec1, spec2, fused_swiglu: bool = False):
    """The bare block with FP8 GEMMs; ``fused_swiglu``: the layer's Triton SwiGLU, else torch's (as ``bare_block``);
    fused with the quantization (``fp8_swiglu``) where the specs hold a handoff."""
    if spec1.handoff is not None and spec1.handoff[0].both is not None:
        fp8_swiglu_mod.prepare(None, spec1.handoff[0])  # as GroupedExperts tells its activation before fc1
    h_M2F = fp8_grouped_mm(x_MD, w13_EDF2, offs_E, spec1)
    if spec1.handoff is not None:
        return fp8_grouped_mm(fp8_swiglu(h_M2F, None, spec1.handoff[0]), w2_EFD, offs_E, spec2)
    if fused_swiglu:
        return fp8_grouped_mm(swiglu(h_M2F, fused=True), w2_EFD, offs_E, spec2)
    gate_MF, up_MF = h_M2F.chunk(2, dim=-1)
    return fp8_grouped_mm(F.silu(gate_MF) * up_MF, w2_EFD, offs_E, spec2)


def fp8_specs(precision: str) -> tuple:
    """``fp8-<recipe>[-hybrid][-bf16wgrad][-fastall][-cached][-aligned]``: one spec per GEMM (delayed scaling keeps a
    history per GEMM); E4M3 gradients unless ``-hybrid``, so that every GEMM can run on the scaled grouped kernel;
    ``-bf16wgrad``: the wgrads from the unquantized operands (``FP8Training(fp8_wgrad=False)``; ``-bf16wgradfc2``:
    fc2's alone); fast
    accumulation in the forward GEMMs only (``FP8Training``'s default) unless ``-fastall`` (dgrad and wgrad too). The
    weights are quantized in every iteration unless ``-cached``: once, as a model does once per optimizer step for all
    its micro-batches (``FP8Training(cache_weights=True)``). ``-aligned``: each expert's rows start on a multiple of
    128 (``ModelConfig.expert_rows_align=128``; the bare block pads its rows so)."""
    parts = precision.split("-")
    recipe, fmt = parts[1], "hybrid" if "hybrid" in parts else "e4m3"
    fast = "all" if "fastall" in parts else "fprop"
    align = ALIGN if "aligned" in parts else 1
    specs = tuple(FP8Spec(recipe, fp8_format=fmt, fast_accum=fast, rows_align=align,
                          fp8_wgrad="bf16wgrad" not in parts and (i == 0 or "bf16wgradfc2" not in parts))
                  for i in range(2))
    for spec in specs:
        spec.step = 0 if "cached" in parts else None
    return specs


def loop_block(x_MD, w13_EDF2, w2_EFD, bounds: list[int]):
    outs = []
    for e in range(w13_EDF2.shape[0]):
        h_m2F = x_MD[bounds[e]:bounds[e + 1]] @ w13_EDF2[e]
        gate, up = h_m2F.chunk(2, dim=-1)
        outs.append((F.silu(gate) * up) @ w2_EFD[e])
    return torch.cat(outs)


def _under_sync_debug(fn) -> list:
    """Run fn with CUDA sync debug mode "warn" and return the warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return caught


def host_syncs(fn, device) -> tuple[int | None, list[str]]:
    """Host<->device synchronisations in one call (CUDA sync debug mode): their number and the distinct Python
    lines that triggered them. (None, []) on CPU."""
    if device.type != "cuda":
        return None, []
    # the first switch into sync-debug mode in a process reports one sync of its own (torch/cuda/__init__.py,
    # seen on H100 with torch 2.11): an untimed call first, so that only the layer's own syncs are counted
    _under_sync_debug(fn)
    caught = _under_sync_debug(fn)
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    sites = sorted({f"{w.filename}:{w.lineno}" for w in syncs})
    return len(syncs), sites


def bench_shape(name: str, shape: dict, args, device, dtype, param_mode: str) -> dict:
    E, h, f, k, T = shape["E"], shape["h"], shape["f"], shape["k"], shape["T"]
    if args.tokens and not args.smoke:
        T = args.tokens
    B = max(1, T // SEQ) if T % SEQ == 0 else 1
    cfg = ModelConfig(hidden_size=h, num_experts=E, moe_ffn_hidden_size=f, topk=k, num_layers=1,
                      seq_length=T // B, compile_router=args.compile_router, router_fusion=not args.unfused,
                      permute_fusion=not args.unfused, router_dtype=args.router_dtype,
                      probs_in_experts=not args.probs_in_combine, swiglu_fusion=not args.no_swiglu_fusion,
                      **shape["router"])
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)

    # ---- (a) the layer
    with torch.device(device):
        layer = MoELayer(cfg, ParallelContext.single(), out_std=cfg.init_std)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, cfg.init_std)
    if param_mode == "bf16":  # bf16 weights, router kept fp32 as the model keeps it
        layer.to(torch.bfloat16)
        layer.router.float()
    layer.train()
    in_dtype = torch.float32 if param_mode in ("autocast", "fp32") else dtype
    x_BSD = torch.randn(B, T // B, h, device=device, dtype=in_dtype, requires_grad=True)
    g_BSD = torch.randn(B, T // B, h, device=device, dtype=in_dtype)
    if args.routing == "balanced":
        layer.router = ForcedRouting(layer.router, balanced_assignment(T, E, k, device, gen))

    def amp():
        if param_mode == "autocast":
            return torch.autocast(device_type=device.type, dtype=dtype)
        return contextlib.nullcontext()

    def layer_step():
        with amp():
            y, aux = layer(x_BSD)
        if aux.requires_grad:
            torch.autograd.backward([y, aux], [g_BSD, torch.ones_like(aux)])
        else:
            y.backward(g_BSD)

    layer_tensors = [x_BSD] + list(layer.parameters())
    layer_step()  # first run: check it computes something finite, and read the routing it produced
    finite = bool(all(torch.isfinite(t.grad).all() for t in layer_tensors if t.grad is not None))
    counts_E = layer.last_stats["tokens_per_expert"].float().cpu()
    rows = int(counts_E.sum())
    imbalance = float(counts_E.max() / counts_E.mean())
    flops = 18.0 * rows * h * f
    rec = {"shape": name, "E": E, "h": h, "f": f, "k": k, "T": T, "sequences": B, "rows": rows,
           "rows_per_expert_mean": rows / E, "rows_per_expert_max": int(counts_E.max()),
           "rows_per_expert_min": int(counts_E.min()), "imbalance_max_over_mean": imbalance,
           "routing": args.routing, "param_mode": param_mode, "compute_dtype": str(dtype),
           "router": {"dtype": cfg.router_dtype, "score_function": cfg.score_function,
                      "load_balancing": cfg.load_balancing,
                      "aux_loss_coeff": cfg.aux_loss_coeff, "z_loss_coeff": cfg.z_loss_coeff,
                      "expert_bias": cfg.expert_bias},
           "expert_gemm_flops": flops, "finite": finite}

    t_layer = time_fn(layer_step, device, args.iters, args.warmup, layer_tensors, args.timer)
    t_layer.update(peak_memory(layer_step, device, layer_tensors))
    t_layer["tflops"] = tflops(flops, t_layer["median_ms"])
    t_layer["host_syncs"], t_layer["host_sync_sites"] = host_syncs(layer_step, device)
    rec["layer"] = t_layer
    fp8_layers = {}
    for precision in args.fp8:  # the same layer with its expert GEMMs swapped to FP8
        spec1, spec2 = fp8_specs(precision)
        layer.experts.fc1._mm = lambda x, w, offs, s=spec1: fp8_grouped_mm(x, w, offs, s)
        layer.experts.fc2._mm = lambda x, w, offs, s=spec2: fp8_grouped_mm(x, w, offs, s)
        layer.dispatcher.cfg = dataclasses.replace(cfg, expert_rows_align=spec1.rows_align)
        hand = fp8_swiglu_mod.attach(layer.experts, spec1, spec2, device)  # FP8Training's default
        fused_act, per_expert = hand is not None, hand is not None and hand.both is not None
        if fused_act and fp8_swiglu_mod.PERMUTE and not per_expert:  # as FP8Training: the permutes quantize x, dy
            layer.dispatcher.fp8_rows = spec1.handoff[0]
        t = time_fn(layer_step, device, args.iters, args.warmup, layer_tensors, args.timer)
        t.update(peak_memory(layer_step, device, layer_tensors))
        t["tflops"] = tflops(flops, t["median_ms"])
        t["swiglu_fused_with_quantization"] = fused_act
        t["swiglu_per_expert_both_layouts"] = per_expert  # fp8_grouped_both's: a and dh never written
        t["permutes_quantize"] = layer.dispatcher.fp8_rows is not None
        fp8_layers[precision] = t
        fp8_swiglu_mod.detach(layer.experts, spec1, spec2)
        layer.dispatcher.__dict__.pop("fp8_rows", None)
        del layer.experts.fc1._mm, layer.experts.fc2._mm
        layer.dispatcher.cfg = cfg

    runs = []
    for i in range(args.split_iters + 1):
        for t in layer_tensors:
            t.grad = None
        gaps = instrumented_step(layer, x_BSD, g_BSD, amp, device)
        if i:  # the first instrumented pass is a warm-up
            runs.append(gaps)
    rec.update(split_summary(runs))
    for t in layer_tensors:
        t.grad = None
    del layer
    gc.collect()

    # ---- (b) the bare grouped-GEMM block with the same per-expert rows
    counts_list = [int(c) for c in counts_E.tolist()]
    offs_E = torch.tensor(counts_list, device=device).cumsum(0).to(torch.int32)
    x_MD = torch.randn(rows, h, device=device, dtype=dtype, requires_grad=True)
    w13 = (torch.randn(E, h, 2 * f, device=device, dtype=dtype) * cfg.init_std).requires_grad_()
    w2 = (torch.randn(E, f, h, device=device, dtype=dtype) * cfg.init_std).requires_grad_()
    g_MD = torch.randn(rows, h, device=device, dtype=dtype)
    bare_tensors = [x_MD, w13, w2]

    def bare_step():
        bare_block(x_MD, w13, w2, offs_E).backward(g_MD)

    t_bare = time_fn(bare_step, device, args.iters, args.warmup, bare_tensors, args.timer)
    t_bare.update(peak_memory(bare_step, device, bare_tensors))
    t_bare["tflops"] = tflops(flops, t_bare["median_ms"])
    rec["bare"] = t_bare
    rec["ratio_layer_over_bare"] = t_bare["median_ms"] / t_layer["median_ms"]
    if device.type == "cuda":  # the same block with the Triton SwiGLU the layer runs by default
        t = time_fn(lambda: bare_fused_block(x_MD, w13, w2, offs_E).backward(g_MD), device, args.iters, args.warmup,
                    bare_tensors, args.timer)
        t["tflops"] = tflops(flops, t["median_ms"])
        rec["bare_fused_swiglu"] = t
        rec["ratio_layer_over_bare_fused_swiglu"] = t["median_ms"] / t_layer["median_ms"]
    padded = padded_rows(counts_list, h, device, dtype) if any("aligned" in p for p in fp8_layers) else None
    for precision, t_fp8_layer in fp8_layers.items():
        spec1, spec2 = fp8_specs(precision)
        x_in, offs_in, g_in = padded if spec1.rows_align > 1 else (x_MD, offs_E, g_MD)

        def fp8_step(s1=spec1, s2=spec2, x_in=x_in, offs_in=offs_in, g_in=g_in, fused=False):
            fp8_block(x_in, w13, w2, offs_in, s1, s2, fused).backward(g_in)

        t = time_fn(fp8_step, device, args.iters, args.warmup, bare_tensors, args.timer)
        t["tflops"] = tflops(flops, t["median_ms"])
        rec.setdefault("fp8", {})[precision] = {
            "layer": t_fp8_layer, "bare": t, "layer_speedup": t_layer["median_ms"] / t_fp8_layer["median_ms"],
            "bare_speedup": t_bare["median_ms"] / t["median_ms"]}
        if "bare_fused_swiglu" in rec:  # both blocks with the Triton SwiGLU the layer runs
            t = time_fn(lambda: fp8_step(fused=True), device, args.iters, args.warmup, bare_tensors, args.timer)
            t["tflops"] = tflops(flops, t["median_ms"])
            rec["fp8"][precision].update(bare_fused_swiglu=t, bare_fused_swiglu_speedup=rec["bare_fused_swiglu"][
                "median_ms"] / t["median_ms"])
            # and the FP8 side's SwiGLU fused with its quantization
            if fp8_layers[precision]["swiglu_fused_with_quantization"]:
                hand = fp8_swiglu_mod.Handoff(both=(spec1, spec2, w2) if fp8_layers[precision][
                    "swiglu_per_expert_both_layouts"] else None)
                spec1.handoff, spec2.handoff = (hand, "fc1"), (hand, "fc2")
                t = time_fn(fp8_step, device, args.iters, args.warmup, bare_tensors, args.timer)
                t["tflops"] = tflops(flops, t["median_ms"])
                spec1.handoff = spec2.handoff = None
                rec["fp8"][precision].update(bare_fp8_swiglu=t, bare_fp8_swiglu_speedup=rec["bare_fused_swiglu"][
                    "median_ms"] / t["median_ms"])

    # ---- (c) optional per-expert loop at the qwen3 shape
    if args.with_loop and name == "qwen3":
        bounds = [0] + torch.tensor(counts_list).cumsum(0).tolist()

        def loop_step():
            loop_block(x_MD, w13, w2, bounds).backward(g_MD)

        with torch.no_grad():
            ref = loop_block(x_MD, w13, w2, bounds).float()
            got = bare_block(x_MD, w13, w2, offs_E).float()
            rel_err = float((got - ref).norm() / ref.norm())
        t_loop = time_fn(loop_step, device, args.iters, args.warmup, bare_tensors, args.timer)
        t_loop["tflops"] = tflops(flops, t_loop["median_ms"])
        t_loop["grouped_vs_loop_rel_err"] = rel_err
        rec["loop"] = t_loop
    del x_MD, w13, w2, g_MD, x_BSD, g_BSD
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {list(SHAPES)}")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 20; 2 with --smoke)")
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations first (default 5; 1 with --smoke)")
    p.add_argument("--split-iters", type=int, default=None, help="instrumented passes for the split (default 5)")
    p.add_argument("--timer", choices=("events", "do_bench"), default="events")
    p.add_argument("--routing", choices=("balanced", "router"), default="balanced")
    p.add_argument("--params", choices=("bf16", "autocast"), default="bf16",
                   help="bf16: bf16 weights (router fp32); autocast: fp32 weights under bf16 autocast, as in "
                        "bf16-mixed training (adds the weight casts)")
    p.add_argument("--tokens", type=int, default=None, help="override T for every shape")
    p.add_argument("--compile-router", action="store_true", help="ModelConfig.compile_router=True")
    p.add_argument("--router-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="ModelConfig.router_dtype: the router GEMM in float32 or in bf16 with float32 logits")
    p.add_argument("--probs-in-combine", action="store_true",
                   help="ModelConfig.probs_in_experts=False: the combine weights the expert outputs (the old way)")
    p.add_argument("--no-swiglu-fusion", action="store_true", help="ModelConfig.swiglu_fusion=False (torch SwiGLU)")
    p.add_argument("--unfused", action="store_true",
                   help="router_fusion=False, permute_fusion=False: the torch reference router and permutes")
    p.add_argument("--precision", default="bf16",
                   help="bf16, plus comma-separated fp8-<recipe>[-hybrid][-bf16wgrad][-fastall][-cached][-aligned] "
                   "(recipes: " + ", ".join(RECIPES) + "; -bf16wgrad: FP8Training(fp8_wgrad=False), not blockwise; "
                   "-bf16wgradfc2: fc2's wgrad alone unquantized; "
                   "-fastall: fast accumulation in dgrad and wgrad too; -cached: the "
                   "weights quantized once, not in every iteration; -aligned, blockwise only: each expert's rows "
                   "start on a multiple of 128, ModelConfig.expert_rows_align=128)")
    p.add_argument("--with-loop", action="store_true", help="also time a per-expert Python loop (qwen3 only)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, float32, CPU, 2 iterations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        p.error(f"unknown shapes {unknown}; choose from {list(SHAPES)}")
    precisions = [s.strip() for s in args.precision.split(",") if s.strip()]
    valid = {f"fp8-{r}" for r in RECIPES} | {"fp8-tensorwise-hybrid", "fp8-delayed-hybrid"}
    valid |= {f"{v}-bf16wgrad{g}" for v in valid if not v.startswith("fp8-blockwise") for g in ("", "fc2")}
    valid |= {f"{v}-fastall" for v in valid}
    valid |= {f"{v}-cached" for v in valid}
    valid |= {f"{v}-aligned" for v in valid if v.startswith("fp8-blockwise")}
    bad = [s for s in precisions if s != "bf16" and s not in valid]
    if bad:
        p.error(f"unknown --precision {bad}; choose from bf16, {', '.join(sorted(valid))}")
    args.fp8 = [s for s in precisions if s != "bf16"]
    args.iters = args.iters or (2 if args.smoke else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 5)
    args.split_iters = args.split_iters or (1 if args.smoke else 5)

    device = pick_device(args.smoke)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    param_mode = "fp32" if args.smoke else args.params
    records = []
    for name in names:
        shape = smoke_shape(SHAPES[name]) if args.smoke else SHAPES[name]
        log(f"{name}: E={shape['E']} h={shape['h']} f={shape['f']} k={shape['k']} T={args.tokens or shape['T']}")
        try:
            rec = bench_shape(name, shape, args, device, dtype, param_mode)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: record it and go on with the next shape
            traceback.print_exc(file=sys.stderr)
            records.append({"shape": name, "error": f"{type(e).__name__}: {str(e)[:500]}"})
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        log(f"{name}: layer {rec['layer']['median_ms']:.3f} ms ({rec['layer']['tflops']:.1f} TFLOP/s), bare "
            f"{rec['bare']['median_ms']:.3f} ms ({rec['bare']['tflops']:.1f} TFLOP/s), "
            f"ratio {rec['ratio_layer_over_bare']:.3f}"
            + (f", against the bare block with the Triton SwiGLU {rec['ratio_layer_over_bare_fused_swiglu']:.3f}"
               if "bare_fused_swiglu" in rec else ""))
        for precision, r in rec.get("fp8", {}).items():
            log(f"{name} {precision}: layer x{r['layer_speedup']:.2f}, block x{r['bare_speedup']:.2f} over bf16")
        records.append(rec)
    result = {"benchmark": "moe_layer", "env": env_info(device), "smoke": args.smoke,
              "config": {"iters": args.iters, "warmup": args.warmup, "split_iters": args.split_iters,
                         "timer": args.timer, "routing": args.routing, "params": param_mode, "seed": args.seed,
                         "flops": "expert GEMMs only: 18*rows*h*f per fwd+bwd"},
              "records": records}
    emit(result, args.out)
    if any("error" in r for r in records):
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
