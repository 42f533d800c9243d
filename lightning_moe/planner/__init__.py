"""The layout planner behind ``lightning-moe plan``: a pure cost model over the folded layouts (no GPU needed)."""

from lightning_moe.planner.choice import Choice, PlanError
from lightning_moe.planner.gpus import GPUS, gpu_kind
from lightning_moe.planner.plan import plan

__all__ = ["Choice", "GPUS", "PlanError", "gpu_kind", "plan"]
