"""The four folded layouts of a mid-size MoE run in bf16 (bf16 weights, fp32 main grads and main params on both sides),
4 ranks against a 1-process reference: the layouts issue 8 runs over NCCL on four GPUs
(``LMOE_PARITY_ACCELERATOR=gpu``), here on gloo.

Compared as in test_ep_parity.py, with the bf16 tolerances (``parity.BF16_TOL``): the loss of each of 3 steps, every
gradient of step 1, every parameter and buffer after 3 AdamW steps.
"""

from __future__ import annotations

import pytest

from tests.parallel.parity import BF16_TOL, TOL, Case, check_case, run_cases, runnable

# Gradients by the norm of the difference: on CPU every tensor is within 3e-2 except the routers' (gradient norm ~1e-3,
# the softmax Jacobian cancels, so bf16 rounding moves it 7-16 %); a wrong scale or a lost micro-batch is >= 0.5.
# Parameters after 3 steps: within 5e-2 by norm, and elementwise within 0.2 of the tensor's max: Adam moves an element
# by ~lr per step whatever its gradient's size, so near-zero gradients whose bf16 sign differs end up to 2 lr per step
# apart (measured on H200s: 3.4e-3 = 3.4 lr, 0.10 of max |w| = 0.033).
BF16 = dict(precision="bf16-true", lr=1e-3,
            tol={"loss": BF16_TOL["loss"], "grads_norm": 0.25, "state": 0.2, "state_norm": 5e-2})
GLOBAL = dict(load_balancing="global_aux_loss")  # DP > 1: the global-batch aux loss is the reference's loss
CASES = runnable([
    Case("bf16_tp2_dp2_ep4", 4, tp=2, ep=4, model=GLOBAL, **BF16),
    Case("bf16_tp2_cp2_ep2_etp2", 4, tp=2, cp=2, ep=2, etp=2, model=dict(qk_norm=True), **BF16),
    Case("bf16_pp2_ep2", 4, pp=2, ep=2, m=2, model=dict(num_layers=4, **GLOBAL), adam_eps=1e-6, **BF16),
    Case("bf16_pp2_tp2", 4, pp=2, tp=2, m=4, model=dict(num_layers=4), adam_eps=1e-6, **BF16),
])


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(CASES, tmp_path_factory.mktemp("bf16"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_parity(results, case):
    check_case(case, results[case.name], TOL)
