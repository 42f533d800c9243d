"""The distributed optimizer, optimizer CPU offload and the precision-aware (bf16) optimizer state (and the experts'
deferred wgrad into its main grads): N gloo ranks
through Trainer + MoEFoldStrategy against the 1-process reference (plain AdamW on whole fp32 tensors).

Compared as in test_ep_parity.py: the loss of each of 3 steps, every gradient of step 1 (gathered from the ranks'
reduce-scattered slices), every parameter after 3 AdamW steps with gradient clipping at 0.5 (the global norm is
summed over the slices: a slice counted twice or missed changes the clipped update), and the expert bias bit for
bit. bf16 moments differ from the fp32 reference by their rounding (~1e-3 in the parameters): checked at 1e-2, ten
times the float32 bound of 1e-4, and far below what a lost or misplaced slice gives (~0.3).
"""

from __future__ import annotations

import pytest

from tests.parallel.parity import BF16_TOL, TOL, Case, check_case, run_cases, runnable

# global aux loss (counts all-reduced over DP: the same on every layout), sigmoid routing with the expert bias
GLOBAL = dict(score_function="sigmoid", expert_bias=True, bias_update_rate=1e-2, load_balancing="global_aux_loss")
# pipeline cases: the reference accumulates each DP shard's micro-batches separately, so no global aux-loss window
BIAS = dict(score_function="sigmoid", expert_bias=True, bias_update_rate=1e-2)
DIST = dict(distributed_optimizer=True)
OFFLOAD = dict(distributed_optimizer=True, optimizer_cpu_offload=0.5)
BF16_STATE = dict(distributed_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
BF16_STATE_TOL = {"loss": 1e-4, "grads": 1e-5, "state": 1e-2}
TIED = dict(BIAS, num_layers=4, tie_embeddings=True, first_k_dense=1, shared_expert_ffn_size=32)

CASES = [
    Case("dp2_dist", 2, model=GLOBAL, accumulate=2, strategy=DIST),
    Case("dp2_offload", 2, model=GLOBAL, accumulate=2, strategy=OFFLOAD),
    Case("dp2_dist_bf16_moments", 2, model=GLOBAL, accumulate=2, strategy=BF16_STATE, tol=BF16_STATE_TOL),
    # the same machinery without the distributed optimizer (each rank owns whole buckets)
    Case("dp2_offload_only", 2, model=GLOBAL, strategy=dict(optimizer_cpu_offload=0.5)),
    Case("ep2_edp2_dist", 4, ep=2, model=GLOBAL, accumulate=2, strategy=DIST),
    Case("ep2_edp2_offload", 4, ep=2, model=GLOBAL, accumulate=2, strategy=OFFLOAD),
    Case("tp2_dp2_dist", 4, tp=2, model=GLOBAL, accumulate=2, strategy=DIST),
    Case("tp2_dp2_offload", 4, tp=2, model=GLOBAL, accumulate=2, strategy=OFFLOAD),
    Case("pp2_dp2_dist", 4, pp=2, m=2, model=dict(BIAS, num_layers=4), strategy=DIST, adam_eps=1e-6),
    Case("pp2_dp2_offload", 4, pp=2, m=2, model=dict(BIAS, num_layers=4), strategy=OFFLOAD, adam_eps=1e-6),
    # tied embeddings across the stages (a bucket of their own, laid out alike on both), uneven split, dense layer,
    # shared expert
    Case("pp2_dp2_tied_dist", 4, pp=2, m=2, model=TIED, strategy=dict(DIST, pipeline_first_stage_layers=3),
         adam_eps=1e-6),
    Case("cp2_ep2_dist", 4, cp=2, ep=2, model=GLOBAL, strategy=DIST),
    Case("ep2_etp2_dist_small_buckets", 4, ep=2, etp=2, model=GLOBAL,
         strategy=dict(OFFLOAD, bucket_size_mb=0.01, overlap_param_gather=False)),
    Case("ep2_edp2_bf16_weights_offload", 4, ep=2, model=dict(dispatcher="alltoall", load_balancing="global_aux_loss"),
         accumulate=2, precision="bf16-true", tol=BF16_TOL, lr=1e-3, strategy=OFFLOAD),
    # the experts' bf16 wgrad deferred to the step's last backward, into the reduce-scattered main grads
    Case("ep2_edp2_bf16_defer_dist", 4, ep=2, model=dict(dispatcher="alltoall", load_balancing="global_aux_loss"),
         accumulate=2, precision="bf16-true", tol=BF16_TOL, lr=1e-3, strategy=dict(DIST, defer_expert_wgrad=True)),
]
CASES = runnable(CASES)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(CASES, tmp_path_factory.mktemp("distopt"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_parity(results, case):
    check_case(case, results[case.name], TOL)


def test_bf16_moments_are_not_fp32(results):
    """The bf16-moment case must differ from the reference by more than float32 rounding (else bf16 state was not
    kept), while the fp32 cases stay within it."""
    bf16 = max(r["state"][1] for r in results["dp2_dist_bf16_moments"])
    fp32 = max(r["state"][1] for r in results["dp2_dist"])
    assert bf16 > 10 * fp32 and bf16 > TOL["state"], (bf16, fp32)
