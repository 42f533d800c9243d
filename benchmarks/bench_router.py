"""Fused (Triton) against unfused (torch reference) router and permutes, forward + backward, in one run.

For each shape, bf16 activations on one GPU, each timed fused and unfused in the same process:
  router    ``TopKRouter`` with the model's router settings, training mode: GEMM, scores, top-k, gates, counts,
            aux and z losses, and the backward to the input (``router_fusion``)
  permute   the single-rank dispatcher's dispatch + combine around an identity 'expert', forward + backward
            (``permute_fusion``); ``permute_fp8`` the same with every expert's rows aligned to 16 (FP8 padding)
  resort    the all-to-all receiver's re-sort by local expert and its inverse (EP8 layout: 8 sources)
``ratio`` is unfused_ms / fused_ms (> 1: the fused path is faster). Prints one JSON object.

    python benchmarks/bench_router.py --out router.json
    python benchmarks/bench_router.py --smoke       # tiny CPU float32 run (both paths are the reference there)
"""

from __future__ import annotations

import argparse

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
from common import emit, env_info, log, pick_device, time_fn

from lightning_moe.modules.config import ModelConfig
from lightning_moe.modules.dispatcher import TokenDispatcher
from lightning_moe.modules.expert_order import resort_by_expert
from lightning_moe.modules.permute import move_rows, take_rows
from lightning_moe.modules.router import RouterOutput, TopKRouter
from lightning_moe.strategy.parallel_context import ParallelContext

SHAPES: dict[str, dict] = {
    "qwen3": dict(E=128, h=2048, k=8, T=16384, router=dict(aux_loss_coeff=1e-3)),
    "olmoe": dict(E=64, h=2048, k=8, T=16384, router=dict(aux_loss_coeff=1e-2, z_loss_coeff=1e-3)),
    "mixtral": dict(E=8, h=4096, k=2, T=16384, router=dict(aux_loss_coeff=0.02)),
    # DeepSeek-V3's router (sigmoid, 8 groups top-4, expert bias, sequence aux loss) at its full 256 experts
    "deepseek-v3": dict(E=256, h=7168, k=8, T=4096,
                        router=dict(score_function="sigmoid", num_groups=8, group_topk=4, topk_scaling_factor=2.5,
                                    expert_bias=True, load_balancing="seq_aux_loss", aux_loss_coeff=1e-4)),
}
SEQ = 4096


def _cfg(shape: dict, **kw) -> ModelConfig:
    return ModelConfig(hidden_size=shape["h"], num_experts=shape["E"], topk=shape["k"], **shape["router"], **kw)


def router_step(shape: dict, fused: bool, device, dtype):
    T, h = shape["T"], shape["h"]
    router = TopKRouter(_cfg(shape, router_fusion=fused)).to(device).train()
    x = torch.randn(T, h, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(T, shape["k"], device=device)
    B = max(1, T // SEQ)

    def step():
        out = router(x, num_sequences=B)
        ((out.probs_TK * g).sum() + out.aux_loss + out.z_loss).backward()
    return step, [x, router.weight]


def permute_step(shape: dict, fused: bool, device, dtype, align: int = 1):
    T, h, E, k = shape["T"], shape["h"], shape["E"], shape["k"]
    cfg = _cfg(shape, permute_fusion=fused, expert_rows_align=align)
    d = TokenDispatcher(cfg, ParallelContext.single())
    x = torch.randn(T, h, device=device, dtype=dtype, requires_grad=True)
    logits = torch.randn(T, E, device=device)
    probs, experts = torch.softmax(logits, -1).topk(k, -1)
    probs.requires_grad_()
    g = torch.randn(T, h, device=device, dtype=dtype)

    zero = torch.zeros((), device=device)
    route = RouterOutput(probs, experts, None, zero, zero, torch.zeros(E, device=device), zero)

    def step():
        x_MD, _, st = d.dispatch(x, route)
        d.combine(x_MD, st).backward(g)
    return step, [x, probs]


def resort_step(shape: dict, fused: bool, device, dtype, sources: int = 8):
    T, h, E, k = shape["T"], shape["h"], shape["E"], shape["k"]
    L = max(1, E // sources)
    counts = torch.full((sources, L), T * k // (sources * L), device=device, dtype=torch.int64)
    counts[0, 0] += T * k - int(counts.sum())
    M = T * k
    x = torch.randn(M, h, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(M, h, device=device, dtype=dtype)

    def step():
        dest, _, R = resort_by_expert(counts, M, 1, fused)
        take_rows(move_rows(x, dest, R), dest).backward(g)
    return step, [x]


BENCHES = {"router": router_step, "permute": permute_step,
           "permute_fp8": lambda s, f, dev, dt: permute_step(s, f, dev, dt, align=16), "resort": resort_step}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3,olmoe,mixtral,deepseek-v3")
    p.add_argument("--benches", default=",".join(BENCHES))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, float32, CPU")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = pick_device(args.smoke)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    results = {}
    for name in args.shapes.split(","):
        shape = dict(SHAPES[name])
        if args.smoke:
            shape.update(E=min(shape["E"], 16), h=32, T=64, k=min(shape["k"], 4))
            if shape["router"].get("num_groups"):
                shape["router"] = dict(shape["router"], num_groups=4, group_topk=2)
        row = {}
        for bench in args.benches.split(","):
            ms = {}
            for fused in (True, False):
                torch.manual_seed(0)
                step, grads = BENCHES[bench](shape, fused, device, dtype)
                ms["fused" if fused else "unfused"] = time_fn(step, device, args.iters, args.warmup, grads)["median_ms"]
            row[bench] = dict(fused_ms=ms["fused"], unfused_ms=ms["unfused"], ratio=ms["unfused"] / ms["fused"])
            log(f"{name} {bench}: fused {ms['fused']:.3f} ms, unfused {ms['unfused']:.3f} ms, "
                f"x{row[bench]['ratio']:.2f}")
        results[name] = dict(shape={k: v for k, v in shape.items()}, **row)
    out = dict(benchmark="bench_router", smoke=args.smoke, dtype=str(dtype), env=env_info(device), results=results)
    emit(out, args.out)
    return out


if __name__ == "__main__":
    main()
