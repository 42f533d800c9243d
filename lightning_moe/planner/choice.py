"""A ranked answer of the planner: one layout with its settings, memory and estimated step time."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_moe.planner.candidate import Candidate
from lightning_moe.planner.cost import StepTime
from lightning_moe.planner.memory import Memory
from lightning_moe.planner.settings import Settings


class PlanError(ValueError):
    """The planner cannot answer: the message says why and what would work."""


@dataclass(frozen=True)
class Choice:
    layout: Candidate
    settings: Settings
    memory: Memory  # of the pipeline rank with the highest peak
    time: StepTime
    tflops_per_gpu: float

    def as_dict(self) -> dict:
        c, s, m = self.layout, self.settings, self.memory
        return {"tp": c.tp, "cp": c.cp, "pp": c.pp, "vpp": c.vpp, "ep": c.ep, "etp": c.etp, "dp": c.dp, "edp": c.edp,
                "memory_gib": round(m.total, 2), "tflops_per_gpu": round(self.tflops_per_gpu, 1),
                "micro_batch_size": c.mb, "num_microbatches": c.m,
                "pipeline_first_stage_layers": c.first, "pipeline_last_stage_layers": c.last,
                "memory_breakdown_gib": {"weights": round(m.weights, 2), "grads": round(m.grads, 2),
                                         "optimizer": round(m.optimizer, 2), "activations": round(m.activations, 2)},
                "host_memory_gib": round(m.host, 2), "step_time_s": round(self.time.seconds, 4),
                "dominant_cost": self.time.dominant, "cost_s": {k: round(v, 4) for k, v in self.time.parts.items()},
                "precision": s.precision, "distributed_optimizer": s.distributed_optimizer,
                "moments_dtype": s.moments_dtype, "optimizer_cpu_offload": s.optimizer_cpu_offload,
                "recompute": list(s.recompute), "activation_offload": list(s.offload)}
