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

``exchange_plans`` says when the executor posts each message and what each op waits for, synchronously
(``phase_plan``) or overlapped with compute (``overlap_plan``); ``simulate_plans`` proves a plan free of deadlock and
mismatched messages and times it.
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


def build_schedule(schedule: str, pp: int, rank: int, num_microbatches: int, vpp: int | None = None,
                   merged: bool = False) -> list[Op]:
    """The ops of ``rank`` in execution order. ``merged`` (``overlap_moe_comm``): one more warmup forward, so that
    every steady-state (F, B) pair holds two different micro-batches and can run as one merged op (Megatron's
    combined 1F1B adds the same one)."""
    check_schedule(schedule, pp, num_microbatches, vpp)
    if not 0 <= rank < pp:
        raise ValueError(f"rank={rank} must be in [0, pp={pp})")
    fwd = [Op("F", mb, c) for mb, c in forward_order(pp, num_microbatches, vpp)]
    bwd = [Op("B", mb, c) for mb, c in backward_order(pp, num_microbatches, vpp)]
    total = len(fwd)
    warmup = min(_warmup(schedule, pp, rank, num_microbatches, vpp) + int(merged), total)
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


def _validate(ops_by_rank: list[list[Op]], pp: int, vpp: int, paired: bool = True) -> None:
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
        if paired and fwd != bwd:  # a forward without backward leaks its activations; the reverse cannot run
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


def op_messages(op: Op, rank: int, pp: int, vpp: int | None = None) -> tuple[tuple | None, tuple | None]:
    """(the message ``op`` receives, the message it sends), each ``(kind, microbatch, receiving virtual stage)`` or
    None: a forward receives ``act`` from stage v - 1 and sends it to v + 1, a backward ``grad`` the other way."""
    v, last = op.chunk * pp + rank, pp * _vpp(vpp) - 1
    if op.kind == "F":
        return ("act", op.microbatch, v) if v > 0 else None, ("act", op.microbatch, v + 1) if v < last else None
    return ("grad", op.microbatch, v) if v < last else None, ("grad", op.microbatch, v - 1) if v > 0 else None


def message_ranks(msg: tuple, pp: int) -> tuple[int, int]:
    """(sender, receiver) pipeline ranks of a message."""
    kind, _, v = msg
    return (v - 1 if kind == "act" else v + 1) % pp, v % pp


class ExchangePlan(NamedTuple):
    """How one rank's executor moves its messages. ``posts[e]``: the ("send" | "recv", message) it posts together
    (one batch) right before op ``e``; ``posts[len(ops)]`` after the last op. ``waits[i]``: the post whose batch
    op ``i`` waits for before it computes (-1: none)."""
    posts: list
    waits: list


def phase_plan(ops: list[Op], phases: list[list[int]], rank: int, pp: int, vpp: int | None = None) -> ExchangePlan:
    """The synchronous executor: before each phase one exchange (the previous phase's sends and this phase's
    receives) that completes before any op of the phase computes."""
    posts: list[list] = [[] for _ in range(len(ops) + 1)]
    waits = [-1] * len(ops)
    for phase in phases:
        for k in phase:
            recv, send = op_messages(ops[k], rank, pp, vpp)
            waits[k] = phase[0]
            if recv:
                posts[phase[0]].append(("recv", recv))
            if send:
                posts[phase[-1] + 1].append(("send", send))
    return ExchangePlan(posts, waits)


def overlap_plan(ops: list[Op], rank: int, pp: int, vpp: int | None = None, prefetch: bool = True) -> ExchangePlan:
    """The overlapped executor: each op's output is posted right after the op, and each op waits only for the batch
    that holds its own input, so transfers run while the rank computes. Where an input's receive is posted:

    * ``prefetch=False`` (Megatron's non-interleaved 1F1B, ``send_forward_recv_backward`` and
      ``send_backward_recv_forward``): right before the op, with the previous op's output;
    * ``prefetch=True`` (Megatron's interleaved schedule with ``overlap_p2p_comm``): right after the previous op of
      the same kind, so it arrives while the op in between computes; the first backward's right before it.
    """
    posts: list[list] = [[] for _ in range(len(ops) + 1)]
    waits = [-1] * len(ops)
    previous: dict[str, int] = {}
    for j, op in enumerate(ops):
        recv, send = op_messages(op, rank, pp, vpp)
        if recv:
            at = j
            if prefetch and op.kind in previous:
                at = previous[op.kind] + 1
            elif prefetch and op.kind == "F":
                at = 0
            posts[at].append(("recv", recv))
            waits[j] = at
        if send:
            posts[j + 1].append(("send", send))
        previous[op.kind] = j
    return ExchangePlan(posts, waits)


# Prefetching deadlocks 1F1B (simulate_plans), which lacks interleaving's doubled warmup: with pp=2, m=3, rank 0
# posts B1's receive right after B0 and rank 1 F2's right after F1; each batch completes only with the other rank's
# next send (after its F2, after its B1), which it posts behind its own pending batch. Interleaved 1F1B's doubled
# warmup pairs every batch with the neighbours' batches of the same step, so it prefetches, as Megatron does.
PREFETCH = {"afab": True, "1f1b": False, "interleaved_1f1b": True}


def exchange_plans(schedule: str, pp: int, num_microbatches: int, vpp: int | None = None, overlap: bool = False,
                   train: bool = True, merged: bool = False) -> tuple[list[list[Op]], list[ExchangePlan]]:
    """Every rank's ops (``build_schedule``; the forwards in ``forward_order`` when not ``train``) and the plan its
    executor follows (``overlap_plan`` when ``overlap``, else ``phase_plan``; forward-only: one op per phase).
    ``merged`` (training, overlapped exchanges): the steady-state pairs run as one op (``merge_plan``)."""
    check_schedule(schedule, pp, num_microbatches, vpp)
    if merged and not (train and overlap):
        raise ValueError("merged (F, B) pairs need the overlapped exchanges of a training schedule")
    fwd = [Op("F", mb, c) for mb, c in forward_order(pp, num_microbatches, vpp)]
    ops = [build_schedule(schedule, pp, r, num_microbatches, vpp, merged) if train else list(fwd) for r in range(pp)]
    if overlap:
        plans = [overlap_plan(o, r, pp, vpp, PREFETCH[schedule]) for r, o in enumerate(ops)]
        if merged:
            plans = [merge_plan(o, plan, r, pp, vpp) for r, (o, plan) in enumerate(zip(ops, plans))]
    else:
        phases = [exchange_phases(schedule, pp, r, num_microbatches, vpp) if train else [[k] for k in range(len(o))]
                  for r, o in enumerate(ops)]
        plans = [phase_plan(o, ph, r, pp, vpp) for r, (o, ph) in enumerate(zip(ops, phases))]
    return ops, plans


def merged_pairs(ops: list[Op]) -> list[int]:
    """Indices ``i`` of the steady-state pairs (F at ``i``, B at ``i + 1``) of a ``merged`` schedule: each runs as one
    op, the backward's steps paired with the forward's (``moe_overlap.run_merged``)."""
    pairs = [i for i in range(len(ops) - 1) if ops[i].kind == "F" and ops[i + 1].kind == "B"]
    for i in pairs:
        if ops[i][1:] == ops[i + 1][1:]:
            raise ValueError(f"{ops[i]!r} and {ops[i + 1]!r} cannot run merged: build the schedule with merged=True")
    return pairs


def merge_plan(ops: list[Op], plan: ExchangePlan, rank: int, pp: int, vpp: int | None = None) -> ExchangePlan:
    """``plan`` for executing each ``merged_pairs`` pair as one op: the backward's input is received no later than
    the post before the forward, which waits for both inputs; nothing is posted between the two ops (their outputs
    leave together after the pair), so the forward's send and the receives posted between them move to after it."""
    posts = [list(p) for p in plan.posts]
    waits = list(plan.waits)
    for i in merged_pairs(ops):
        recv, _ = op_messages(ops[i + 1], rank, pp, vpp)
        if recv is not None and ("recv", recv) in posts[i + 1]:  # the first backward's: posted before the pair
            posts[i + 1].remove(("recv", recv))
            posts[i].append(("recv", recv))
        if recv is not None:
            waits[i] = max(waits[i], i if waits[i + 1] == i + 1 else waits[i + 1])
        waits[i + 1] = waits[i]
        posts[i + 2] = posts[i + 1] + posts[i + 2]
        posts[i + 1] = []
        waits = [i + 2 if w == i + 1 else w for w in waits]
    return ExchangePlan(posts, waits)


def plan_problems(ops_by_rank: list[list[Op]], plans: list[ExchangePlan], pp: int, vpp: int | None = None) -> list[str]:
    """What is wrong with the plans besides deadlocks; empty when nothing is. Every message is posted once by its
    sender after the op producing it and once by its receiver no later than the op consuming it, which waits for it;
    and on every (sender, receiver) pair both ends post their messages in the same order (by post, then by message
    within a batch, the order the executor posts a batch in): NCCL matches a pair's untagged messages in order, and
    for pp = 2 one pair carries both activations and gradients."""
    problems = []
    posted: dict[tuple[str, tuple], list] = {}
    order: dict[tuple[str, int, int], list] = {}
    for r, (ops, plan) in enumerate(zip(ops_by_rank, plans)):
        if len(plan.posts) != len(ops) + 1 or len(plan.waits) != len(ops):
            problems.append(f"rank {r}: {len(plan.posts)} posts and {len(plan.waits)} waits for {len(ops)} ops")
            continue
        at = {}
        for e, post in enumerate(plan.posts):
            for what, msg in sorted(post, key=lambda p: p[1]):
                posted.setdefault((what, msg), []).append((r, e))
                order.setdefault((what, *message_ranks(msg, pp)), []).append(msg)
                at[(what, msg)] = e
        for i, op in enumerate(ops):
            recv, send = op_messages(op, r, pp, vpp)
            if send and not at.get(("send", send), -1) > i:
                problems.append(f"rank {r}: {op!r} sends {send} at post {at.get(('send', send))}, not after it")
            if recv and not (recv_at := at.get(("recv", recv), len(ops) + 1)) <= plan.waits[i] <= i:
                problems.append(f"rank {r}: {op!r} receives {recv} at post {recv_at} but waits for post "
                                f"{plan.waits[i]}")
    for (what, msg), where in sorted(posted.items()):
        other = "recv" if what == "send" else "send"
        if len(where) > 1 or (other, msg) not in posted:
            problems.append(f"{msg} is posted as {what} at (rank, post) {where} and as {other} at "
                            f"{posted.get((other, msg), [])}")
    for (what, src, dst), msgs in sorted(order.items()):
        got = order.get(("recv", src, dst), [])
        if what == "send" and msgs != got:
            k = next((i for i, (a, b) in enumerate(zip(msgs, got)) if a != b), min(len(msgs), len(got)))
            problems.append(f"{src}->{dst}: message #{k} is sent as {msgs[k] if k < len(msgs) else None} but "
                            f"received as {got[k] if k < len(got) else None}")
    return problems


def simulate_plans(ops_by_rank: list[list[Op]], plans: list[ExchangePlan], pp: int, vpp: int | None = None,
                   f_time: float = 1.0, b_time: float = 2.0) -> dict:
    """Check that the executors' plans cannot deadlock (RuntimeError naming the stuck ranks; also for any
    ``plan_problems``) and time them with free communication; the result is ``simulate_ops``'s.

    Deadlock model (rendezvous, no buffering, as NCCL): a batch completes once every peer has posted the matching
    side; a rank's batches complete one after another (one NCCL stream); and a rank moves past a post only when that
    batch has completed. The last rule is NCCL's worst case: a receive kernel left waiting while the host launches
    more work can block that host at any moment (an implicit device synchronisation, e.g. a cudaFree or a module
    load) until the kernel completes. A plan that passes completes however often that happens.

    Timing (GPU time): a batch starts when its rank's compute reaches it and the previous batch has completed, a
    message arrives when both of its batches have started, a batch completes with its last message, and an op starts
    when its rank is free and the batch it waits for has completed (the executor waits on the GPU, not the host)."""
    v = _vpp(vpp)
    _validate(ops_by_rank, pp, v, paired=False)
    problems = plan_problems(ops_by_rank, plans, pp, vpp)
    if problems:
        raise RuntimeError(f"exchange plans (pp={pp}, vpp={vpp}): " + "; ".join(problems))
    where = {(what, msg): (r, e) for r, plan in enumerate(plans) for e, post in enumerate(plan.posts)
             for what, msg in post}
    start: dict[tuple[int, int], float] = {}  # (rank, post) -> when its batch started
    upto: list[list[float]] = [[] for _ in range(pp)]  # per rank and post: when all its batches so far completed
    pos, free = [0] * pp, [0] * pp  # next event per rank (2e: post e, 2e + 1: op e); end of its last op
    timeline: list[list[tuple[Op, float, float]]] = [[] for _ in range(pp)]
    busy = [0] * pp  # ints, so that Fraction times stay exact
    while True:
        progressed = False
        for r, (ops, plan) in enumerate(zip(ops_by_rank, plans)):
            while pos[r] <= 2 * len(ops):
                e, is_op = divmod(pos[r], 2)
                if is_op:
                    op, w = ops[e], plan.waits[e]
                    t = max(free[r], upto[r][w] if w >= 0 else 0)
                    free[r] = t + (f_time if op.kind == "F" else b_time)
                    timeline[r].append((op, t, free[r]))
                    busy[r] += free[r] - t
                else:
                    done = upto[r][-1] if upto[r] else 0
                    if plan.posts[e]:
                        start.setdefault((r, e), max(free[r], done))
                        peers = [where[("recv" if what == "send" else "send", msg)] for what, msg in plan.posts[e]]
                        if any(p not in start for p in peers):
                            break  # a peer has not posted its side yet
                        done = max([start[(r, e)]] + [start[p] for p in peers])
                    upto[r].append(done)
                pos[r] += 1
                progressed = True
        if all(pos[r] > 2 * len(ops) for r, ops in enumerate(ops_by_rank)):
            break
        if not progressed:
            stuck = [f"rank {r} at post {pos[r] // 2}: {plans[r].posts[pos[r] // 2]}" for r in range(pp)
                     if pos[r] <= 2 * len(ops_by_rank[r])]
            raise RuntimeError("deadlock in the p2p exchanges: " + "; ".join(stuck))
    makespan = max([max(u) if u else 0 for u in upto] + free)
    return {"makespan": makespan, "busy": busy, "idle": [makespan - b for b in busy],
            "bubble_fraction": 1 - sum(busy) / (pp * makespan) if makespan else 0.0, "timeline": timeline}


def simulate_rendezvous(schedule: str, pp: int, num_microbatches: int, vpp: int | None = None,
                        overlap: bool = False, train: bool = True) -> dict:
    """``simulate_plans`` for the executor of a schedule (``exchange_plans``): RuntimeError if it can deadlock or
    mismatch messages, else its timing with free communication."""
    ops, plans = exchange_plans(schedule, pp, num_microbatches, vpp, overlap, train)
    return simulate_plans(ops, plans, pp, vpp)


def check_rendezvous(ops_by_rank: list[list[Op]], phases_by_rank: list[list[list[int]]], pp: int,
                     vpp: int | None = None) -> None:
    """``simulate_plans`` for synchronous exchanges before the given phases (``phase_plan``): RuntimeError naming
    the stuck ranks if they can deadlock."""
    plans = [phase_plan(ops, phases, r, pp, vpp) for r, (ops, phases) in enumerate(zip(ops_by_rank, phases_by_rank))]
    simulate_plans(ops_by_rank, plans, pp, vpp)
