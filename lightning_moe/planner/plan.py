"""``lightning_moe.plan``: rank the folded layouts of a model on N GPUs of one kind."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from lightning_moe.flops import training_flops_per_token
from lightning_moe.modules.config import ModelConfig
from lightning_moe.planner.candidate import Candidate
from lightning_moe.planner.choice import Choice, PlanError
from lightning_moe.planner.cost import step_time
from lightning_moe.planner.gpus import GPU, gpu_kind
from lightning_moe.planner.memory import Memory, activations, states
from lightning_moe.planner.search import candidates
from lightning_moe.planner.settings import Settings, activation_options, optimizer_options
from lightning_moe.planner.shape import ModelShape

USABLE = 0.92  # of the GPU's memory: the rest goes to the CUDA context, NCCL buffers and allocator fragmentation


def model_config(preset: Optional[str] = None, overrides: Optional[dict] = None,
                 config: Optional[ModelConfig] = None) -> ModelConfig:
    """The model as ``MoELanguageModel`` builds it from a preset with overrides, or a ``ModelConfig``."""
    if config is not None:
        return config.replace(**overrides) if overrides else config
    return ModelConfig.from_preset(preset or "tiny", **(overrides or {}))


def plan(preset: Optional[str] = None, overrides: Optional[dict] = None, *, gpus: int, gpu: str = "h100-80gb",
         config: Optional[ModelConfig] = None, seq_length: Optional[int] = None,
         micro_batch_size: Optional[int] = None, global_batch_size: Optional[int] = None,
         precision: str = "bf16-true", top: int = 10) -> list[Choice]:
    """The ``top`` fastest layouts that fit, best first.

    ``global_batch_size`` (sequences per optimizer step) defaults to 8 per GPU; ``micro_batch_size`` (per data-parallel
    rank) to the best of 1, 2 and 4. Each layout gets the fastest of the memory settings that fit (``settings.py``).
    Raises ``PlanError`` when no layout can use the GPUs or none fits, saying why.
    """
    kind = gpu_kind(gpu)
    cfg = model_config(preset, overrides, config)
    seq = seq_length or cfg.seq_length
    for name, value in (("gpus", gpus), ("seq_length", seq), ("micro_batch_size", micro_batch_size),
                        ("global_batch_size", global_batch_size), ("top", top)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise PlanError(f"{name} must be an integer >= 1, got {value!r}")
    gbs = global_batch_size or 8 * gpus
    model, base = ModelShape(cfg, seq), Settings(precision=precision)
    options = {sharded: [[replace(a, distributed_optimizer=o.distributed_optimizer,
                                  optimizer_cpu_offload=o.optimizer_cpu_offload) for o in optimizer_options(base, sharded)]
                         for a in activation_options(base)] for sharded in (False, True)}
    flops = training_flops_per_token(cfg, seq) * gbs * seq
    fits, closest, seen, static = [], None, 0, {}
    for c in candidates(cfg, gpus, kind.gpus_per_node, seq, gbs, micro_batch_size):
        seen += 1
        best, smallest = _best(model, c, options, kind, static)
        if best is not None:
            fits.append(Choice(c, best[0], best[1], best[2], flops / best[2].seconds / gpus / 1e12))
        elif closest is None or smallest[2].total < closest[2].total:
            closest = smallest
    if not seen:
        raise PlanError(_no_layout(cfg, gpus, gbs, micro_batch_size, seq))
    if not fits:
        raise PlanError(_fits_nowhere(cfg, gpus, kind, *closest))
    fits.sort(key=lambda ch: ch.time.seconds)
    return fits[:top]


def _best(model: ModelShape, c: Candidate, options: dict, kind: GPU, static: dict):
    """((settings, memory, time) of the fastest settings that fit, or None; (candidate, settings, memory) of the
    smallest peak seen). ``options``: the settings to try, {sharded optimizer: [[settings] per activation option]};
    ``static``: the states per layout and optimizer option, shared by the micro-batch sizes of one layout."""
    cap = USABLE * kind.memory_gib
    grid = options[c.dp * c.cp > 1 or c.edp > 1]
    ranks = model.peak_ranks(c.pp, c.vpp, c.first, c.last)
    layout = (c.tp, c.cp, c.pp, c.vpp, c.ep, c.etp, c.first, c.last)
    for o in grid[0]:
        if (layout, o) not in static:
            static[layout, o] = [states(model, c, o, r) for r in ranks]
    best = smallest = None
    for row in grid:
        act = [activations(model, c, row[0], r) for r in ranks]
        for o, s in zip(grid[0], row):
            mem = max((m._replace(activations=x) for m, x in zip(static[layout, o], act)), key=lambda m: m.total)
            if smallest is None or mem.total < smallest[2].total:
                smallest = (c, s, mem)
            if mem.total <= cap:
                t = step_time(model, c, s, kind)
                if best is None or t.seconds < best[2].seconds:
                    best = (s, mem, t)
                break  # more offload only costs time
    return best, smallest


def _no_layout(cfg: ModelConfig, gpus: int, gbs: int, mb: Optional[int], seq: int) -> str:
    """Pure data parallelism is always a valid layout, so what fails is the split of the global batch."""
    from lightning_moe.planner.search import layouts
    dps = sorted({gpus // (tp * cp * pp) for tp, cp, pp, *_ in layouts(cfg, gpus, gpus, seq)})
    step = dps[0] * (mb or 1)
    return (f"no layout of {gpus} GPUs splits the global batch of {gbs} sequences into micro-batches"
            f"{f' of {mb}' if mb else ''} over its data-parallel ranks (the valid layouts have DP = "
            f"{', '.join(map(str, dps))}); choose a global batch that one of them divides, e.g. "
            f"{step * -(-gbs // step)}")


def _fits_nowhere(cfg: ModelConfig, gpus: int, kind: GPU, c: Candidate, s: Settings, m: Memory) -> str:
    cap = USABLE * kind.memory_gib
    where = (f"the smallest peak is {m.total:.1f} GiB per GPU (tp={c.tp} cp={c.cp} pp={c.pp} ep={c.ep} etp={c.etp}, "
             f"micro-batch {c.mb}, {s.describe()}) against {cap:.1f} GiB usable on a {kind.name}")
    if m.weights > cap:
        part = f"the weights alone take {m.weights:.1f} GiB, {m.weights - cap:.1f} GiB too many"
    elif m.weights + m.grads > cap:
        part = f"weights and gradients take {m.weights + m.grads:.1f} GiB, {m.weights + m.grads - cap:.1f} GiB too many"
    elif m.weights + m.grads + m.optimizer > cap:
        static = m.weights + m.grads + m.optimizer
        part = f"weights, gradients and optimizer state take {static:.1f} GiB, {static - cap:.1f} GiB too many"
    else:
        left = cap - m.weights - m.grads - m.optimizer
        part = f"the activations need {m.activations:.1f} GiB where {left:.1f} GiB remain, {m.total - cap:.1f} GiB too many"
    return f"the model fits on no layout of {gpus} x {kind.name}: {where}; {part}. Use more GPUs, or a larger GPU kind"
