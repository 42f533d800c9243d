"""One MoE layer under expert parallelism (all-to-all dispatcher, NCCL) against EP=1, same tokens per GPU.

Weak scaling: each rank routes T tokens over E experts; EP=1 holds all E experts, EP=N holds E/N. The forward is
split with CUDA events around the dispatcher's steps: local permute + count exchange + host sync of split sizes
(dispatch_preprocess), the token all-to-all (token_dispatch / token_combine), experts, and the rest.

--fp8-dispatch also times the EP layer with the token all-to-all in FP8 (E4M3 rows and an fp32 scale each:
h + 4 bytes a row instead of 2h; ``lightning_moe/modules/fp8_dispatch.py``); the GEMMs stay bf16 in every run.

    python benchmarks/bench_ep.py --ep 2 --shape qwen3 [--dispatcher alltoall_dedup] [--fp8-dispatch] --out ep.json
"""

from __future__ import annotations

import argparse
import os
import statistics

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = {"qwen3": dict(E=128, h=2048, f=768, k=8, T=16384), "mixtral": dict(E=8, h=4096, f=14336, k=2, T=8192)}


def _layer(shape, ctx, dispatcher):
    from lightning_moe import ModelConfig
    from lightning_moe.modules.init import init_weights
    from lightning_moe.modules.moe_layer import MoELayer
    sync_free = dispatcher == "deepep_sync_free"  # DeepEP with worst-case receive buffers: no host sync
    cfg = ModelConfig(hidden_size=shape["h"], num_experts=shape["E"], moe_ffn_hidden_size=shape["f"], topk=shape["k"],
                      dispatcher="deepep" if sync_free else dispatcher, sync_free_dispatch=sync_free,
                      aux_loss_coeff=1e-3)
    layer = MoELayer(cfg, ctx, 0.02).cuda()
    init_weights(layer, 0)
    layer.experts.to(torch.bfloat16)
    return layer


def _timed(layer, x, iters, split):
    events, t = {}, []
    d = layer.dispatcher
    if split:  # wrap the dispatcher's steps with events (forward only)
        for name in ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess", "combine_preprocess",
                     "token_combine", "combine_postprocess"):
            fn = getattr(d, name)

            def wrapped(*a, _fn=fn, _n=name):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                out = _fn(*a)
                e.record()
                events.setdefault(_n, []).append((s, e))
                return out
            setattr(d, name, wrapped)
    for i in range(iters + 3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        y, aux = layer(x)
        (y.float().square().mean() + aux).backward()
        e.record()
        if i >= 3:
            t.append((s, e))
    torch.cuda.synchronize()
    out = {"fwd_bwd_ms": statistics.median(s.elapsed_time(e) for s, e in t)}
    for n, ev in events.items():
        out[f"fwd_{n}_ms"] = statistics.median(s.elapsed_time(e) for s, e in ev[3:])
    return out


def worker(rank, world, shape_name, iters, out_path, dispatcher="alltoall", fp8_dispatch=False):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    from lightning_moe import ParallelContext, build_layout
    shape = dict(SHAPES[shape_name])
    ctx = ParallelContext.from_layout(build_layout(world, ep=world), rank)
    gen = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(shape["T"] // 4096, 4096, shape["h"], device="cuda", dtype=torch.bfloat16, generator=gen)
    res = {"rank": rank}
    ep = f"ep{world}"
    runs = [("ep1", ParallelContext.single(), False), (ep, ctx, False)]
    runs += [(f"{ep}_fp8_dispatch", ctx, True)] if fp8_dispatch else []
    for label, c, fp8 in runs:
        layer = _layer(shape, c, dispatcher)
        layer.dispatcher.fp8_dispatch = fp8
        plain = _timed(layer, x, iters, split=False)
        split = _timed(layer, x, max(3, iters // 2), split=True)
        counts = layer.last_stats["tokens_per_expert"].float()
        flops = 18 * shape["T"] * shape["k"] * shape["h"] * shape["f"]  # expert GEMMs fwd+bwd, this rank's tokens
        res[label] = {**plain, **{k: v for k, v in split.items() if k != "fwd_bwd_ms"},
                      "tflops_per_gpu": flops / plain["fwd_bwd_ms"] / 1e9,
                      "router_imbalance_max_over_mean": (counts.max() / counts.mean()).item()}
        del layer
        torch.cuda.empty_cache()
    for label, *_ in runs[1:]:
        res[label]["weak_scaling_efficiency"] = res[label]["tflops_per_gpu"] / res["ep1"]["tflops_per_gpu"]
    if fp8_dispatch:  # > 1: the FP8 all-to-all is faster than the bf16 one
        on = res[f"{ep}_fp8_dispatch"]
        on["fwd_bwd_speedup"] = res[ep]["fwd_bwd_ms"] / on["fwd_bwd_ms"]
        on["token_dispatch_speedup"] = res[ep]["fwd_token_dispatch_ms"] / on["fwd_token_dispatch_ms"]
    gathered = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:
        import json
        text = json.dumps({"benchmark": "moe_layer_ep", "shape": shape_name, "dispatcher": dispatcher,
                           "fp8_dispatch": fp8_dispatch, **SHAPES[shape_name], "world": world,
                           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "ranks": gathered},
                          indent=1)
        print(text)
        if out_path:
            with open(out_path, "w") as f:
                f.write(text)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--shape", default="qwen3", choices=sorted(SHAPES))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("--dispatcher", default="alltoall", choices=("alltoall", "alltoall_dedup", "allgather", "deepep", "deepep_sync_free"))
    p.add_argument("--fp8-dispatch", action="store_true",
                   help="also time the EP layer with the token all-to-all in FP8 (alltoall dispatcher only)")
    a = p.parse_args()
    if a.fp8_dispatch and a.dispatcher != "alltoall":
        p.error(f"--fp8-dispatch needs --dispatcher alltoall, not {a.dispatcher}")
    mp.spawn(worker, args=(a.ep, a.shape, a.iters, a.out, a.dispatcher, a.fp8_dispatch), nprocs=a.ep)


if __name__ == "__main__":
    main()
