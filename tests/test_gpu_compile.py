"""MoEFoldStrategy(compile_blocks=True) on one GPU (skipped without CUDA): inductor-compiled blocks with the fused
Triton router and permutes (the defaults on CUDA) as custom ops, bf16-true, against eager; with CUDA graphs capturing
the compiled blocks; and the graph breaks of each kind of block (none on one GPU)."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch

from lightning_moe.strategy import compile_blocks as cb

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

OVR = dict(seq_length=256, hidden_size=256, num_layers=2, num_attention_heads=4, num_kv_heads=2,
           ffn_hidden_size=512, moe_ffn_hidden_size=256, num_experts=8, topk=2, vocab_size=512, z_loss_coeff=1e-3)
# DeepSeek-style routing (sigmoid, expert bias, groups, sequence aux loss), a shared expert and a dense first layer
DSV3 = dict(score_function="sigmoid", expert_bias=True, num_groups=4, group_topk=2, shared_expert_ffn_size=256,
            first_k_dense=1, load_balancing="seq_aux_loss", num_layers=3)
BLOCKS = {
    "softmax_aux": dict(),
    "qwen3_like": dict(qk_norm=True, num_experts=128, topk=8, moe_ffn_hidden_size=128, z_loss_coeff=None),
    "dsv3_like": DSV3,
}
FUSED_OPS = {"lightning_moe.fused_router_fwd.default", "lightning_moe.expert_order_rank_copies.default",
             "lightning_moe.permute_gather.default", "lightning_moe.permute_combine_fwd.default"}


@pytest.mark.parametrize("name", list(BLOCKS))
def test_blocks_have_no_graph_break(name):
    """Every block (dense and MoE) of a bf16 model on one GPU is one graph, with the fused kernels in it as custom
    ops (forward and, inside permute.py's Functions, backward)."""
    from lightning_moe.modules.config import ModelConfig
    from lightning_moe.modules.transformer import MoETransformer
    torch._dynamo.reset()
    cfg = ModelConfig.from_preset("tiny", **{**OVR, **BLOCKS[name]})
    model = MoETransformer(cfg)
    model.init_weights(0)
    model = model.cuda().bfloat16()
    for blk in model.layers:  # rotary tables and kernel modules, as the strategy's setup does
        cb._prepare(blk, torch.device("cuda"))
    x = torch.randn(2, 256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(256, device="cuda")
    for i, blk in enumerate(model.layers):
        ex = torch._dynamo.explain(blk)(x, positions)
        reasons = [r.reason.strip().splitlines()[0] for r in ex.break_reasons]
        ops = {str(n.target) for g in ex.graphs for m in g.modules() if isinstance(m, torch.fx.GraphModule)
               for n in m.graph.nodes if "lightning_moe" in str(n.target)}
        print(f"{name} layer {i} ({'moe' if blk.is_moe else 'dense'}): {ex.graph_count} graph(s), "
              f"{ex.graph_break_count} break(s) {reasons}, custom ops {sorted(ops)}")
        assert ex.graph_break_count == 0, reasons
        if blk.is_moe:
            assert FUSED_OPS <= ops, ops


def _fit(tokens, compiled: bool, graphs: bool):
    from lightning_moe import MoEFoldStrategy, MoELanguageModel, TokenDataModule
    losses, grads, seen = [], [], {}

    class Rec(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(outputs["lm_loss"].detach().clone())
            blk = pl_module.model.layers[1]  # graphed: capture_blocks' guarded forward replaced the method
            seen.setdefault("graphed", []).append("forward" in vars(blk))
            seen.setdefault("module_compiled", []).append(blk._compiled_call_impl is not None)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if not grads:  # the first step's synced gradients (with fp32 main params: p.main_grad)
                grads.append({n: (p.grad if p.grad is not None else p.main_grad).float().clone()
                              for n, p in pl_module.model.named_parameters()})

    L.seed_everything(0, verbose=False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    trainer = L.Trainer(accelerator="gpu", devices=1,
                        strategy=MoEFoldStrategy(compile_blocks=compiled, cuda_graphs=graphs), precision="bf16-true",
                        max_steps=4, accumulate_grad_batches=2, gradient_clip_val=1.0, limit_val_batches=0,
                        num_sanity_val_steps=0, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, callbacks=[Rec()])
    model = MoELanguageModel(preset="tiny", overrides={**OVR, **DSV3}, seed=3, lr=1e-3, warmup_steps=1)
    trainer.fit(model, datamodule=TokenDataModule(path=tokens, seq_length=256, batch_size=2))
    state = {k: v.detach().float().cpu() for k, v in model.model.state_dict().items()}
    seen["graphs_compiled"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    return torch.stack(losses).float().cpu(), grads[0], state, seen, breaks


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory):
    from lightning_moe.data import write_tokens
    path = write_tokens(str(tmp_path_factory.mktemp("tok") / "t.bin"),
                        np.random.default_rng(0).integers(0, 512, 80000), "uint16")
    return path, _fit(path, compiled=False, graphs=False)


@pytest.mark.parametrize("graphs", [False, True], ids=["compiled", "compiled_cuda_graphs"])
def test_compiled_training_matches_eager(eager_run, graphs):
    """4 optimizer steps of 2 micro-batches, bf16-true with fp32 main grads and params, clipping, DeepSeek-style
    routing through the fused router, a shared expert and a dense first layer: inductor-compiled blocks (and, with
    ``cuda_graphs``, the compiled blocks captured) against eager. bf16 tolerances (tests/parallel/parity.py's
    BF16_TOL, in norms): inductor fuses the elementwise work and rounds to bf16 in other places than eager. No graph
    break anywhere in the compiled run; the checkpoint keys are unchanged."""
    tokens, (loss_e, grads_e, state_e, _, _) = eager_run
    params = set(grads_e)  # the weights (the state also holds the routing counters)
    loss_c, grads_c, state_c, seen, breaks = _fit(tokens, compiled=True, graphs=graphs)
    assert len(loss_c) == len(loss_e) == 8 and seen["graphs_compiled"] > 0  # dynamo compiled the blocks
    # without graphs the blocks stay nn.Module-compiled; with graphs capture_blocks replaced their forward by the
    # graphed one (for_capture had compiled it first)
    assert all(seen["graphed"]) == graphs and any(seen["graphed"]) == graphs
    assert all(seen["module_compiled"]) != graphs and any(seen["module_compiled"]) != graphs
    assert sum(breaks.values()) == 0, breaks
    assert list(state_c) == list(state_e)  # checkpoint keys unchanged
    g_worst, g_name = max((((grads_c[k] - g).norm() / g.norm().clamp_min(1e-12)).item(), k)
                          for k, g in grads_e.items())
    p_worst, p_name = max((((state_c[k] - v).norm() / v.norm().clamp_min(1e-12)).item(), k)
                          for k, v in state_e.items() if v.is_floating_point() and k in params)
    print(f"graphs={graphs}: losses eager {loss_e.tolist()} compiled {loss_c.tolist()}; max |loss diff| "
          f"{(loss_c - loss_e).abs().max().item():.3g}, worst grad rel-norm diff {g_worst:.3g} ({g_name}), worst "
          f"param rel-norm diff {p_worst:.3g} ({p_name})")
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-2, atol=0)
    assert g_worst < 5e-2, (g_worst, g_name)  # a wrong gradient (e.g. pytorch/pytorch#197039's) is off by far more
    assert p_worst < 0.1, (p_worst, p_name)  # Adam's first steps move every weight by ~lr whatever its gradient
    assert not torch.equal(state_c["layers.1.ffn.router.expert_bias"], torch.zeros(8))  # updated from the counters
