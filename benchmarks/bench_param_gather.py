"""The distributed optimizer's weight all-gather in bf16 against the FP8 parameter all-gather
(``FP8Training(fp8_param_gather=True)``, ``strategy/fp8_param_gather.py``), on N GPUs over NCCL.

One bucket holds one MoE layer's expert weights (w13 and w2) at a model's shape. Timed, per rank, median over
``--iters``:
  bf16        the plain all-gather of the bucket's bf16 weights;
  fp8_wire    the all-gather of the FP8 chunks alone (the bytes on the wire);
  fp8         the whole FP8 path: block amaxes and their all-reduce, quantization of this rank's slice, the gather,
              and the dequantization of every slice into the bf16 weights;
  fp8_amax, fp8_dequant   two of its parts alone.

    python benchmarks/bench_param_gather.py --gpus 2 --shape mixtral,qwen3 --recipe tensorwise,blockwise
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SHAPES = {  # experts of one layer: (L, hidden, 2 * ffn), (L, ffn, hidden)
    "mixtral": (8, 4096, 14336),
    "qwen3": (128, 2048, 768),
    "deepseek_ep8": (32, 7168, 2048),
}


def _time(fn, iters: int) -> float:
    times = []
    for _ in range(iters + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times = sorted(times[2:])
    return times[len(times) // 2]


def worker(rank: int, world: int, shapes: list, recipes: list, iters: int, out: str, port: int,
           tiles: list) -> None:
    from lightning_moe.modules import triton_block_quant as tk
    from lightning_moe.strategy import fp8_param_gather as g
    from lightning_moe.strategy.comm import all_gather_flat
    from lightning_moe.strategy.flat_shards import bucket_layout, owned_slice
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    records = []
    for shape in shapes:
        L, h, f = SHAPES[shape]
        dims = [(L, h, 2 * f), (L, f, h)]
        offsets, total = bucket_layout([L * a * b for _, a, b in dims], world)
        flat = torch.randn(total, device="cuda", dtype=torch.float32).mul_(0.02).to(torch.bfloat16)
        params = [torch.nn.Parameter(flat[o:o + d[0] * d[1] * d[2]].view(d), requires_grad=False)
                  for o, d in zip(offsets, dims)]
        lo, hi = owned_slice(total, world, rank)
        bf16 = _time(lambda: all_gather_flat(flat, flat[lo:hi], group).wait(), iters)
        for recipe, tile in [(r, t) for r in recipes for t in tiles]:
            tk.TR, tk.TC, tk.WARPS = tile
            fp8 = {i: g.FP8Weight(p, g.weight_blocks(tuple(p.shape), recipe, True)) for i, p in enumerate(params)}
            plan = g.plan_bucket(params, offsets, total, world, fp8, 2, group)
            amaxes = g.WeightAmaxes()

            def fp8_path():
                g.reduce_amaxes([plan], [flat], [rank])
                g.start(plan, flat, rank, world).wait()
                g.finish(plan, flat, amaxes)

            wire = torch.empty(world * plan.chunk, dtype=torch.uint8, device="cuda")
            mine = wire[rank * plan.chunk:(rank + 1) * plan.chunk]
            t_wire = _time(lambda: all_gather_flat(wire, mine, group).wait(), iters)
            t_fp8 = _time(fp8_path, iters)
            t_amax = _time(lambda: g.reduce_amaxes([plan], [flat], [rank]), iters)  # with its all-reduce
            g.start(plan, flat, rank, world).wait()
            gathered = plan.out

            def unpack():
                plan.out = gathered
                g.finish(plan, flat, amaxes)

            t_dequant = _time(unpack, iters)
            records.append({"shape": shape, "recipe": recipe, "gpus": world, "elements": total, "tile": tile,
                            "bf16_bytes_per_rank": (hi - lo) * 2, "fp8_bytes_per_rank": plan.chunk,
                            "bf16_ms": round(bf16, 3), "fp8_wire_ms": round(t_wire, 3), "fp8_ms": round(t_fp8, 3),
                            "fp8_amax_ms": round(t_amax, 3), "fp8_dequant_ms": round(t_dequant, 3),
                            "fp8_vs_bf16": round(bf16 / t_fp8, 3), "wire_vs_bf16": round(bf16 / t_wire, 3),
                            "device": torch.cuda.get_device_name(), "torch": torch.__version__})
    if rank == 0:
        text = json.dumps({"records": records}, indent=1)
        print(text)
        if out:
            with open(out, "w") as fh:
                fh.write(text)
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--shape", default="mixtral,qwen3", help=f"comma-separated: {', '.join(SHAPES)}")
    p.add_argument("--recipe", default="tensorwise,blockwise")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--tiles", default="32x128x4",
                   help="comma-separated ROWSxCOLSxWARPS of triton_block_quant's whole-row tiles, each measured")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    from tests.parallel.harness import free_port
    tiles = [tuple(int(v) for v in t.split("x")) for t in a.tiles.split(",")]
    mp.spawn(worker, args=(a.gpus, a.shape.split(","), a.recipe.split(","), a.iters, a.out, free_port(), tiles),
             nprocs=a.gpus)


if __name__ == "__main__":
    main()
