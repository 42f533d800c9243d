"""GPU (skipped without CUDA): shared experts on a side stream (ModelConfig.shared_expert_overlap) change no number."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_moe.modules.init import init_weights
from lightning_moe.modules.moe_layer import MoELayer
from lightning_moe.strategy.parallel_context import ParallelContext
from tests.modules.test_moe_layer import cfg_

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _run(overlap: bool):
    cfg = cfg_(hidden_size=512, num_experts=8, topk=2, moe_ffn_hidden_size=1024, shared_expert_ffn_size=2048,
               shared_expert_overlap=overlap)
    layer = MoELayer(cfg, ParallelContext.single(), out_std=0.02)
    init_weights(layer, 0)
    layer = layer.cuda().to(torch.bfloat16)
    x = torch.randn(4, 512, 512, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(0))
    x.requires_grad_(True)
    for _ in range(2):  # twice: the second call reuses the side stream and the allocator's blocks
        x.grad = None
        layer.zero_grad(set_to_none=True)
        y, aux = layer(x)
        (y.float().square().mean() + aux).backward()
    torch.cuda.synchronize()
    streams = [k for k in layer.ctx.comm_buffers if k[0] == "shared_expert_stream"]
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}, streams


def test_shared_expert_overlap_is_bit_identical():
    y0, gx0, g0, s0 = _run(False)
    y1, gx1, g1, s1 = _run(True)
    assert not s0 and len(s1) == 1  # the side stream was used only when asked for
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1)
    assert all(torch.equal(g0[n], g1[n]) for n in g0), [n for n in g0 if not torch.equal(g0[n], g1[n])]


# ---------------------------------------------------------------- overlap_moe_comm: the exchanges on a side stream
class _SlowCopy(torch.autograd.Function):
    """A stand-in for a token exchange: spins the stream, then copies (forward and backward). Were the compute stream
    not to wait for the exchange's stream, it would read the copy's buffer before it is written."""

    @staticmethod
    def forward(ctx, x):
        torch.cuda._sleep(2_000_000)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        torch.cuda._sleep(2_000_000)
        return g.clone()


from lightning_moe.modules.dispatcher import TokenDispatcher  # noqa: E402


class SlowCopyDispatcher(TokenDispatcher):
    def token_dispatch(self, x_ND, st):
        return _SlowCopy.apply(x_ND)

    def token_combine(self, y_MD, st):
        return _SlowCopy.apply(y_MD)


def _lm():
    from lightning_moe import MoELanguageModel
    model = MoELanguageModel(preset="tiny", seed=7, overrides=dict(
        seq_length=256, num_layers=3, hidden_size=256, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=512,
        moe_ffn_hidden_size=256, num_experts=8, topk=2, first_k_dense=1, shared_expert_ffn_size=256,
        tie_embeddings=True, score_function="sigmoid", expert_bias=True,
        dispatcher="tests.test_gpu_moe_overlap.SlowCopyDispatcher"))
    model.configure_model()
    return model.cuda().to(torch.bfloat16).train()


def _grads_of(model, mbs, merged: bool, stream=None):
    from lightning_moe.strategy.pipeline.moe_overlap import Tape, run_merged
    model.zero_grad(set_to_none=True)
    scale, losses = 1 / len(mbs), []
    if not merged:
        for mb in mbs:
            out, aux = model.pipeline_forward(0, mb, None)
            ((out + aux) * scale).backward()
            losses.append(out.detach())
    else:
        previous = None
        for i in range(len(mbs) + 1):
            tape = Tape(model.pipeline_forward_steps(0, mbs[i], None), scale) if i < len(mbs) else None
            run_merged(tape, previous, stream)
            if tape is not None:
                losses.append(tape.result[0].detach())
                tape.add_roots([tape.result[0] * scale])
            previous = tape
    torch.cuda.synchronize()
    return torch.stack(losses), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_merged_schedule_on_a_side_stream_is_bit_identical():
    model = _lm()
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, 256, (12, 257), generator=g).cuda()
    mbs = [{"input_ids": toks[4 * i:4 * i + 4, :-1], "labels": toks[4 * i:4 * i + 4, 1:]} for i in range(3)]
    loss0, ref = _grads_of(model, mbs, merged=False)
    stream = torch.cuda.Stream()
    for _ in range(2):  # twice: the allocator reuses the blocks of the first run
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss1, got = _grads_of(model, mbs, merged=True, stream=stream)
        assert not [w for w in caught if "AccumulateGrad node's stream" in str(w.message)]
        assert torch.equal(loss0, loss1)
        bad = [n for n in ref if not torch.equal(ref[n], got[n])]
        assert not bad, f"gradients differ with the exchanges on a side stream: {bad}"


def test_merged_schedule_with_fine_grained_recompute_on_a_side_stream():
    """Recompute's modules rebuilt inside the merged schedule's steps, the exchanges on a side stream: the gradients
    of the plain schedule without recomputation, bit for bit."""
    import types

    from lightning_moe import Recompute
    model = _lm()
    toks = torch.randint(0, 256, (8, 257), generator=torch.Generator().manual_seed(1)).cuda()
    mbs = [{"input_ids": toks[4 * i:4 * i + 4, :-1], "labels": toks[4 * i:4 * i + 4, 1:]} for i in range(2)]
    loss0, ref = _grads_of(model, mbs, merged=False)
    Recompute(["moe_act", "layernorm", "core_attn"]).on_fit_start(
        types.SimpleNamespace(strategy=types.SimpleNamespace(cuda_graphs=False)), model)
    model._lmoe_saved_tensors.stats.clear()
    loss1, got = _grads_of(model, mbs, merged=True, stream=torch.cuda.Stream())
    assert min(model._lmoe_saved_tensors.stats.values()) > 0
    assert torch.equal(loss0, loss1)
    bad = [n for n in ref if not torch.equal(ref[n], got[n])]
    assert not bad, bad
