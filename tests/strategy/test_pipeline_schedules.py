"""Pipeline schedules (lightning_moe.strategy.pipeline.schedules): op lists, timing model, deadlocks, p2p FIFO order."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from lightning_moe.strategy.pipeline.schedules import (
    SCHEDULES,
    Op,
    backward_order,
    build_schedule,
    check_p2p_order,
    check_schedule,
    forward_order,
    p2p_order_problems,
    simulate,
    simulate_ops,
)


def _valid(schedule, pp, m, vpp):
    try:
        check_schedule(schedule, pp, m, vpp)
    except ValueError:
        return False
    return True


GRID = [
    (s, pp, m, vpp)
    for s, pp, vpp, m in itertools.product(SCHEDULES, range(1, 5), (None, 2, 3), range(1, 9))
    if _valid(s, pp, m, vpp)
]


def _ops(text: str) -> list[Op]:
    """'F0 B0 F1.1' -> [F(mb 0, chunk 0), B(mb 0, chunk 0), F(mb 1, chunk 1)]."""
    out = []
    for tok in text.split():
        mb, _, chunk = tok[1:].partition(".")
        out.append(Op(tok[0], int(mb), int(chunk or 0)))
    return out


def test_grid_covers_every_schedule():
    assert {s for s, *_ in GRID} == set(SCHEDULES)
    assert any(s == "interleaved_1f1b" and pp == 1 for s, pp, _, _ in GRID)
    assert any(s == "afab" and vpp and m % pp for s, pp, m, vpp in GRID)


# ------------------------------------------------------------------------------------------------- op list structure
def test_every_op_once_and_backward_after_forward():
    for schedule, pp, m, vpp in GRID:
        wanted = {(mb, c) for mb in range(m) for c in range(vpp or 1)}
        for rank in range(pp):
            ops = build_schedule(schedule, pp, rank, m, vpp)
            case = (schedule, pp, m, vpp, rank, ops)
            assert len(ops) == 2 * len(wanted) == len(set(ops)), case
            pos = {op: i for i, op in enumerate(ops)}
            assert all(pos[Op("F", mb, c)] < pos[Op("B", mb, c)] for mb, c in wanted), case
            # forwards / backwards keep the rank-independent orders (what keeps FIFO messages matched)
            assert [(o.microbatch, o.chunk) for o in ops if o.kind == "F"] == forward_order(pp, m, vpp), case
            assert [(o.microbatch, o.chunk) for o in ops if o.kind == "B"] == backward_order(pp, m, vpp), case


def test_1f1b_pp2_m4():
    assert build_schedule("1f1b", 2, 0, 4) == _ops("F0 F1 B0 F2 B1 F3 B2 B3")
    assert build_schedule("1f1b", 2, 1, 4) == _ops("F0 B0 F1 B1 F2 B2 F3 B3")


def test_1f1b_fewer_microbatches_than_stages():
    assert build_schedule("1f1b", 4, 0, 2) == _ops("F0 F1 B0 B1")
    assert build_schedule("1f1b", 4, 3, 2) == _ops("F0 B0 F1 B1")


def test_pp1_is_gradient_accumulation():
    assert build_schedule("1f1b", 1, 0, 3) == _ops("F0 B0 F1 B1 F2 B2")
    assert build_schedule("afab", 1, 0, 3) == _ops("F0 F1 F2 B0 B1 B2")


def test_interleaved_pp2_vpp2_m4_by_hand():
    # total = 8; forward k -> (mb, chunk): 0:(0,0) 1:(1,0) 2:(0,1) 3:(1,1) 4:(2,0) 5:(3,0) 6:(2,1) 7:(3,1)
    # backward k:                          0:(0,1) 1:(1,1) 2:(0,0) 3:(1,0) 4:(2,1) 5:(3,1) 6:(2,0) 7:(3,0)
    # warmup: rank 0 = (2-0-1)*2 + (2-1)*2 = 4, rank 1 = 0 + 2 = 2
    assert forward_order(2, 4, 2) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    assert backward_order(2, 4, 2) == [(0, 1), (1, 1), (0, 0), (1, 0), (2, 1), (3, 1), (2, 0), (3, 0)]
    assert build_schedule("interleaved_1f1b", 2, 0, 4, 2) == _ops(
        "F0.0 F1.0 F0.1 F1.1 "  # warmup
        "F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 "  # steady 1F1B
        "B2.1 B3.1 B2.0 B3.0"  # cooldown
    )
    assert build_schedule("interleaved_1f1b", 2, 1, 4, 2) == _ops(
        "F0.0 F1.0 "
        "F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 "
        "B2.0 B3.0"
    )


def test_interleaved_m_equals_pp_is_all_warmup():
    for rank in range(2):
        ops = build_schedule("interleaved_1f1b", 2, rank, 2, 3)
        assert [o.kind for o in ops] == ["F"] * 6 + ["B"] * 6


def test_afab_orders_with_short_last_group():
    # m=3 over groups of pp=2: chunk-major within [0, 1], then the short group [2]
    assert forward_order(2, 3, 2) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (2, 1)]
    assert backward_order(2, 3, 2) == [(0, 1), (1, 1), (0, 0), (1, 0), (2, 1), (2, 0)]
    assert forward_order(3, 2) == [(0, 0), (1, 0)]


# ------------------------------------------------------------------------------------------------------- timing model
def test_simulate_no_deadlock_and_accounting():
    for schedule, pp, m, vpp in GRID:
        r = simulate(schedule, pp, m, vpp)
        assert r["busy"] == [m * (vpp or 1) * 3.0] * pp
        assert r["idle"] == pytest.approx([r["makespan"] - b for b in r["busy"]])
        assert 0 <= r["bubble_fraction"] < 1
        assert r["ideal"] == pytest.approx((pp - 1) / ((vpp or 1) * m + pp - 1))


@pytest.mark.parametrize("f,b", [(1, 2), (1, 1), (1, 3), (3, 1)])
def test_bubble_matches_megatron_formula(f, b):
    """Exact (in fractions) for any f:b whenever vpp == 1 or m % pp == 0, as the docstring of simulate says."""
    for schedule, pp, m, vpp in GRID:
        if (vpp or 1) == 1 or m % pp == 0:
            r = simulate(schedule, pp, m, vpp, Fraction(f), Fraction(b))
            assert r["bubble_fraction"] == Fraction(pp - 1, (vpp or 1) * m + pp - 1), (schedule, pp, m, vpp)


def test_1f1b_bubble_default_times():
    for pp, m in itertools.product(range(1, 5), range(1, 9)):
        assert simulate("1f1b", pp, m)["bubble_fraction"] == pytest.approx((pp - 1) / (m + pp - 1))


@pytest.mark.parametrize("pp,m,vpp", [(2, 4, 2), (4, 8, 2), (4, 8, 3)])
def test_interleaved_beats_1f1b(pp, m, vpp):
    assert simulate("interleaved_1f1b", pp, m, vpp)["bubble_fraction"] < simulate("1f1b", pp, m)["bubble_fraction"]


def test_afab_same_makespan_as_1f1b():
    for pp, m in itertools.product(range(1, 5), range(1, 9)):
        assert simulate("afab", pp, m)["makespan"] == simulate("1f1b", pp, m)["makespan"]
    for pp, m, vpp in [(2, 4, 2), (4, 8, 2), (2, 6, 3)]:
        assert simulate("afab", pp, m, vpp)["makespan"] == simulate("interleaved_1f1b", pp, m, vpp)["makespan"]


def test_afab_vpp_short_last_group_is_worse():
    r = simulate("afab", 2, 1, 2, Fraction(1), Fraction(2))
    assert r["bubble_fraction"] == Fraction(1, 2) and r["ideal"] == pytest.approx(1 / 3)
    r = simulate("afab", 2, 3, 2, Fraction(1), Fraction(2))
    assert r["bubble_fraction"] > Fraction(1, 7)


def test_simulate_timeline_1f1b_pp2_m2():
    tl = simulate("1f1b", 2, 2)["timeline"]
    assert [(str(op), s, e) for op, s, e in tl[1]] == [
        ("F(mb=0, chunk=0)", 1, 2), ("B(mb=0, chunk=0)", 2, 4), ("F(mb=1, chunk=0)", 4, 5), ("B(mb=1, chunk=0)", 5, 7)
    ]


# ------------------------------------------------------------------------------------------------- broken schedules
def test_backward_before_next_stage_forward_deadlocks():
    # rank 0 waits in B0 for rank 1's B0, which waits behind F1, which needs rank 0's F1 after B0
    ops = [_ops("F0 B0 F1 B1"), _ops("F0 F1 B0 B1")]
    with pytest.raises(RuntimeError, match=r"deadlock.*rank 0 op #1 B\(mb=0, chunk=0\) waits for B\(mb=0, stage=1\)"):
        simulate_ops(ops, pp=2)


def test_backward_before_own_forward_deadlocks():
    with pytest.raises(RuntimeError, match=r"deadlock.*rank 1 op #0 B\(mb=1, chunk=0\) waits for F\(mb=1, stage=1\)"):
        simulate_ops([_ops("F0 F1 B0 B1"), _ops("B1 F0 F1 B0")], pp=2)


def test_reversed_forwards_mismatch_p2p_but_do_not_deadlock():
    ops = [_ops("F0 F1 B0 B1"), _ops("F1 F0 B0 B1")]
    simulate_ops(ops, pp=2)  # zero-latency buffered sends: fine for timing
    problems = p2p_order_problems(ops, pp=2)
    assert problems == ["act 0->1: message #0 is sent as (mb=0, stage=0) but received as (mb=1, stage=0)"]


def test_check_p2p_order_raises_on_mismatch(monkeypatch):
    import lightning_moe.strategy.pipeline.schedules as mod

    real = mod.build_schedule
    broken = {1: _ops("F1 F0 B0 B1")}
    monkeypatch.setattr(mod, "build_schedule", lambda s, pp, r, *a: broken.get(r) or real(s, pp, r, *a))
    with pytest.raises(RuntimeError, match=r"'afab' \(pp=2, num_microbatches=2, vpp=None\).*act 0->1: message #0"):
        check_p2p_order("afab", 2, 2)


def test_p2p_wraparound_mismatch_pp1_vpp2():
    # rank 0 sends to itself: chunk 0 produces mb 0, 1 but chunk 1 consumes mb 1, 0; likewise for the gradients
    ops = [_ops("F0.0 F1.0 F1.1 F0.1 B1.1 B0.1 B0.0 B1.0")]
    problems = p2p_order_problems(ops, pp=1, vpp=2)
    assert "act 0->0: message #0 is sent as (mb=0, stage=0) but received as (mb=1, stage=0)" in problems
    assert "grad 0->0: message #0 is sent as (mb=1, stage=1) but received as (mb=0, stage=1)" in problems


def test_invalid_op_lists_rejected():
    with pytest.raises(ValueError, match="expected pp=2"):
        simulate_ops([_ops("F0 B0")], pp=2)
    with pytest.raises(ValueError, match="runs an op twice"):
        simulate_ops([_ops("F0 F0 B0")], pp=1)
    with pytest.raises(ValueError, match=r"only F \[\(1, 0\)\]"):
        p2p_order_problems([_ops("F0 F1 B0")], pp=1)
    with pytest.raises(ValueError, match="invalid"):
        simulate_ops([_ops("F0.2 B0.2")], pp=1, vpp=2)


def test_p2p_order_on_grid():
    for schedule, pp, m, vpp in GRID:
        check_p2p_order(schedule, pp, m, vpp)


# ---------------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("args,pattern", [
    (("gpipe", 2, 4), r"unknown pipeline schedule 'gpipe'; known: afab, 1f1b, interleaved_1f1b"),
    (("1f1b", 0, 4), r"pp=0 must be >= 1"),
    (("1f1b", 2, 0), r"num_microbatches=0 must be >= 1"),
    (("afab", 2, 4, 0), r"vpp=0 must be >= 1"),
    (("1f1b", 2, 4, 2), r"vpp=2.*use schedule='interleaved_1f1b'"),
    (("interleaved_1f1b", 2, 4), r"needs virtual_pipeline_size >= 2, got vpp=None"),
    (("interleaved_1f1b", 2, 4, 1), r"needs virtual_pipeline_size >= 2, got vpp=1"),
    (("interleaved_1f1b", 4, 6, 2), r"groups of pp=4.*num_microbatches=6 must be a multiple of 4 \(e\.g\. 4 or 8\)"),
    (("interleaved_1f1b", 4, 3, 2), r"num_microbatches=3 must be a multiple of 4 \(e\.g\. 4\)"),
])
def test_check_schedule_errors(args, pattern):
    with pytest.raises(ValueError, match=pattern):
        check_schedule(*args)
    with pytest.raises(ValueError, match=pattern):
        simulate(*args)
    with pytest.raises(ValueError, match=pattern):
        build_schedule(args[0], args[1], 0, *args[2:])


def test_build_schedule_rank_range():
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, pp=2\)"):
        build_schedule("1f1b", 2, 2, 4)
    with pytest.raises(ValueError, match=r"rank=-1"):
        build_schedule("1f1b", 2, -1, 4)


def test_afab_accepts_any_vpp_and_m():
    check_schedule("afab", 3, 5, 4)
    check_schedule("afab", 1, 1, None)


def test_executor_exchanges_never_deadlock():
    """The engine's exchange pattern (a phase's receives posted with the previous phase's sends, all completed before
    computing) under rendezvous semantics, on the whole grid; and a broken pattern is caught."""
    from lightning_moe.strategy.pipeline.schedules import check_rendezvous, exchange_phases, simulate_rendezvous
    n = 0
    for name in SCHEDULES:
        for pp in range(1, 5):
            for vpp in (None, 2, 3):
                for m in range(1, 9):
                    try:
                        check_schedule(name, pp, m, vpp)
                    except ValueError:
                        continue
                    if pp == 1 and vpp:  # the layout refuses virtual stages without PP (no self-sends)
                        continue
                    simulate_rendezvous(name, pp, m, vpp)
                    n += 1
    assert n > 100
    assert exchange_phases("1f1b", 2, 0, 4) == [[0], [1, 2], [3, 4], [5, 6], [7]]
    for pp, vpp, m in ((2, None, 3), (4, 2, 8), (3, 3, 6)):  # validation: forwards only, one exchange each
        fwd = [[Op("F", mb, c) for mb, c in forward_order(pp, m, vpp)] for _ in range(pp)]
        check_rendezvous(fwd, [[[k] for k in range(len(f))] for f in fwd], pp, vpp)
    # one exchange per op (each op's receive posted with the previous op's sends) deadlocks interleaved 1F1B
    ops = [build_schedule("interleaved_1f1b", 2, r, 4, 2) for r in range(2)]
    with pytest.raises(RuntimeError, match="deadlock"):
        check_rendezvous(ops, [[[k] for k in range(len(o))] for o in ops], 2, 2)


# ------------------------------------------------------------------------------------------- overlapped p2p (plans)
def test_overlapped_plans_never_deadlock_and_keep_the_schedules_bubble():
    """Every schedule of the grid with overlap_p2p_comm, training and forwards only: no deadlock under the worst-case
    rendezvous of simulate_plans (a host may block on all its pending batches at any moment), both ends of every pair
    post their messages in the same order, and with free communication the bubble is exactly the schedule's."""
    from lightning_moe.strategy.pipeline.schedules import exchange_plans, simulate_plans, simulate_rendezvous
    n = 0
    for schedule, pp, m, vpp in GRID:
        if pp == 1 and vpp:  # the layout refuses virtual stages without PP (no self-sends)
            continue
        ops, plans = exchange_plans(schedule, pp, m, vpp, overlap=True)
        for f, b in ((Fraction(1), Fraction(2)), (Fraction(3), Fraction(1))):
            got = simulate_plans(ops, plans, pp, vpp, f, b)
            assert got["bubble_fraction"] == simulate(schedule, pp, m, vpp, f, b)["bubble_fraction"], \
                (schedule, pp, m, vpp, f, b)
        simulate_rendezvous(schedule, pp, m, vpp, overlap=True, train=False)
        n += 1
    assert n > 100


def test_synchronous_1f1b_makes_the_stages_take_turns():
    """The fallback's 1F1B exchanges pair a steady-state F with the next B and send both outputs after both ran, so
    with pp=2 the stages alternate (bubble 1/2, the schedule's is 1/5); the overlapped plan sends each output at once.
    Interleaved 1F1B's synchronous pairs already reach its bubble."""
    from lightning_moe.strategy.pipeline.schedules import simulate_rendezvous
    assert simulate_rendezvous("1f1b", 2, 4)["bubble_fraction"] == 0.5
    assert simulate_rendezvous("1f1b", 2, 4, overlap=True)["bubble_fraction"] == pytest.approx(0.2)
    assert simulate_rendezvous("1f1b", 4, 8)["bubble_fraction"] > 0.5 > simulate("1f1b", 4, 8)["bubble_fraction"]
    assert (simulate_rendezvous("interleaved_1f1b", 2, 4, 2)["bubble_fraction"]
            == pytest.approx(simulate("interleaved_1f1b", 2, 4, 2)["bubble_fraction"]))


def test_overlap_plans_by_hand():
    from lightning_moe.strategy.pipeline.schedules import exchange_plans
    # 1F1B (Megatron's send_forward_recv_backward / send_backward_recv_forward): receive right before the op
    ops, plans = exchange_plans("1f1b", 2, 4, overlap=True)
    assert ops[0] == _ops("F0 F1 B0 F2 B1 F3 B2 B3")
    assert plans[0].posts[:4] == [[], [("send", ("act", 0, 1))],
                                  [("send", ("act", 1, 1)), ("recv", ("grad", 0, 0))], []]
    assert plans[0].waits == [-1, -1, 2, -1, 4, -1, 6, 7]
    assert plans[1].posts[:3] == [[("recv", ("act", 0, 1))], [], [("send", ("grad", 0, 0)), ("recv", ("act", 1, 1))]]
    assert plans[1].posts[-1] == [("send", ("grad", 3, 0))]
    # interleaved (Megatron's overlap_p2p_comm): the next forward's input is received right after this forward, the
    # next backward's right after this backward, the first backward's with the last warmup forward's output
    ops, plans = exchange_plans("interleaved_1f1b", 2, 4, 2, overlap=True)
    assert ops[1][:4] == _ops("F0.0 F1.0 F0.1 B0.1")
    assert plans[1].posts[:4] == [[("recv", ("act", 0, 1))], [("send", ("act", 0, 2)), ("recv", ("act", 1, 1))],
                                  [("send", ("act", 1, 2)), ("recv", ("act", 0, 3))], [("recv", ("act", 1, 3))]]
    assert plans[1].waits[:4] == [0, 1, 2, -1]  # B0.1 on the last stage needs no gradient
    assert ops[0][5] == Op("B", 0, 1) and ("recv", ("grad", 0, 2)) in plans[0].posts[5] and plans[0].waits[5] == 5


def test_prefetching_1f1b_deadlocks():
    """Why 1F1B does not prefetch (schedules.PREFETCH): rank 0 posts B1's receive after B0, rank 1 F2's after F1,
    and each completes only with a send the other posts behind it."""
    from lightning_moe.strategy.pipeline.schedules import overlap_plan, simulate_plans
    ops = [build_schedule("1f1b", 2, r, 3) for r in range(2)]
    with pytest.raises(RuntimeError, match=r"deadlock.*rank 0 at post 3: \[\('recv', \('grad', 1, 0\)\)\]; "
                                           r"rank 1 at post 3: \[\('recv', \('act', 2, 1\)\)\]"):
        simulate_plans(ops, [overlap_plan(o, r, 2, None, prefetch=True) for r, o in enumerate(ops)], 2)


def test_plan_problems_catch_misordered_and_misplaced_messages():
    from lightning_moe.strategy.pipeline.schedules import exchange_plans, plan_problems, simulate_plans
    ops, plans = exchange_plans("interleaved_1f1b", 2, 4, 2, overlap=True)
    assert plan_problems(ops, plans, 2, 2) == []
    # pp=2: rank 0 -> 1 carries gradients and activations; rank 0 sends grad (0, 1) at post 6, act (3, 1) at post 7.
    # Rank 1 receiving both at post 6 (still before F3.0 needs it) sorts act first: NCCL would swap the two.
    moved = [list(p) for p in plans[1].posts]
    moved[7].remove(("recv", ("act", 3, 1)))
    moved[6].append(("recv", ("act", 3, 1)))
    bad = [plans[0], plans[1]._replace(posts=moved, waits=[w if w != 7 else 6 for w in plans[1].waits])]
    problems = plan_problems(ops, bad, 2, 2)
    assert problems == ["0->1: message #5 is sent as ('grad', 0, 1) but received as ('act', 3, 1)"], problems
    with pytest.raises(RuntimeError, match="sent as"):
        simulate_plans(ops, bad, 2, 2)
    # a send before the op that produces it, a receive the op does not wait for
    early = [list(p) for p in plans[0].posts]
    early[1].remove(("send", ("act", 0, 1)))
    early[0].append(("send", ("act", 0, 1)))
    assert plan_problems(ops, [plans[0]._replace(posts=early), plans[1]], 2, 2) == [
        "rank 0: F(mb=0, chunk=0) sends ('act', 0, 1) at post 0, not after it"]
    nowait = plans[1]._replace(waits=[-1] + plans[1].waits[1:])
    assert plan_problems(ops, [plans[0], nowait], 2, 2) == [
        "rank 1: F(mb=0, chunk=0) receives ('act', 0, 1) at post 0 but waits for post -1"]


def test_the_first_versions_prefetch_is_rejected():
    """The plan of the first NCCL executor, which hung: each op's input received while the previous op computes."""
    from lightning_moe.strategy.pipeline.schedules import ExchangePlan, op_messages, simulate_plans

    def one_ahead(ops, rank, pp, vpp):
        posts, waits = [[] for _ in range(len(ops) + 1)], [-1] * len(ops)
        for j, op in enumerate(ops):
            recv, send = op_messages(op, rank, pp, vpp)
            if recv:
                posts[max(j - 1, 0)].append(("recv", recv))
                waits[j] = max(j - 1, 0)
            if send:
                posts[j + 1].append(("send", send))
        return ExchangePlan(posts, waits)

    for schedule, pp, m, vpp in (("1f1b", 2, 4, None), ("interleaved_1f1b", 2, 4, 2), ("afab", 4, 8, None)):
        ops = [build_schedule(schedule, pp, r, m, vpp) for r in range(pp)]
        with pytest.raises(RuntimeError, match="deadlock"):
            simulate_plans(ops, [one_ahead(o, r, pp, vpp) for r, o in enumerate(ops)], pp, vpp)


# ------------------------------------------------------------------ merged (F, B) pairs (overlap_moe_comm)
@pytest.mark.parametrize("pp,vpp", [(2, 2), (4, 2), (2, 3), (4, 3)])
@pytest.mark.parametrize("groups", [2, 3])
def test_merged_interleaved_pairs_are_deadlock_free_and_keep_the_bubble(pp, vpp, groups):
    from lightning_moe.strategy.pipeline.schedules import exchange_plans, merged_pairs, simulate_plans
    m = groups * pp
    ops, plans = exchange_plans("interleaved_1f1b", pp, m, vpp, overlap=True, train=True, merged=True)
    merged = simulate_plans(ops, plans, pp, vpp)  # raises on deadlock or mismatched messages
    plain_ops, plain_plans = exchange_plans("interleaved_1f1b", pp, m, vpp, overlap=True, train=True)
    plain = simulate_plans(plain_ops, plain_plans, pp, vpp)
    assert merged["bubble_fraction"] == pytest.approx(plain["bubble_fraction"])
    for r, rank_ops in enumerate(ops):
        pairs = merged_pairs(rank_ops)
        # one warmup forward more than the plain schedule (whose first backward follows its first steady forward);
        # every later forward is merged with a backward
        plain_warmup = [o.kind for o in plain_ops[r]].index("B") - 1
        assert len(pairs) == sum(o.kind == "F" for o in rank_ops) - (plain_warmup + 1) > 0
        for i in pairs:
            assert plans[r].posts[i + 1] == [] and plans[r].waits[i + 1] == plans[r].waits[i]


def test_merged_pairs_need_the_interleaved_steady_state():
    from lightning_moe.strategy.pipeline.schedules import exchange_plans, simulate_plans
    # without interleaving, each merged pair waits for the next stage's pair: the bubble more than doubles
    ops, plans = exchange_plans("1f1b", 4, 16, None, overlap=True, train=True, merged=True)
    plain_ops, plain_plans = exchange_plans("1f1b", 4, 16, None, overlap=True, train=True)
    assert simulate_plans(ops, plans, 4)["bubble_fraction"] > 2 * simulate_plans(plain_ops, plain_plans,
                                                                                 4)["bubble_fraction"]
    # with num_microbatches == pp there is no steady state: merging the warmup's last forward deadlocks
    ops, plans = exchange_plans("interleaved_1f1b", 2, 2, 2, overlap=True, train=True, merged=True)
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate_plans(ops, plans, 2, 2)
    with pytest.raises(ValueError, match="overlapped exchanges"):
        exchange_plans("interleaved_1f1b", 2, 4, 2, overlap=False, train=True, merged=True)
