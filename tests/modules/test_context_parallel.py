"""Context-parallel causal attention (zig-zag shards, all-gathered K/V) against full causal SDPA on one process.

Every check compares outputs and q/k/v gradients (random upstream gradient) with the matching rows of the reference;
k/v gradients are summed over ranks, as the reduce-scatter behind the all-gather does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.modules.context_parallel import (check_cp_seq_len, context_parallel_attention,
                                                    zigzag_attention_local, zigzag_positions, zigzag_shard,
                                                    zigzag_unshard)
from tests.parallel.harness import run_ranks

B, H, S = 2, 4, 32


def _data(G, E, Fv, dtype=torch.float32, device="cpu", seed=0, seq=S):
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, H, seq, E), (B, G, seq, E), (B, G, seq, Fv), (B, H, seq, Fv)]  # q, k, v, upstream grad
    return [torch.randn(*s, generator=g, dtype=torch.float64).to(device, dtype) for s in shapes]


def _reference(q, k, v, do):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def _err(a, b, rel=False):
    e = (a.float() - b.float()).abs().max()
    return (e / b.float().abs().max() if rel else e).item()


def _cp_local(q, k, v, do, cp, backend, dtype=None, expand=False):
    """Run every rank of ``zigzag_attention_local`` on one process; returns (o, dq, dk, dv) in natural order.
    ``expand``: hand it K/V repeated to H heads; otherwise the G kv heads, as the model does."""
    k, v = (t.detach().requires_grad_() for t in (k, v))
    outs, dqs = [], []
    for r in range(cp):
        q_loc = zigzag_shard(q, cp, r, dim=2).detach().requires_grad_()
        rep = H // k.shape[1] if expand else 1
        o = zigzag_attention_local(q_loc, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), cp, r,
                                   backend=backend)
        o.backward(zigzag_shard(do, cp, r, dim=2))
        outs.append(o.detach())
        dqs.append(q_loc.grad)
    return zigzag_unshard(outs, cp, dim=2), zigzag_unshard(dqs, cp, dim=2), k.grad, v.grad


@pytest.mark.parametrize("backend", ["math", "cpu_flash"])
def test_gqa_heads_expanded_inside_equal_expanded_outside(backend):
    q, k, v, do = _data(2, 16, 16, seed=3)
    inside, outside = _cp_local(q, k, v, do, 2, backend), _cp_local(q, k, v, do, 2, backend, expand=True)
    for a, b in zip(inside, outside):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_zigzag_layout_round_trip(cp):
    x = torch.arange(2 * S).view(2, S)
    parts = [zigzag_shard(x, cp, r, dim=1) for r in range(cp)]
    assert torch.equal(zigzag_unshard(parts, cp, dim=1), x)
    assert torch.equal(zigzag_unshard(torch.cat(parts, 1), cp, dim=1), x)
    for r in range(cp):
        pos = zigzag_positions(S, cp, r)
        assert pos.dtype == torch.int64 and torch.equal(parts[r][0], pos)
    # each rank's causal work (sum over its queries of the keys they see) is the same
    assert len({int((zigzag_positions(S, cp, r) + 1).sum()) for r in range(cp)}) == 1


def test_check_cp_seq_len():
    check_cp_seq_len(12, 1)
    check_cp_seq_len(16, 4)
    for n, cp in [(12, 4), (10, 2), (9, 2)]:
        with pytest.raises(ValueError, match=f"seq_len={n}, cp={cp}"):
            check_cp_seq_len(n, cp)
    with pytest.raises(ValueError, match="seq_len=12, cp=4"):
        zigzag_shard(torch.zeros(1, 12), 4, 0)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("backend,G,E,Fv", [
    ("math", 4, 16, 16), ("math", 2, 16, 16), ("math", 2, 24, 16),
    ("cpu_flash", 4, 16, 16), ("cpu_flash", 2, 16, 16), ("cpu_flash", 2, 24, 16),  # E != F: v zero-padded
], ids=["math-mha", "math-gqa", "math-EneF", "cpuflash-mha", "cpuflash-gqa", "cpuflash-EneF"])
def test_local_matches_full_causal(cp, backend, G, E, Fv):
    q, k, v, do = _data(G, E, Fv)
    ref = _reference(q, k, v, do)
    got = _cp_local(q, k, v, do, cp, backend)
    errs = {n: _err(a, b) for n, a, b in zip(("o", "dq", "dk", "dv"), got, ref)}
    print(f"cp={cp} {backend} G={G} E={E} F={Fv}: " + ", ".join(f"{n}={e:.1e}" for n, e in errs.items()))
    for n, e in errs.items():
        assert e < 1e-5, f"{n} differs from full causal attention by {e:.2e}"


def test_float64_and_default_backend():
    q, k, v, do = _data(2, 16, 16, dtype=torch.float64)
    ref = _reference(q, k, v, do)
    for backend in (None, "math"):
        for a, b in zip(_cp_local(q, k, v, do, 4, backend), ref):
            assert _err(a, b) < 1e-12
    assert torch.equal(context_parallel_attention(q, k, v, None, 0, 1), ref[0])  # no group: plain SDPA
    with pytest.raises(ValueError, match="unknown attention backend"):
        zigzag_attention_local(q[:, :, :8], k, v, 4, 0, backend="nope")


def _worker(rank, world, cases):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    out = []
    for (G, E, Fv, backend), (q, k, v, do), ref in cases:
        q, k, v = (zigzag_shard(t, world, rank, dim=2).detach().requires_grad_() for t in (q, k, v))
        o = context_parallel_attention(q, k, v, dist.group.WORLD, rank, world, backend=backend)
        o.backward(zigzag_shard(do, world, rank, dim=2))
        out.append({n: _err(a, zigzag_shard(b, world, rank, dim=2))
                    for n, a, b in zip(("o", "dq", "dk", "dv"), (o.detach(), q.grad, k.grad, v.grad), ref)})
    dist.destroy_process_group()
    return out


def test_two_rank_gloo_matches_reference(tmp_path):
    cases = []
    for G, E, Fv, backend in [(2, 16, 16, None), (2, 24, 16, "math")]:
        data = _data(G, E, Fv, seed=1)
        cases.append(((G, E, Fv, backend), data, _reference(*data)))
    for rank, res in enumerate(run_ranks(_worker, 2, cases, out_dir=str(tmp_path), timeout=120)):
        for (cfg, _, _), errs in zip(cases, res):
            print(f"gloo rank{rank} {cfg}: " + ", ".join(f"{n}={e:.1e}" for n, e in errs.items()))
            for n, e in errs.items():
                assert e < 1e-5, f"rank {rank} {cfg}: {n} differs by {e:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("G,E,Fv", [(2, 64, 64), (4, 192, 128)], ids=["gqa", "mla_pad"])
def test_flash_bf16_matches_math_fp32(cp, G, E, Fv):
    q, k, v, do = _data(G, E, Fv, dtype=torch.bfloat16, device="cuda", seq=256)
    want = _cp_local(*(t.float() for t in (q, k, v, do)), cp, "math")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the CP forward/backward must not wait on the device
    try:
        got = _cp_local(q, k, v, do, cp, "flash")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    errs = {n: _err(a, b, rel=True) for n, a, b in zip(("o", "dq", "dk", "dv"), got, want)}
    print(f"flash cp={cp} G={G} E={E} F={Fv}: " + ", ".join(f"{n}={e:.1e}" for n, e in errs.items()))
    for n, e in errs.items():
        assert e < 2e-2, f"{n}: flash bf16 differs from math fp32 by {e:.2e} (relative to max)"
