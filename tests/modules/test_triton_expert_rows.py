"""``expert_padding.fp8_rows_layout``: the FP8 expert GEMMs' row layout in one Triton launch
(``triton_expert_rows``) against torch's ops (``expert_of_rows``, ``padded_ends``), on CPU under the Triton
interpreter. Skipped without triton (CI runs the torch path in ``test_expert_padding_ends.py``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.modules.interpreted import INSIDE, run_interpreted  # noqa: E402


@pytest.mark.skipif(INSIDE, reason="the outer test only")
def test_kernels_under_the_interpreter():
    run_interpreted(__file__, timeout=300, passed=6)


inside = pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")


@inside
@pytest.mark.parametrize("counts,tail,align", [([5, 0, 17, 128, 1], 9, 128), ([0, 0, 3], 0, 16),
                                               ([300, 0, 17], 83, 16), ([0], 4, 128),
                                               ([3] * 40 + [0] * 9 + [130], 2, 128), ([1] * 300, 5, 16)])
def test_layout_is_torchs(counts, tail, align):
    """Empty experts, tail rows past the last end, one expert, and more experts than a row block's width."""
    from lightning_moe.modules import triton_expert_rows as tk
    from lightning_moe.modules.expert_padding import padded_ends
    from lightning_moe.modules.fp8_grouped import expert_of_rows
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    M = int(offs[-1]) + tail
    gid, pends, P, gid_P = tk.rows_layout(offs, M, align)
    want_pends, want_P = padded_ends(offs, M, align)
    assert P == want_P and gid.dtype == gid_P.dtype == pends.dtype == torch.int32
    assert torch.equal(gid, expert_of_rows(M, offs, offs.device, int32=True))
    assert torch.equal(pends, want_pends)
    assert torch.equal(gid_P, expert_of_rows(P, want_pends, offs.device, int32=True))
    alone = tk.rows_layout(offs, M)  # the rows' experts alone
    assert torch.equal(alone[0], gid) and alone[1:] == (None, None, None)
