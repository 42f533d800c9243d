"""``expert_padding.padded_ends``: ``padded_layout``'s padded ends and length, alone and as int32 (the FP8 kernels'
layout), and ``expert_of_rows(int32=True)`` against the int64 one."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.modules.expert_padding import padded_ends, padded_layout
from lightning_moe.modules.fp8_grouped import expert_of_rows


@pytest.mark.parametrize("counts,M,align", [([5, 0, 17, 128, 1], 160, 128), ([0, 0, 3], 3, 16), ([300, 0, 17], 400, 16)])
def test_padded_ends_are_padded_layouts(counts, M, align):
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    pends, P = padded_ends(offs, M, align)
    _, want, _, want_P = padded_layout(offs, M, align)
    assert pends.dtype == torch.int32 and torch.equal(pends.long(), want) and P == want_P
    gid = expert_of_rows(P, pends, pends.device, int32=True)
    assert gid.dtype == torch.int32 and torch.equal(gid.long(), expert_of_rows(P, want, want.device))


@pytest.mark.parametrize("counts,tail,align", [([5, 0, 17, 128, 1], 9, 128), ([0, 0, 3], 0, 16), ([300, 0, 17], 83, 0)])
def test_fp8_rows_layout_torch_path(counts, tail, align):
    """``fp8_rows_layout``'s torch path (``fused=False``; the Triton one: ``test_triton_expert_rows.py``): the rows'
    experts, padded ends and padded positions' experts as ``expert_of_rows`` and ``padded_ends`` give them."""
    from lightning_moe.modules.expert_padding import fp8_rows_layout
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    M = int(offs[-1]) + tail
    gid, pends, P, gid_P = fp8_rows_layout(offs, M, align, fused=False)
    assert gid.dtype == torch.int32 and torch.equal(gid.long(), expert_of_rows(M, offs, offs.device))
    if not align:
        assert pends is None and P is None and gid_P is None
        return
    want, want_P = padded_ends(offs, M, align)
    assert torch.equal(pends, want) and P == want_P
    assert torch.equal(gid_P.long(), expert_of_rows(P, want, want.device))
