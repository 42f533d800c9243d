"""Peak memory of each pipeline rank: weights, gradients and optimizer state from ``strategy/memory.py``'s bytes per
parameter, plus the activations of the micro-batches in flight and the loss's logits."""

from __future__ import annotations

from typing import NamedTuple

from lightning_moe.planner.activations import dispatch_bytes, loss_bytes
from lightning_moe.planner.candidate import Candidate
from lightning_moe.planner.kernels import WORKSPACE_GIB
from lightning_moe.planner.settings import Settings
from lightning_moe.planner.shape import ModelShape

GIB = 2 ** 30


class Memory(NamedTuple):
    weights: float  # GiB, each
    grads: float
    optimizer: float  # main params and moments on the device
    activations: float  # with the workspace
    host: float  # optimizer state offloaded to the host

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations


def _per_param(model: ModelShape, settings: Settings, shard: int) -> dict[str, float]:
    return model.bytes_per_param(
        settings.weight_bytes, fp32_main_params=settings.fp32_main_params if settings.precision == "bf16-true" else
        False, exp_avg_dtype=settings.moments_dtype, exp_avg_sq_dtype=settings.moments_dtype,
        distributed_optimizer=settings.distributed_optimizer, optimizer_cpu_offload=settings.optimizer_cpu_offload,
        shard=shard)


def states(model: ModelShape, c: Candidate, settings: Settings, rank: int) -> Memory:
    """Weights, gradients and optimizer state of pipeline rank ``rank`` (no activations)."""
    dense, expert = c.rank_params(model, rank)
    parts = [(dense, _per_param(model, settings, c.dp * c.cp)), (expert, _per_param(model, settings, c.edp))]
    w, g, state, main, host = (sum(n * b[k] for n, b in parts) / GIB for k in (
        "weights", "grads", "optimizer_state", "main_params", "host"))
    return Memory(w, g, state + main, 0.0, host)


def activations(model: ModelShape, c: Candidate, settings: Settings, rank: int) -> float:
    """GiB of activations at the peak of pipeline rank ``rank``: its micro-batches in flight, one layer rebuilt by a
    recomputation, the loss on the last stage, the MoE dispatch buffers and the workspace."""
    kinds = c.ranks(model)[rank].kinds
    per_kind = {moe: model.kept(moe, settings, c.tp, c.cp, c.etp) for moe in (False, True) if moe in model.params}
    kept = [sum(n * per_kind[moe][0] for moe, n in zip((False, True), k) if n) for k in kinds]
    rebuilt = max((per_kind[moe][1] for k in kinds for moe, n in zip((False, True), k) if n), default=0.0)
    # interleaved: the chunks in flight take turns; count the average chunk
    act = c.pipeline(model).in_flight[rank] * sum(kept) / len(kept) + rebuilt
    if rank == c.pp - 1:
        act += loss_bytes(model.cfg, c.tp)
    if c.ep * c.etp > 1 and any(k[1] for k in kinds):
        act += dispatch_bytes(model.cfg, c.tp, c.etp)
    tokens = c.mb * model.seq / c.cp  # of each micro-batch on this rank
    gib = act * tokens / GIB + WORKSPACE_GIB
    if settings.precision == "bf16-mixed":  # autocast keeps each weight's bf16 copy for backward
        gib += 2 * sum(c.rank_params(model, rank)) / GIB
    return gib


def rank_memory(model: ModelShape, c: Candidate, settings: Settings, rank: int) -> Memory:
    return states(model, c, settings, rank)._replace(activations=activations(model, c, settings, rank))

