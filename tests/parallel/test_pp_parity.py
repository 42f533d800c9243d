"""Pipeline parallelism (1F1B, interleaved, all-forward-all-backward) folded with EP and TP: N gloo ranks through
Trainer + MoEFoldStrategy against a 1-process reference that accumulates the same micro-batches.

Compared as in test_ep_parity.py: the loss of each of 3 steps, every gradient of step 1 on each stage (after sync,
before clipping; the global norm for clipping at 0.5 spans the stages), every parameter and buffer after 3 steps.
"""

from __future__ import annotations

import pytest

from tests.parallel.parity import PACKED, TOL, Case, check_case, run_cases, runnable

FOUR = dict(num_layers=4)
CASES = [
    Case("pp2_1f1b_m4", 2, pp=2, m=4, model=FOUR),
    Case("pp2_packed_documents_m2", 2, pp=2, m=2, model=FOUR, data=PACKED),
    Case("pp2_interleaved_v2_m4", 2, pp=2, m=4, model=FOUR, strategy=dict(virtual_pipeline_size=2)),
    Case("pp2_afab_m2_accumulate2", 2, pp=2, m=2, accumulate=2, model=FOUR, strategy=dict(pipeline_schedule="afab")),
    # uneven split (1 + 2 layers), tied embeddings (the last stage's copy and the first stage's embedding get the
    # summed gradient), a dense first layer and a shared expert
    Case("pp2_uneven_tied", 2, pp=2, m=2, model=dict(num_layers=3, tie_embeddings=True, first_k_dense=1,
                                                      shared_expert_ffn_size=32),
         strategy=dict(pipeline_first_stage_layers=1)),
    # the expert-bias counts and the global-aux-loss window accumulate over the micro-batches of both stages' layers
    Case("pp2_bias_global_aux_m4", 2, pp=2, m=4, model=dict(num_layers=4, expert_bias=True, bias_update_rate=1e-2,
                                                           score_function="sigmoid",
                                                           load_balancing="global_aux_loss")),
    Case("pp2_ep2", 4, pp=2, ep=2, m=2, model=FOUR),
    Case("pp2_tp2", 4, pp=2, tp=2, m=4, model=FOUR),
]
for _c in CASES:
    _c.adam_eps = 1e-6
CASES = runnable(CASES)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(CASES, tmp_path_factory.mktemp("pp"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_parity(results, case):
    check_case(case, results[case.name], TOL)
