"""The fused Triton kernels (router, expert order, re-sort, gather, combine) on CPU under the Triton interpreter,
against their torch references (``fused_cases.py``). Skipped without triton (CI); small shapes, as the interpreter
runs every program in Python. The GPU grid is ``tests/test_gpu_fused.py``.

The interpreter must be chosen before the kernels are defined, and other tests import them without it, so the
outer test runs this file again in a fresh process with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.modules.interpreted import INSIDE, run_interpreted  # noqa: E402


@pytest.mark.skipif(INSIDE, reason="the outer test only")
def test_kernels_under_the_interpreter():
    run_interpreted(__file__, timeout=1200, TRITON_DEFAULT_FP_FUSION="1")


inside = pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")

ROUTERS = [
    dict(topk=2),
    dict(topk=3, pre_softmax=True, z_loss_coeff=1e-2),
    dict(topk=1, pre_softmax=True, load_balancing="global_aux_loss"),
    dict(topk=4, score_function="sigmoid", z_loss_coeff=1e-2, topk_scaling_factor=2.5),
    dict(topk=1, score_function="sigmoid", load_balancing="none"),
    dict(topk=4, score_function="sigmoid", expert_bias=True, num_groups=4, group_topk=2, topk_scaling_factor=2.5,
         load_balancing="seq_aux_loss"),
    dict(topk=4, num_groups=4, group_topk=2, load_balancing="seq_aux_loss", z_loss_coeff=1e-3),
    dict(topk=2, capacity_factor=1.0, drop_policy="probs"),
    dict(topk=2, capacity_factor=0.5, drop_policy="position", score_function="sigmoid", expert_bias=True),
]


@inside
@pytest.mark.parametrize("kw", ROUTERS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("T,E", [(40, 16), (24, 12)])
def test_router(kw, T, E):
    from tests.modules.fused_cases import check_router
    if kw.get("num_groups") and E % kw["num_groups"]:
        pytest.skip("groups must divide E")
    check_router("cpu", T, E, **kw)


@inside
@pytest.mark.parametrize("N,E,div,align,stride,drop", [(300, 8, 2, 1, 0, 0.0), (2100, 5, 3, 1, 0, 0.2),
                                                       (300, 8, 1, 16, 0, 0.1), (257, 6, 1, 1, 40, 0.3),
                                                       (9000, 4, 2, 8, 0, 0.1)])  # > 16 blocks of keys
def test_expert_order(N, E, div, align, stride, drop):
    from tests.modules.fused_cases import check_expert_order
    check_expert_order("cpu", N, E, div, align, stride, drop)


@inside
@pytest.mark.parametrize("S,L,align", [(4, 3, 1), (2, 8, 16), (8, 16, 1)])
def test_resort(S, L, align):
    from tests.modules.fused_cases import check_resort
    check_resort("cpu", S, L, align)


@inside
@pytest.mark.parametrize("kw", [dict(), dict(expert_rows_align=16), dict(capacity_factor=1.0),
                                dict(capacity_factor=1.0, pad_to_capacity=True, expert_rows_align=8),
                                dict(capacity_factor=1.0, probs_in_experts=False)],
                         ids=["dropless", "aligned", "dropping", "padded", "weighted_combine"])
def test_dispatch(kw):
    from tests.modules.fused_cases import check_dispatch
    check_dispatch("cpu", T=48, D=24, E=6, topk=2, **kw)
