"""``MoEFoldStrategy(overlap_moe_comm=True)``: the merged forward-backward schedule changes no number.

Each case trains 3 steps on gloo ranks with the overlap and compares the loss, every gradient of step 1 and every
parameter after step 3 with the 1-process reference (as tests/parallel/test_ep_parity.py), and bit for bit with the
same layout without the overlap (``digest``: SHA-256 of the losses, gradients and parameters).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest

from lightning_moe import Recompute
from tests.parallel.parity import BF16_TOL, TOL, Case, check_case, run_cases, runnable

# expert bias; the aux loss per rank and micro-batch (a global one couples the DP ranks' micro-batches, which the
# 1-process reference cannot group the same way)
BIAS = dict(score_function="sigmoid", expert_bias=True, bias_update_rate=1e-2)
CAP = dict(capacity_factor=1.0, drop_policy="probs")
ON = dict(overlap_moe_comm=True)

OVERLAPPED = [
    # expert bias, a dense first layer and shared experts, tied embeddings: 4 micro-batches
    Case("ep2_alltoall_m4", 2, ep=2, m=4, strategy=ON,
         model=dict(dispatcher="alltoall", num_layers=3, first_k_dense=1, shared_expert_ffn_size=32,
                    tie_embeddings=True, **BIAS)),
    Case("ep2_allgather_capacity_m2", 2, ep=2, m=2, strategy=ON, model=dict(dispatcher="allgather", **CAP)),
    # Recompute's fine-grained modules inside the steps (their saved-tensor hooks around each step)
    Case("ep2_recompute_m2", 2, ep=2, m=2, strategy=ON, model=dict(dispatcher="alltoall", **BIAS),
         callbacks=(partial(Recompute, ["moe_act", "layernorm", "core_attn"]),)),
    # folded: TP2 (sequence parallel) attention and EP2, with the dedup dispatcher's probabilities in flight
    # its parameters after 3 AdamW steps differ from the reference by up to 3e-3 (router weight: AdamW turns float32
    # rounding of near-zero gradients into whole steps; the first step's gradients agree within 1e-5)
    Case("tp2_ep2_dedup_m2", 4, tp=2, ep=2, m=2, strategy=ON, adam_eps=1e-6, tol=dict(TOL, state=1e-2),
         model=dict(dispatcher="alltoall_dedup", **BIAS)),
    Case("ep2_etp2_alltoall_m2", 4, ep=2, etp=2, m=2, strategy=ON, model=dict(dispatcher="alltoall", **BIAS)),
    # interleaved pipeline (2 stages x 2 chunks): the steady-state (F, B) pairs merged, tied embeddings over the
    # stages, a dense first layer and shared experts
    Case("pp2_vpp2_ep2_m4", 4, pp=2, ep=2, m=4, strategy=dict(ON, virtual_pipeline_size=2), adam_eps=1e-6,
         model=dict(dispatcher="alltoall", num_layers=4, first_k_dense=1, shared_expert_ffn_size=32,
                    tie_embeddings=True, **BIAS)),
    # bf16 weights, fp32 main grads with gradient-accumulation fusion, small buckets launched in the last backward
    Case("ep2_bf16_main_grads_m2", 2, ep=2, m=2, precision="bf16-true", tol=BF16_TOL, lr=1e-3,
         strategy=dict(ON, bucket_size_mb=0.01), model=dict(dispatcher="alltoall", tie_embeddings=True, **BIAS)),
]
# the same layouts without the overlap, for the bitwise comparison
PLAIN = [dataclasses.replace(c, name=c.name + "_plain",
                             strategy={k: v for k, v in c.strategy.items() if k != "overlap_moe_comm"})
         for c in OVERLAPPED]
CASES = runnable(OVERLAPPED + PLAIN)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(CASES, tmp_path_factory.mktemp("overlap"))


@pytest.mark.parametrize("case", [c for c in CASES if c in OVERLAPPED], ids=lambda c: c.name)
def test_overlap_matches_reference_and_plain_run(results, case):
    check_case(case, results[case.name], TOL)
    # every rank ran merged (F, B) pairs: F(i+1) with B(i) without PP, the steady state with it
    assert all(r["pipeline"]["merged_pairs"] == (case.m - 1 if case.pp == 1 else r["pipeline"]["merged_pairs"]) > 0
               for r in results[case.name])
    assert all(r["pipeline"]["merged_pairs"] == 0 for r in results[case.name + "_plain"])
    for rank, (on, off) in enumerate(zip(results[case.name], results[case.name + "_plain"])):
        assert on["losses"] == off["losses"], f"rank {rank}: losses differ with overlap_moe_comm"
        assert on["digest"] == off["digest"], (f"rank {rank}: gradients or parameters differ bitwise with "
                                               "overlap_moe_comm")
