"""MoEFoldStrategy(compile_blocks=True) on CPU: compiled blocks train to the same numbers as eager ones (1 process,
float32, and EP2 over gloo against the 1-process reference), keep their state-dict keys, break their graphs only
where expected, and the combinations that cannot work are refused.

The backend is ``aot_eager`` (``LMOE_COMPILE_BACKEND``; inductor's CPU compile takes ~40 s here): dynamo, AOTAutograd
and its partitioner run as on the GPU, without inductor's kernels. The fused Triton paths run here on stand-ins:
the real launcher modules imported over a stub ``triton``, with their kernel launches replaced by torch code, so that
the custom ops they define under compile (schemas, fake kernels, the router's autograd) are what is checked."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import lightning as L
import numpy as np
import pytest
import torch

from lightning_moe import MoEFoldStrategy, MoELanguageModel, Recompute, TokenDataModule
from lightning_moe.strategy import compile_blocks as cb

TINY = dict(seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
            moe_ffn_hidden_size=32, num_experts=4, topk=2, vocab_size=64, z_loss_coeff=1e-3)


@pytest.fixture
def aot_eager(monkeypatch):
    monkeypatch.setenv("LMOE_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _tokens(tmp_path):
    from lightning_moe.data import write_tokens
    return write_tokens(str(tmp_path / "t.bin"), np.random.default_rng(0).integers(0, 64, 20000), "uint16")


def _fit(tokens, compile_blocks: bool, callbacks=(), precision="32-true", steps=3, **overrides):
    from lightning_moe.modules import wgrad_fusion
    losses, grads, seen = [], [], {}

    class Rec(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].detach().clone())

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads.append({n: (p.grad if p.grad is not None else p.main_grad).detach().clone()
                          for n, p in pl_module.model.named_parameters()})
            seen["keys"] = list(pl_module.model.state_dict())
            seen["compiled"] = [b._compiled_call_impl is not None for b in pl_module.model.layers]
            seen["fused_wgrad"] = sorted(n for n, p in pl_module.model.named_parameters()
                                         if wgrad_fusion.sink_of(p) is not None)

    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=MoEFoldStrategy(compile_blocks=compile_blocks),
                        max_steps=steps, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Rec(), *callbacks], precision=precision)
    model = MoELanguageModel(preset="tiny", overrides={**TINY, **overrides}, seed=3, lr=1e-2, warmup_steps=1)
    trainer.fit(model, TokenDataModule(path=tokens, seq_length=16, batch_size=2))
    return torch.stack(losses), grads, seen, trainer.callback_metrics.get("val_loss", torch.zeros(())).item(), model


def test_compiled_training_matches_eager(tmp_path, aot_eager):
    """3 steps (a dense first layer, a MoE layer with global aux loss and z-loss) and a validation: the same losses,
    gradients and validation loss; the state-dict keys of the compiled model are the eager model's; the blocks are
    back to eager after fit. float32: the grouped GEMMs run outside the graph (2 breaks per MoE block), nothing else
    breaks it. The global aux loss is the regression case of pytorch/pytorch#197039 (a buffer read recomputed in
    backward after the forward mutated it: wrong router gradients)."""
    tokens = _tokens(tmp_path)
    kw = dict(first_k_dense=1, load_balancing="global_aux_loss")
    loss_e, grads_e, seen_e, val_e, _ = _fit(tokens, False, **kw)
    loss_c, grads_c, seen_c, val_c, model = _fit(tokens, True, **kw)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=0)
    for g_c, g_e in zip(grads_c, grads_e, strict=True):
        for n, g in g_e.items():
            torch.testing.assert_close(g_c[n], g, rtol=1e-5, atol=1e-7, msg=n)
    assert val_c == pytest.approx(val_e, rel=1e-5)
    assert seen_c["compiled"] == [True, True] and seen_e["compiled"] == [False, False]
    assert seen_c["keys"] == seen_e["keys"] and "layers.1.ffn.router.weight" in seen_c["keys"]
    assert all(b._compiled_call_impl is None for b in model.model.layers)  # released at teardown
    breaks = torch._dynamo.utils.counters["graph_break"]
    assert breaks and all("_grouped_mm" in reason or "_global_window" in reason for reason in breaks), dict(breaks)


def test_bf16_main_grads_blocks_are_one_graph(tmp_path, aot_eager):
    """bf16-true with fp32 main grads: the compiled blocks have no graph break (bf16 grouped GEMMs are graph ops;
    the blocks' linears leave gradient-accumulation fusion, whose backward updates GradSync in Python; the untied
    head keeps it), and train as eager does (bf16 tolerance: the fused wgrad skips a bf16 rounding)."""
    tokens = _tokens(tmp_path)
    loss_e, _, seen_e, _, _ = _fit(tokens, False, precision="bf16-true", steps=2)
    loss_c, _, seen_c, _, _ = _fit(tokens, True, precision="bf16-true", steps=2)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert "layers.0.attn.wq.weight" in seen_e["fused_wgrad"] and seen_c["fused_wgrad"] == ["head.weight"]
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-2, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_graph_breaks_per_block(dtype, aot_eager):
    """The torch paths (CPU): a bf16 MoE block is one graph; in float32 only the two grouped GEMMs run outside it
    (explain counts 5 breaks: each GEMM's call site and the frames of GroupedMM that resume around it)."""
    blk = _model(TINY, dtype).layers[0]
    n, why = cb.graph_breaks(blk, torch.randn(2, 16, 32, dtype=dtype, requires_grad=True), torch.arange(16))
    if dtype == torch.bfloat16:
        assert n == 0, why
    else:
        assert n > 0 and all("torch.compiler.disable()" in w for w in why), why


def _model(overrides, dtype):
    from lightning_moe.modules.config import ModelConfig
    from lightning_moe.modules.transformer import MoETransformer
    torch.manual_seed(0)
    m = MoETransformer(ModelConfig.from_preset("tiny", **overrides))
    m.init_weights(0)
    return m.to(dtype)


# ------------------------------------------------------------------------------------------------ fused stand-ins
def _blocks_sum(x_T, block_t):  # per block of block_t tokens, as the router kernel's partial sums
    pad = -x_T.shape[0] % block_t
    x = torch.cat([x_T, x_T.new_zeros(pad, *x_T.shape[1:])]) if pad else x_T
    return x.view(-1, block_t, *x_T.shape[1:]).sum(1)


def _gates(l, experts, score, scale, topk):
    p = (torch.softmax(l.gather(1, experts), -1) if score == 0 else torch.softmax(l, -1).gather(1, experts)
         if score == 1 else torch.sigmoid(l).gather(1, experts))
    if score == 2 and topk > 1:
        p = p / (p.sum(-1, keepdim=True) + 1e-20)
    return p * scale if scale else p


def _aux_scores(l, aux):
    s = torch.softmax(l, -1) if aux == 1 else torch.sigmoid(l)
    return s if aux == 1 else s / (s.sum(-1, keepdim=True) + 1e-20)


def _router_fwd(logits, bias, *, topk, score, groups, group_topk, scale, count, z, aux, aux_topk, block_t):
    from lightning_moe.modules.router import topk_routing
    cfg = types.SimpleNamespace(score_function="sigmoid" if score == 2 else "softmax", pre_softmax=score == 1,
                                num_groups=groups or None, group_topk=group_topk or None, topk=topk,
                                topk_scaling_factor=scale)
    experts = topk_routing(logits, cfg, bias)[1]
    empty = logits.new_empty(0)  # the flags' empty outputs are one tensor, as the launcher's
    tpe = logits.new_zeros(logits.shape[1]).scatter_add_(0, experts.flatten(), logits.new_ones(experts.numel()))
    spart = cpart = empty
    if aux:
        s = _aux_scores(logits, aux)
        routed = torch.zeros_like(s).scatter_(1, s.topk(topk, -1).indices if aux_topk else experts, 1.0)
        spart, cpart = _blocks_sum(s, block_t), _blocks_sum(routed, block_t)
    return (_gates(logits, experts, score, scale, topk), experts, tpe if count else empty,
            _blocks_sum(torch.logsumexp(logits, -1).square(), block_t) if z else empty, spart, cpart)


def _router_bwd(logits, experts, g_probs, g_z, g_s, *, score, scale, aux, block_t):
    def total(l):  # torch.func: a custom op's body runs below autograd
        t = (_gates(l, experts, score, scale, experts.shape[1]) * g_probs).sum()
        if g_z is not None:
            t = t + (_blocks_sum(torch.logsumexp(l, -1).square(), block_t) * g_z).sum()
        return t + (_blocks_sum(_aux_scores(l, aux), block_t) * g_s).sum() if g_s is not None else t
    return torch.func.grad(total)(logits)


def _copies(y, rows, keep):
    y_TKD = y[rows.clamp(max=y.shape[0] - 1)].float()
    return torch.where(keep.unsqueeze(-1), y_TKD, 0) if keep is not None else y_TKD


def _combine_fwd(y, rows, probs, keep, out_dtype):
    y_TKD = _copies(y, rows, keep)
    return (y_TKD * probs.unsqueeze(-1).float() if probs is not None else y_TKD).sum(1).to(out_dtype)


def _combine_bwd(g, y, rows, probs, keep, permutation):
    N, D = y.shape
    g_TKD = probs.unsqueeze(-1).float() * g.unsqueeze(1).float()
    g_TKD = torch.where(keep.unsqueeze(-1), g_TKD, 0) if keep is not None else g_TKD
    gy = (y.new_empty(N, D) if permutation else y.new_zeros(N + 1, D)).index_copy_(
        0, rows.flatten(), g_TKD.reshape(-1, D).to(y.dtype))
    return gy[:N], (_copies(y, rows, keep) * g.unsqueeze(1).float()).sum(-1)


def _rank_copies(keys, E, div, stride, align, R, fill):
    from lightning_moe.modules.expert_order import expert_order
    o = expert_order(keys, E, div=div, align=align, stride=stride, fused=False)
    return o.rows_N, o.src_R, o.counts_E, o.sizes_E


def _resort_dest(counts, M, align):
    from lightning_moe.modules.expert_order import resort_by_expert
    return resort_by_expert(counts, M, align, fused=False)[:2]


_LAUNCHES = {"triton_router": dict(router_fwd=_router_fwd, router_bwd=_router_bwd),
             "triton_permute": dict(_gather=lambda x, src: torch.cat([x, x.new_zeros(1, x.shape[1])])[
                 torch.where(src < 0, x.shape[0], src)], _combine_fwd=_combine_fwd, _combine_bwd=_combine_bwd),
             "triton_expert_order": dict(_rank_copies=_rank_copies, _resort_dest=_resort_dest)}
_STUBBED: dict = {}  # imported once per process: their custom ops register at import


@pytest.fixture
def fused_stand_ins(monkeypatch):
    """The Triton launcher modules over a stub triton, launches in torch, loaded by ``kernels`` for CPU tensors
    (TRITON_INTERPRET=1). Counts the launches."""
    if importlib.util.find_spec("triton") is not None:
        pytest.skip("triton is installed: tests/test_gpu_compile.py runs the real kernels")
    from lightning_moe.modules import kernels
    calls: dict = {}
    if not _STUBBED:
        triton, tl = types.ModuleType("triton"), types.ModuleType("triton.language")
        triton.jit, triton.cdiv = (lambda fn: fn), (lambda a, b: -(-a // b))
        triton.next_power_of_2 = lambda n: 1 << max(n - 1, 0).bit_length()
        tl.constexpr, triton.language = (lambda v=None: v), tl
        with monkeypatch.context() as m:
            m.setitem(sys.modules, "triton", triton)
            m.setitem(sys.modules, "triton.language", tl)
            for name in _LAUNCHES:
                _STUBBED[name] = importlib.import_module(f"lightning_moe.modules.{name}")
                m.delitem(sys.modules, f"lightning_moe.modules.{name}")
    for name, launches in _LAUNCHES.items():
        mod = _STUBBED[name]
        monkeypatch.setitem(sys.modules, f"lightning_moe.modules.{name}", mod)  # dynamo re-imports by name
        monkeypatch.setitem(kernels._MODULES, name, mod)
        for attr, fn in launches.items():
            monkeypatch.setattr(mod, attr, lambda *a, _f=fn, _n=attr, **k: calls.update({_n: calls.get(_n, 0) + 1})
                                or _f(*a, **k))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return calls


def test_fused_kernels_compile_as_custom_ops(fused_stand_ins, aot_eager):
    """The fused router, permutes and expert order in a compiled bf16 block: no graph break (what the GPU should see),
    the custom ops in the graph, and the same loss and gradients as the eager Triton path."""
    import copy
    ovr = dict(TINY, load_balancing="seq_aux_loss")
    eager = _model(ovr, torch.bfloat16)
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16, requires_grad=True)
    ex = torch._dynamo.explain(eager.layers[0])(x, torch.arange(16))
    ops = {str(n.target) for g in ex.graphs for m in g.modules() if isinstance(m, torch.fx.GraphModule)
           for n in m.graph.nodes if "lightning_moe" in str(n.target)}  # permute.py's Functions: subgraphs
    assert ex.graph_break_count == 0, [r.reason for r in ex.break_reasons]
    assert {"lightning_moe.fused_router_fwd.default", "lightning_moe.expert_order_rank_copies.default",
            "lightning_moe.permute_gather.default", "lightning_moe.permute_combine_fwd.default",
            "lightning_moe.permute_combine_bwd.default"} <= ops, ops
    compiled = copy.deepcopy(eager)
    cb.compile_blocks(list(compiled.layers), torch.device("cpu"))
    tok = torch.randint(0, 64, (2, 17))
    for model in (eager, compiled):
        logits, aux = model(tok[:, :-1])
        (torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tok[:, 1:].flatten()) + aux).backward()
    grads = dict(eager.named_parameters())
    for n, p in compiled.named_parameters():
        torch.testing.assert_close(p.grad, grads[n].grad, rtol=0, atol=0, msg=n)
    assert {"router_fwd", "router_bwd", "_rank_copies", "_gather", "_combine_fwd", "_combine_bwd"} <= set(
        fused_stand_ins)


def test_fused_custom_ops_check(fused_stand_ins):
    """torch.library.opcheck: schemas, fake kernels against the real outputs, the router's autograd registration."""
    ops = torch.ops.lightning_moe
    T, K, D, E = 12, 2, 8, 4
    logits, x, y = torch.randn(T, E), torch.randn(T, D), torch.randn(T * K, D)
    rows, probs, keep = torch.randperm(T * K).view(T, K), torch.rand(T, K), torch.rand(T, K) > 0.3
    keys = torch.randint(0, E, (T * K,))
    for op, args in [
        (ops.fused_router_fwd, (logits.clone().requires_grad_(), None, 2, 0, 0, 0, None, True, True, 1, False, 4)),
        (ops.fused_router_fwd, (logits.clone().requires_grad_(), torch.randn(E), 2, 2, 2, 1, 2.5, True, False, 2,
                                True, 4)),
        (ops.fused_router_fwd, (logits, None, 2, 0, 0, 0, None, True, False, 0, False, 4)),  # eval: aliased empties
        (ops.expert_order_rank_copies, (keys, E, K, 0, 1, T * K, None)),
        (ops.expert_order_rank_copies, (keys, E, K, 0, 4, T * K + E * 3, -1)),
        (ops.expert_order_resort_dest, (torch.tensor([[2, 1], [0, 3]]), 6, 1)),
        (ops.permute_gather, (x, torch.tensor([0, 3, -1, 5]))),
        (ops.permute_combine_fwd, (y, rows, probs, None, torch.float32)),
        (ops.permute_combine_bwd, (x, y, rows, probs, None, True)),
        (ops.permute_combine_bwd, (x, y, rows, probs, keep, False)),
    ]:
        torch.library.opcheck(op, args)


# ------------------------------------------------------------------------------------------------ CUDA-graph hand-off
def test_for_capture_compiles_forward_and_release_restores(aot_eager):
    """Before a CUDA-graph capture the blocks trade ``nn.Module.compile`` for a compiled ``forward`` (what
    ``capture_blocks`` warms up, captures and falls back to); release gives eager blocks back."""
    model = _model(TINY, torch.float32)
    blocks = list(model.layers)
    x, pos = torch.randn(2, 16, 32), torch.arange(16)
    want = blocks[0](x, pos)[0]
    cb.compile_blocks(blocks, torch.device("cpu"))
    cb.for_capture(blocks)
    assert all(b._compiled_call_impl is None and "forward" in vars(b) for b in blocks)
    torch.testing.assert_close(blocks[0](x, pos)[0], want)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the forward did compile
    cb.release(blocks)
    assert all(b._compiled_call_impl is None and "forward" not in vars(b) for b in blocks)


# ------------------------------------------------------------------------------------------------ refused
def test_bad_flag():
    with pytest.raises(ValueError, match="compile_blocks must be True or False"):
        MoEFoldStrategy(compile_blocks="yes")
    assert MoEFoldStrategy(compile_blocks=True).compile_blocks and not MoEFoldStrategy().compile_blocks


def test_recompute_offload_and_low_precision_refused(tmp_path):
    from lightning_moe import ActivationOffload, FP8Training, NVFP4Training
    tokens = _tokens(tmp_path)
    for callback in (Recompute(), ActivationOffload(), FP8Training("rowwise"), NVFP4Training()):
        with pytest.raises(ValueError, match=f"{type(callback).__name__} cannot be combined with "
                                             r"MoEFoldStrategy\(compile_blocks=True\)"):
            _fit(tokens, True, callbacks=[callback])
    with pytest.raises(TypeError, match=r"\.model\.layers"):
        cb.model_blocks(torch.nn.Linear(2, 2))


# ------------------------------------------------------------------------------------------------ 2 gloo ranks
def test_ep2_compiled_matches_one_process(tmp_path, aot_eager):
    """EP2 (attention DP2) over gloo with compiled blocks against the 1-process eager reference: losses, every
    gradient and the parameters after 3 steps. The dropless all-to-all's split sizes break each MoE block's graph
    (a host sync), the blocks recompile once with symbolic row counts, then run compiled."""
    from tests.parallel.parity import TOL, Case, check_case, run_cases
    case = Case("ep2_alltoall_compiled", 2, ep=2, model=dict(dispatcher="alltoall", load_balancing="global_aux_loss"),
                strategy=dict(compile_blocks=True))
    check_case(case, run_cases([case], tmp_path)[case.name], TOL)
