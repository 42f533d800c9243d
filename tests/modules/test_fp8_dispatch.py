"""FP8 token dispatch on one process: each row travels as its E4M3 bytes and the 4 bytes of its fp32 scale, arrives as
fp8.py's rowwise quantize-dequantize of it, and passes its gradient through unchanged; the alltoall dispatcher
rounds there only with the flag on, dropless and padded to capacity."""

from __future__ import annotations

import pytest
import torch

from lightning_moe import ModelConfig, ParallelContext
from lightning_moe.modules.dispatcher import build_dispatcher
from lightning_moe.modules.fp8 import Tiling, dequantize, quantize
from lightning_moe.modules.fp8_dispatch import fp8_all_to_all, pack, row_bytes, unpack
from lightning_moe.modules.router import TopKRouter


def _rows(dtype=torch.float32):
    x_ND = torch.randn(6, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 6).unsqueeze(1)
    x_ND[2] = 0  # a padding row stays zero
    x_ND[3, 5] = 1e4  # one outlier: its row's scale follows it, the others' do not
    return x_ND.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_travel_as_e4m3_bytes_and_a_scale(dtype):
    x_ND = _rows(dtype)
    packed_NB = pack(x_ND)
    # half of bf16, plus the scale and zeros to a multiple of 16 bytes per row (aligned all-to-all chunks)
    assert packed_NB.dtype == torch.uint8 and packed_NB.shape == (6, 80) and row_bytes(64) == 80
    assert packed_NB.numel() == x_ND.to(torch.bfloat16).nbytes // 2 + 16 * 6
    q_ND, scale_N1 = quantize(x_ND, "e4m3", Tiling(1, None))
    assert torch.equal(packed_NB[:, :64], q_ND.view(torch.uint8))
    assert torch.equal(packed_NB[:, 64:68].contiguous().view(torch.float32), scale_N1)
    assert not packed_NB[:, 68:].any()
    ref_ND = dequantize(q_ND, scale_N1, Tiling(1, None)).to(dtype)
    y_ND = unpack(packed_NB, dtype, 64)
    assert y_ND.dtype == dtype and torch.equal(y_ND, ref_ND)
    assert not torch.equal(y_ND, x_ND) and torch.equal(y_ND[2], x_ND[2])
    # E4M3 keeps 3 mantissa bits (half a step: 1/16 relative), subnormals steps of 2^-9 (in the row's scaled units)
    err_ND = (y_ND.float() - x_ND.float()).abs()
    assert (err_ND <= x_ND.float().abs() / 16 + 2.0 ** -10 / scale_N1 + 1e-3 * y_ND.float().abs()).all()


def test_gradient_is_straight_through():
    x_ND = _rows().requires_grad_()
    y_ND = fp8_all_to_all(x_ND)  # no group: the quantize-dequantize alone
    assert torch.equal(y_ND, unpack(pack(x_ND), torch.float32, 64))
    g_ND = torch.randn_like(y_ND)
    y_ND.backward(g_ND)
    assert torch.equal(x_ND.grad, g_ND)
    assert fp8_all_to_all(torch.zeros(0, 64)).shape == (0, 64)  # a rank with no rows to send


@pytest.mark.parametrize("cap", [{}, dict(capacity_factor=1.0, pad_to_capacity=True)], ids=["dropless", "padded"])
def test_alltoall_dispatcher_rounds_only_with_the_flag(cap):
    cfg = ModelConfig(hidden_size=64, num_experts=4, moe_ffn_hidden_size=32, topk=2, **cap)
    ctx = ParallelContext.single()
    d = build_dispatcher(cfg, ctx)
    x_TD = _rows().repeat(2, 1)
    route = TopKRouter(cfg, ctx)(x_TD, num_sequences=1)
    plain_MD, counts_L, _ = d.dispatch(x_TD, route)
    d.fp8_dispatch = True
    fp8_MD, fp8_counts_L, _ = d.dispatch(x_TD, route)
    assert torch.equal(fp8_counts_L, counts_L) and not torch.equal(fp8_MD, plain_MD)
    assert torch.equal(fp8_MD, unpack(pack(plain_MD), torch.float32, plain_MD.shape[1]))
