"""The source's folding example on 8 ranks, in bf16: attention TP2 x CP2 x DP2 and TP2 x DP4, both with MoE EP8
(ETP1), against a 1-process reference. Over NCCL on eight GPUs with ``LMOE_PARITY_ACCELERATOR=gpu`` (issue 9); on
CPU only with ``LMOE_PARITY_EIGHT=1`` (8 gloo ranks on a 2-core CI machine take minutes).

Compared as in test_bf16_layouts_parity.py, with its tolerances.
"""

from __future__ import annotations

import pytest

from tests.parallel.parity import TOL, Case, check_case, run_cases, runnable
from tests.parallel.test_bf16_layouts_parity import BF16

GLOBAL = dict(load_balancing="global_aux_loss")  # DP > 1: the global-batch aux loss is the reference's loss
CASES = [
    Case("bf16_tp2_cp2_dp2_ep8", 8, tp=2, cp=2, ep=8, model=dict(qk_norm=True, **GLOBAL), **BF16),
    Case("bf16_tp2_dp4_etp1_ep8", 8, tp=2, ep=8, etp=1, model=GLOBAL, **BF16),
]
CASES = runnable(CASES)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(CASES, tmp_path_factory.mktemp("eight"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_parity(results, case):
    check_case(case, results[case.name], TOL)
