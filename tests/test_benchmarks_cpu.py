"""CPU smoke test of the GPU benchmark scripts: each runs in its --smoke mode (tiny shapes, float32, CPU) as a
subprocess from the repository root and must print one JSON object with positive, finite numbers."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, *args: str, out=None) -> dict:
    cmd = [sys.executable, os.path.join("benchmarks", script), "--smoke", *args]
    if out is not None:
        cmd += ["--out", str(out)]
    env = dict(os.environ, LMOE_BENCH_NO_GIT="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)  # stdout holds the JSON object and nothing else


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _check_env(res: dict) -> None:
    env = res["env"]
    for key in ("device_name", "torch_version", "git_commit", "timestamp_utc"):
        assert key in env
    assert env["device_type"] == "cpu" and res["smoke"] is True


@pytest.fixture(scope="module")
def layer_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "layer.json"
    res = _run("bench_layer.py", "--with-loop", "--precision", "bf16,fp8-rowwise", out=out)
    with open(out) as f:
        assert json.load(f) == res
    return res


@pytest.fixture(scope="module")
def model_result():
    return _run("bench_model.py")


def test_bench_layer_smoke(layer_result):
    res = layer_result
    assert res["benchmark"] == "moe_layer"
    _check_env(res)
    recs = res["records"]
    assert [r["shape"] for r in recs] == ["mixtral", "qwen3", "olmoe", "deepseek-v3-ep8"]
    for r in recs:
        assert "error" not in r, r
        assert r["finite"] is True and r["routing"] == "balanced"
        assert r["rows"] == r["T"] * r["k"]
        assert r["imbalance_max_over_mean"] == pytest.approx(1.0)
        assert r["expert_gemm_flops"] == pytest.approx(18 * r["rows"] * r["h"] * r["f"])
        for block in ("layer", "bare"):
            for key in ("median_ms", "min_ms", "max_ms", "tflops"):
                assert _positive(r[block][key]), (r["shape"], block, key, r[block][key])
        assert r["ratio_layer_over_bare"] == pytest.approx(r["bare"]["median_ms"] / r["layer"]["median_ms"])
        assert r["split_ok"] is True
        assert set(r["split_ms"]) == {"router", "dispatch", "experts", "combine", "other"}
        assert all(math.isfinite(v) and v >= 0 for v in r["split_ms"].values())
        assert sum(r["split_fraction"].values()) == pytest.approx(1.0)
        assert ("loop" in r) == (r["shape"] == "qwen3")
        fp8 = r["fp8"]["fp8-rowwise"]
        assert fp8["layer_speedup"] == pytest.approx(r["layer"]["median_ms"] / fp8["layer"]["median_ms"])
        assert fp8["bare_speedup"] == pytest.approx(r["bare"]["median_ms"] / fp8["bare"]["median_ms"])
    loop = recs[1]["loop"]
    assert _positive(loop["median_ms"]) and _positive(loop["tflops"])
    assert loop["grouped_vs_loop_rel_err"] < 1e-4


def test_bench_model_smoke(model_result):
    res = model_result
    assert res["benchmark"] == "moe_model_training"
    _check_env(res)
    (r,) = res["records"]
    assert "error" not in r, r
    assert r["preset"] == "tiny" and r["precision"] == "32-true"
    assert r["steps_run"] == r["steps"] == 3 and r["measured_steps"] == r["steps"] - r["warmup_steps"]
    for key in ("step_time_s", "step_time_median_s", "tokens_per_sec", "flops_per_token", "tflops_per_gpu", "mfu",
                "params", "active_params"):
        assert _positive(r[key]), (key, r[key])
    assert r["tokens_per_step"] == r["micro_batch_size"] * r["seq_length"]
    assert r["tokens_per_sec"] == pytest.approx(r["tokens_per_step"] / r["step_time_s"])
    assert r["mfu"] == pytest.approx(r["tflops_per_gpu"] / 989.4)
    assert r["losses_finite"] is True
    check = r["flops_per_token_check"]
    if check["package"] is not None:  # the local Megatron formula agrees with lightning_moe.flops
        assert check["local_formula"] == pytest.approx(check["package"])


def test_bench_model_optimizer_options_smoke():
    """The distributed optimizer with half the state offloaded and bf16 first moments (and FP8 GEMMs and token
    dispatch): the run reports the optimizer's share of the step and the predicted bytes per parameter (one process,
    fp32 weights: 4 weight + 4 grad + half of the 2 + 4 bytes of moments on the device; the other half, the weight
    copy and the gradient copy of that half on the host)."""
    res = _run("bench_model.py", "--distributed-optimizer", "--offload", "0.5", "--exp-avg-dtype", "bf16",
               "--fp8", "rowwise", "--fp8-dispatch")
    (r,) = res["records"]
    assert "error" not in r, r
    assert r["fp8"] == "rowwise" and r["fp8_dispatch"] is True
    assert "distributed_optimizer=True" in r["strategy"] and "optimizer_cpu_offload=0.5" in r["strategy"]
    assert _positive(r["optimizer_step_ms_median"]) and r["losses_finite"] is True
    assert r["device_bytes_per_param"] == pytest.approx(4 + 4 + 6 / 2)
    assert r["host_bytes_per_param"] == pytest.approx((4 + 6 + 4) / 2)


def test_bench_model_dynamic_cp_smoke():
    """``--dynamic-cp`` over CP2 on 2 gloo ranks with packed documents: every micro-batch's CP size is recorded."""
    res = _run("bench_model.py", "--devices", "2", "--cp", "2", "--batch", "2", "--pack-documents",
               "--doc-median", "16", "--dynamic-cp", "--steps", "3", "--warmup-steps", "1")
    (r,) = res["records"]
    assert "error" not in r, r
    assert r["pack_documents"] is True and "context_parallel_size=2" in r["strategy"]
    choices = r["dynamic_cp_choices"]
    assert set(choices) <= {"1", "2"} and sum(choices.values()) == 3, choices  # 3 steps of one micro-batch
    assert _positive(r["tokens_per_sec"]) and r["losses_finite"] is True
    sizes = r["dynamic_cp_sizes_per_step"]
    assert len(sizes) == 3 and all(len(s) == 1 and s[0] in (1, 2) for s in sizes), sizes
    assert len(r["step_times_s"]) == 2
    assert r["warm_steps"] == sum(set(sizes[i]) <= {c for s in sizes[:i] for c in s} for i in (1, 2)), r


def test_warm_step_times_drop_each_cp_sizes_first_step(monkeypatch):
    """A step whose micro-batches include a CP size not seen in an earlier step (it compiles new shapes) is left out
    of the steady-state median; the warm-up steps count as earlier."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    from bench_model import warm_step_times
    sizes = [[4], [4], [4], [1], [2], [4], [1, 2], [2, 4]]
    times = [0.6, 25.0, 20.0, 0.7, 0.65, 0.8]  # steps 2..7 after 2 warm-up steps
    assert warm_step_times(times, sizes, 2) == [0.6, 0.7, 0.65, 0.8]
    assert warm_step_times(times[1:], sizes, 3) == [0.7, 0.65, 0.8]


def test_kernel_breakdown_splits_compute_comm_idle(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    from common import kernel_breakdown, kernel_kind
    assert kernel_kind("ncclDevKernel_AllReduce_Sum_bf16") == "nccl"
    assert kernel_kind("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT") == "gemm"
    assert kernel_kind("flash_fwd_kernel") == "attention"
    assert kernel_kind("triton_poi_fused_add_0") == "other"
    # window 0..100 us: a GEMM 0-40, an all-reduce 30-60 (10 us hidden, 20 exposed), idle 60-70, an add 70-100
    b = kernel_breakdown([("sm90_xmma_gemm", 0, 40), ("ncclDevKernel_AllReduce", 30, 60), ("add_kernel", 70, 100)])
    assert b["window_ms"] == pytest.approx(0.1)
    assert b["compute_frac"] == pytest.approx(0.7)
    assert b["comm_exposed_frac"] == pytest.approx(0.2)
    assert b["idle_frac"] == pytest.approx(0.1)
    assert b["kernel_ms"] == {"gemm": 0.04, "nccl": 0.03, "other": 0.03}
    assert b["sendrecv_frac"] == 0.0
    assert kernel_breakdown([("gemm", 0, 10), ("ncclDevKernel_SendRecv", 5, 15)])["sendrecv_frac"] == pytest.approx(2 / 3)
    assert kernel_breakdown([]) == {}


def test_idle_gaps_charge_the_next_launch(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    from gaps import blocking_calls, idle_gaps
    # kernels (start, end, launch): 0-40 a, 30-50 b (overlaps: no gap), 80-90 c (30 us gap), 92-100 a (2 us: jitter),
    # 150-160 c (50 us gap)
    k = [(0, 40, 1), (30, 50, 2), (80, 90, 3), (92, 100, 1), (150, 160, 3)]
    g = idle_gaps(k, {1: "router", 2: "experts", 3: "dispatch.cpu()"}, min_gap_us=5)
    assert g["window_ms"] == pytest.approx(0.16)
    assert g["idle_ms"] == pytest.approx(0.082)
    assert g["idle_in_short_gaps_ms"] == pytest.approx(0.002)
    assert g["by_next_launch"] == [{"where": "dispatch.cpu()", "idle_ms": 0.08, "gaps": 2}]
    assert idle_gaps([], {}) == {}
    calls = [("cudaLaunchKernel", 5, "x"), ("cudaStreamSynchronize", 300, "a2a"), ("cudaStreamSynchronize", 100, "a2a"),
             ("cudaFree", 900, "alloc")]
    assert blocking_calls(calls) == [{"call": "cudaFree", "where": "alloc", "ms": 0.9, "count": 1},
                                     {"call": "cudaStreamSynchronize", "where": "a2a", "ms": 0.4, "count": 2}]


def test_trace_gaps_name_the_launching_code(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    from gaps import trace_gaps

    def X(cat, name, ts, dur, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}
    events = [  # backward thread 2 launches kernel 6 (0-50); the forward's kernel 7 starts at 100: a 50 us gap
        X("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 0, 10, tid=2),
        X("cpu_op", "aten::mm", 1, 8, tid=2), X("cuda_runtime", "cudaLaunchKernel", 2, 1, tid=2, correlation=6),
        X("python_function", "/x/site-packages/lightning_moe/modules/experts.py(80): forward", 0, 99),
        X("python_function", "torch/nn/functional.py(10): silu", 59, 30),
        X("cpu_op", "aten::mm", 60, 40), X("cuda_runtime", "cudaStreamSynchronize", 61, 35),
        X("cuda_runtime", "cudaLaunchKernel", 96, 1, correlation=7),
        X("kernel", "gemm", 0, 50, tid=9, correlation=6), X("kernel", "gemm", 100, 10, tid=9, correlation=7)]
    g = trace_gaps(events)
    assert g["idle_ms"] == pytest.approx(0.05)
    assert g["by_next_launch"] == [{"where": "lightning_moe/modules/experts.py(80): forward [aten::mm]",
                                    "idle_ms": 0.05, "gaps": 1}]
    assert g["blocking_calls"] == [{"call": "cudaStreamSynchronize", "ms": 0.035, "count": 1,
                                    "where": "lightning_moe/modules/experts.py(80): forward [aten::mm]"}]
    # without a frame of ours: outermost op > innermost op
    events[3]["name"] = "torch/autograd/__init__.py(1): backward"
    assert trace_gaps(events)["by_next_launch"][0]["where"] == "aten::mm"


def test_fp8_convergence_smoke():
    """The convergence comparison runs each precision on the same data and reports its final loss against bf16."""
    res = _run("fp8_convergence.py", "--runs", "bf16,fp8-rowwise")
    runs = res["runs"]
    assert list(runs) == ["bf16", "fp8-rowwise"] and runs["bf16"]["vs_bf16"] == 0
    for r in runs.values():
        assert len(r["losses"]) == 4 and all(_positive(v) for v in r["losses"])
        assert r["vs_bf16"] == pytest.approx(r["final_loss"] / runs["bf16"]["final_loss"] - 1)
    assert runs["fp8-rowwise"]["losses"] != runs["bf16"]["losses"]  # FP8 changed the numbers


def test_bench_router_smoke():
    res = _run("bench_router.py", "--iters", "2", "--warmup", "1")
    assert res["benchmark"] == "bench_router"
    _check_env(res)
    assert list(res["results"]) == ["qwen3", "olmoe", "mixtral", "deepseek-v3"]
    for row in res["results"].values():
        for bench in ("router", "permute", "permute_fp8", "resort"):
            assert _positive(row[bench]["fused_ms"]) and _positive(row[bench]["unfused_ms"])
            assert _positive(row[bench]["ratio"])


def test_cp_block_efficiency_counts(monkeypatch):
    """``cp_block_efficiency.py``: one causal document of two blocks has one full and two partial (diagonal) blocks;
    over the ranks of packed CP the allowed pairs add up to one process's, whatever the chunks."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import numpy as np
    import torch
    from cp_block_efficiency import block_counts, packed_row, rank_counts
    doc = torch.zeros(256, dtype=torch.long)
    pos = torch.arange(256)
    c = block_counts(doc, pos, doc, pos)
    assert (c["full_blocks"], c["partial_blocks"], c["allowed_pairs"]) == (1, 2, 256 * 257 // 2)
    row = packed_row(np.random.default_rng(0), 2048, 200.0, 8)
    assert row.numel() == 2048 and (torch.unique_consecutive(row, return_counts=True)[1] % 8 == 0).all()
    one = rank_counts(row, 1, 0)["allowed_pairs"]
    assert sum(rank_counts(row, 4, r)["allowed_pairs"] for r in range(4)) == one
