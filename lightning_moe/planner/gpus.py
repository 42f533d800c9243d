"""GPU kinds the planner knows: memory, dense bf16 peak, and the bandwidths its cost model divides by.

``hbm_bytes_s`` is the sustained HBM bandwidth of memory-bound kernels (docs/PERFORMANCE.md: the fp32 main-grad
accumulation runs at ~2.6 TB/s on an H100, 0.78 of its 3.35 TB/s datasheet figure; other kinds get the same
fraction). ``nvlink_bytes_s`` and ``network_bytes_s`` are per GPU and direction: NVLink inside a node, the
InfiniBand/RoCE NIC (one 400 Gb/s NIC per GPU) across nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_moe.flops import PEAK_FLOPS

HBM_SUSTAINED = 2.6e12 / 3.35e12  # measured on the H100 (main-grad accumulation), applied to every kind


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float  # what torch.cuda reports as total memory
    bf16_flops: float  # dense tensor-core peak
    hbm_bytes_s: float  # sustained
    nvlink_bytes_s: float  # per GPU, one direction
    network_bytes_s: float  # per GPU, one direction, between nodes
    gpus_per_node: int = 8


def _gpu(name: str, memory_gib: float, peak_key: str, hbm_tb_s: float, nvlink_gb_s: float,
         network_gb_s: float) -> GPU:
    return GPU(name, memory_gib, PEAK_FLOPS[peak_key]["bf16"], hbm_tb_s * 1e12 * HBM_SUSTAINED, nvlink_gb_s * 1e9,
               network_gb_s * 1e9)


GPUS: dict[str, GPU] = {g.name: g for g in (
    _gpu("h100-80gb", 79.1, "h100-sxm", 3.35, 450, 50),
    _gpu("h800-80gb", 79.1, "h100-sxm", 3.35, 200, 50),  # the H100 with NVLink cut to 400 GB/s both ways
    _gpu("h200-141gb", 139.8, "h200-sxm", 4.8, 450, 50),
    _gpu("a100-80gb", 79.1, "a100", 2.04, 300, 25),
)}


def gpu_kind(name: str) -> GPU:
    """The GPU kind called ``name`` (e.g. ``h100-80gb``); ValueError listing the known kinds otherwise."""
    key = str(name).lower()
    if key not in GPUS:
        raise ValueError(f"unknown GPU kind {name!r}; known kinds: {', '.join(GPUS)}")
    return GPUS[key]
