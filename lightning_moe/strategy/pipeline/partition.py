"""Which layers each pipeline stage holds (pure functions, no torch).

A model of ``L`` layers is split over ``V = pp * vpp`` virtual stages. Rank ``r`` of the pipeline holds the virtual
stages ``r, r + pp, ..., r + (vpp - 1) * pp`` as its model chunks (Megatron's interleaved placement), so with
``vpp`` chunks a micro-batch visits every rank ``vpp`` times. The embedding lives on virtual stage 0, the final norm,
head and loss on virtual stage ``V - 1``.

By default the layers split evenly. ``first``/``last`` give explicit layer counts for the first and last virtual
stages (Megatron's ``--decoder-first/last-pipeline-num-layers``; e.g. fewer layers where the embedding or the head
sits); the remaining layers then split evenly over the other stages.
"""

from __future__ import annotations

from typing import Optional


def partition_layers(num_layers: int, pp: int, vpp: Optional[int] = None, first: Optional[int] = None,
                     last: Optional[int] = None) -> list[range]:
    """The layer range of each of the ``pp * vpp`` virtual stages, in stage order. Raises ValueError naming the
    numbers when the layers cannot be split that way."""
    V = pp * (vpp or 1)
    what = f"num_layers={num_layers} over pipeline_parallel_size={pp}" + (f" x virtual_pipeline_size={vpp}"
                                                                          if vpp else "")
    for name, n in (("first", first), ("last", last)):
        if n is not None and (not isinstance(n, int) or n < 0):
            raise ValueError(f"pipeline {name}-stage layers must be an integer >= 0, got {n!r}")
    if V == 1:
        if first not in (None, num_layers) or last not in (None, num_layers):
            raise ValueError(f"first/last stage layer counts ({first}, {last}) need pipeline_parallel_size > 1")
        return [range(num_layers)]
    fixed = {i: n for i, n in ((0, first), (V - 1, last)) if n is not None}
    rest = num_layers - sum(fixed.values())
    free = V - len(fixed)
    if rest < free or rest % free:
        given = f" with {fixed.get(0)} layers on the first and {fixed.get(V - 1)} on the last stage" if fixed else ""
        raise ValueError(f"cannot split {what} = {V} stages{given}: the remaining {rest} layers do not divide "
                         f"evenly over {free} stages with at least one layer each. Change num_layers, the pipeline "
                         "sizes, or set pipeline_first_stage_layers / pipeline_last_stage_layers.")
    counts = [fixed.get(i, rest // free) for i in range(V)]
    starts = [sum(counts[:i]) for i in range(V)]
    return [range(s, s + n) for s, n in zip(starts, counts)]


def local_stages(pp: int, pp_rank: int, vpp: Optional[int] = None) -> list[int]:
    """The virtual stages held by pipeline rank ``pp_rank``, one per model chunk."""
    return [pp_rank + c * pp for c in range(vpp or 1)]
