"""One optimizer step over a model's parameters (fp32 main params of bf16 weights): torch's fused AdamW followed by the
bf16 write-back (``_foreach_copy_``), against ``MoEFoldStrategy(fused_optimizer_writeback)``'s one Triton pass
(``strategy/fused_adam.py``).

The limit is the bytes each must move at the bandwidth of a device-to-device copy measured in the same run: 30 bytes
per parameter for the fused pass (read and write the fp32 weight and both moments, read the fp32 gradient, write the
bf16 weight), 34 for torch's two passes. Prints JSON.

    python benchmarks/bench_optimizer.py --shapes qwen3,mixtral
"""

from __future__ import annotations

import argparse
import gc

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
from common import copy_bandwidth_tb_s, emit, env_info, log, time_fn

# name: the parameter shapes of one layer of the model benchmarks (experts stacked), and the layers. The embedding
# and head are left out: the same bytes per parameter.
SHAPES = {
    "qwen3": ([(128, 1536, 2048), (128, 2048, 768), (4096, 2048), (512, 2048), (512, 2048), (2048, 4096),
               (128, 2048), (2048,), (2048,), (128,), (128,)], 4),
    "mixtral": ([(8, 28672, 4096), (8, 4096, 14336), (4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096),
                 (8, 4096), (4096,), (4096,)], 2),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3,mixtral")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from lightning_moe.strategy.fused_adam import FusedAdamStep
    dev = torch.device("cuda")
    copy_bw = copy_bandwidth_tb_s(dev, 20)
    records = []
    for name in args.shapes.split(","):
        shapes, layers = SHAPES[name]
        lows = [torch.randn(s, device=dev).mul_(0.02).bfloat16() for _ in range(layers) for s in shapes]
        mains = [w.float() for w in lows]
        for m in mains:
            m.grad = torch.randn_like(m).mul_(1e-3)
        n = sum(m.numel() for m in mains)
        t = {}
        for fused in (False, True):
            opt = torch.optim.AdamW(mains, lr=1e-4, weight_decay=0.1, fused=True)
            if fused:
                FusedAdamStep(opt, {id(m): w for m, w in zip(mains, lows)})
                step = opt.step
            else:
                def step(opt=opt, lows=lows, mains=mains):
                    opt.step()
                    torch._foreach_copy_(lows, mains)
            t[fused] = time_fn(step, dev, args.iters, 2)["median_ms"]
            del opt, step  # the moments: the next run makes its own
            gc.collect()
            torch.cuda.empty_cache()
        limit = {f: n * (30 if f else 34) / copy_bw / 1e9 for f in (False, True)}
        rec = {"shape": name, "params": n, "torch_ms": t[False], "fused_ms": t[True], "speedup": t[False] / t[True],
               "fused_limit_ms": limit[True], "fused_over_limit": t[True] / limit[True],
               "torch_over_its_limit": t[False] / limit[False], "copy_tb_s": copy_bw}
        log(f"{name}: {n / 1e9:.2f} B params, torch AdamW + copy {t[False]:.2f} ms -> fused {t[True]:.2f} ms "
            f"(x{rec['speedup']:.3f}); limit {limit[True]:.2f} ms at {copy_bw:.2f} TB/s")
        records.append(rec)
        del lows, mains
        gc.collect()
        torch.cuda.empty_cache()
    emit({"benchmark": "bench_optimizer", "env": env_info(dev), "records": records}, args.out)


if __name__ == "__main__":
    main()
