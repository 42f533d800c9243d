"""Packed documents in the model: a row of several documents under the document mask, with positions restarting at
each document, gives each document's token losses and the weights' gradients of running every document alone (GQA
with q/k norms and MLA, both with RoPE; float32). Without the mask the same row does not (the test can fail)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.documents import IGNORE
from lightning_moe.modules.lm import MoELanguageModel

GQA = dict(seq_length=32, num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
           moe_ffn_hidden_size=32, num_experts=4, topk=2, first_k_dense=1, vocab_size=64, qk_norm=True,
           aux_loss_coeff=0.0, z_loss_coeff=0.0)  # no batch-wide routing terms: each token's loss is its own
MLA = dict(GQA, attention_type="mla", q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
           v_head_dim=16, num_kv_heads=4, qk_norm=False)
EOD, LENGTHS = 1, (7, 12, 4, 5)  # each document ends with its EOD; 28 tokens and 4 of padding in a row of 32


def _model(over):
    lm = MoELanguageModel(preset="tiny", overrides=over, seed=5)
    lm.configure_model()
    return lm.model


def _documents():
    g = torch.Generator().manual_seed(0)
    docs = [torch.cat([torch.randint(2, 64, (n - 1,), generator=g), torch.tensor([EOD])]) for n in LENGTHS]
    return docs


def _token_losses(model, tokens_BS, labels_BS, positions=None, documents=None):
    logits_BSV, _ = model(tokens_BS, positions, documents)
    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), labels_BS.flatten(), ignore_index=IGNORE,
                           reduction="none")


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("over", [GQA, MLA], ids=["gqa", "mla"])
def test_packed_row_equals_each_document_alone(over):
    model, docs = _model(over), _documents()
    # alone: each document is one row; its last target (after the EOD) does not exist
    alone_losses, alone_total = [], 0
    for d in docs:
        labels = torch.cat([d[1:], torch.tensor([IGNORE])])
        losses = _token_losses(model, d.unsqueeze(0), labels.unsqueeze(0))
        alone_losses.append(losses[:-1])
        alone_total = alone_total + losses[:-1].sum()
    alone_grads = _grads(model, alone_total)
    # packed: one row of the documents and padding, as PackedDocumentDataset lays it out
    S = over["seq_length"]
    row = torch.cat(docs + [torch.full((S + 1 - sum(LENGTHS),), EOD)])
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)] + [torch.full((S + 1 - sum(LENGTHS),), 4)])
    pos = torch.cat([torch.arange(n) for n in LENGTHS] + [torch.arange(S + 1 - sum(LENGTHS))])
    labels = row[1:].clone()
    labels[doc[:-1] != doc[1:]] = IGNORE
    labels[doc[:-1] == len(LENGTHS)] = IGNORE
    args = (row[:-1].unsqueeze(0), labels.unsqueeze(0), pos[:-1].unsqueeze(0), doc[:-1].unsqueeze(0))
    packed = _token_losses(model, *args)
    starts = torch.tensor((0,) + LENGTHS).cumsum(0)
    for i, ref in enumerate(alone_losses):
        torch.testing.assert_close(packed[starts[i]:starts[i + 1] - 1], ref, rtol=1e-5, atol=1e-5)
    assert (packed[starts[-1] - 1:] == 0).all()  # cross-document and padding targets count for nothing
    packed_grads = _grads(model, packed.sum())
    assert packed_grads.keys() == alone_grads.keys()
    for name, g in alone_grads.items():
        torch.testing.assert_close(packed_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    # the mask is what makes it so: attending across documents changes the losses of all but the first
    unmasked = _token_losses(model, args[0], args[1], args[2], None)
    assert not torch.allclose(unmasked[starts[1]:starts[2] - 1], alone_losses[1], atol=1e-3)


def test_mean_loss_counts_only_real_targets():
    model = _model(GQA)
    tokens = torch.randint(2, 64, (2, 32))
    labels = torch.randint(2, 64, (2, 32))
    labels[:, ::3] = IGNORE
    docs = torch.zeros(2, 32, dtype=torch.long)
    loss, _ = model.loss(tokens, labels, None, docs)
    per_token = _token_losses(model, tokens, labels, None, docs)
    torch.testing.assert_close(loss, per_token.sum() / (labels != IGNORE).sum())


def test_refusals():
    from types import SimpleNamespace
    lm = MoELanguageModel(preset="tiny", overrides=GQA)
    lm.configure_model()
    batch = {"input_ids": torch.zeros(1, 32, dtype=torch.long), "document_ids": torch.zeros(1, 32, dtype=torch.long)}
    with pytest.raises(ValueError, match="packed documents .* need cuda_graphs=False"):
        lm.cuda_graph_blocks(batch)
    lm.model.ctx = SimpleNamespace(cp=2, pp=1, rank=lambda name: 0)  # the check runs before any collective
    batch["document_ids"][:, 30:] = 1  # documents of 30 and 2 tokens: not multiples of 2 x cp
    with pytest.raises(ValueError, match=r"packed documents needs every document padded to a multiple of 2 x "
                                         r"context_parallel_size = 4: set TokenDataModule\(document_multiple=4\)"):
        lm.model(batch["input_ids"], None, batch["document_ids"])


@pytest.mark.parametrize("cp", [2, 4])
def test_packed_zigzag_split_and_mask(cp):
    """Each document in 2·cp chunks, rank r holding chunks r and 2·cp-1-r of every one: together the ranks hold each
    position once, in equal shares of every document; and each rank's queries over the gathered keys under its mask
    give the single-process document-masked attention of its tokens."""
    from lightning_moe.modules.packed_context_parallel import packed_cp_mask
    from lightning_moe.modules.transformer import document_mask
    lengths = [8 * cp, 4 * cp, 2 * cp, 2 * cp]
    doc_BS = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0).repeat(2, 1)
    doc_BS[1] = doc_BS[1].flip(0)  # the second row: the same documents in the other order
    S = doc_BS.shape[1]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, S, 8, generator=g) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(doc_BS))
    idx = [packed_cp_mask(doc_BS, cp, r)[0] for r in range(cp)]
    keys = torch.cat(idx, dim=1)
    assert (keys.sort(1).values == torch.arange(S)).all()
    for r in range(cp):
        mine, mask = packed_cp_mask(doc_BS, cp, r)
        for b in range(2):
            assert torch.equal(doc_BS[b, mine[b]].bincount(), torch.tensor(lengths) // cp)  # an equal share each
        pick = lambda t, i: t.gather(2, i[:, None, :, None].expand(-1, 3, -1, 8))  # noqa: E731
        out = F.scaled_dot_product_attention(pick(q, mine), pick(k, keys), pick(v, keys), attn_mask=mask)
        torch.testing.assert_close(out, pick(full, mine), rtol=1e-5, atol=1e-6)
