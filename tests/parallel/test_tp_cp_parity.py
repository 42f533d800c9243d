"""Tensor, sequence, context and expert parallelism folded over the same ranks: N gloo ranks through Trainer +
MoEFoldStrategy against a 1-process reference (same weights, same global batch).

Compared as in test_ep_parity.py: the loss of each of 3 steps, every gradient of step 1 (after sync, before
clipping; TP shards against the matching slice of the full gradient), every parameter and buffer after 3 AdamW steps
with clipping at 0.5 (so the global norm, with TP shards summed over TP, matters).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from lightning_moe import DynamicContextParallel

from tests.parallel.parity import PACKED, TOL, Case, check_case, run_cases, runnable

# dp > 1 needs the global-batch aux loss to equal the reference's (each DP rank's own aux loss is a different loss)
GLOBAL = dict(load_balancing="global_aux_loss")
# DeepSeek-V3 in miniature: MLA with a q LoRA, a dense first layer, a shared expert, sigmoid group-limited routing
# with the expert bias and the sequence-wise aux loss
MLA = dict(attention_type="mla", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=8, first_k_dense=1, shared_expert_ffn_size=32, score_function="sigmoid", num_groups=4,
           group_topk=2, topk_scaling_factor=2.5, expert_bias=True, bias_update_rate=1e-2,
           load_balancing="seq_aux_loss")

CASES = [
    # 2 ranks; the first five share one model, so their loss curves must agree with each other too
    Case("tp2", 2, tp=2, sp=False),
    Case("tp2_sp", 2, tp=2, sp=True),
    Case("tp2_sp_packed_documents", 2, tp=2, sp=True, data=PACKED),
    Case("cp2", 2, cp=2),
    Case("cp2_packed_documents", 2, cp=2, data=dict(PACKED, document_multiple=4)),
    # DynamicContextParallel as it chooses (whole rows per rank on these short documents; the aux loss stays over
    # the micro-batch)
    Case("cp2_dynamic", 2, cp=2, model=dict(load_balancing="aux_loss"), data=dict(PACKED, document_multiple=4),
         callbacks=(DynamicContextParallel,)),
    Case("tp2_ep2_alltoall", 2, tp=2, ep=2),
    Case("tp2_ep2_allgather_nosp", 2, tp=2, ep=2, sp=False, model=dict(dispatcher="allgather")),
    # capacity is per rank (as in Megatron), so which copies drop depends on the layout: a factor of E/K = 4 keeps
    # every copy while running the capacity code path (keep masks, padded buffers)
    Case("tp2_ep2_dedup_capacity", 2, tp=2, ep=2, model=dict(dispatcher="alltoall_dedup", capacity_factor=4.0)),
    Case("tp2_ep2_padded_nosp", 2, tp=2, ep=2, sp=False, model=dict(capacity_factor=4.0, pad_to_capacity=True)),
    Case("cp2_ep2_tied", 2, cp=2, ep=2, model=dict(tie_embeddings=True, qk_norm=True)),
    # batches longer than the config's seq_length: the RoPE table grows to the global length (positions reach it)
    Case("cp2_data_longer_than_config", 2, cp=2, model=dict(seq_length=16)),
    Case("mla_tp2", 2, tp=2, model=MLA),
    Case("mla_cp2", 2, cp=2, model=MLA),
    # 4 ranks
    Case("tp2_dp2_ep4", 4, tp=2, ep=4, model=GLOBAL),
    Case("tp2_cp2_ep2_etp2", 4, tp=2, cp=2, ep=2, etp=2, model=dict(qk_norm=True)),
    Case("tp2_cp2_ep2_etp2_allgather", 4, tp=2, cp=2, ep=2, etp=2, model=dict(dispatcher="allgather")),
    Case("cp2_dp2_ep4", 4, cp=2, ep=4, model=GLOBAL),
    Case("cp4_packed_documents_mla", 4, cp=4, model=MLA, data=dict(PACKED, document_multiple=8)),
    Case("cp4_dynamic_cp2_mla", 4, cp=4, model=dict(MLA, load_balancing="aux_loss"),
         data=dict(PACKED, document_multiple=8),
         callbacks=(partial(DynamicContextParallel, sizes=[2]),)),  # sub-groups of 2 ranks
]
for _c in CASES:
    _c.adam_eps = 1e-6
SAME_MODEL = ["tp2", "tp2_sp", "cp2", "tp2_ep2_alltoall"]
# float32 with different reduction orders: losses agree to ~1e-7, gradients to ~6e-7 relative, parameters after
# 3 steps to ~1e-5. Adam eps is 1e-6 here: with 1e-8 Adam divides near-zero gradient elements (~1e-8) by their own
# magnitude, which turns their ~1e-9 absolute reduction-order noise into ~1e-3 of a weight (measured); the gradients
# themselves are compared directly. A wrong scale or a missed reduction fails by orders of magnitude.
CASES = runnable(CASES)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(CASES, tmp_path_factory.mktemp("tpcp"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_parity(results, case):
    check_case(case, results[case.name], TOL)


def test_loss_curve_is_layout_invariant(results):
    """One model, one global batch: TP, TP+SP, CP and TP+EP give the same loss curve, and it goes down."""
    curves = {name: torch.tensor(results[name][0]["losses"][0]) for name in SAME_MODEL if name in results}
    ref = torch.tensor(results["ref"]["tp2"]["losses"].tolist())
    for name, curve in curves.items():
        torch.testing.assert_close(curve.double(), ref.double(), rtol=1e-5, atol=0, msg=name)
    assert ref[-1] < ref[0]
