"""Packed documents' two mask forms (``modules/document_mask.py``): the FlexAttention BlockMask allows exactly the
(query, key) pairs of the dense mask, per pair and per block, with and without packed context parallelism (cp ranks
simulated one at a time), and the flex path of the model gives the dense path's logits and gradients (GQA and MLA,
positions restarting per document or not; float32).

torch 2.13 refuses FlexAttention's backward on CPU in the API's device check only; its eager implementation has one
(the math reference). The ``cpu_flex_backward`` fixture lifts that check so that CPU tests can compare gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as flex_api
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_mask

from lightning_moe.modules.config import ModelConfig
from lightning_moe.modules.document_mask import build_document_mask, document_attention, document_mask, use_flex
from lightning_moe.modules.lm import MoELanguageModel

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

GQA = dict(seq_length=32, num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
           moe_ffn_hidden_size=32, num_experts=4, topk=2, first_k_dense=1, vocab_size=64, qk_norm=True)
MLA = dict(GQA, attention_type="mla", q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=16, num_kv_heads=4, qk_norm=False)  # q/k head dim 24, v 16 (DeepSeek-V3: 192, 128)


@pytest.fixture
def cpu_flex_backward(monkeypatch):
    monkeypatch.setattr(flex_api, "_validate_device", lambda *args: None)


def _documents(lengths, B=2):
    """(B, S) document ids; the second row holds the documents in the other order."""
    doc_BS = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0).repeat(B, 1)
    doc_BS[1] = doc_BS[1].flip(0)
    return doc_BS


def _positions(doc_BS):
    """Each token's offset in its document (RoPE restarting at every document, as PackedDocumentDataset gives)."""
    first_BS = torch.ones_like(doc_BS, dtype=torch.bool)
    first_BS[:, 1:] = doc_BS[:, 1:] != doc_BS[:, :-1]
    t_S = torch.arange(doc_BS.shape[1])
    return t_S - torch.cummax(torch.where(first_BS, t_S, 0), dim=1).values


def test_config_and_choice():
    with pytest.raises(ValueError, match=r"ModelConfig.document_attention: unknown 'sparse'; choose from "
                                         r"\('auto', 'flex', 'dense'\)"):
        ModelConfig(document_attention="sparse")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert (use_flex("auto", cpu), use_flex("auto", cuda), use_flex("flex", cpu), use_flex("dense", cuda)) == \
        (False, True, True, False)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_block_mask_allows_the_dense_pairs(cp):
    """Per pair (the mask_mod on the whole grid) and per block of 8 x 8 (which blocks flex visits, which it takes
    as full without calling the mask_mod), for every simulated CP rank."""
    doc_BS = _documents([24, 8, 16, 16])  # 64 tokens, every document a multiple of 2·cp
    B, S, s, blk = 2, 64, 64 // cp, 8
    seen = []
    for rank in range(cp):
        mine, dense_B1sS = build_document_mask(doc_BS, cp, rank)
        mine_f, bm = build_document_mask(doc_BS, cp, rank, flex=True, block_size=blk)
        assert isinstance(bm, BlockMask) and dense_B1sS.dtype == torch.bool and dense_B1sS.shape == (B, 1, s, S)
        assert (mine is None and mine_f is None and cp == 1) or torch.equal(mine, mine_f)
        seen.append(mine)
        assert torch.equal(create_mask(bm.mask_mod, B, 1, s, S, device="cpu"), dense_B1sS)
        blocks = dense_B1sS.view(B, 1, s // blk, blk, S // blk, blk)
        assert torch.equal(bm.to_dense().bool(), blocks.any(5).any(3))  # visited: partial or full
        assert bm.full_kv_num_blocks.sum() == blocks.all(5).all(3).sum()  # full ones skip the mask_mod
    if cp > 1:  # the ranks' queries cover the row once
        assert (torch.cat(seen, 1).sort(1).values == torch.arange(S)).all()
    else:
        assert torch.equal(dense_B1sS, document_mask(doc_BS))


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_cp_attention_flex_equals_dense(cp, cpu_flex_backward):
    """Each rank's queries over every rank's keys (rank-major, the all-gather's order): the flex path gives the dense
    path's output and q/k/v gradients, GQA (4 query heads over 2 kv heads) with MLA-like head dims (q/k 24, v 16)."""
    doc_BS = _documents([8 * cp, 4 * cp, 2 * cp, 2 * cp])
    B, S, H, G, E, Fv = 2, 16 * cp, 4, 2, 24, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(B, H, S, E, generator=g), torch.randn(B, G, S, E, generator=g), \
        torch.randn(B, G, S, Fv, generator=g)
    keys = torch.cat([build_document_mask(doc_BS, cp, r)[0] for r in range(cp)], 1) if cp > 1 else \
        torch.arange(S).expand(B, S)
    pick = lambda t, i: t.gather(2, i[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))  # noqa: E731
    for rank in range(cp):
        mine, dense = build_document_mask(doc_BS, cp, rank)
        _, bm = build_document_mask(doc_BS, cp, rank, flex=True, block_size=8)
        mine = keys if mine is None else mine
        outs = []
        for mask in (dense, bm):
            leaves = [t.clone().requires_grad_() for t in (pick(q, mine), pick(k, keys), pick(v, keys))]
            o = document_attention(*leaves, mask, scale=0.3)
            do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1))
            outs.append([o, *torch.autograd.grad(o, leaves, do)])
        for name, a, b in zip(("out", "dq", "dk", "dv"), *outs):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)


def _run(over, mode, tokens_BS, positions_BS, doc_BS):
    lm = MoELanguageModel(preset="tiny", overrides=dict(over, document_attention=mode), seed=5)
    lm.configure_model()
    logits_BSV, aux = lm.model(tokens_BS, positions_BS, doc_BS)
    loss = F.cross_entropy(logits_BSV.flatten(0, 1), tokens_BS.roll(-1, 1).flatten()) + aux
    loss.backward()
    return logits_BSV.detach(), {n: p.grad for n, p in lm.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("reset", [True, False], ids=["rope_reset", "row_positions"])
@pytest.mark.parametrize("over", [GQA, MLA], ids=["gqa", "mla"])
def test_model_flex_equals_dense(over, reset, cpu_flex_backward):
    doc_BS = _documents([7, 12, 4, 9])
    tokens_BS = torch.randint(2, 64, doc_BS.shape, generator=torch.Generator().manual_seed(2))
    positions_BS = _positions(doc_BS) if reset else None
    dense, dense_grads = _run(over, "dense", tokens_BS, positions_BS, doc_BS)
    flex, flex_grads = _run(over, "flex", tokens_BS, positions_BS, doc_BS)
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
    assert flex_grads.keys() == dense_grads.keys()
    for name, grad in dense_grads.items():
        torch.testing.assert_close(flex_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_cpu_flex_without_grad_needs_no_patch():
    """On CPU, flex runs as it is only without gradients (evaluation); torch refuses its backward there."""
    doc_BS = _documents([8, 8, 16])
    q, k, v = torch.randn(2, 4, 32, 8), torch.randn(2, 2, 32, 8), torch.randn(2, 2, 32, 8)
    _, bm = build_document_mask(doc_BS, flex=True)
    torch.testing.assert_close(document_attention(q, k, v, bm), document_attention(q, k, v, document_mask(doc_BS)),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        document_attention(q.requires_grad_(), k, v, bm)


@pytest.mark.parametrize("modules", [["core_attn", "layernorm"], ["full"]])
def test_recompute_passes_the_block_mask(modules, cpu_flex_backward):
    """Recompute's rebuilt and checkpointed modules take the BlockMask along: the gradients of no recomputation."""
    from types import SimpleNamespace

    from lightning_moe.callbacks.recompute import Recompute
    doc_BS = _documents([7, 12, 4, 9])
    tokens_BS = torch.randint(2, 64, doc_BS.shape, generator=torch.Generator().manual_seed(2))
    grads = []
    for callbacks in ([], [Recompute(modules)]):
        lm = MoELanguageModel(preset="tiny", overrides=dict(GQA, document_attention="flex"), seed=5)
        lm.configure_model()
        for cb in callbacks:
            cb.on_fit_start(SimpleNamespace(strategy=SimpleNamespace(cuda_graphs=False)), lm)
        lm.train()
        loss, aux = lm.model.loss(tokens_BS, tokens_BS.roll(-1, 1), _positions(doc_BS), doc_BS)
        (loss + aux).backward()
        grads.append({n: p.grad for n, p in lm.model.named_parameters() if p.grad is not None})
        for cb in callbacks:
            cb.teardown(None, lm, "fit")
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        assert torch.equal(grads[1][name], g), name
