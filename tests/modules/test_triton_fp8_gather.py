"""The permutes' gathers fused with the rowwise FP8 quantization (``triton_fp8_gather``) on CPU under the Triton
interpreter: bit for bit ``triton_permute.gather`` followed by ``triton_fp8_quant.rowwise_quant`` of what it gathered
(holes read as zeros; zero, NaN and outlier rows; rows kept in registers and read twice). Then the dispatcher's
handoffs: its gather puts x's quantization (``Handoff.input``) and the combine's backward puts dy's (``grad_out``) for
the very tensors the experts' GEMMs get; with dropped copies, FP8 dispatch rounding or no ``fp8_rows`` it puts none.
Skipped without triton (CI). Run in a fresh process with ``TRITON_INTERPRET=1``, as ``test_fused_interpret.py``
explains."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.modules.interpreted import INSIDE, run_interpreted  # noqa: E402
from tests.modules.test_triton_fp8_quant_col_amax import _same_bits  # noqa: E402


@pytest.mark.skipif(INSIDE, reason="the outer test only")
def test_kernels_under_the_interpreter():
    run_interpreted(__file__, timeout=600, passed=6)


inside = pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")


def _tokens(T: int, D: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g) * torch.logspace(-3, 2, T).unsqueeze(1)
    x[1] = 0  # scale from the tiny floor
    x[2, 3] = 3e4  # an outlier sets its row's scale; the rest of the row lands in E4M3's subnormals
    if T > 4:
        x[4, D // 2] = float("nan")  # its copies' scales and values are NaN, as rowwise_quant's
    return x.to(torch.bfloat16)


@inside
@pytest.mark.parametrize("T,R,D", [(7, 12, 256), (6, 9, 96), (5, 6, 8200)], ids=["one_pass", "odd_width", "wide"])
def test_gather_quant_is_the_gather_then_rowwise_quant(T, R, D):
    from lightning_moe.modules import triton_fp8_gather as tg
    from lightning_moe.modules import triton_fp8_quant as tq
    from lightning_moe.modules import triton_permute as tp
    x = _tokens(T, D, seed=D)
    src = torch.randint(0, T, (R,), generator=torch.Generator().manual_seed(1))
    src[3] = -1  # a hole of a padded layout
    for inverse in (True, False):
        out, q, s = tg.gather_quant(x, src, inverse=inverse)
        ref = tp.gather(x, src)
        rq, rs = tq.rowwise_quant(ref, inverse=inverse)
        _same_bits(out, ref)
        _same_bits(q, rq)
        _same_bits(s, rs)
    assert all(t.shape[0] == 0 for t in tg.gather_quant(x, src[:0]))


def _dispatcher(**cfg):
    from lightning_moe import ModelConfig, ParallelContext
    from lightning_moe.modules.dispatcher import build_dispatcher
    from lightning_moe.modules.fp8_swiglu import Handoff
    d = build_dispatcher(ModelConfig(hidden_size=64, num_experts=4, moe_ffn_hidden_size=32, topk=2, **cfg),
                         ParallelContext.single())
    d.fp8_rows = Handoff()
    return d


def _route(T: int, dropped: bool = False):
    from lightning_moe.modules.router import RouterOutput
    g = torch.Generator().manual_seed(T)
    experts_TK = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(T)])
    keep_TK = None
    if dropped:
        keep_TK = torch.ones(T, 2, dtype=torch.bool)
        keep_TK[0, 1] = False
    counts = torch.bincount(experts_TK.reshape(-1), minlength=4).float()
    return RouterOutput(torch.rand(T, 2, generator=g), experts_TK, keep_TK, torch.zeros(()), torch.zeros(()), counts,
                        torch.zeros(()))


class _Grab(torch.autograd.Function):
    """Identity that keeps the gradient tensor it is handed (the one the next GEMM's backward would get)."""

    @staticmethod
    def forward(ctx, t, box):
        ctx.box = box
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        ctx.box.append(g)
        return g, None


@inside
@pytest.mark.parametrize("cap", [{}, dict(capacity_factor=2.0, pad_to_capacity=True)], ids=["dropless", "padded"])
def test_the_permutes_hand_x_and_dy_to_the_experts(cap):
    from lightning_moe.modules import triton_fp8_quant as tq
    d = _dispatcher(**cap)
    hand = d.fp8_rows
    x_TD = _tokens(6, 64, seed=3).requires_grad_()
    x_ND, st = d.dispatch_preprocess(x_TD, _route(6))
    q, inv, amax = hand.take("input", x_ND)
    rq, rinv = tq.rowwise_quant(x_ND.detach(), inverse=True)
    _same_bits(q, rq)
    _same_bits(inv, rinv)
    assert amax is None  # an FP8 wgrad takes its column amax in a pass of its own
    st.probs_applied = True  # as MoELayer.compute sets it: the combine sums the experts' weighted rows
    grads: list = []
    y_ND = _Grab.apply(x_ND * 2, grads)
    out_TD = d.combine_postprocess(y_ND, st)
    out_TD.backward(torch.randn_like(out_TD))
    dy_ND = grads[0]
    q, inv, amax = hand.take("grad_out", dy_ND)
    rq, rinv = tq.rowwise_quant(dy_ND, inverse=True)
    _same_bits(q, rq)
    _same_bits(inv, rinv)
    assert amax is None and hand.input is None and hand.grad_out is None


@inside
def test_no_handoff_where_the_rows_do_not_reach_the_experts_as_gathered():
    from lightning_moe.modules.dispatchers import AllToAllDispatcher
    x_TD = _tokens(6, 64, seed=4)
    d = _dispatcher(capacity_factor=1.0)  # dropped copies: the experts mask a tail, a new tensor
    x_ND, st = d.dispatch_preprocess(x_TD, _route(6, dropped=True))
    assert st.has_tail and d.fp8_rows.input is None
    d = _dispatcher()
    assert isinstance(d, AllToAllDispatcher)
    d.fp8_dispatch = True  # FP8Training(fp8_dispatch=True) rounds the rows on their way: a new tensor
    d.dispatch_preprocess(x_TD, _route(6))
    assert d.fp8_rows.input is None
    d.fp8_dispatch, hand, d.fp8_rows = False, d.fp8_rows, None  # not attached
    plain_ND, _ = d.dispatch_preprocess(x_TD, _route(6))
    d.fp8_rows = hand
    fused_ND, _ = d.dispatch_preprocess(x_TD, _route(6))
    assert hand.input is not None and hand.input[0] is fused_ND
    _same_bits(fused_ND, plain_ND)  # the same rows with or without the quantization
