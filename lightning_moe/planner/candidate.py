"""One point of the planner's search: a folded layout, the micro-batching, and which layers each pipeline rank holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_moe.strategy.pipeline.schedules import build_schedule, exchange_phases, simulate


@dataclass(frozen=True)
class Candidate:
    gpus: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    ep: int = 1
    etp: int = 1
    mb: int = 1  # micro-batch per data-parallel rank
    m: int = 1  # micro-batches per optimizer step (accumulation, or the pipeline's num_microbatches)
    first: Optional[int] = None  # layers on the first / last virtual stage (None: even split)
    last: Optional[int] = None

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        return self.gpus // (self.etp * self.ep * self.pp)

    def ranks(self, model) -> list:
        """Per pipeline rank, its layers and parameters (``model``: a ``ModelShape``)."""
        return model.ranks(self.pp, self.vpp, self.first, self.last)

    def rank_params(self, model, rank: int) -> tuple[float, float]:
        """(dense, expert) parameters on one GPU of pipeline rank ``rank``."""
        return self.ranks(model)[rank].params.per_rank(self.tp, self.ep, self.etp)

    def pipeline(self, model) -> "PipelineShape":
        return model.pipeline(self.pp, self.m, self.vpp)


@dataclass(frozen=True)
class PipelineShape:
    bubble: float  # idle share of the schedule (the simulator's, backward = 2 x forward)
    in_flight: tuple[int, ...]  # per rank: the most (micro-batch, chunk) forwards whose backward has not run
    exchanges: int  # p2p exchanges per rank and step (the executor synchronises at each)


def pipeline_shape(pp: int, m: int, vpp: Optional[int]) -> PipelineShape:
    """What the pipeline schedule simulator says about ``pp`` stages, ``m`` micro-batches and ``vpp`` chunks.

    Beyond 2 x pp micro-batches a schedule only lengthens its steady state: the in-flight counts stop growing and the
    bubble follows the simulator's (pp - 1) / (vpp * m + pp - 1) (exact for 1F1B and interleaved 1F1B, see
    ``schedules.simulate``), so the simulator runs on at most 2 x pp micro-batches and large m stays cheap.
    ``ModelShape.pipeline`` caches it for a planning run."""
    if pp == 1:
        return PipelineShape(0.0, (1,), 0)
    vpp = vpp if (vpp or 1) > 1 else None
    schedule = "interleaved_1f1b" if vpp else "1f1b"
    small = min(m, 2 * pp)
    bubble = simulate(schedule, pp, small, vpp)["bubble_fraction"]
    if small < m:
        bubble = (pp - 1) / ((vpp or 1) * m + pp - 1)
    in_flight = []
    for r in range(pp):
        live = most = 0
        for op in build_schedule(schedule, pp, r, small, vpp):
            live += 1 if op.kind == "F" else -1
            most = max(most, live)
        in_flight.append(most)
    return PipelineShape(bubble, tuple(in_flight), len(exchange_phases(schedule, pp, 0, m, vpp)) + 1)
