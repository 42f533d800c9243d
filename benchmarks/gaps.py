"""Who keeps the GPU idle: each idle gap of a profiled window charged to the code that launched the kernel after it.

A gap in the device timeline ends when the host launches the next kernel. If the host was blocked (a sync, an
allocator ``cudaFree``) or slow (many small launches), the code around that launch is what to fix, so the gap is
charged to it. Host calls that block (synchronisations, device allocations) are listed separately with their time.

``idle_gaps`` is pure (tuples in, dict out) so that CPU tests can check it; ``profiler_gaps`` feeds it from a
``torch.profiler.profile`` recorded with ``with_stack=True`` (the Python frame names the code).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Optional

# host runtime calls that block the CPU until the GPU catches up (or that may: a cudaFree syncs the device)
BLOCKING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaFree",
                  "cudaMalloc", "cudaHostAlloc", "cudaMemcpy", "cudaStreamWaitEvent")


def idle_gaps(kernels: Iterable[tuple[float, float, Any]], labels: dict[Any, str], min_gap_us: float = 5.0,
              top: int = 25) -> dict[str, Any]:
    """``kernels``: ``(start_us, end_us, launch_id)`` of every device kernel; ``labels``: launch_id -> where it was
    launched. Returns the window, the idle total, and the idle time per label (gaps shorter than ``min_gap_us`` are
    launch jitter and are only counted in the total)."""
    ks = sorted(kernels, key=lambda k: k[0])
    if not ks:
        return {}
    per_label: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    busy_end, idle, small = ks[0][1], 0.0, 0.0
    for start, end, launch in ks[1:]:
        gap = start - busy_end
        if gap > 0:
            idle += gap
            if gap >= min_gap_us:
                entry = per_label[labels.get(launch, "?")]
                entry[0] += gap
                entry[1] += 1
            else:
                small += gap
        busy_end = max(busy_end, end)
    window = busy_end - ks[0][0]
    rows = sorted(per_label.items(), key=lambda kv: -kv[1][0])
    return {"window_ms": window / 1e3, "idle_ms": idle / 1e3, "idle_frac": idle / max(window, 1e-9),
            "idle_in_short_gaps_ms": small / 1e3,
            "by_next_launch": [{"where": where, "idle_ms": round(us / 1e3, 3), "gaps": n}
                               for where, (us, n) in rows[:top]]}


def blocking_calls(calls: Iterable[tuple[str, float, str]], top: int = 15) -> list[dict[str, Any]]:
    """``calls``: ``(runtime call name, duration_us, where)``; summed per (call, where), longest first."""
    acc: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for name, dur, where in calls:
        if any(name.startswith(b) for b in BLOCKING_CALLS):
            acc[(name, where)][0] += dur
            acc[(name, where)][1] += 1
    rows = sorted(acc.items(), key=lambda kv: -kv[1][0])
    return [{"call": c, "where": w, "ms": round(us / 1e3, 3), "count": n} for (c, w), (us, n) in rows[:top]]


def launch_sites(trace_events: list[dict], repo_marks: tuple[str, ...] = ("lightning_moe/", "lightning/"),
                 ) -> tuple[dict[Any, str], list[tuple[str, float, str]]]:
    """From a Chrome trace (``prof.export_chrome_trace``): correlation id -> where the host launched it, and every
    runtime call as ``(name, dur_us, where)``. "Where" is the innermost Python frame of our code (or Lightning's)
    around the launch, else the outermost op (in backward: ``autograd::engine::evaluate_function: XBackward0``),
    followed by the innermost op. The trace's host events nest per thread, so one sweep with a stack finds them."""
    by_tid: dict[Any, list] = defaultdict(list)
    for e in trace_events:
        cat, ph = e.get("cat", ""), e.get("ph")
        if ph != "X":
            continue
        if cat in ("cpu_op", "python_function", "user_annotation"):
            by_tid[e["tid"]].append((float(e["ts"]), 0, float(e["ts"]) + float(e.get("dur", 0)), cat, e["name"]))
        elif cat in ("cuda_runtime", "cuda_driver"):
            by_tid[e["tid"]].append((float(e["ts"]), 1, float(e.get("dur", 0)), cat, e))
    labels: dict[Any, str] = {}
    calls: list[tuple[str, float, str]] = []
    for items in by_tid.values():
        items.sort(key=lambda it: (it[0], it[1], -it[2]))  # intervals open before a launch at the same time
        stack: list = []
        for ts, is_call, x, cat, obj in items:
            while stack and stack[-1][0] <= ts:
                stack.pop()
            if not is_call:
                stack.append((x, cat, obj))
                continue
            ops = [name for _, c, name in stack if c != "python_function"]
            frame = next((name for _, c, name in reversed(stack)
                          if c == "python_function" and any(m in name for m in repo_marks)), None)
            op = ops[-1] if ops else "?"
            where = f"{frame.split('site-packages/')[-1]} [{op}]" if frame else (
                f"{ops[0]} > {op}" if len(ops) > 1 else op)
            corr = (obj.get("args") or {}).get("correlation")
            if corr is not None:
                labels[corr] = where
            calls.append((obj["name"], x, where))
    return labels, calls


def trace_gaps(trace_events: list[dict], min_gap_us: float = 5.0, top: int = 25) -> Optional[dict[str, Any]]:
    """``idle_gaps`` and ``blocking_calls`` of a Chrome trace's events (device kernels, memcpys and memsets)."""
    labels, calls = launch_sites(trace_events)
    kernels = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), (e.get("args") or {}).get("correlation"))
               for e in trace_events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    out = idle_gaps(kernels, labels, min_gap_us, top)
    if out:
        out["blocking_calls"] = blocking_calls(calls)
    return out or None


def profiler_gaps(prof, min_gap_us: float = 5.0, top: int = 25) -> Optional[dict[str, Any]]:
    """``trace_gaps`` of a finished ``torch.profiler.profile`` (record it ``with_stack=True`` for Python frames)."""
    import json
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    return trace_gaps(events, min_gap_us, top)
