"""FP8Training under EP2, TP2 and EP2·ETP2 (gloo) against the one-process FP8 run: the amax reductions over the
ranks that split features (TP, ETP) or tokens (DP x CP, EDP) give every scale its one-process value, so the quantized
operands are the same and the first step's loss and gradients agree to float32 summation order (a value that lands
on a rounding boundary can still move by one FP8 step: 2e-3). Later steps are not compared: such flips then grow
through Adam. Blockwise tiles along tokens are the same only where each rank holds whole 128-token tiles (EP2 here)."""

from __future__ import annotations

from functools import partial

import pytest

from lightning_moe import FP8Training
from tests.parallel.parity import Case, check_case, run_cases, runnable

MODEL = dict(hidden_size=128, num_attention_heads=4, num_kv_heads=4, ffn_hidden_size=256, moe_ffn_hidden_size=128,
             load_balancing="global_aux_loss")
FIRST_STEP = {"loss": 2e-3, "grads": 2e-3}


def _case(name, world, recipe, **kw):
    return Case(name, world, model=MODEL, callbacks=(partial(FP8Training, recipe),), tol=FIRST_STEP, **kw)


CASES = runnable([
    _case("ep2_tensorwise", 2, "tensorwise", ep=2),
    _case("ep2_blockwise", 2, "blockwise", ep=2),
    _case("tp2_delayed", 2, "delayed", tp=2),
    _case("tp2_rowwise", 2, "rowwise", tp=2),
    _case("ep2_etp2_rowwise", 4, "rowwise", ep=2, etp=2),
])


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(CASES, tmp_path_factory.mktemp("fp8"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fp8_parity(results, case):
    check_case(case, results[case.name], FIRST_STEP)
    for r in results[case.name]:  # the loss of the first step: the same quantized forward
        assert abs(r["losses"][0][0] - r["losses"][1][0]) <= 1e-5 * abs(r["losses"][1][0])
