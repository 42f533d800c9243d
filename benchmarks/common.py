"""Shared helpers for the GPU benchmarks: environment record, timing, peak memory and JSON output.

Timing follows the workplace method: warm up, then the median of many iterations timed with CUDA events (no host
sync inside the timed region), or ``triton.testing.do_bench(return_mode="median")`` when asked for. On CPU (the
``--smoke`` modes) a host clock is used instead.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Iterable, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as `python benchmarks/x.py` from a checkout that is not pip-installed
    sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

DENSE_BF16_PEAK_TFLOPS = 989.4  # H100/H200 SXM dense bf16 (DESIGN.md: never the 1,979 sparse figure)


# ------------------------------------------------------------------------------------------------ environment
def git_commit(root: str = REPO_ROOT) -> Optional[str]:
    """``LMOE_BENCH_COMMIT`` when set (for copies without ``.git``, e.g. a lent GPU machine); else HEAD's commit,
    read from ``.git`` directly, with ``git rev-parse HEAD`` as a fallback (skipped when ``LMOE_BENCH_NO_GIT=1``).
    None when nothing works."""
    if os.environ.get("LMOE_BENCH_COMMIT"):
        return os.environ["LMOE_BENCH_COMMIT"]
    git_dir = os.path.join(root, ".git")
    try:
        if os.path.isfile(git_dir):  # worktree / submodule: "gitdir: <path>"
            with open(git_dir) as f:
                git_dir = os.path.join(root, f.read().split(":", 1)[1].strip())
        with open(os.path.join(git_dir, "HEAD")) as f:
            head = f.read().strip()
        if not head.startswith("ref:"):
            return head
        ref = head.split(":", 1)[1].strip()
        ref_path = os.path.join(git_dir, ref)
        if os.path.isfile(ref_path):
            with open(ref_path) as f:
                return f.read().strip()
        packed = os.path.join(git_dir, "packed-refs")
        if os.path.isfile(packed):
            with open(packed) as f:
                for line in f:
                    parts = line.split()
                    if len(parts) == 2 and parts[1] == ref:
                        return parts[0]
    except (OSError, IndexError):
        pass
    if os.environ.get("LMOE_BENCH_NO_GIT") == "1":
        return None
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if out.returncode != 0:
            return None
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def env_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device_type": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "git_commit": git_commit(),
        "timestamp_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["device_memory_gib"] = round(props.total_memory / 2**30, 2)
        info["sm_count"] = props.multi_processor_count
    else:
        info["cpu_threads"] = torch.get_num_threads()
    for mod in ("triton", "lightning"):
        try:
            info[f"{mod}_version"] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - optional
            info[f"{mod}_version"] = None
    return info


def pick_device(smoke: bool) -> torch.device:
    if smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        sys.exit("error: this benchmark needs CUDA (use --smoke for the tiny CPU run)")
    return torch.device("cuda", torch.cuda.current_device())


# ------------------------------------------------------------------------------------------------ timing
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stamp(device: torch.device):
    """A point in the device's stream order: a recorded CUDA event, or a host clock reading on CPU."""
    if device.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def elapsed_ms(a, b) -> float:
    """Milliseconds from stamp ``a`` to stamp ``b`` (call ``sync`` first when they are CUDA events)."""
    if isinstance(a, float):
        return (b - a) * 1e3
    return a.elapsed_time(b)


def _clear_grads(tensors: Iterable[torch.Tensor]) -> None:
    for t in tensors:
        t.grad = None


def summarize_ms(times: list[float]) -> dict[str, float]:
    times = sorted(times)
    return {"median_ms": statistics.median(times), "mean_ms": statistics.fmean(times), "min_ms": times[0],
            "max_ms": times[-1], "n": len(times)}


def time_fn(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int,
            grad_to_none: Iterable[torch.Tensor] = (), timer: str = "events") -> dict[str, Any]:
    """Median time of ``fn`` over ``iters`` runs after ``warmup`` runs. Gradients of ``grad_to_none`` are cleared
    before every run, outside the timed region, so that backward writes fresh gradients instead of accumulating.

    ``timer``: ``events`` (a CUDA event pair per run, one sync at the end) or ``do_bench`` (triton's, median; it
    flushes L2 between runs and chooses its own number of runs from a time budget).
    """
    grad_to_none = list(grad_to_none)
    if timer == "do_bench" and device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError as e:
            raise ImportError("--timer do_bench needs triton; use --timer events") from e
        ms = do_bench(fn, warmup=max(25, warmup), rep=max(100, iters * 5), grad_to_none=grad_to_none or None,
                      return_mode="median")
        return {"median_ms": float(ms), "timer": "triton.do_bench(median)"}
    for _ in range(warmup):
        _clear_grads(grad_to_none)
        fn()
    sync(device)
    pairs = []
    for _ in range(iters):
        _clear_grads(grad_to_none)
        a = stamp(device)
        fn()
        b = stamp(device)
        pairs.append((a, b))
    sync(device)
    out = summarize_ms([elapsed_ms(a, b) for a, b in pairs])
    out["timer"] = "cuda_events" if device.type == "cuda" else "host_clock"
    return out


def copy_bandwidth_tb_s(device: torch.device, iters: int = 20) -> float:
    """The device's memory bandwidth as a device-to-device copy of 256 MiB sees it (read + write), TB/s: the limit of
    memory-bound kernels, measured in the same run as they are."""
    big = torch.empty(2**28, device=device, dtype=torch.uint8)
    ms = time_fn(lambda: big.clone(), device, iters, 3)["median_ms"]
    return 2 * big.numel() / ms / 1e9


def peak_memory(fn: Callable[[], Any], device: torch.device,
                grad_to_none: Iterable[torch.Tensor] = ()) -> dict[str, Optional[float]]:
    """Peak allocated memory of one call of ``fn`` (GiB), absolute and above what was allocated before it."""
    if device.type != "cuda":
        return {"peak_mem_gib": None, "peak_mem_delta_gib": None}
    _clear_grads(grad_to_none)
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device)
    return {"peak_mem_gib": peak / 2**30, "peak_mem_delta_gib": (peak - base) / 2**30}


def tflops(flops: float, ms: Optional[float]) -> Optional[float]:
    return flops / (ms * 1e-3) / 1e12 if ms else None


# ------------------------------------------------------------------------------------------------ output
def _clean(obj: Any) -> Any:
    """JSON-safe: non-finite floats become None, tensors and dtypes become numbers and strings."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return _clean(obj.tolist())
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    return obj


def emit(result: dict[str, Any], out: Optional[str]) -> None:
    """Print the result as one JSON object on stdout (nothing else goes there) and write it to ``out``."""
    text = json.dumps(_clean(result), indent=2, allow_nan=False)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(text + "\n")
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


@contextlib.contextmanager
def stdout_to_stderr():
    """Keep stdout for the JSON alone: anything a library prints goes to stderr meanwhile."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ time breakdown
KERNEL_KINDS = (  # first match wins; lower-case substrings of kernel names
    ("nccl", ("nccl",)),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "grouped_mm")),
    ("attention", ("flash", "fmha", "attention")),
    ("memcpy", ("memcpy", "memset")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"  # elementwise, norms, softmax, Triton permutes, reductions


def _union_us(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def kernel_breakdown(kernels: Iterable[tuple[str, float, float]]) -> dict[str, Any]:
    """Where one rank's GPU time went, from its kernels ``(name, start_us, end_us)`` over a profiled window.

    ``busy``: time any kernel ran; ``compute``: time a non-NCCL kernel ran; ``comm_exposed``: time only NCCL kernels ran
    (communication not hidden behind compute; NCCL kernels also run while they wait for a peer, so this includes
    waiting for slower ranks and pipeline stages); ``idle``: no kernel at all (host launch gaps, syncs). Fractions are
    of the window from the first kernel's start to the last one's end; ``sendrecv_frac``: time NCCL send/recv kernels ran
    (all-to-all, p2p), overlapped or not. ``kernel_ms`` sums durations per kind (kernels
    on different streams overlap, so these can add up to more than the window)."""
    kernels = list(kernels)
    if not kernels:
        return {}
    t0, t1 = min(k[1] for k in kernels), max(k[2] for k in kernels)
    window = max(t1 - t0, 1e-9)
    busy = _union_us([(a, b) for _, a, b in kernels])
    compute = _union_us([(a, b) for n, a, b in kernels if kernel_kind(n) != "nccl"])
    per_kind: dict[str, float] = {}
    for n, a, b in kernels:
        per_kind[kernel_kind(n)] = per_kind.get(kernel_kind(n), 0.0) + (b - a) / 1e3
    sendrecv = [(a, b) for n, a, b in kernels if kernel_kind(n) == "nccl" and "sendrecv" in n.lower()]
    return {"window_ms": window / 1e3, "compute_frac": compute / window, "comm_exposed_frac": (busy - compute) / window,
            "idle_frac": 1 - busy / window, "kernel_ms": {k: round(v, 3) for k, v in sorted(per_kind.items())},
            # NCCL send/recv kernels: the expert all-to-all (and, under PP, the stage exchanges)
            "sendrecv_frac": _union_us(sendrecv) / window}


def profiler_kernels(prof) -> list[tuple[str, float, float]]:
    """``(name, start_us, end_us)`` of every device kernel/memcpy a ``torch.profiler.profile`` recorded. Annotations
    mirrored on the GPU timeline (``Optimizer.step#AdamW.step``, record_function ranges) span idle time and are left
    out."""
    out = []
    for e in prof.events():
        annotation = getattr(e, "is_user_annotation", False) or "annotation" in str(getattr(e, "activity_type", ""))
        if e.device_type == torch.autograd.DeviceType.CUDA and not annotation and "#" not in e.name:
            out.append((e.name, float(e.time_range.start), float(e.time_range.end)))
    return out
