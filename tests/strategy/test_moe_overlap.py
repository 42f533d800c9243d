"""The merged forward-backward schedule of ``overlap_moe_comm`` on one process (strategy/pipeline/moe_overlap.py):
cutting the forward into steps and running each step's backward alone gives the gradients of one backward, bit for
bit; every token exchange is paired with a compute step of the other micro-batch; bad layouts are refused."""

from __future__ import annotations

import pytest
import torch

from lightning_moe import MoEFoldStrategy, MoELanguageModel
from lightning_moe.callbacks.wrap_forward import wrap_forward
from lightning_moe.strategy.pipeline import moe_overlap
from lightning_moe.strategy.pipeline.moe_overlap import Tape, cut, run_merged


def _model(**over) -> MoELanguageModel:
    cfg = dict(seq_length=32, num_layers=3, hidden_size=32, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
               moe_ffn_hidden_size=32, num_experts=8, topk=2, z_loss_coeff=1e-3, first_k_dense=1,
               shared_expert_ffn_size=32, tie_embeddings=True, score_function="sigmoid", expert_bias=True)
    cfg.update(over)
    model = MoELanguageModel(preset="tiny", overrides=cfg, seed=7)
    model.configure_model()
    model.train()
    return model


def _micro_batches(m: int) -> list[dict]:
    toks = torch.randint(0, 256, (2 * m, 33), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": toks[2 * i:2 * i + 2, :-1], "labels": toks[2 * i:2 * i + 2, 1:]} for i in range(m)]


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _plain(model, mbs, scale):
    model.zero_grad(set_to_none=True)
    for mb in mbs:
        out, aux = model.pipeline_forward(0, mb, None)
        ((out + aux) * scale).backward()
    return _grads(model)


def _merged(model, mbs, scale):
    model.zero_grad(set_to_none=True)
    previous, losses = None, []
    for i in range(len(mbs) + 1):
        tape = Tape(model.pipeline_forward_steps(0, mbs[i], None), scale) if i < len(mbs) else None
        run_merged(tape, previous, None)
        if tape is not None:
            loss, aux = tape.result
            assert not aux.requires_grad  # the layers' aux losses were roots of their own steps
            losses.append(loss.detach())
            tape.add_roots([loss * scale])
        previous = tape
    return _grads(model), losses


@pytest.mark.parametrize("over", [{}, dict(tie_embeddings=False, first_k_dense=0, shared_expert_ffn_size=0),
                                  dict(capacity_factor=1.0, dispatcher="allgather")],
                         ids=["tied_dense_shared", "plain_moe", "allgather_capacity"])
def test_steps_give_the_gradients_of_one_backward(over):
    model, mbs = _model(**over), _micro_batches(3)
    ref = _plain(model, mbs, 1 / 3)
    got, losses = _merged(model, mbs, 1 / 3)
    assert got.keys() == ref.keys()
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in got.values())
    bad = [n for n in ref if not torch.equal(ref[n], got[n])]
    assert not bad, f"gradients differ bitwise: {bad}"
    assert [float(x) for x in losses] == [float(model.pipeline_forward(0, mb, None)[0].detach()) for mb in mbs]


def test_a_tied_head_in_the_embedding_s_step_gets_its_gradient():
    """No MoE layer between the embedding and the tied head: one step holds both; the head's gradient reaches the
    weight in a second backward of that step (summed in another order: float32 rounding)."""
    model, mbs = _model(first_k_dense=3), _micro_batches(2)
    ref = _plain(model, mbs, 0.5)
    got, _ = _merged(model, mbs, 0.5)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-7, msg=n)


def test_every_exchange_runs_next_to_the_other_micro_batch_compute(monkeypatch):
    model, mbs = _model(), _micro_batches(2)
    pairs, alone = [], []
    real_pair = moe_overlap._pair

    def spy(comm, comp, stream):
        pairs.append((comm.__name__, comp.__name__))
        real_pair(comm, comp, stream)
    monkeypatch.setattr(moe_overlap, "_pair", spy)
    first = Tape(model.pipeline_forward_steps(0, mbs[0], None), 0.5)
    run_merged(first, None, None)
    first.add_roots([first.result[0] * 0.5])
    second = Tape(model.pipeline_forward_steps(0, mbs[1], None), 0.5)
    kinds = []
    for tape, step in ((second, "forward_step"), (first, "backward_step")):
        orig = getattr(tape, step)

        def logged(orig=orig, name=step):
            alone.append(name)
            return orig()
        logged.__name__ = step
        setattr(tape, step, logged)
    run_merged(second, first, None)
    kinds = [s.kind for s in second.steps]
    exchanges = kinds.count("comm")  # 2 per MoE layer
    assert exchanges == 4
    # every exchange of either micro-batch is paired: forward ones with backward compute and the other way round
    assert len(pairs) == 2 * exchanges
    assert pairs.count(("forward_step", "backward_step")) == exchanges
    assert pairs.count(("backward_step", "forward_step")) == exchanges
    # and only the first backward step and the last forward step run alone
    assert len(alone) - 2 * len(pairs) == 2


def test_cut_replaces_every_tensor_that_needs_a_gradient_once():
    a = torch.ones(2, requires_grad=True) * 2
    b = torch.zeros(2)
    leaves: list = []
    out = cut({"x": (a, b), "y": [a]}, leaves, {})
    assert len(leaves) == 1 and leaves[0][0] is a
    leaf = leaves[0][1]
    assert out["x"][0] is leaf and out["y"][0] is leaf and out["x"][1] is b
    assert leaf.is_leaf and leaf.requires_grad and torch.equal(leaf, a)
    # leaves (parameters, earlier cuts) stay themselves unless asked for
    assert cut((leaf,), [], {})[0] is leaf
    more: list = []
    assert cut(leaf, more, {}, leaves_too=True) is not leaf and more[0][0] is leaf


def test_a_wrapped_block_is_refused():
    model, mbs = _model(first_k_dense=0), _micro_batches(1)
    block = model.model.layers[0]
    wrap_forward(block, lambda inner: (lambda *a, **k: inner(*a, **k)))
    with pytest.raises(ValueError, match="cannot recompute a whole block or MoE layer"):
        run_merged(Tape(model.pipeline_forward_steps(0, mbs[0], None), 1.0), None, None)


def test_activation_offload_is_refused_in_steps():
    from lightning_moe.callbacks.saved_tensors import SavedTensorPolicy
    policy = SavedTensorPolicy()
    policy.offloader = object()  # what ActivationOffload sets
    with pytest.raises(ValueError, match="ActivationOffload cannot run with"):
        with policy.step_context():
            pass


@pytest.mark.parametrize("kwargs, match", [
    (dict(overlap_moe_comm="yes"), "must be True or False"),
    (dict(expert_parallel_size=2), "num_microbatches >= 2"),
    (dict(expert_parallel_size=2, num_microbatches=4, pipeline_parallel_size=2), "interleaved schedule"),
    (dict(expert_parallel_size=2, num_microbatches=2, pipeline_parallel_size=2, virtual_pipeline_size=2),
     "num_microbatches >= 2 x pipeline_parallel_size = 4"),
    (dict(expert_parallel_size=2, num_microbatches=4, pipeline_parallel_size=2, virtual_pipeline_size=2,
          overlap_p2p_comm=False), "overlap_p2p_comm=True"),
    (dict(num_microbatches=2), "no token exchange"),
    (dict(expert_parallel_size=2, num_microbatches=2, cuda_graphs=True), "CUDA graphs"),
])
def test_bad_layouts_are_refused(kwargs, match):
    kwargs.setdefault("overlap_moe_comm", True)
    with pytest.raises(ValueError, match=match):
        MoEFoldStrategy(**kwargs)


def test_fine_grained_recompute_runs_inside_the_steps():
    """Recompute's saved-tensor hooks wrap each step of a block: its modules are rebuilt in the merged schedule's
    backward (bytes counted), and the gradients stay those of one plain backward without recomputation."""
    import types

    from lightning_moe import Recompute
    model, mbs = _model(), _micro_batches(2)
    ref = _plain(model, mbs, 0.5)
    Recompute(["moe_act", "layernorm", "core_attn"]).on_fit_start(
        types.SimpleNamespace(strategy=types.SimpleNamespace(cuda_graphs=False)), model)
    policy = model._lmoe_saved_tensors
    policy.stats.clear()
    got, _ = _merged(model, mbs, 0.5)
    assert set(policy.stats) == {"moe_act", "layernorm", "core_attn"} and min(policy.stats.values()) > 0
    assert all(torch.equal(ref[n], got[n]) for n in ref)


@pytest.mark.parametrize("modules,refused", [(["full"], True), (["moe"], True), (["moe_act", "layernorm"], False)])
def test_whole_block_recompute_is_refused_when_training_starts(modules, refused):
    """MoEFoldStrategy.on_train_start (after the callbacks' on_fit_start) walks the MoE blocks' wrappers."""
    import types

    from lightning_moe import Recompute
    model = _model()
    Recompute(modules).on_fit_start(types.SimpleNamespace(strategy=types.SimpleNamespace(cuda_graphs=False)), model)
    strategy = MoEFoldStrategy(expert_parallel_size=2, num_microbatches=2, overlap_moe_comm=True)
    strategy._lightning_module = model
    if refused:
        with pytest.raises(ValueError, match="cannot recompute a whole block or MoE layer"):
            strategy.on_train_start()
    else:
        strategy.on_train_start()
