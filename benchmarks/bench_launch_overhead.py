"""The host's microseconds per call of each kernel that an FP8 step launches, at shapes so small that the GPU waits for
the host: what a GEMM's Python and launch path costs, whatever the GEMM's size. One GPU.

  torch           ``torch.mm``, ``F.grouped_mm`` (the bf16 step's GEMMs)
  triton          ``triton_grouped_wgrad.wgrad_into``, ``triton_fp8_quant.rowwise_quant``, ``triton_expert_rows``
  fp8 GEMMs       ``triton_fp8_grouped_mm.grouped_mm`` (fast), ``gluon_fp8_grouped_ws.grouped_mm``, ``torch._scaled_mm``
  whole calls     ``fp8_grouped_mm`` and ``fp8_linear``, forward alone and forward + backward (``profile_fp8_host.py``
                  times them with the main grads)

Each case is timed through ``triton_launch.launch`` (the compiled kernels' launchers) and through triton's
``kernel[grid]`` (``triton_launch.ENABLED = False``, what ``LMOE_TRITON_LAUNCH=0`` sets), alternating in one process,
so that the host's drift falls on both. Prints JSON: for each, the median over ``--repeats`` of the mean host µs per
call over ``--calls`` calls (the GPU synchronized before and after each batch).

    python benchmarks/bench_launch_overhead.py --calls 400
"""

from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
import torch.nn.functional as F
from common import emit, env_info, log


def host_us(fn, calls: int, repeats: int) -> dict:
    """{"launch": µs, "kernel[grid]": µs}, alternating between the two."""
    from lightning_moe.modules import triton_launch
    out = {True: [], False: []}
    try:
        for r in range(repeats):
            for enabled in (True, False) if r % 2 == 0 else (False, True):
                triton_launch.ENABLED = enabled
                for _ in range(10):
                    fn()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                out[enabled].append((time.perf_counter() - t0) / calls * 1e6)  # the host's issue time
                torch.cuda.synchronize()
    finally:
        triton_launch.ENABLED = True
    return {"launch": round(statistics.median(out[True]), 1), "kernel[grid]": round(statistics.median(out[False]), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from lightning_moe.modules import gluon_fp8_grouped_ws as ws
    from lightning_moe.modules import triton_expert_rows, triton_fp8_grouped_mm, triton_fp8_quant
    from lightning_moe.modules.fp8_grouped import fp8_grouped_mm
    from lightning_moe.modules.fp8_linear import FP8Spec, fp8_linear
    from lightning_moe.modules.triton_grouped_wgrad import wgrad_into
    dev = torch.device("cuda")
    L, K, N, M = 8, 256, 256, 1024
    bf = dict(device=dev, dtype=torch.bfloat16)
    x, dy, w = torch.randn(M, K, **bf), torch.randn(M, N, **bf), torch.randn(L, K, N, **bf) * 0.05
    offs = torch.full((L,), M // L, device=dev).cumsum(0).to(torch.int32)
    main_LKN = torch.zeros(L, K, N, device=dev)
    xq, xs = triton_fp8_quant.rowwise_quant(x, inverse=True)
    wq = w.transpose(1, 2).contiguous().to(torch.float8_e4m3fn)  # (L, N, K)
    ws_LN = torch.ones(L, N, device=dev)
    a2, b2 = xq, wq[0].contiguous()  # (M, K), (N, K)
    one = torch.ones(1, device=dev)
    spec = FP8Spec("rowwise", step=0, fp8_wgrad=False, fast_accum="all")
    wp = torch.nn.Parameter(w.clone())
    wd = torch.nn.Parameter(w[0].t().contiguous())
    cases = {
        "torch.mm": lambda: torch.mm(x, w[0]),
        "F.grouped_mm": lambda: F.grouped_mm(x, w, offs=offs),
        "triton wgrad_into": lambda: wgrad_into(main_LKN, x, dy, offs, False),
        "triton rowwise_quant": lambda: triton_fp8_quant.rowwise_quant(x, inverse=True),
        "triton rows_layout": lambda: triton_expert_rows.rows_layout(offs, M, 128),
        "triton fp8 grouped_mm (fast)": lambda: triton_fp8_grouped_mm.grouped_mm(xq, wq, xs.reshape(M), ws_LN, offs,
                                                                                 True),
        "gluon ws grouped_mm": lambda: ws.grouped_mm(xq, wq, xs.reshape(M), ws_LN, offs),
        "torch._scaled_mm": lambda: torch._scaled_mm(a2, b2.t(), one, one, out_dtype=torch.bfloat16),
        "fp8_grouped_mm forward (no grad)": lambda: _no_grad(fp8_grouped_mm, x, wp, offs, spec),
        "fp8_linear forward (no grad)": lambda: _no_grad(fp8_linear, x, wd, spec),
        "fp8_grouped_mm forward + backward": lambda: fp8_grouped_mm(x.detach().requires_grad_(), wp, offs,
                                                                    spec).backward(dy),
        "fp8_linear forward + backward": lambda: fp8_linear(x.detach().requires_grad_(), wd, spec).backward(dy),
    }
    rec = {"shapes": {"L": L, "K": K, "N": N, "M": M}, "host_us_per_call": {}}
    for name, fn in cases.items():
        try:
            rec["host_us_per_call"][name] = host_us(fn, args.calls, args.repeats)
        except Exception as e:  # noqa: BLE001 - a kernel this tree lacks: recorded, the others still run
            rec["host_us_per_call"][name] = f"error: {type(e).__name__}: {e}"[:200]
        log(f"{name}: {rec['host_us_per_call'][name]}")
    emit({"benchmark": "launch_overhead", "env": env_info(dev), "records": [rec]}, args.out)


def _no_grad(fn, *args):
    with torch.no_grad():
        return fn(*args)


if __name__ == "__main__":
    main()
