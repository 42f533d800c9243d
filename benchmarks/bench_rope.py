"""RoPE of q and k, after the per-head RMSNorm where the model has one (Qwen3), forward + backward: the Triton kernel
(``ModelConfig.rope_fusion``, ``triton_rope.py``) against the torch ops (``attention.rotate(..., fused=False)``); for
MLA (deepseek) the rope heads' split, rotation and cat (``mla.rope_heads``, ``triton_mla_rope.py``).

The limit is the bytes the fused passes must move (forward: read x, write out; backward: read the gradient and, with
the norm, x; write dx) at the bandwidth of a device-to-device copy measured in the same run. Prints JSON.

    python benchmarks/bench_rope.py --shapes qwen3,mixtral
"""

from __future__ import annotations

import argparse

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
from common import copy_bandwidth_tb_s, emit, env_info, log, time_fn
from torch import nn

# name: (B, S, query heads, kv heads, head dim, q/k norms) of the model benchmarks' micro-batches
SHAPES = {"qwen3": (2, 4096, 32, 4, 128, True), "mixtral": (1, 4096, 32, 8, 128, False)}
# MLA (B, S, heads, nope, rope, value dim): q's and k's rope heads (mla.rope_heads, triton_mla_rope.py)
MLA_SHAPES = {"deepseek": (1, 4096, 128, 128, 64, 128)}


def mla_record(name: str, dev: torch.device, iters: int, copy_bw: float) -> dict:
    from lightning_moe.modules.attention import RotaryCache
    from lightning_moe.modules.mla import rope_heads
    B, S, H, N, R, V = MLA_SHAPES[name]
    dt, C = torch.bfloat16, 512
    cos, sin = RotaryCache(R, 1e4, S)(torch.arange(S, device=dev), S)
    q = torch.randn(B, S, H * (N + R), device=dev, dtype=dt, requires_grad=True)
    up = torch.randn(B, S, H * (N + V), device=dev, dtype=dt, requires_grad=True)
    down = torch.randn(B, S, C + R, device=dev, dtype=dt, requires_grad=True)
    go = torch.randn(B, S, H, N + R, device=dev, dtype=dt)
    gv = torch.randn(B, S, H, V, device=dev, dtype=dt)

    def step(fused):
        k_nope, v = up.view(B, S, H, N + V).split([N, V], dim=-1)
        q_out, k_out = rope_heads(q.view(B, S, H, N + R), k_nope, down.split([C, R], dim=-1)[1], cos, sin, fused)
        torch.autograd.backward([q_out, k_out, v], [go, go, gv])

    t = {f: time_fn(lambda f=f: step(f), dev, iters, 3, grad_to_none=[q, up, down])["median_ms"] for f in (False, True)}
    rows = B * S * H
    # q: read and write the head vectors each way; k: read the nope part, write the keys forward, read the rope part
    # backward; the input gradient of the up-projection (nope next to v) is autograd's own cat in both paths
    moved = 2 * rows * (4 * (N + R) + N + (N + R) + R)
    limit_ms = moved / copy_bw / 1e9
    log(f"{name} (MLA): torch {t[False]:.3f} ms -> fused {t[True]:.3f} ms (x{t[False] / t[True]:.2f}); limit "
        f"{limit_ms:.3f} ms")
    return {"shape": name, "mla": True, "B": B, "S": S, "heads": H, "nope": N, "rope": R, "torch_ms": t[False],
            "fused_ms": t[True], "speedup": t[False] / t[True], "limit_ms": limit_ms,
            "fused_over_limit": t[True] / limit_ms, "copy_tb_s": copy_bw}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3,mixtral,deepseek")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from lightning_moe.modules.attention import RotaryCache, rotate
    dev, dt = torch.device("cuda"), torch.bfloat16
    copy_bw = copy_bandwidth_tb_s(dev, args.iters)
    records = []
    for name in args.shapes.split(","):
        if name in MLA_SHAPES:
            records.append(mla_record(name, dev, args.iters, copy_bw))
            continue
        B, S, H, G, Dh, has_norm = SHAPES[name]
        cos, sin = RotaryCache(Dh, 1e6, S)(torch.arange(S, device=dev), S)
        xs = [torch.randn(B, S, n, Dh, device=dev, dtype=dt, requires_grad=True) for n in (H, G)]
        gs = [torch.randn_like(x) for x in xs]
        norms = [nn.RMSNorm(Dh, eps=1e-6, device=dev, dtype=dt) if has_norm else None for _ in xs]

        def step(fused):
            for x, g, norm in zip(xs, gs, norms):
                rotate(x, cos, sin, norm, fused).backward(g)

        grads = xs + [n.weight for n in norms if n is not None]
        t = {f: time_fn(lambda f=f: step(f), dev, args.iters, 3, grad_to_none=grads)["median_ms"]
             for f in (False, True)}
        elems = sum(x.numel() for x in xs)
        moved = elems * 2 * (2 + (3 if has_norm else 2))  # bf16: forward 2 passes, backward 3 (2 without the norm)
        limit_ms = moved / copy_bw / 1e9
        rec = {"shape": name, "B": B, "S": S, "heads": H, "kv_heads": G, "head_dim": Dh, "qk_norm": has_norm,
               "torch_ms": t[False], "fused_ms": t[True], "speedup": t[False] / t[True], "limit_ms": limit_ms,
               "fused_over_limit": t[True] / limit_ms, "copy_tb_s": copy_bw}
        for fused in (False, True):  # where the time goes: the device time per kernel and step, microseconds
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    step(fused)
                torch.cuda.synchronize()
            kernels = {e.key[:60]: round(getattr(e, "device_time_total", 0) / 5, 1) for e in prof.key_averages()
                       if getattr(e, "device_time_total", 0) > 0}
            rec["kernels_us_fused" if fused else "kernels_us_torch"] = dict(
                sorted(kernels.items(), key=lambda kv: -kv[1])[:10])
        log(f"{name}: torch {t[False]:.3f} ms -> fused {t[True]:.3f} ms (x{rec['speedup']:.2f}); copy-bandwidth "
            f"limit {limit_ms:.3f} ms ({copy_bw:.2f} TB/s)")
        records.append(rec)
    emit({"benchmark": "bench_rope", "env": env_info(dev), "records": records}, args.out)


if __name__ == "__main__":
    main()
