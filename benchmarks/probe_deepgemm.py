"""Probe (not wired into the library): DeepGEMM's FP8 m-grouped GEMM (1 x 128 activation and 128 x 128 weight scales:
the blockwise recipe) at our expert shapes, against torch's bf16 ``grouped_mm`` and rowwise ``_scaled_grouped_mm`` on
the same rows; and its k-grouped wgrad GEMM (``dW_g = x_g^T dy_g``, 1 x 128 scales along the tokens) against torch's
bf16 one. It decides whether DeepGEMM can carry the FP8 block targets of issue 19, where torch 2.11's FP8
grouped kernel reaches 1.2x bf16 at Qwen3's shape.

Needs DeepGEMM built in place (``benchmarks/prepare_deepgemm.sh`` here, ``benchmarks/build_deepgemm.sh`` there). Uses
DeepGEMM's own test generators for its operand layouts. Prints JSON; each measurement that fails says why.

    PYTHONPATH=.:.deepgemm/src python3 benchmarks/probe_deepgemm.py --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch
import torch.nn.functional as F

SHAPES = {  # name: (groups, rows per group, N, K) of y = x W^T
    "qwen3_fc1": (128, 1024, 1536, 2048),
    "qwen3_fc2": (128, 1024, 2048, 768),
    "mixtral_fc1": (8, 2048, 28672, 4096),
    "mixtral_fc2": (8, 2048, 4096, 14336),
}


def _events(fn, iters: int = 20) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def probe(name: str, groups: int, per: int, n: int, k: int) -> dict:
    import deep_gemm
    from deep_gemm.testing import bench_kineto, calc_diff
    from generators import MajorTypeAB, generate_m_grouped_contiguous
    out = {"shape": name, "groups": groups, "rows_per_group": per, "N": n, "K": k}
    km = MajorTypeAB.KMajor
    ue8m0 = torch.cuda.get_device_capability()[0] != 9  # Hopper takes fp32 scales, Blackwell packed UE8M0
    m, a, b, layout, d, ref = generate_m_grouped_contiguous(groups, per, n, k, km, km, use_ue8m0=ue8m0)
    flops = 2 * m * n * k
    out["M"] = m
    try:
        def run():
            deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, d, layout, disable_ue8m0_cast=not ue8m0)

        run()
        out["deepgemm_fp8_diff"] = float(calc_diff(d, ref))
        t = bench_kineto(run, "gemm_", suppress_kineto_output=True)
        out["deepgemm_fp8_tflops"] = flops / t / 1e12
    except Exception:  # noqa: BLE001 - report and go on
        out["deepgemm_fp8_error"] = traceback.format_exc()[-600:]
    # torch on the same rows: bf16 grouped_mm and the rowwise FP8 kernel, groups cut at the same ends
    ends = torch.nonzero(torch.diff(layout.long(), append=layout.new_full((1,), groups).long())).flatten() + 1
    offs = ends[layout[ends - 1] >= 0].to(torch.int32) if ends.numel() else ends.to(torch.int32)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(groups, k, n, device="cuda", dtype=torch.bfloat16)
    if offs.numel() == groups:
        out["torch_bf16_tflops"] = flops / _events(lambda: F.grouped_mm(x, w, offs=offs)) / 1e12
        try:
            xq, wq = x.to(torch.float8_e4m3fn), w.transpose(1, 2).contiguous().to(torch.float8_e4m3fn).transpose(1, 2)
            sx, sw = torch.ones(m, device="cuda"), torch.ones(groups, n, device="cuda")
            out["torch_fp8_rowwise_fast_tflops"] = flops / _events(lambda: torch._scaled_grouped_mm(
                xq, wq, sx, sw, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True)) / 1e12
        except Exception:  # noqa: BLE001
            out["torch_fp8_error"] = traceback.format_exc()[-600:]
    return out


def probe_wgrad(name: str, groups: int, per: int, n: int, k: int) -> dict:
    """dW_g (k x n) = x_g^T dy_g over each expert's ``per`` tokens: DeepGEMM's m x n output per group is our K x N."""
    import deep_gemm
    from deep_gemm.testing import bench_kineto, calc_diff
    from deep_gemm.utils import align, set_mk_alignment_for_contiguous_layout
    from generators import MajorTypeAB, generate_k_grouped_contiguous
    out = {"shape": name + "_wgrad", "groups": groups, "rows_per_group": per, "N": n, "K": k}
    set_mk_alignment_for_contiguous_layout(128)
    ks = [align(per, 128)] * groups
    major = MajorTypeAB.KMajor if torch.cuda.get_device_capability()[0] == 9 else MajorTypeAB.MNMajor
    kgemm = deep_gemm.k_grouped_fp8_gemm_nt_contiguous if major == MajorTypeAB.KMajor else \
        deep_gemm.k_grouped_fp8_gemm_tn_contiguous
    total, a, b, c, d, ref, layout, _ = generate_k_grouped_contiguous(
        groups, k, n, major, major, ks, use_ue8m0=major != MajorTypeAB.KMajor, gran_k=128)
    flops = 2 * total * n * k
    try:
        def run():
            kgemm(a, b, d, ks, layout, c, recipe=(1, 1, 128))

        run()  # accumulates into c (= d): the error is checked on a fresh accumulation
        out["deepgemm_fp8_tflops"] = flops / bench_kineto(run, "gemm_", suppress_kineto_output=True) / 1e12
        total, a, b, c, d, ref, layout, _ = generate_k_grouped_contiguous(
            groups, k, n, major, major, ks, use_ue8m0=major != MajorTypeAB.KMajor, gran_k=128)
        run()
        out["deepgemm_fp8_diff"] = float(calc_diff(d, ref))
    except Exception:  # noqa: BLE001
        out["deepgemm_fp8_error"] = traceback.format_exc()[-600:]
    x = torch.randn(total, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(total, n, device="cuda", dtype=torch.bfloat16)
    offs = torch.cumsum(torch.tensor(ks, device="cuda"), 0).to(torch.int32)
    out["torch_bf16_tflops"] = flops / _events(lambda: F.grouped_mm(x.t(), dy, offs=offs)) / 1e12
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    src = os.environ.get("DEEPGEMM_SRC", ".deepgemm/src")
    sys.path[:0] = [src, os.path.join(src, "tests")]
    records = []
    for name in a.shapes.split(","):
        for fn in (probe, probe_wgrad):
            try:
                records.append(fn(name, *SHAPES[name]))
            except Exception:  # noqa: BLE001
                records.append({"shape": name, "probe": fn.__name__, "error": traceback.format_exc()[-800:]})
            print(json.dumps(records[-1]), flush=True)
    text = json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "records": records},
                      indent=1)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
