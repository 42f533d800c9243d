"""Packed documents' FlexAttention path on CUDA (skipped without it; ``modules/document_mask.py``):

* bf16 flex against bf16 dense (masked SDPA) for packed rows of 2048 tokens, GQA (8 query heads over 2 kv heads,
  head dim 128) and MLA (q/k 192, v 128), on one process and on each simulated rank of packed CP (cp=2): values and
  gradients, each no further from the float32 dense result than about twice dense's own bf16 error;
* a 32k-token row of 20 documents, where the dense mask alone would take 1 GiB: forward and backward run in a
  fraction of that memory, and each document's output is causal flash attention over that document alone;
* the model on packed documents (flex chosen by ``auto``): no host sync and no recompilation once warm, with new
  document layouts every step; Recompute and ActivationOffload take the BlockMask along, bit for bit.

Run with ``-s`` to see the memory figures.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lightning_moe.modules.document_mask import build_document_mask, document_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = torch.device("cuda")
SHAPES = {"gqa": dict(H=8, G=2, E=128, Fv=128), "mla": dict(H=8, G=8, E=192, Fv=128)}


@pytest.fixture(autouse=True)
def _fresh_compile_caches():
    # every test compiles its own shapes: keeps each under dynamo's recompile limit (dynamic=False compiles)
    torch._dynamo.reset()
    yield


def _lengths(S: int, n: int, multiple: int, seed: int) -> list[int]:
    """``n`` lognormal document lengths, multiples of ``multiple``, that fill ``S`` (the last takes the rest)."""
    w = np.random.default_rng(seed).lognormal(0.0, 1.0, n)
    units = np.maximum(1, np.floor(w / w.sum() * (S // multiple))).astype(int)[:-1]
    while units.sum() >= S // multiple:
        units[np.argmax(units)] -= 1
    return [int(u) * multiple for u in units] + [S - int(units.sum()) * multiple]


def _doc_ids(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(r)]) for r in rows]).to(CUDA)


def _pick(t_BHSD: torch.Tensor, idx_Bs) -> torch.Tensor:
    """The tokens ``idx_Bs`` of every row (all of them when None)."""
    if idx_Bs is None:
        return t_BHSD
    return t_BHSD.gather(2, idx_Bs[:, None, :, None].expand(-1, t_BHSD.shape[1], -1, t_BHSD.shape[3]))


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("kind", list(SHAPES))
def test_flex_matches_dense_bf16(kind, cp):
    H, G, E, Fv = SHAPES[kind].values()
    B, S = 2, 2048
    doc_BS = _doc_ids([_lengths(S, 6, 2 * cp, 0), _lengths(S, 9, 2 * cp, 1)])
    g = torch.Generator(CUDA).manual_seed(0)
    q, k, v = (torch.randn(B, n, S, d, device=CUDA, generator=g) for n, d in ((H, E), (G, E), (G, Fv)))
    keys = torch.cat([build_document_mask(doc_BS, cp, r)[0] for r in range(cp)], 1) if cp > 1 else None
    for rank in range(cp):
        mine, dense = build_document_mask(doc_BS, cp, rank)
        _, flex = build_document_mask(doc_BS, cp, rank, flex=True)
        results = {}
        for name, mask, dtype in (("ref", dense, torch.float32), ("dense", dense, torch.bfloat16),
                                  ("flex", flex, torch.bfloat16)):
            leaves = [_pick(t, i).to(dtype).requires_grad_() for t, i in ((q, mine), (k, keys), (v, keys))]
            o = document_attention(*leaves, mask, scale=E ** -0.5)
            do = torch.randn(o.shape, device=CUDA, generator=torch.Generator(CUDA).manual_seed(1)).to(dtype)
            results[name] = [o, *torch.autograd.grad(o, leaves, do)]
        for i, what in enumerate(("out", "dq", "dk", "dv")):
            ref = results["ref"][i]
            e_flex, e_dense = _rel(results["flex"][i], ref), _rel(results["dense"][i], ref)
            assert e_flex <= 2 * e_dense + 2e-3, f"{kind} cp={cp} rank={rank} {what}: flex {e_flex:.2e}, " \
                                                 f"dense {e_dense:.2e} (relative max error against fp32)"


def test_32k_row_of_20_documents():
    B, S, H, G, D = 1, 32768, 8, 2, 128
    lengths = _lengths(S, 20, 128, 3)
    doc_BS = _doc_ids([lengths])
    g = torch.Generator(CUDA).manual_seed(0)
    q, k, v = (torch.randn(B, n, S, D, device=CUDA, dtype=torch.bfloat16, generator=g).requires_grad_()
               for n in (H, G, G))
    do = torch.randn(B, H, S, D, device=CUDA, dtype=torch.bfloat16, generator=g)

    def step():
        _, mask = build_document_mask(doc_BS, flex=True)
        o = document_attention(q, k, v, mask)
        o.backward(do)
        return o

    step()  # compiles
    for t in (q, k, v):
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o = step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v)) / 2**30
    print(f"\n[32k, 20 documents] peak above the inputs: {peak:.3f} GiB (q/k/v {inputs:.3f} GiB; "
          f"a dense bool mask would be {B * S * S / 2**30:.2f} GiB)")
    assert peak < 0.5, f"peak {peak:.2f} GiB"
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    # within a document, document attention is causal attention over that document alone
    start = 0
    with torch.no_grad():
        for n in lengths:
            sl = slice(start, start + n)
            ref = F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True,
                                                 enable_gqa=True)
            torch.testing.assert_close(o[:, :, sl], ref, rtol=2e-2, atol=2e-2, msg=f"document at {start}")
            start += n


OVR = dict(seq_length=256, hidden_size=256, num_layers=2, num_attention_heads=4, num_kv_heads=2,
           ffn_hidden_size=512, moe_ffn_hidden_size=256, num_experts=8, topk=2, vocab_size=512, first_k_dense=1)
MLA = dict(OVR, attention_type="mla", q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
           v_head_dim=32, num_kv_heads=4)


def _packed_batch(step: int, B: int = 4, S: int = 256):
    rows = [_lengths(S, 3 + (step + b) % 4, 1, 100 * step + b) for b in range(B)]
    doc_BS = _doc_ids(rows)
    pos_BS = torch.cat([torch.cat([torch.arange(n) for n in r]).unsqueeze(0) for r in rows]).to(CUDA)
    tokens = torch.randint(0, 512, (B, S + 1), device=CUDA, generator=torch.Generator(CUDA).manual_seed(step))
    return tokens, pos_BS, doc_BS


@pytest.mark.parametrize("over", [OVR, MLA], ids=["gqa", "mla"])
def test_model_step_no_host_sync_no_recompile(over):
    from torch._dynamo.utils import counters

    from lightning_moe.modules.document_mask import BlockMask
    from lightning_moe.modules.lm import MoELanguageModel
    lm = MoELanguageModel(preset="tiny", overrides=over)
    lm.configure_model()
    model = lm.model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    masks = []
    model.layers[0].attn.core_attn.register_forward_hook(lambda m, a, kw, o: masks.append(type(kw["mask"])),
                                                         with_kwargs=True)

    batches = [_packed_batch(i) for i in range(5)]  # made up front: their host-to-device copies synchronise

    def step(i):
        tokens, pos_BS, doc_BS = batches[i]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, aux = model(tokens[:, :-1], pos_BS, doc_BS)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()) + aux
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for i in range(2):  # warm up: compiles the mask builder and flex's forward and backward
        step(i)
    torch.cuda.synchronize()
    graphs = counters["stats"]["unique_graphs"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(2, 5):  # new document layouts, same shapes
            loss = step(i)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert counters["stats"]["unique_graphs"] == graphs, "a new document layout recompiled"
    assert set(masks) == {BlockMask}
    assert torch.isfinite(loss).item()


def test_recompute_and_offload_take_the_block_mask():
    from lightning_moe import ActivationOffload, Recompute
    from lightning_moe.modules.lm import MoELanguageModel
    tokens, pos_BS, doc_BS = _packed_batch(0)
    stub = SimpleNamespace(strategy=SimpleNamespace(root_device=CUDA, cuda_graphs=False))
    grads = {}
    for name, callbacks in (("none", []), ("recompute", [Recompute(["core_attn", "layernorm"])]),
                            ("recompute_full", [Recompute(["full"])]),
                            ("offload", [ActivationOffload(["core_attn", "attn_proj"], min_bytes=0)])):
        lm = MoELanguageModel(preset="tiny", overrides=OVR, seed=3)
        lm.configure_model()
        lm = lm.cuda().bfloat16()
        for cb in callbacks:
            cb.on_fit_start(stub, lm)
        lm.train()
        lm_loss, aux = lm.model.loss(tokens[:, :-1], tokens[:, 1:], pos_BS, doc_BS)
        (lm_loss + aux).backward()
        grads[name] = {n: p.grad.float().clone() for n, p in lm.model.named_parameters() if p.grad is not None}
        for cb in callbacks:
            cb.teardown(None, lm, "fit")
    for name in ("recompute", "recompute_full", "offload"):
        assert grads[name].keys() == grads["none"].keys()
        for n, g in grads["none"].items():
            assert torch.equal(grads[name][n], g), f"{name}: {n}"
