"""Expert-parallel parity: N gloo ranks through Trainer + MoEFoldStrategy against a 1-process reference.

Compared: the loss of each of 3 steps, every gradient of step 1 (after sync, before clipping), every parameter and
buffer after 3 AdamW steps with gradient clipping (0.5, so it engages), and the expert bias bit for bit.
"""

from __future__ import annotations

import importlib.util

import lightning as L
import pytest

from tests.parallel.parity import ACCELERATOR, BF16_TOL, PACKED, TOL, Case, check_case, run_cases, runnable

GLOBAL = dict(score_function="sigmoid", expert_bias=True, bias_update_rate=1e-2, load_balancing="global_aux_loss")
CAP = dict(capacity_factor=1.0, drop_policy="probs")
FIXED = dict(GLOBAL, bias_update_rate=0.0)
FAKE = "tests.parallel.fake_deep_ep"


class TwoExpertsTakeAll(L.Callback):
    """Extreme routing: every token to experts 0 and 1 (both on EP rank 0), their expert bias dwarfing every sigmoid
    score; the other rank's experts get nothing."""

    def on_fit_start(self, trainer, pl_module):
        for moe in pl_module.model.moe_layers():
            moe.router.expert_bias[:2] = 100.0


CASES = [
    Case("ep2_alltoall_dropless", 2, ep=2, model=dict(dispatcher="alltoall", load_balancing="global_aux_loss")),
    # packed documents over DP2: each rank's targets differ in number, the loss is normalised over the global batch
    Case("ep2_packed_documents", 2, ep=2, model=dict(load_balancing="global_aux_loss"), data=PACKED),
    Case("ep2_allgather_dropless", 2, ep=2, model=dict(dispatcher="allgather", load_balancing="global_aux_loss")),
    # all tokens to two experts of one rank: dropless survives, capacity drops all but each expert's capacity
    Case("ep2_two_experts_take_all", 2, ep=2, model=FIXED, callbacks=(TwoExpertsTakeAll,)),
    Case("ep2_two_experts_take_all_capacity", 2, ep=2, callbacks=(TwoExpertsTakeAll,),
         model=dict(score_function="sigmoid", expert_bias=True, bias_update_rate=0.0, **CAP)),
    Case("ep2_alltoall_capacity", 2, ep=2, model=dict(dispatcher="alltoall", **CAP)),
    Case("ep2_allgather_capacity", 2, ep=2, model=dict(dispatcher="allgather", **CAP)),
    Case("ep2_alltoall_padded", 2, ep=2, model=dict(dispatcher="alltoall", pad_to_capacity=True, **CAP)),
    Case("ep2_sigmoid_bias_global_aux", 2, ep=2, model=dict(dispatcher="alltoall", **GLOBAL)),
    Case("ep4_alltoall", 4, ep=4, model=dict(dispatcher="alltoall", **GLOBAL)),
    Case("ep2_edp2_alltoall", 4, ep=2, model=dict(dispatcher="alltoall", **GLOBAL)),
    Case("ep2_etp2_alltoall", 4, ep=2, etp=2, model=dict(dispatcher="alltoall", **GLOBAL)),
    Case("ep2_etp2_allgather", 4, ep=2, etp=2, model=dict(dispatcher="allgather", **GLOBAL)),
    Case("ep4_alltoall_capacity", 4, ep=4, model=dict(dispatcher="alltoall", **CAP)),
    Case("ep2_accumulate2_global_aux", 2, ep=2, model=dict(dispatcher="alltoall", **GLOBAL), accumulate=2),
    Case("ep2_accumulate2_capacity", 2, ep=2, model=dict(dispatcher="allgather", **CAP), accumulate=2),
    Case("ep2_dedup_dropless", 2, ep=2, model=dict(dispatcher="alltoall_dedup", **GLOBAL)),
    Case("ep2_dedup_capacity", 2, ep=2, model=dict(dispatcher="alltoall_dedup", **CAP)),
    Case("ep4_dedup", 4, ep=4, model=dict(dispatcher="alltoall_dedup", **GLOBAL)),
    Case("ep2_etp2_dedup", 4, ep=2, etp=2, model=dict(dispatcher="alltoall_dedup", **GLOBAL)),
    Case("ep2_no_overlap_small_buckets", 2, ep=2, model=dict(dispatcher="alltoall", **GLOBAL),
         strategy=dict(overlap_grad_sync=False, bucket_size_mb=0.01)),
    # bf16 weights with fp32 main grads and main params on both sides
    Case("ep2_bf16_main_params", 2, ep=2, model=dict(dispatcher="alltoall", load_balancing="global_aux_loss"),
         precision="bf16-true", tol=BF16_TOL, lr=1e-3),
    Case("ep2_edp2_bf16_main_params_accumulate2", 4, ep=2,
         model=dict(dispatcher="alltoall", load_balancing="global_aux_loss"), accumulate=2, precision="bf16-true",
         tol=BF16_TOL, lr=1e-3),
    # the deepep dispatcher's logic on a gloo double of DeepEP's intranode buffer (tests/parallel/fake_deep_ep.py)
    Case("ep2_deepep_gloo", 2, ep=2, model=dict(dispatcher=f"{FAKE}.GlooDeepEPDispatcher", **GLOBAL)),
    Case("ep2_deepep_gloo_sync_free_capacity", 2, ep=2, model=dict(dispatcher=f"{FAKE}.GlooDeepEPSyncFree", **CAP)),
]
if ACCELERATOR == "gpu" and importlib.util.find_spec("deep_ep") is not None:  # real DeepEP moves bf16
    DEEPEP = dict(precision="bf16-true", tol=BF16_TOL, lr=1e-3)
    CASES += [Case("ep2_deepep", 2, ep=2, model=dict(dispatcher="deepep", **GLOBAL), **DEEPEP),
              Case("ep2_deepep_sync_free", 2, ep=2, model=dict(dispatcher="deepep", sync_free_dispatch=True,
                                                                 **GLOBAL), **DEEPEP),
              Case("ep2_deepep_capacity", 2, ep=2, model=dict(dispatcher="deepep", **CAP), **DEEPEP),
              Case("ep4_deepep", 4, ep=4, model=dict(dispatcher="deepep", **GLOBAL), **DEEPEP)]

CASES = runnable(CASES)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(CASES, tmp_path_factory.mktemp("parity"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_parity(results, case):
    check_case(case, results[case.name], TOL)
