"""The memory settings a planned layout runs with: precision, the optimizer options of ``MoEFoldStrategy`` and the
``Recompute`` / ``ActivationOffload`` callbacks. The planner tries each activation option with the least optimizer
offload that fits, and keeps the fastest (docs/PERFORMANCE.md measured what each costs)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from lightning_moe.callbacks.activation_offload import MODULES as OFFLOAD_MODULES
from lightning_moe.callbacks.recompute import MODULES as RECOMPUTE_MODULES

PRECISIONS = ("bf16-true", "bf16-mixed", "32-true")


@dataclass(frozen=True)
class Settings:
    precision: str = "bf16-true"
    fp32_main_params: bool = True  # only read under bf16-true (moe_fold's default there)
    distributed_optimizer: bool = False
    moments_dtype: Optional[str] = None  # "bf16": both Adam moments in bf16 (exp_avg_dtype, exp_avg_sq_dtype)
    optimizer_cpu_offload: float = 0.0
    recompute: tuple[str, ...] = ()
    offload: tuple[str, ...] = ()  # ActivationOffload modules
    expert_wgrad_fusion: bool = True  # the experts' wgrad adds into the fp32 main grads (moe_fold's default on CUDA)
    # AdamW and the bf16 write-back in one pass (moe_fold's default on CUDA with fp32 main params and fp32 moments)
    fused_optimizer_writeback: bool = True

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; the planner knows {', '.join(PRECISIONS)}")
        bad = [m for m in self.recompute if m not in RECOMPUTE_MODULES] + [
            m for m in self.offload if m not in OFFLOAD_MODULES]
        if bad:
            raise ValueError(f"unknown recompute/offload module {bad[0]!r}")

    @property
    def weight_bytes(self) -> int:
        return 2 if self.precision == "bf16-true" else 4

    def describe(self) -> str:
        parts = []
        if self.distributed_optimizer:
            parts.append("dist-opt")
        if self.moments_dtype:
            parts.append(f"{self.moments_dtype} moments")
        if self.optimizer_cpu_offload:
            parts.append(f"opt-offload {self.optimizer_cpu_offload:g}")
        if self.recompute:
            parts.append("recompute " + "+".join(self.recompute))
        if self.offload:
            parts.append("act-offload " + "+".join(self.offload))
        return ", ".join(parts) or "-"


# (recompute, offload): nothing; the cheap recomputations (~8 % step time measured); plus the expert inputs to the
# host (~6 %); the MoE layers recomputed whole; whole blocks recomputed (one more forward)
ACTIVATION_OPTIONS = (((), ()), (("moe_act", "layernorm"), ()), (("moe_act", "layernorm"), ("expert_fc1",)),
                      (("moe", "layernorm"), ()), (("full",), ()))
OPTIMIZER_OFFLOAD = (0.0, 0.5, 1.0)  # of the optimizer state, stepped on the CPU (slow: only when nothing else fits)


def activation_options(base: Settings) -> list[Settings]:
    return [replace(base, recompute=r, offload=o) for r, o in ACTIVATION_OPTIONS]


def optimizer_options(base: Settings, sharded: bool) -> list[Settings]:
    """Least offload first; the distributed optimizer whenever there are data-parallel ranks to shard over (it is
    never slower: a reduce-scatter instead of an all-reduce, and a 1/d share of the step)."""
    return [replace(base, distributed_optimizer=sharded or f > 0, optimizer_cpu_offload=f) for f in OPTIMIZER_OFFLOAD]
