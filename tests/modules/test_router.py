"""Router tests against hand-derived numbers and independent loop references (never the vectorised code itself)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_moe.modules.config import ModelConfig
from lightning_moe.modules.router import (
    RouterOutput,
    TopKRouter,
    apply_capacity,
    aux_loss_scores,
    expert_capacity,
    group_limited_topk,
    switch_load_balancing_loss,
    topk_routing,
    updated_expert_bias,
    z_loss,
)
from lightning_moe.strategy.parallel_context import ParallelContext


# ------------------------------------------------------------------------------------------ helpers / references
def cfg_(**kw) -> ModelConfig:
    kw.setdefault("num_attention_heads", 1)
    kw.setdefault("hidden_size", kw.get("num_experts", 8))
    return ModelConfig(**kw)


def identity_router(cfg: ModelConfig, ctx=None) -> TopKRouter:
    """A router whose logits equal its input (hidden_size == num_experts, weight = I)."""
    assert cfg.hidden_size == cfg.num_experts
    r = TopKRouter(cfg, ctx)
    with torch.no_grad():
        r.weight.copy_(torch.eye(cfg.num_experts))
    return r.train()


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def ref_softmax(row):
    m = max(row)
    ex = [math.exp(v - m) for v in row]
    return [v / sum(ex) for v in ex]


def ref_topk(row, k):
    """Indices of the k largest values, largest first (no ties in the test data)."""
    return sorted(range(len(row)), key=lambda i: -row[i])[:k]


def ref_aux_scores(logits, score_function, topk):
    scores, maps = [], []
    for row in logits:
        if score_function == "softmax":
            s = ref_softmax(row)
        else:
            s = [sig(v) for v in row]
            s = [v / (sum(s) + 1e-20) for v in s]
        chosen = ref_topk(s, topk)
        scores.append(s)
        maps.append([e in chosen for e in range(len(row))])
    return scores, maps


def ref_switch(scores, counts, total, topk, num_experts, coeff):
    E = len(counts)
    acc = sum(sum(scores[t][e] for t in range(len(scores))) * counts[e] for e in range(E))
    return acc * num_experts * coeff / (topk * total * total)


def ref_group_topk(row, topk, num_groups, group_topk):
    per = len(row) // num_groups
    gscore = [sum(sorted(row[g * per:(g + 1) * per], reverse=True)[:topk // group_topk]) for g in range(num_groups)]
    groups = ref_topk(gscore, group_topk)
    allowed = [e for g in groups for e in range(g * per, (g + 1) * per)]
    chosen = sorted(allowed, key=lambda e: -row[e])[:topk]
    return [row[e] for e in chosen], chosen


def ref_capacity(probs, experts, num_experts, capacity, policy):
    keep = [[False] * len(probs[0]) for _ in probs]
    for e in range(num_experts):
        slots = [(t, k) for t in range(len(probs)) for k in range(len(probs[0])) if experts[t][k] == e]
        if policy == "probs":
            slots.sort(key=lambda tk: -probs[tk[0]][tk[1]])
        for t, k in slots[:capacity]:  # "position": slots are already in token order
            keep[t][k] = True
    return keep


class FakeReplicatedContext(ParallelContext):
    """Pretends every rank holds the same tokens: an all-reduce (sum) multiplies by the group size."""

    def all_reduce_(self, t, name, op=None):
        return t.mul_(self.sizes[name])


def replicated_ctx(tp=1, cp=1, dp=1) -> ParallelContext:
    ctx = ParallelContext.single()
    ctx.sizes.update(tp=tp, cp=cp, dp=dp, dp_cp=dp * cp, tp_cp=tp * cp, tp_dp_cp=tp * dp * cp)
    return FakeReplicatedContext(sizes=ctx.sizes, members=ctx.members)


LOGITS = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, -1.0, 2.0, 4.0]])


# ------------------------------------------------------------------------------------------ scoring
def test_softmax_post_topk_hand_numbers():
    probs, experts = topk_routing(LOGITS, cfg_(num_experts=4, topk=2))
    # token 0: top logits 3 (e1), 2 (e2) -> softmax([3,2]) = [e/(1+e), 1/(1+e)]; token 1: 4 (e3), 2 (e2)
    e, e2 = math.e, math.e ** 2
    assert experts.tolist() == [[1, 2], [3, 2]] and experts.dtype == torch.int64
    torch.testing.assert_close(probs, torch.tensor([[e / (1 + e), 1 / (1 + e)], [e2 / (1 + e2), 1 / (1 + e2)]]))
    assert probs.dtype == torch.float32


def test_softmax_pre_softmax_no_renormalisation():
    probs, experts = topk_routing(LOGITS, cfg_(num_experts=4, topk=2, pre_softmax=True))
    z0 = math.exp(1) + math.exp(3) + math.exp(2) + 1.0
    z1 = math.exp(0.5) + math.exp(-1) + math.exp(2) + math.exp(4)
    assert experts.tolist() == [[1, 2], [3, 2]]
    torch.testing.assert_close(probs, torch.tensor([[math.exp(3) / z0, math.exp(2) / z0],
                                                    [math.exp(4) / z1, math.exp(2) / z1]]))
    assert probs.sum(-1).lt(1).all()  # the full softmax is not renormalised over the chosen k


def test_sigmoid_without_bias():
    probs, experts = topk_routing(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), cfg_(num_experts=4, topk=2,
                                                                              score_function="sigmoid"))
    s = sig(2) + sig(1)
    assert experts.tolist() == [[0, 1]]
    torch.testing.assert_close(probs, torch.tensor([[sig(2) / s, sig(1) / s]]))


def test_sigmoid_topk1_is_not_normalised():
    probs, experts = topk_routing(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), cfg_(num_experts=4, topk=1,
                                                                              score_function="sigmoid"))
    assert experts.tolist() == [[0]]
    torch.testing.assert_close(probs, torch.tensor([[sig(2)]]))


def test_sigmoid_bias_steers_selection_but_not_gates():
    cfg = cfg_(num_experts=4, topk=2, score_function="sigmoid", expert_bias=True)
    probs, experts = topk_routing(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), cfg, torch.tensor([0.0, 0.0, 0.0, 5.0]))
    # biased scores: e3 = sig(-1)+5 first, then e0 = sig(2); gates use the unbiased sigmoid values
    s = sig(-1) + sig(2)
    assert experts.tolist() == [[3, 0]]
    torch.testing.assert_close(probs, torch.tensor([[sig(-1) / s, sig(2) / s]]))


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_scaling_factor(score_function):
    cfg = cfg_(num_experts=4, topk=2, score_function=score_function)
    base, _ = topk_routing(LOGITS, cfg)
    scaled, _ = topk_routing(LOGITS, cfg.replace(topk_scaling_factor=2.5))
    torch.testing.assert_close(scaled, 2.5 * base)
    torch.testing.assert_close(scaled.sum(-1), torch.full((2,), 2.5))


# ------------------------------------------------------------------------------------------ group-limited
def test_group_limited_topk_changes_the_answer():
    # groups {0,1,2} and {3,4,5}; group score = sum of the top topk/group_topk = 2 scores: g0 = 9 + 0, g1 = 5 + 5.
    # The max alone would pick g0, plain top-2 would pick e0 first; the group rule picks {3, 4}.
    scores = torch.tensor([[9.0, 0.0, 0.0, 5.0, 5.0, 0.0]])
    values, idx = group_limited_topk(scores, topk=2, num_groups=2, group_topk=1)
    assert sorted(idx[0].tolist()) == [3, 4] and values.tolist() == [[5.0, 5.0]]
    assert 0 in scores.topk(2).indices[0].tolist()


def test_group_limited_topk_matches_loop_reference():
    g = torch.Generator().manual_seed(0)
    for E, k, G, gk in [(8, 4, 4, 2), (12, 3, 4, 3), (16, 4, 8, 4), (6, 2, 3, 1)]:
        scores = torch.randn(7, E, generator=g)
        values, idx = group_limited_topk(scores, k, G, gk)
        for t, row in enumerate(scores.tolist()):
            ref_v, ref_i = ref_group_topk(row, k, G, gk)
            assert idx[t].tolist() == ref_i
            torch.testing.assert_close(values[t], torch.tensor(ref_v))


def test_group_limited_routing_modes():
    cfg = cfg_(num_experts=6, topk=2, num_groups=2, group_topk=1)
    # softmax, group scores from logits: g0 = 9, g1 = 10 -> experts 3, 4 with equal logits -> gates 0.5 each
    probs, experts = topk_routing(torch.tensor([[9.0, 0.0, 0.0, 5.0, 5.0, 0.0]]), cfg)
    assert sorted(experts[0].tolist()) == [3, 4]
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.5]]))
    # sigmoid: g0 = sig(4) + sig(-3) = 1.029 < g1 = 2 sig(1) = 1.462
    probs, experts = topk_routing(torch.tensor([[4.0, -3.0, -3.0, 1.0, 1.0, -3.0]]),
                                  cfg.replace(score_function="sigmoid"))
    assert sorted(experts[0].tolist()) == [3, 4]
    # the expert bias also drives group selection: unbiased g0 wins (2 sig(2) > 2 sig(0)), biased g1 wins
    cfg4 = cfg_(num_experts=4, topk=2, num_groups=2, group_topk=1, score_function="sigmoid", expert_bias=True)
    logits = torch.tensor([[2.0, 2.0, 0.0, 0.0]])
    assert sorted(topk_routing(logits, cfg4)[1][0].tolist()) == [0, 1]
    probs, experts = topk_routing(logits, cfg4, torch.tensor([0.0, 0.0, 1.0, 1.0]))
    assert sorted(experts[0].tolist()) == [2, 3]
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.5]]))  # unbiased sig(0) / (2 sig(0))


# ------------------------------------------------------------------------------------------ capacity
def test_expert_capacity():
    assert expert_capacity(10, 4, 2, 1.0) == 5  # 10*2/4 = 5
    assert expert_capacity(3, 8, 2, 1.5) == 2  # ceil(0.75 * 1.5 = 1.125)
    assert expert_capacity(5, 4, 1, 0.5) == 1  # ceil(0.625)
    assert expert_capacity(16, 8, 2, 1.0) == 4


def test_capacity_policies_disagree():
    probs = torch.tensor([[0.1], [0.9], [0.5], [0.7]])
    experts = torch.zeros(4, 1, dtype=torch.long)
    keep_p = apply_capacity(probs, experts, 2, 2, "probs")
    keep_pos = apply_capacity(probs, experts, 2, 2, "position")
    assert keep_p[:, 0].tolist() == [False, True, False, True]  # the two highest gates
    assert keep_pos[:, 0].tolist() == [True, True, False, False]  # the first two tokens
    assert keep_p.dtype == torch.bool


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("capacity", [1, 2, 3, 50])
def test_capacity_matches_loop_reference(policy, capacity):
    g = torch.Generator().manual_seed(capacity)
    probs, experts = topk_routing(torch.randn(9, 5, generator=g), cfg_(num_experts=5, topk=2))
    keep = apply_capacity(probs, experts, 5, capacity, policy)
    assert keep.tolist() == ref_capacity(probs.tolist(), experts.tolist(), 5, capacity, policy)


@pytest.mark.parametrize("pad", [False, True])
def test_router_capacity_drops(pad):
    # sigmoid top-1: tokens 0,1 -> e0 (gates sig 3, sig 1); tokens 2,3 -> e1 (sig 2, sig 5); capacity ceil(4*1/2*.5)=1
    x = torch.tensor([[3.0, 0.0], [1.0, 0.0], [0.0, 2.0], [0.0, 5.0]])
    for policy, kept in [("probs", [True, False, False, True]), ("position", [True, False, True, False])]:
        cfg = cfg_(num_experts=2, topk=1, score_function="sigmoid", capacity_factor=0.5, drop_policy=policy,
                   pad_to_capacity=pad, load_balancing="none")
        r = identity_router(cfg)
        out = r(x, num_sequences=1)
        assert out.keep_TK[:, 0].tolist() == kept
        gates = [sig(3), sig(1), sig(2), sig(5)]
        torch.testing.assert_close(out.probs_TK[:, 0], torch.tensor([g if k else 0.0 for g, k in zip(gates, kept)]))
        assert out.tokens_per_expert_E.tolist() == [1.0, 1.0]
        assert out.num_dropped.item() == 2.0 and out.num_dropped.dtype == torch.float32
        assert r.local_tokens_per_expert.tolist() == [1.0, 1.0]  # kept assignments only


def test_dropless_and_eval():
    cfg = cfg_(num_experts=4, topk=2, z_loss_coeff=0.1)
    r = identity_router(cfg)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    out = r(x, num_sequences=2)
    assert isinstance(out, RouterOutput) and out.keep_TK is None
    assert out.num_dropped.item() == 0.0 and out.tokens_per_expert_E.sum().item() == 12.0
    counts = [sum(1 for row in out.experts_TK.tolist() if e in row) for e in range(4)]
    assert out.tokens_per_expert_E.tolist() == counts and not out.tokens_per_expert_E.requires_grad
    assert out.aux_loss.item() > 0 and out.z_loss.item() > 0
    r.eval()
    out = r(x, num_sequences=2)
    assert out.aux_loss.dim() == 0 and out.aux_loss.item() == 0.0 and out.z_loss.item() == 0.0
    assert r.local_tokens_per_expert.tolist() == [float(c) for c in counts]  # eval does not count


# ------------------------------------------------------------------------------------------ losses
def test_aux_loss_hand_numbers():
    # scores [1/4, 3/4] for both tokens; both route to e1: counts [0, 2]; total 2
    # loss = (0.5*0 + 1.5*2) * E=2 * c / (K=1 * 2^2) = 1.5 c
    c = 0.1
    r = identity_router(cfg_(num_experts=2, topk=1, pre_softmax=True, aux_loss_coeff=c))
    out = r(torch.tensor([[0.0, math.log(3)], [0.0, math.log(3)]]), num_sequences=1)
    torch.testing.assert_close(out.aux_loss, torch.tensor(1.5 * c))
    assert out.aux_loss.dtype == torch.float32


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_aux_loss_matches_loop_reference(score_function):
    cfg = cfg_(num_experts=4, topk=2, aux_loss_coeff=0.1, score_function=score_function)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    out = identity_router(cfg)(x, num_sequences=2)
    scores, maps = ref_aux_scores(x.tolist(), score_function, 2)
    counts = [sum(m[e] for m in maps) for e in range(4)]
    torch.testing.assert_close(out.aux_loss.item(), ref_switch(scores, counts, 6, 2, 4, 0.1), rtol=1e-5, atol=0)
    s, m = aux_loss_scores(x, score_function, 2)
    torch.testing.assert_close(s, torch.tensor(scores))
    assert m.dtype == torch.bool and m.tolist() == maps


def test_seq_aux_loss_hand_numbers():
    # two sequences of one token: [0, ln3] and [ln3, 0]. Batch-wide counts [1,1] give aux_loss = c, but each sequence
    # alone has scores [.25,.75] (or reversed) and count 1 on its top expert: 0.75 * 2 * c / 1 = 1.5 c; mean 1.5 c
    c = 0.1
    x = torch.tensor([[0.0, math.log(3)], [math.log(3), 0.0]])
    seq = identity_router(cfg_(num_experts=2, topk=1, pre_softmax=True, aux_loss_coeff=c, load_balancing="seq_aux_loss"))(x, 2)
    glob = identity_router(cfg_(num_experts=2, topk=1, pre_softmax=True, aux_loss_coeff=c))(x, 2)
    torch.testing.assert_close(seq.aux_loss, torch.tensor(1.5 * c))
    torch.testing.assert_close(glob.aux_loss, torch.tensor(c))


def test_seq_aux_loss_matches_loop_reference():
    B, S, E, K, c = 3, 4, 5, 2, 0.01
    x = torch.randn(B * S, E, generator=torch.Generator().manual_seed(3))
    out = identity_router(cfg_(num_experts=E, topk=K, aux_loss_coeff=c, load_balancing="seq_aux_loss"))(x, B)
    ref = 0.0
    for b in range(B):
        scores, maps = ref_aux_scores(x[b * S:(b + 1) * S].tolist(), "softmax", K)
        ref += ref_switch(scores, [sum(m[e] for m in maps) for e in range(E)], S, K, E, c) / B
    torch.testing.assert_close(out.aux_loss.item(), ref, rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="num_sequences"):
        identity_router(cfg_(num_experts=E, topk=K, load_balancing="seq_aux_loss"))(x, 5)


def test_global_aux_loss_accumulates_and_resets():
    E, K, c = 4, 2, 0.1
    r = identity_router(cfg_(num_experts=E, topk=K, aux_loss_coeff=c, load_balancing="global_aux_loss"))
    g = torch.Generator().manual_seed(4)
    x1, x2, x3 = (torch.randn(5, E, generator=g) for _ in range(3))
    s1, m1 = ref_aux_scores(x1.tolist(), "softmax", K)
    s2, m2 = ref_aux_scores(x2.tolist(), "softmax", K)
    s3, m3 = ref_aux_scores(x3.tolist(), "softmax", K)
    c1, c2, c3 = ([sum(row[e] for row in m) for e in range(E)] for m in (m1, m2, m3))

    l1 = r(x1, 1).aux_loss.item()
    torch.testing.assert_close(l1, ref_switch(s1, c1, 5, K, E, c), rtol=1e-5, atol=0)
    l2 = r(x2, 1).aux_loss.item()  # counts averaged over the two steps
    avg = [(a + b) / 2 for a, b in zip(c1, c2)]
    torch.testing.assert_close(l2, ref_switch(s2, avg, 5, K, E, c), rtol=1e-5, atol=0)
    assert r.global_tokens_per_expert.tolist() == [float(a + b) for a, b in zip(c1, c2)]
    assert r.global_aux_steps.item() == 2.0
    assert {"global_tokens_per_expert", "global_aux_steps"} <= set(r.state_dict())

    r.eval()
    r(x3, 1)
    assert r.global_aux_steps.item() == 2.0  # eval leaves the window alone
    r.train()
    r.reset_global_aux_state()
    assert r.global_tokens_per_expert.tolist() == [0.0] * E and r.global_aux_steps.item() == 0.0
    torch.testing.assert_close(r(x3, 1).aux_loss.item(), ref_switch(s3, c3, 5, K, E, c), rtol=1e-5, atol=0)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("mode", ["aux_loss", "seq_aux_loss", "global_aux_loss"])
def test_parallel_scale_replicated_ranks_match_single_process(mode, tp):
    # If every rank held the same tokens, the global batch is copies of the local one and its balance loss equals
    # the single-process one. After the dp x cp gradient AVERAGE, the scaled per-rank loss must give exactly that.
    # Tensor-parallel ranks hold different sequence-parallel shards whose router gradients are SUMMED over tp, so
    # each rank's share is 1/tp of the whole.
    cfg = cfg_(num_experts=4, topk=2, aux_loss_coeff=0.1, load_balancing=mode)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(5))
    single = identity_router(cfg)(x, 2).aux_loss
    multi = identity_router(cfg, replicated_ctx(tp=tp, cp=2, dp=2))(x, 2).aux_loss
    torch.testing.assert_close(multi * tp, single)


def test_z_loss_hand_numbers():
    logits = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    lse = [math.log(math.e + math.e ** 2), math.log(2.0)]
    expected = (lse[0] ** 2 + lse[1] ** 2) / 2 * 0.1
    torch.testing.assert_close(z_loss(logits, 0.1).item(), expected, rtol=1e-6, atol=0)
    r = identity_router(cfg_(num_experts=2, topk=1, pre_softmax=True, z_loss_coeff=0.1, load_balancing="none"))
    torch.testing.assert_close(r(logits, 1).z_loss.item(), expected, rtol=1e-6, atol=0)
    assert identity_router(cfg_(num_experts=2, topk=1, pre_softmax=True))(logits, 1).z_loss.item() == 0.0  # no coefficient


def test_switch_loss_is_coeff_when_balanced():
    # uniform scores and counts: sum_e (T/E) * (T K / E) * E c / (K T^2) = c
    T, E, K = 8, 4, 2
    loss = switch_load_balancing_loss(torch.full((T, E), 1 / E), torch.full((E,), T * K / E), T, K, E, 0.3)
    torch.testing.assert_close(loss, torch.tensor(0.3))


# ------------------------------------------------------------------------------------------ expert bias
def test_updated_expert_bias_pure():
    torch.testing.assert_close(updated_expert_bias(torch.zeros(2), torch.tensor([1.0, 3.0]), 0.5),
                               torch.tensor([0.5, -0.5]))  # mean 2: e0 under-loaded (+), e1 over-loaded (-)
    torch.testing.assert_close(updated_expert_bias(torch.tensor([0.1, 0.2]), torch.tensor([2.0, 2.0]), 0.5),
                               torch.tensor([0.1, 0.2]))  # balanced: sign(0) = 0


def test_expert_bias_update_cycle():
    cfg = cfg_(num_experts=4, topk=1, score_function="sigmoid", expert_bias=True, bias_update_rate=0.01,
               load_balancing="none")
    r = identity_router(cfg)
    assert "expert_bias" in r.state_dict() and "local_tokens_per_expert" in r.state_dict()
    x = torch.eye(4)[[0, 0, 0, 1, 2]] * 3.0  # top-1 experts 0,0,0,1,2
    r(x, 1)
    r(x, 1)
    assert r.local_tokens_per_expert.tolist() == [6.0, 2.0, 2.0, 0.0]
    r.update_expert_bias()  # mean 2.5 -> sign(2.5 - [6,2,2,0]) = [-1, +1, +1, +1]
    torch.testing.assert_close(r.expert_bias, torch.tensor([-0.01, 0.01, 0.01, 0.01]))
    assert r.local_tokens_per_expert.tolist() == [0.0] * 4
    r.update_expert_bias()  # no counts: no change
    torch.testing.assert_close(r.expert_bias, torch.tensor([-0.01, 0.01, 0.01, 0.01]))
    # the bias now steers a near-tie: logits 0.01 (e0) vs 0 (e1): sig diff ~0.0025 < bias diff 0.02
    assert r(torch.tensor([[0.01, 0.0, -5.0, -5.0]]), 1).experts_TK.tolist() == [[1]]
    # without expert_bias the counts are still zeroed by the step hook
    r2 = identity_router(cfg_(num_experts=4, topk=1, pre_softmax=True, load_balancing="none"))
    r2(x, 1)
    r2.update_expert_bias()
    assert r2.local_tokens_per_expert.tolist() == [0.0] * 4 and r2.expert_bias is None


# ------------------------------------------------------------------------------------------ gradients / dtypes
def test_gradcheck_pure_functions():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    counts = torch.tensor([3.0, 1.0, 4.0, 2.0], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda s: switch_load_balancing_loss(s, counts, 5, 2, 4, 0.1), (logits,))
    assert torch.autograd.gradcheck(lambda lg: z_loss(lg, 0.1), (logits,))
    for sf in ("softmax", "sigmoid"):
        def aux(lg, sf=sf):
            scores, routing_map = aux_loss_scores(lg, sf, 2)
            return switch_load_balancing_loss(scores, routing_map.sum(0).double(), 5, 2, 4, 0.1)
        assert torch.autograd.gradcheck(aux, (logits,))
    bias = torch.tensor([0.0, 0.3, 0.0, -0.2], dtype=torch.float64)
    for cfg, b in [(cfg_(num_experts=4, topk=2), None), (cfg_(num_experts=4, topk=2, pre_softmax=True), None),
                   (cfg_(num_experts=4, topk=2, score_function="sigmoid", expert_bias=True,
                         topk_scaling_factor=2.5), bias),
                   (cfg_(num_experts=4, topk=2, num_groups=2, group_topk=2), None)]:
        assert topk_routing(logits, cfg, b)[0].dtype == torch.float64
        assert torch.autograd.gradcheck(lambda lg, cfg=cfg, b=b: topk_routing(lg, cfg, b)[0], (logits,))


def test_module_aux_gradient_matches_reference():
    E, K, c = 4, 2, 0.1
    r = TopKRouter(cfg_(num_experts=E, hidden_size=3, topk=K, aux_loss_coeff=c, init_std=0.5)).train()
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(7))
    r(x, 1).aux_loss.backward()
    w = r.weight.detach().clone().requires_grad_(True)
    logits = x @ w.t()
    probs = torch.softmax(logits, -1)
    counts = [sum(e in ref_topk(row, K) for row in probs.tolist()) for e in range(E)]
    ref = sum(probs[t, e] * counts[e] for t in range(6) for e in range(E)) * E * c / (K * 36)
    ref.backward()
    torch.testing.assert_close(r.weight.grad, w.grad)


def test_weight_fp32_and_autocast_keeps_router_in_fp32():
    cfg = cfg_(num_experts=8, hidden_size=64, topk=2, z_loss_coeff=1e-3, init_std=0.5)
    r = TopKRouter(cfg).train()
    assert r.weight.dtype == torch.float32 and r.weight.shape == (8, 64)
    assert abs(r.weight.std().item() - 0.5) < 0.1
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(8))
    ref = r(x, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.nn.functional.linear(x, r.weight).dtype == torch.bfloat16  # autocast is active here
        out = r(x, 2)
    assert out.probs_TK.dtype == torch.float32 and out.z_loss.dtype == torch.float32
    assert out.aux_loss.dtype == torch.float32
    assert torch.equal(out.probs_TK, ref.probs_TK) and torch.equal(out.z_loss, ref.z_loss)  # bf16 would round
    assert torch.equal(out.experts_TK, ref.experts_TK)


# ------------------------------------------------------------------------------------------ config validation
@pytest.mark.parametrize("kwargs, word", [
    (dict(topk=9, num_experts=8), "topk"),
    (dict(capacity_factor=0), "capacity_factor"),
    (dict(num_experts=8, topk=2, num_groups=4, group_topk=3), "group_topk"),
    (dict(score_function="tanh"), "score_function"),
])
def test_bad_config(kwargs, word):
    with pytest.raises(ValueError, match=word):
        ModelConfig(**kwargs)


def test_router_state_stays_fp32_under_module_casts():
    """precision="bf16-true" calls module.to(bf16): the router must keep fp32 weights, bias and counters."""
    router = TopKRouter(ModelConfig(hidden_size=16, num_experts=4, topk=2, score_function="sigmoid",
                                    expert_bias=True, load_balancing="global_aux_loss")).to(torch.bfloat16)
    for name, t in list(router.named_parameters()) + list(router.named_buffers()):
        assert t.dtype == torch.float32, name
    for _ in range(300):  # a bf16 counter would stop at 256
        router.global_aux_steps += 1
    assert router.global_aux_steps.item() == 300
    assert router.double().weight.dtype == torch.float64  # higher precision (gradcheck) is allowed


def test_topk1_softmax_needs_pre_softmax():
    with pytest.raises(ValueError, match="pre_softmax"):
        ModelConfig(num_experts=4, topk=1)
    ModelConfig(num_experts=4, topk=1, pre_softmax=True)
    ModelConfig(num_experts=4, topk=1, score_function="sigmoid")


@pytest.mark.parametrize("score_function,pre_softmax", [("softmax", False), ("softmax", True), ("sigmoid", False)])
def test_aux_routing_map_reuses_the_router_topk(score_function, pre_softmax):
    # without groups or bias the router ranks experts like the aux-loss scores do: its top-k can be reused
    from lightning_moe.modules.router import aux_loss_scores, topk_routing
    cfg = ModelConfig.from_preset("tiny", num_experts=16, topk=4, score_function=score_function,
                                  pre_softmax=pre_softmax)
    logits_TE = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    _, experts_TK = topk_routing(logits_TE, cfg)
    s_ref, map_ref = aux_loss_scores(logits_TE, score_function, 4)
    s, map_ = aux_loss_scores(logits_TE, score_function, 4, experts_TK)
    assert torch.equal(s, s_ref) and torch.equal(map_, map_ref) and map_.sum() == 64 * 4
