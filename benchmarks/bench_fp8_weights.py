"""The rowwise recipe's two E4M3 copies of the experts' weights (forward, transposed, per-column scales; dgrad,
per-row scales), once per optimizer step: the torch code of ``fp8_grouped_kernels`` (two amax reductions, two
saturating casts compiled by inductor) against ``triton_fp8_weights.quantize_both`` (two passes), with a ``copy_`` of
the weight as the bandwidth reference, at the presets' expert weights (fc1 [gate | up] and fc2). One GPU; JSON.

    python benchmarks/bench_fp8_weights.py --shapes mixtral,qwen3,olmoe,deepseek-v3-ep8
"""

from __future__ import annotations

import common  # noqa: F401  (puts the repo root on sys.path)
import torch
from bench_fp8_wgrad import SHAPES, parse_args
from common import emit, env_info, log, time_fn


def main() -> None:
    args = parse_args(__doc__)
    from lightning_moe.modules import fp8_grouped_kernels as k
    from lightning_moe.modules import triton_fp8_weights as tw
    from lightning_moe.modules.fp8 import abs_amax, scale_of
    from lightning_moe.modules.fp8_grouped import _cast
    dev = torch.device("cuda")
    records = []
    for name in args.shapes.split(","):
        E, _, D, Fh = SHAPES[name]
        for gemm, K, N in (("fc1", D, 2 * Fh), ("fc2", Fh, D)):
            w = (torch.randn(E, K, N, device=dev) * 0.02).bfloat16()
            out = torch.empty_like(w)

            def torch_copies():
                ws = scale_of(abs_amax(w, 1), "e4m3")
                k.saturate_t(w, ws, 448.0, torch.float8_e4m3fn)
                _cast(w, abs_amax(w, 2), "e4m3")

            ms = {n: time_fn(f, dev, args.iters, 2)["median_ms"] for n, f in (
                ("copy", lambda: out.copy_(w)), ("torch", torch_copies), ("triton", lambda: tw.quantize_both(w)))}
            for c in ((64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 8)):
                ms["triton_" + "x".join(map(str, c))] = time_fn(lambda c=c: tw.quantize_both(w, "e4m3", c), dev,
                                                                args.iters, 2)["median_ms"]
            rec = {"shape": name, "gemm": gemm, "weight": [E, K, N], "ms": ms,
                   # bytes moved as a fraction of the copy's rate: torch about 10 per element, the kernels 6
                   "of_copy": {"torch": 10 / 4 * ms["copy"] / ms["torch"], "triton": 6 / 4 * ms["copy"] / ms["triton"]}}
            log(f"{name} {gemm}: {rec}")
            records.append(rec)
            torch.cuda.empty_cache()
    emit({"benchmark": "fp8_weights", "env": env_info(dev), "records": records}, args.out)


if __name__ == "__main__":
    main()
