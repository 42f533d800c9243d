"""Recompute: every module setting trains bit-identically to no recomputation (float32, CPU) with accumulation,
clipping, a dense layer, a shared expert, the expert bias and the global aux loss; and each one frees what it claims,
seen from the outside: the module outputs autograd no longer holds after the forward (weak references die)."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lightning_moe import MoELanguageModel, Recompute, TokenDataModule
from lightning_moe.callbacks.saved_tensors import policy_of

GQA = dict(seq_length=32, num_layers=3, hidden_size=32, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
           moe_ffn_hidden_size=32, num_experts=8, topk=2, first_k_dense=1, shared_expert_ffn_size=32,
           score_function="sigmoid", expert_bias=True, bias_update_rate=1e-2, load_balancing="global_aux_loss",
           z_loss_coeff=1e-3)
# v_head_dim = the q/k head dim: CPU SDPA's flash kernel (keeps q, k, v as they are; its math fallback keeps a
# scaled copy of q, which mla_up_proj could not free)
MLA = dict(GQA, attention_type="mla", q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
           v_head_dim=16, num_kv_heads=4)
QK = dict(GQA, qk_norm=True)  # Qwen3's q/k norms: "layernorm" also rebuilds their rotated outputs (attention's q, k)


class _Record(L.Callback):
    def __init__(self):
        self.losses, self.grads = [], None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.grads is None:
            self.grads = {n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None}


def _fit(tokens, root, model, modules=None, layers="all", extra=()):
    L.seed_everything(0, verbose=False)
    rec = _Record()
    callbacks = [rec] + ([Recompute(modules, layers=layers)] if modules else []) + list(extra)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.5,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=callbacks, default_root_dir=root)
    lm = MoELanguageModel(preset="tiny", overrides=model, lr=1e-2, warmup_steps=1, seed=3)
    trainer.fit(lm, datamodule=TokenDataModule(path=tokens, seq_length=32, batch_size=4, seed=3))
    state = {n: t.detach().clone() for n, t in lm.state_dict().items()}
    return rec.losses, rec.grads, state


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    from tests.parallel.parity import make_tokens
    return make_tokens(str(tmp_path_factory.mktemp("rc") / "t.bin"))


@pytest.mark.parametrize("model,settings", [
    (GQA, [["core_attn"], ["layernorm"], ["moe_act"], ["shared_experts"], ["mlp"], ["moe"], ["full"],
           ["core_attn", "layernorm", "moe_act", "shared_experts", "mlp"]]),
    (MLA, [["mla_up_proj"], ["mla_up_proj", "core_attn", "layernorm"], ["full"]]),
    (QK, [["layernorm"], ["layernorm", "core_attn", "moe_act"]]),
], ids=["gqa", "mla", "qk_norm"])
def test_recompute_is_bit_identical(tmp_path, tokens, model, settings):
    ref = _fit(tokens, str(tmp_path), model)
    for modules in settings:
        losses, grads, state = _fit(tokens, str(tmp_path), model, modules)
        assert losses == ref[0], modules
        assert all(torch.equal(grads[k], v) for k, v in ref[1].items()), modules
        assert all(torch.equal(state[k], v) for k, v in ref[2].items()), modules  # weights, expert bias, counters


@pytest.mark.parametrize("model,modules", [(GQA, ["moe"]), (GQA, ["full"]), (GQA, ["mlp", "shared_experts"]),
                                           (GQA, ["moe", "shared_experts"]), (MLA, ["mla_up_proj"])],
                         ids=["moe", "full", "mlp+shared", "moe+shared", "mla_up_proj"])
def test_recompute_under_delayed_fp8_is_bit_identical(tmp_path, tokens, model, modules):
    """FP8Training('delayed') (emulated on the CPU), a history of two so that a second push changes the scale: a
    recomputed region (a checkpoint, or a rebuilt module with FP8 linears: MLA's up-projections) scales each operand
    by what its first pass used and pushes nothing into the amax histories (as Transformer Engine restores its scales
    for a recomputation), so training is bit-identical to no recomputation, the histories' first uses (step one)
    included. The shared experts inside a recomputed MoE layer are replayed with it, not as a first pass of their
    own. Without that the replay scaled by a history its first pass had advanced, and pushed it again."""
    from lightning_moe import FP8Training
    ref = _fit(tokens, str(tmp_path), model, extra=[FP8Training("delayed", amax_history=2)])
    losses, grads, state = _fit(tokens, str(tmp_path), model, modules, extra=[FP8Training("delayed", amax_history=2)])
    assert losses == ref[0]
    assert all(torch.equal(grads[k], v) for k, v in ref[1].items())
    assert all(torch.equal(state[k], v) for k, v in ref[2].items())


def test_a_retained_graph_replays_its_recomputed_regions_again():
    """A second backward through a retained graph recomputes each checkpointed region again (the replay contexts
    enter again and read their first pass's values from the start: the global aux-loss window here): the same
    gradients as the first backward."""
    lm = _lm(GQA)
    Recompute(["moe", "mlp"]).on_fit_start(SimpleNamespace(strategy=SimpleNamespace(cuda_graphs=False)), lm)
    lm.train()
    tokens = torch.randint(0, lm.config.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
    lm_loss, aux = lm.model.loss(tokens[:, :-1], tokens[:, 1:])
    (lm_loss + aux).backward(retain_graph=True)
    first = {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}
    lm.zero_grad(set_to_none=True)
    (lm_loss + aux).backward()
    assert first and all(torch.equal(p.grad, first[n]) for n, p in lm.named_parameters() if n in first)


# ------------------------------------------------------------------------------------------------ memory
def _outputs_held(lm, modules, callbacks=None):
    """Forward one micro-batch; then the bytes of each submodule's outputs that autograd still holds, by module."""
    refs = []

    def grab(name):
        def hook(mod, args, out):
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    refs.append((name, weakref.ref(t), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return hook

    handles = [m.register_forward_hook(grab(n)) for n, m in lm.model.named_modules() if ".layers." in f".{n}"]
    callbacks = callbacks if callbacks is not None else ([Recompute(modules)] if modules else [])
    for cb in callbacks:
        cb.on_fit_start(SimpleNamespace(strategy=SimpleNamespace(cuda_graphs=False)), lm)
    lm.train()
    tokens = torch.randint(0, lm.config.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
    lm_loss, aux = lm.model.loss(tokens[:, :-1], tokens[:, 1:])
    loss = lm_loss + aux
    gc.collect()
    held: dict[str, dict[int, int]] = {}  # module -> {storage address: bytes} still held
    for name, ref, ptr, nbytes in refs:
        if ref() is not None:
            held.setdefault(name, {})[ptr] = nbytes
    stats = dict(policy_of(lm).stats)
    loss.backward()  # the recomputation runs (and must work) after the measurement
    for h in handles:
        h.remove()
    for cb in callbacks:
        cb.teardown(None, lm, "fit")
    return held, stats


def _lm(model):
    lm = MoELanguageModel(preset="tiny", overrides=model, seed=3)
    lm.configure_model()
    return lm


def _match(held: dict, *patterns) -> int:
    """Bytes of the distinct storages held by the modules whose names end with ``patterns``."""
    storages = {}
    for k, v in held.items():
        if any(k.endswith(p) for p in patterns):
            storages.update(v)
    return sum(storages.values())


@pytest.mark.parametrize("model,modules,freed", [
    (GQA, ["moe_act"], ("experts.act",)),
    (GQA, ["layernorm"], ("attn_norm", "ffn_norm")),
    (GQA, ["core_attn"], ("core_attn",)),
    (MLA, ["mla_up_proj"], ("up_proj", "wkv_b")),  # v is a view of wkv_b's output: freeing v frees it
    (GQA, ["moe_act", "layernorm", "core_attn"], ("experts.act", "attn_norm", "ffn_norm", "core_attn")),
    (QK, ["layernorm"], ("attn_norm", "ffn_norm", "norm_rotate")),
    # a recomputed core_attn keeps its inputs, the rotated q and k: those stay, and are not claimed
    (QK, ["layernorm", "core_attn"], ("attn_norm", "ffn_norm", "core_attn")),
], ids=["moe_act", "layernorm", "core_attn", "mla_up_proj", "combined", "qk_norm", "qk_norm_core_attn"])
def test_rebuilt_modules_free_their_outputs(model, modules, freed):
    base, _ = _outputs_held(_lm(model), None)
    held, stats = _outputs_held(_lm(model), modules)
    claimed = _match(base, *freed)
    assert claimed > 0, base  # the outputs were held without recomputation (else the test would prove nothing)
    assert _match(held, *freed) == 0  # ... and are not now
    others = {k: sum(v.values()) for k, v in base.items() if not any(k.endswith(p) for p in freed)}
    assert {k: sum(held.get(k, {}).values()) for k in others} == others  # nothing else changes
    assert sum(stats.values()) == claimed  # the callback's own count of what it kept off the device


@pytest.mark.parametrize("modules,inside", [
    (["moe"], r"layers\.[12]\.ffn\."), (["mlp"], r"layers\.0\.ffn\."), (["shared_experts"], r"shared_experts\."),
    (["full"], r"layers\.\d+\."),
], ids=["moe", "mlp", "shared_experts", "full"])
def test_whole_modules_keep_only_their_inputs(modules, inside):
    """Nothing computed inside the recomputed module is held after the forward (its input is: the region's own
    input, e.g. the next block's input under ``full``)."""
    import re
    base, _ = _outputs_held(_lm(GQA), None)
    held, _ = _outputs_held(_lm(GQA), modules)
    assert [k for k in base if re.match(inside, k) or re.search(inside, k)]
    assert not [k for k in held if re.search(inside, k)], held


def test_layers_select_blocks(tokens, tmp_path):
    lm = _lm(GQA)
    base, _ = _outputs_held(lm, None)
    cb = Recompute(["layernorm"], layers=[2])
    cb.on_fit_start(SimpleNamespace(strategy=SimpleNamespace(cuda_graphs=False)), lm)
    assert len(policy_of(lm)._wrapped) == 1 and policy_of(lm)._wrapped[0][0] is lm.model.layers[2]
    cb.teardown(None, lm, "fit")
    cb = Recompute(["moe_act"], layers=1)  # the first layer of each stage: a dense one, without experts
    with pytest.raises(ValueError, match="no 'moe_act'"):
        cb.on_fit_start(SimpleNamespace(strategy=SimpleNamespace(cuda_graphs=False)), _lm(GQA))


@pytest.mark.parametrize("kw,match", [
    (dict(modules=["attn"]), r"unknown module 'attn'; valid: core_attn, layernorm, moe_act"),
    (dict(modules=[]), r"unknown module None"),
    (dict(layers="some"), r"layers='some'"),
    (dict(layers=[-1]), r"layers=\[-1\]"),
])
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        Recompute(**kw)


def test_out_of_range_layer_and_cuda_graphs_refused():
    with pytest.raises(ValueError, match=r"layer 7 is out of range; the model has 3 layers \(0..2\)"):
        Recompute(["layernorm"], layers=[0, 7]).on_fit_start(
            SimpleNamespace(strategy=SimpleNamespace(cuda_graphs=False)), _lm(GQA))
    with pytest.raises(ValueError, match="cannot be combined with MoEFoldStrategy\\(cuda_graphs=True\\)"):
        Recompute().on_fit_start(SimpleNamespace(strategy=SimpleNamespace(cuda_graphs=True)), _lm(GQA))
    with pytest.raises(ValueError, match="no 'mla_up_proj'"):
        Recompute(["mla_up_proj"]).on_fit_start(SimpleNamespace(strategy=SimpleNamespace(cuda_graphs=False)),
                                                _lm(GQA))


@pytest.mark.parametrize("order", ["fine_first", "full_first"])
def test_whole_block_recompute_composes_with_block_hooks(order):
    """A block recomputed whole inside another callback's saved-tensor hooks: the checkpoint goes under them, whatever
    the order, so it still keeps nothing inside the block (hooks nested the other way would hide the checkpoint's);
    teardown, in any order, leaves the blocks' own forward."""
    import re
    lm = _lm(GQA)
    callbacks = [Recompute(["layernorm"]), Recompute(["full"])]
    held, _ = _outputs_held(lm, None, callbacks if order == "fine_first" else callbacks[::-1])
    assert not [k for k in held if re.search(r"layers\.\d+\.", k)], held
    assert all("forward" not in vars(block) for block in lm.model.layers)
