"""Pipeline-parallel schedules as plain op lists (no torch), plus a timing model that doubles as a deadlock check.

A rank ``r`` of ``pp`` holds ``vpp`` model chunks; chunk ``c`` is virtual stage ``v = c * pp + r``, so the stages
``0 .. pp*vpp-1`` visit the ranks round-robin. A schedule is, per rank, the order in which it runs forwards ``F`` and
backwards ``B`` of (microbatch, chunk). The schedules follow Megatron-LM:

* ``afab``: all forwards, then all backwards (GPipe); any ``vpp``.
* ``1f1b``: ``forward_backward_pipelining_without_interleaving``; ``vpp`` must be 1.
* ``interleaved_1f1b``: ``forward_backward_pipelining_with_interleaving``; ``vpp >= 2`` and ``num_microbatches``
  a multiple of ``pp``.

On every rank the forwards run in ``forward_order`` and the backwards in ``backward_order`` (the same on all ranks),
which is what keeps the untagged FIFO point-to-point messages of the executor matched (see ``p2p_order_problems``).
"""

from __future__ import annotations

from typing import NamedTuple

SCHEDULES = ("afab", "1f1b", "interleaved_1f1b")


class Op(NamedTuple):
    kind: str  # "F" (forward) or "B" (backward)
    microbatch: int
    chunk: int  # local model chunk of this rank; virtual stage = chunk * pp + rank

    def __repr__(self) -> str:
        return f"{self.kind}(mb={self.microbatch}, chunk={self.chunk})"


def _vpp(vpp: int | None) -> int:
    return 1 if vpp is None else vpp


def check_schedule(schedule: str, pp: int, num_microbatches: int, vpp: int | None = None) -> None:
    """Raise ``ValueError`` (naming the numbers and the fix) unless ``schedule`` can run with these sizes."""
    m, sizes = num_microbatches, f"schedule={schedule!r}, pp={pp}, num_microbatches={num_microbatches}, vpp={vpp}"
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    if pp < 1:
        raise ValueError(f"pp={pp} must be >= 1 ({sizes})")
    if m < 1:
        raise ValueError(f"num_microbatches={m} must be >= 1 ({sizes})")
    if vpp is not None and vpp < 1:
        raise ValueError(f"vpp={vpp} must be >= 1 or None ({sizes})")
    if schedule == "1f1b" and _vpp(vpp) > 1:
        raise ValueError(f"schedule '1f1b' runs one model chunk per rank but vpp={vpp}; "
                         f"use schedule='interleaved_1f1b' for virtual pipeline stages ({sizes})")
    if schedule == "interleaved_1f1b":
        if _vpp(vpp) < 2:
            raise ValueError(f"schedule 'interleaved_1f1b' needs virtual_pipeline_size >= 2, got vpp={vpp}; "
                             f"set vpp >= 2 or use schedule='1f1b' ({sizes})")
        if m % pp:
            lower, upper = (m // pp) * pp, (m // pp + 1) * pp
            hint = f"{lower} or {upper}" if lower else f"{upper}"
            raise ValueError(f"schedule 'interleaved_1f1b' runs microbatches in groups of pp={pp} per virtual stage, "
                             f"so num_microbatches={m} must be a multiple of {pp} (e.g. {hint}) ({sizes})")


def _order(pp: int, num_microbatches: int, vpp: int | None, forward: bool) -> list[tuple[int, int]]:
    """Megatron's ``get_model_chunk_id`` / ``get_microbatch_id_in_model_chunk`` over groups of ``pp`` microbatches.

    When ``pp`` does not divide ``num_microbatches`` (only afab allows it with ``vpp > 1``) the microbatches are
    padded to a multiple of ``pp`` and the padding is skipped: groups stay chunk-major, the last group is shorter.
    Every chunk of a group then runs the same microbatches in the same order, which the wrap-around messages
    (last rank, chunk c -> rank 0, chunk c + 1) need to stay FIFO-matched.
    """
    v, m = _vpp(vpp), num_microbatches
    group = pp * v
    padded = -(-m // pp) * pp
    out = []
    for k in range(padded * v):
        j = k % group
        mb = (k // group) * pp + j % pp
        if mb < m:
            chunk = j // pp
            out.append((mb, chunk if forward else v - 1 - chunk))
    return out


def forward_order(pp: int, num_microbatches: int, vpp: int | None = None) -> list[tuple[int, int]]:
    """(microbatch, chunk) of the forwards in execution order; the same on every rank."""
    return _order(pp, num_microbatches, vpp, forward=True)


def backward_order(pp: int, num_microbatches: int, vpp: int | None = None) -> list[tuple[int, int]]:
    """(microbatch, chunk) of the backwards in execution order; the same on every rank."""
    return _order(pp, num_microbatches, vpp, forward=False)


def build_schedule(schedule: str, pp: int, rank: int, num_microbatches: int, vpp: int | None = None) -> list[Op]:
    """The ops of ``rank`` in execution order."""
    check_schedule(schedule, pp, num_microbatches, vpp)
    if not 0 <= rank < pp:
        raise ValueError(f"rank={rank} must be in [0, pp={pp})")
    fwd = [Op("F", mb, c) for mb, c in forward_order(pp, num_microbatches, vpp)]
    bwd = [Op("B", mb, c) for mb, c in backward_order(pp, num_microbatches, vpp)]
    total = len(fwd)
    warmup = _warmup(schedule, pp, rank, num_microbatches, vpp)
    ops = fwd[:warmup]
    for i in range(total - warmup):
        ops += [fwd[warmup + i], bwd[i]]
    return ops + bwd[total - warmup:]


def _warmup(schedule: str, pp: int, rank: int, num_microbatches: int, vpp: int | None) -> int:
    """Forwards before the first backward (the rest alternate F, B, then the remaining Bs)."""
    total = num_microbatches * _vpp(vpp)
    if schedule == "afab":
        return total
    if schedule == "1f1b":
        # Stage r keeps pp - r - 1 forwards in flight before the first gradient comes back.
        return min(pp - rank - 1, total)
    if num_microbatches == pp:
        return total  # Megatron runs everything as warmup here: all forwards, then all backwards
    # Twice the 1f1b depth (Megatron overlaps send and receive) plus a full round over the other chunks.
    return min((pp - rank - 1) * 2 + (_vpp(vpp) - 1) * pp, total)


def _validate(ops_by_rank: list[list[Op]], pp: int, vpp: int) -> None:
    if len(ops_by_rank) != pp:
        raise ValueError(f"got op lists for {len(ops_by_rank)} ranks, expected pp={pp}")
    for rank, ops in enumerate(ops_by_rank):
        for op in ops:
            if op.kind not in ("F", "B") or not 0 <= op.chunk < vpp or op.microbatch < 0:
                raise ValueError(f"rank {rank}: invalid {op!r} (pp={pp}, vpp={vpp})")
        if len(set(ops)) != len(ops):
            raise ValueError(f"rank {rank} runs an op twice: {ops}")
        fwd = {(op.microbatch, op.chunk) for op in ops if op.kind == "F"}
        bwd = {(op.microbatch, op.chunk) for op in ops if op.kind == "B"}
        if fwd != bwd:  # a forward without backward leaks its activations; the reverse cannot run
            raise ValueError(f"rank {rank}: forwards and backwards differ in (microbatch, chunk): "
                             f"only F {sorted(fwd - bwd)}, only B {sorted(bwd - fwd)}")


def _deps(op: Op, rank: int, pp: int, vpp: int) -> list[tuple[str, int, int]]:
    """(kind, microbatch, virtual stage) that must have finished before ``op`` may start."""
    v, last = op.chunk * pp + rank, pp * vpp - 1
    if op.kind == "F":
        return [("F", op.microbatch, v - 1)] if v > 0 else []
    return [("F", op.microbatch, v)] + ([("B", op.microbatch, v + 1)] if v < last else [])


def simulate_ops(ops_by_rank: list[list[Op]], pp: int, vpp: int | None = None,
                 f_time: float = 1.0, b_time: float = 2.0) -> dict:
    """Run explicit per-rank op lists in a zero-communication timing model; raise ``RuntimeError`` on deadlock.

    Each rank runs its ops strictly in order; an op starts when its rank is free and its dependencies have finished
    (see ``_deps``). Start times are the longest paths of that graph, so the sweep order below does not matter, and
    a sweep that starts nothing means the graph has a cycle: a deadlock.
    """
    v = _vpp(vpp)
    _validate(ops_by_rank, pp, v)
    finish: dict[tuple[str, int, int], float] = {}
    pos, free = [0] * pp, [0] * pp
    timeline: list[list[tuple[Op, float, float]]] = [[] for _ in range(pp)]
    busy = [0] * pp
    while True:
        progressed = False
        for rank, ops in enumerate(ops_by_rank):
            while pos[rank] < len(ops):
                op = ops[pos[rank]]
                deps = _deps(op, rank, pp, v)
                if any(d not in finish for d in deps):
                    break
                start = max([free[rank]] + [finish[d] for d in deps])
                duration = f_time if op.kind == "F" else b_time
                free[rank] = finish[(op.kind, op.microbatch, op.chunk * pp + rank)] = start + duration
                timeline[rank].append((op, start, start + duration))
                busy[rank] += duration
                pos[rank] += 1
                progressed = True
        if all(pos[r] == len(ops_by_rank[r]) for r in range(pp)):
            break
        if not progressed:
            blocked = []
            for rank, ops in enumerate(ops_by_rank):
                if pos[rank] < len(ops):
                    op = ops[pos[rank]]
                    missing = [d for d in _deps(op, rank, pp, v) if d not in finish]
                    waits = [f"{k}(mb={mb}, stage={s})" for k, mb, s in missing]
                    blocked.append(f"rank {rank} op #{pos[rank]} {op!r} waits for {', '.join(waits)}")
            raise RuntimeError(f"deadlock (pp={pp}, vpp={vpp}): no rank can start its next op; " + "; ".join(blocked))
    makespan = max(free)
    return {
        "makespan": makespan,
        "busy": busy,
        "idle": [makespan - b for b in busy],
        "bubble_fraction": 1 - sum(busy) / (pp * makespan) if makespan else 0.0,
        "timeline": timeline,
    }


def simulate(schedule: str, pp: int, num_microbatches: int, vpp: int | None = None,
             f_time: float = 1.0, b_time: float = 2.0) -> dict:
    """Timing of ``schedule`` with op times ``f_time``/``b_time`` per chunk and free communication.

    Returns ``makespan``, ``busy``/``idle`` per rank, ``bubble_fraction`` (idle share of all rank time), ``timeline``
    (per rank: (op, start, end)) and ``ideal`` = (pp - 1) / (vpp * m + pp - 1), the Megatron paper's bubble fraction
    (bubble time (pp - 1) * (f + b) over the busy time m * vpp * (f + b)). In this model ``bubble_fraction`` equals
    ``ideal`` exactly, for any f_time and b_time, whenever vpp == 1 or m % pp == 0: 1f1b, interleaved_1f1b, and afab
    with the same makespan as those. Only afab with vpp > 1 and m % pp != 0 is worse: its short last group cannot
    fill the pipeline between the wrap-arounds (e.g. pp=2, vpp=2, m=1 gives 1/2 instead of 1/3).
    """
    check_schedule(schedule, pp, num_microbatches, vpp)
    ops = [build_schedule(schedule, pp, r, num_microbatches, vpp) for r in range(pp)]
    result = simulate_ops(ops, pp, vpp, f_time, b_time)
    result["ideal"] = (pp - 1) / (_vpp(vpp) * num_microbatches + pp - 1)
    return result


def p2p_order_problems(ops_by_rank: list[list[Op]], pp: int, vpp: int | None = None) -> list[str]:
    """Where untagged FIFO messages would be matched to the wrong (microbatch, stage); empty when all is well.

    Per (sender, receiver, kind) the sender's op order fixes the order it sends in and the receiver's op order the
    order it receives in; "act" goes from stage v to v + 1 after F, "grad" from stage v to v - 1 after B.
    """
    v = _vpp(vpp)
    _validate(ops_by_rank, pp, v)
    last = pp * v - 1
    sent: dict[tuple[int, int, str], list[tuple[int, int]]] = {}
    received: dict[tuple[int, int, str], list[tuple[int, int]]] = {}
    for rank, ops in enumerate(ops_by_rank):
        nxt, prev = (rank + 1) % pp, (rank - 1) % pp
        for op in ops:
            stage = op.chunk * pp + rank
            if op.kind == "F":
                if stage > 0:
                    received.setdefault((prev, rank, "act"), []).append((op.microbatch, stage - 1))
                if stage < last:
                    sent.setdefault((rank, nxt, "act"), []).append((op.microbatch, stage))
            else:
                if stage < last:
                    received.setdefault((nxt, rank, "grad"), []).append((op.microbatch, stage + 1))
                if stage > 0:
                    sent.setdefault((rank, prev, "grad"), []).append((op.microbatch, stage))
    problems = []
    for key in sorted(set(sent) | set(received)):
        src, dst, kind = key
        s, r = sent.get(key, []), received.get(key, [])
        for i, (a, b) in enumerate(zip(s, r)):
            if a != b:
                problems.append(f"{kind} {src}->{dst}: message #{i} is sent as (mb={a[0]}, stage={a[1]}) "
                                f"but received as (mb={b[0]}, stage={b[1]})")
                break
        else:
            if len(s) != len(r):
                problems.append(f"{kind} {src}->{dst}: {len(s)} messages sent but {len(r)} received")
    return problems


def check_p2p_order(schedule: str, pp: int, num_microbatches: int, vpp: int | None = None) -> None:
    """Raise ``RuntimeError`` if ``schedule`` would match any point-to-point message to the wrong microbatch."""
    ops = [build_schedule(schedule, pp, r, num_microbatches, vpp) for r in range(pp)]
    problems = p2p_order_problems(ops, pp, vpp)
    if problems:
        raise RuntimeError(f"schedule {schedule!r} (pp={pp}, num_microbatches={num_microbatches}, vpp={vpp}) "
                           f"mismatches point-to-point messages: " + "; ".join(problems))


def exchange_phases(schedule: str, pp: int, rank: int, num_microbatches: int,
                    vpp: int | None = None) -> list[list[int]]:
    """Indices into ``build_schedule``'s ops, grouped into the phases between which the executor exchanges
    activations and gradients. Megatron's structure: each warmup forward and each cooldown backward is its own phase;
    each steady-state (F, B) pair is one (its inputs arrive together before it, its outputs leave together after)."""
    total = num_microbatches * _vpp(vpp)
    warmup = _warmup(schedule, pp, rank, num_microbatches, vpp)
    steady = total - warmup
    return ([[k] for k in range(warmup)] + [[warmup + 2 * i, warmup + 2 * i + 1] for i in range(steady)]
            + [[k] for k in range(warmup + 2 * steady, 2 * total)])


def simulate_rendezvous(schedule: str, pp: int, num_microbatches: int, vpp: int | None = None) -> None:
    """``check_rendezvous`` for a schedule: RuntimeError if its exchanges can deadlock."""
    ops = [build_schedule(schedule, pp, r, num_microbatches, vpp) for r in range(pp)]
    phases = [exchange_phases(schedule, pp, r, num_microbatches, vpp) for r in range(pp)]
    check_rendezvous(ops, phases, pp, vpp)


def check_rendezvous(ops_by_rank: list[list[Op]], phases_by_rank: list[list[list[int]]], pp: int,
                     vpp: int | None = None) -> None:
    """Check the executor's communication pattern cannot deadlock (RuntimeError naming the stuck ranks if it can).

    The executor (``engine.PipelineEngine`` with ``p2p.StageComm``) runs one exchange before each phase of
    ``exchange_phases``: the sends produced by the previous phase and the receives this phase needs, and waits until
    all of them complete; one more exchange after the last phase sends what it produced. A send completes only once
    its receiver has posted the matching receive, and a receive once its sender has posted the send (NCCL
    rendezvous, no buffering assumed)."""
    V = pp * _vpp(vpp)
    last = V - 1
    sent_at: dict = {}  # message -> (rank, exchange index)
    recv_at: dict = {}
    steps: list[list[list]] = []
    for rank, (ops, phases) in enumerate(zip(ops_by_rank, phases_by_rank)):
        ex: list[list] = [[] for _ in range(len(phases) + 1)]
        for j, phase in enumerate(phases):
            for k in phase:
                op = ops[k]
                v = op.chunk * pp + rank
                step = 1 if op.kind == "F" else -1
                kind = "act" if op.kind == "F" else "grad"
                if (op.kind == "F" and v > 0) or (op.kind == "B" and v < last):
                    recv_at[(kind, op.microbatch, v)] = (rank, j)
                    ex[j].append(("recv", (kind, op.microbatch, v)))
                if (op.kind == "F" and v < last) or (op.kind == "B" and v > 0):
                    sent_at[(kind, op.microbatch, v + step)] = (rank, j + 1)
                    ex[j + 1].append(("send", (kind, op.microbatch, v + step)))
        steps.append(ex)
    pos = [0] * pp

    def ready(rank: int) -> bool:
        for what, msg in steps[rank][pos[rank]]:
            peer, k = (recv_at if what == "send" else sent_at)[msg]
            if pos[peer] < k:  # the peer has not posted its side yet
                return False
        return True

    while True:
        moved = False
        for r in range(pp):
            while pos[r] < len(steps[r]) and ready(r):
                pos[r] += 1
                moved = True
        if all(pos[r] == len(steps[r]) for r in range(pp)):
            return
        if not moved:
            stuck = [f"rank {r} at exchange {pos[r]}: {steps[r][pos[r]]}" for r in range(pp) if pos[r] < len(steps[r])]
            raise RuntimeError("deadlock in the p2p exchanges: " + "; ".join(stuck))
