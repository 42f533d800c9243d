"""The experts' FP8 wgrad kernel (``triton_fp8_wgrad.py``) on CPU under the Triton interpreter, whose dot has no FP8:
the same kernel on fp32 operands (it is generic in the operand type), against a float64 reference of its sum. Both
scale layouts (per 128-token block, per expert), written and accumulated, empty experts, and dims that are not
multiples of the tiles. Skipped without triton (CI); the FP8 cases run on a GPU (``tests/test_gpu_fp8.py``,
``tests/test_gpu_fp8_deepgemm.py``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.modules.interpreted import INSIDE, run_interpreted  # noqa: E402


@pytest.mark.skipif(INSIDE, reason="the outer test only")
def test_kernel_under_the_interpreter():
    run_interpreted(__file__, timeout=600, passed=30)


inside = pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")


def _case(per_expert: bool, seed: int = 0):
    """Experts of 256, 0, 128 and 384 tokens (128-token boundaries), K = 48 and N = 40 (partial tiles)."""
    g = torch.Generator().manual_seed(seed)
    K, N, counts = 48, 40, [256, 0, 128, 384]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    P = int(offs[-1])
    aT = torch.randn(K, P, generator=g)
    bT = torch.randn(N, P, generator=g)
    L = len(counts)
    if per_expert:
        sa, sb = torch.rand(L, K, generator=g) + 0.5, torch.rand(L, N, generator=g) + 0.5
    else:
        sa, sb = torch.rand(P // 128, K, generator=g) + 0.5, torch.rand(P // 128, N, generator=g) + 0.5
    return aT, sa, bT, sb, offs, counts


def _reference(aT, sa, bT, sb, offs, counts, per_expert):
    L, K, N = len(counts), aT.shape[0], bT.shape[0]
    out = torch.zeros(L, K, N, dtype=torch.float64)
    start = 0
    for e, end in enumerate(offs.tolist()):
        for t0 in range(start, end, 128):
            a, b = aT[:, t0:t0 + 128].double(), bT[:, t0:t0 + 128].double()
            if per_expert:
                out[e] += a @ b.t()
            else:
                out[e] += (a @ b.t()) * sa[t0 // 128, :, None].double() * sb[t0 // 128, None, :].double()
        if per_expert:
            out[e] *= sa[e, :, None].double() * sb[e, None, :].double()
        start = end
    return out


@inside
@pytest.mark.parametrize("per_expert", [False, True])
@pytest.mark.parametrize("config", [(32, 32, 4, 1), (16, 64, 4, 2)])
def test_written_matches_the_reference(per_expert, config):
    from lightning_moe.modules import triton_fp8_wgrad as tw
    aT, sa, bT, sb, offs, counts = _case(per_expert)
    out = torch.full((len(counts), aT.shape[0], bT.shape[0]), float("nan"))
    tw.wgrad_into(out, (aT, sa), (bT, sb), offs, True, per_expert=per_expert, config=config)
    ref = _reference(aT, sa, bT, sb, offs, counts, per_expert)
    assert not out[1].any()  # the empty expert is written as zeros
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)


@inside
@pytest.mark.parametrize("per_expert", [False, True])
def test_accumulated_adds_and_skips_empty_experts(per_expert):
    from lightning_moe.modules import triton_fp8_wgrad as tw
    aT, sa, bT, sb, offs, counts = _case(per_expert, seed=1)
    start = torch.randn(len(counts), aT.shape[0], bT.shape[0])
    out = start.clone()
    tw.wgrad_into(out, (aT, sa), (bT, sb), offs, False, per_expert=per_expert, config=(32, 32, 4, 1))
    ref = _reference(aT, sa, bT, sb, offs, counts, per_expert) + start.double()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)
    assert torch.equal(out[1], start[1])  # nothing added to the empty expert
    with pytest.raises(ValueError, match="per expert"):  # scales of the other layout
        tw.wgrad_into(out, (aT, sa), (bT, sb), offs, False, per_expert=not per_expert)
    # no tokens at all (a rank that got none): zeros written, nothing added
    none = torch.zeros(len(counts), dtype=torch.int32)
    empty = ((aT[:, :0], sa[:0] if not per_expert else sa), (bT[:, :0], sb[:0] if not per_expert else sb))
    tw.wgrad_into(out, *empty, none, False, per_expert=per_expert)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)
    tw.wgrad_into(out, *empty, none, True, per_expert=per_expert)
    assert not out.any()


@inside
@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("programs,tma_out", [(3, False), (64, False), (2, True), (3, True), (5, True), (64, True)])
def test_persistent_gives_the_one_tile_kernels_bits(first, programs, tma_out):
    """The persistent kernel (3 programs: each loops over many tiles, the empty expert's among them; 64: more
    programs than tiles), its output by pointers or by TMA (K = 48 over tiles of 32: a tile past an expert's last row,
    which TMA must clip, not write into the next expert's), against the one-tile kernel: the same bits, the empty
    expert zeroed or left as it was."""
    from lightning_moe.modules import triton_fp8_wgrad as tw
    aT, sa, bT, sb, offs, counts = _case(True, seed=2)
    sa[1], sb[1] = float("inf"), float("nan")  # an empty expert's scales can be anything
    start = torch.randn(len(counts), aT.shape[0], bT.shape[0])
    one, per = start.clone(), start.clone()
    tw.wgrad_into(one, (aT, sa), (bT, sb), offs, first, per_expert=True, config=(32, 32, 4, 1), persistent=False)
    tw.wgrad_into(per, (aT, sa), (bT, sb), offs, first, per_expert=True, config=(32, 32, 4, 1), persistent=True,
                  programs=programs, tma_out=tma_out)
    full = [0, 2, 3]
    assert torch.equal(per[full], one[full])
    assert torch.equal(per[1], torch.zeros_like(per[1]) if first else start[1])
    with pytest.raises(ValueError, match="per-expert"):
        tw.wgrad_into(per, (aT, sa), (bT, sb), offs, first, config=(32, 32, 4, 1), persistent=True)


@inside
def test_tma_out_refusals():
    from lightning_moe.modules import triton_fp8_wgrad as tw
    aT, sa, bT, sb, offs, counts = _case(True, seed=2)
    out = torch.zeros(len(counts), aT.shape[0], bT.shape[0])
    with pytest.raises(ValueError, match="option of the persistent kernel"):
        tw.wgrad_into(out, (aT, sa), (bT, sb), offs, True, per_expert=True, persistent=False, tma_out=True)
    odd = torch.zeros(len(counts), aT.shape[0], 3)
    with pytest.raises(ValueError, match="16-byte aligned"):
        tw.wgrad_into(odd, (aT, sa), (bT[:3].contiguous(), sb[:, :3].contiguous()), offs, True, per_expert=True,
                      persistent=True, tma_out=True)
    shifted = torch.zeros(out.numel() + 1)[1:].view(out.shape)  # 4 bytes past an aligned start
    with pytest.raises(ValueError, match="16-byte aligned"):
        tw.wgrad_into(shifted, (aT, sa), (bT, sb), offs, True, per_expert=True, tma_out=True)
    with pytest.raises(ValueError, match="want"):  # a bad shape is refused as such, not by the alignment check
        tw.wgrad_into(out[0], (aT, sa), (bT, sb), offs, True, per_expert=True, tma_out=True)


@inside
def test_default_kernel_choice(monkeypatch):
    """By default the persistent kernel adds into main grads and the one-tile kernel writes; blockwise scales never
    take it; LMOE_FP8_WGRAD_PERSISTENT forces either, and refuses anything else."""
    import os
    from lightning_moe.modules import triton_fp8_wgrad as tw
    assert tw.PERSISTENT == os.environ.get("LMOE_FP8_WGRAD_PERSISTENT", "auto")
    monkeypatch.setattr(tw, "PERSISTENT", "auto")
    assert tw.use_persistent(True, first=False) and not tw.use_persistent(True, first=True)
    assert not tw.use_persistent(False, first=False)
    monkeypatch.setattr(tw, "PERSISTENT", "1")
    assert tw.use_persistent(True, first=True) and not tw.use_persistent(False, first=True)
    monkeypatch.setattr(tw, "PERSISTENT", "0")
    assert not tw.use_persistent(True, first=False)
    monkeypatch.setattr(tw, "PERSISTENT", "yes")
    with pytest.raises(ValueError, match="LMOE_FP8_WGRAD_PERSISTENT='yes'"):
        tw.use_persistent(True, first=False)
    assert not tw.use_persistent(False, first=False)  # blockwise scales: never, whatever the variable says


@inside
def test_persistent_config_by_tokens_per_expert():
    """64 x 128 tiles at two programs per SM where the experts average at most 1,024 tokens (Qwen3's expert shapes),
    128 x 128 at one per SM above (Mixtral's)."""
    from lightning_moe.modules import triton_fp8_wgrad as tw
    assert tw.persistent_config(1024 * 128, 128) == (tw.PERSISTENT_NARROW_CONFIG, 2)
    assert tw.persistent_config(2048 * 8, 8) == (tw.PERSISTENT_CONFIG, 1)
    assert tw.persistent_config(1024 * 8 + 128, 8) == (tw.PERSISTENT_CONFIG, 1)
    assert tw.persistent_config(0, 0) == (tw.PERSISTENT_CONFIG, 1)


@inside
@pytest.mark.parametrize("first", [True, False])
def test_persistent_default_config_gives_the_one_tile_bits(first):
    """The persistent kernel with its default config (this case's 192 tokens per expert take the 64 x 128 tiles) gives
    the one-tile kernel's bits with the same tiles, written and added (numpy's sums depend on the tile shape here; the
    GPU's FP8 MMAs do not, which ``tests/test_gpu_fp8.py`` checks across configs)."""
    from lightning_moe.modules import triton_fp8_wgrad as tw
    aT, sa, bT, sb, offs, counts = _case(True, seed=4)
    assert tw.persistent_config(aT.shape[1], len(counts))[0] == tw.PERSISTENT_NARROW_CONFIG
    start = torch.randn(len(counts), aT.shape[0], bT.shape[0])
    one, per = start.clone(), start.clone()
    tw.wgrad_into(one, (aT, sa), (bT, sb), offs, first, per_expert=True, config=tw.PERSISTENT_NARROW_CONFIG,
                  persistent=False)
    tw.wgrad_into(per, (aT, sa), (bT, sb), offs, first, per_expert=True, persistent=True)
    assert torch.equal(one, per)


def _segments(seed: int = 5):
    """Three micro-batches' operands side by side: experts of (256, 0, 128, 384), (128, 128, 0, 256) and (0, 0, 0,
    128) tokens, each segment with its own per-expert scales (the empty experts' anything)."""
    g = torch.Generator().manual_seed(seed)
    K, N, L = 48, 40, 4
    counts = [[256, 0, 128, 384], [128, 128, 0, 256], [0, 0, 0, 128]]
    segs = []
    for c in counts:
        offs = torch.tensor(c).cumsum(0).to(torch.int32)
        P = int(offs[-1])
        sa, sb = torch.rand(L, K, generator=g) + 0.5, torch.rand(L, N, generator=g) + 0.5
        for e, n in enumerate(c):
            if not n:
                sa[e], sb[e] = float("inf"), float("nan")
        segs.append((torch.randn(K, P, generator=g), sa, torch.randn(N, P, generator=g), sb, offs))
    base, starts, ends = 0, [], []
    for *_, offs in segs:
        ends.append(offs + base)
        starts.append(torch.cat([offs.new_zeros(1), offs[:-1]]) + base)
        base += int(offs[-1])
    cat = (torch.cat([s[0] for s in segs], 1), torch.stack([s[1] for s in segs]),
           torch.cat([s[2] for s in segs], 1), torch.stack([s[3] for s in segs]))
    return segs, cat, torch.stack(starts), torch.stack(ends)


@inside
@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("config", [(32, 32, 4, 1), (16, 64, 4, 2)])
def test_segments_give_one_kernel_per_segments_bits(first, config):
    """The deferred wgrad (all micro-batches of a step in one pass) against one one-tile kernel per micro-batch, the
    first writing (or adding) and the others adding: the same bits, the empty experts' scales never read into it."""
    from lightning_moe.modules import triton_fp8_wgrad as tw
    segs, (aT, sa, bT, sb), starts, ends = _segments()
    start = torch.randn(4, aT.shape[0], bT.shape[0])
    seq, one = start.clone(), start.clone()
    for i, (a_, sa_, b_, sb_, offs) in enumerate(segs):
        tw.wgrad_into(seq, (a_, sa_), (b_, sb_), offs, first and i == 0, per_expert=True, config=config,
                      persistent=False)
    tw.wgrad_segments_into(one, (aT, sa), (bT, sb), starts, ends, first, config=config)
    # the one-tile kernel writes an empty expert's zero product times its scales (NaN here), the segments add nothing
    full = [0, 2, 3] if first else [0, 1, 2, 3]
    assert torch.equal(one[full], seq[full])
    assert not torch.isnan(one).any()


@inside
def test_segments_refuse_bad_shapes_and_write_zeros_without_tokens():
    from lightning_moe.modules import triton_fp8_wgrad as tw
    segs, (aT, sa, bT, sb), starts, ends = _segments()
    out = torch.randn(4, aT.shape[0], bT.shape[0])
    with pytest.raises(ValueError, match="over segments"):
        tw.wgrad_segments_into(out, (aT, sa[:2]), (bT, sb), starts, ends, True)
    with pytest.raises(ValueError, match="over segments"):
        tw.wgrad_segments_into(out, (aT, sa), (bT, sb), starts[:, :3], ends, True)
    kept = out.clone()
    tw.wgrad_segments_into(out, (aT[:, :0], sa), (bT[:, :0], sb), starts * 0, ends * 0, False)
    assert torch.equal(out, kept)
    tw.wgrad_segments_into(out, (aT[:, :0], sa), (bT[:, :0], sb), starts * 0, ends * 0, True)
    assert not out.any()


@inside
def test_segments_config_by_tokens_per_expert_and_accumulation():
    """64 x 128 tiles unless the fast accumulation runs over more than 2,048 tokens per expert (Mixtral's step)."""
    from lightning_moe.modules import triton_fp8_wgrad as tw
    assert tw.segments_config(4096 * 8, 8, fast=True) == tw.SEGMENTS_CONFIG
    assert tw.segments_config(4096 * 8, 8, fast=False) == tw.SEGMENTS_NARROW_CONFIG
    assert tw.segments_config(1024 * 128, 128, fast=True) == tw.SEGMENTS_NARROW_CONFIG
    assert tw.segments_config(0, 0, fast=True) == tw.SEGMENTS_NARROW_CONFIG



@inside
def test_segments_read_column_slices_of_a_wider_buffer():
    """The held operands in their arenas: (K, P) column slices of a (K, C) buffer, read in place (TMA strides), with
    the bits of the contiguous copies."""
    from lightning_moe.modules import triton_fp8_wgrad as tw
    _, (aT, sa, bT, sb), starts, ends = _segments(seed=6)
    P = aT.shape[1]
    wide_a, wide_b = torch.full((aT.shape[0], P + 256), float("nan")), torch.full((bT.shape[0], P + 256), float("nan"))
    wide_a[:, :P], wide_b[:, :P] = aT, bT
    dense, strided = torch.zeros(4, aT.shape[0], bT.shape[0]), torch.zeros(4, aT.shape[0], bT.shape[0])
    tw.wgrad_segments_into(dense, (aT, sa), (bT, sb), starts, ends, True, config=(32, 32, 4, 1))
    tw.wgrad_segments_into(strided, (wide_a[:, :P], sa), (wide_b[:, :P], sb), starts, ends, True, config=(32, 32, 4, 1))
    assert tw._rows_16(wide_a[:, :P]).data_ptr() == wide_a.data_ptr()  # no copy
    assert torch.equal(dense, strided)
