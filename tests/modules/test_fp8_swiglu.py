"""The handoff between the experts' SwiGLU and their FP8 GEMMs (``fp8_swiglu``) on CPU: a GEMM takes a quantization
only for the very tensor it was made for, once; without the fused kernels (no CUDA, no triton) the SwiGLU is the plain
one and nothing is swapped. The kernels and the autograd function are tested under the Triton interpreter
(``test_triton_fp8_swiglu.py``) and on the GPU (``tests/test_gpu_fp8_swiglu.py``)."""

from __future__ import annotations

import torch

from lightning_moe.modules.experts import GroupedExperts, swiglu
from lightning_moe.modules.fp8_linear import FP8Spec
from lightning_moe.modules.fp8_swiglu import Handoff, attach, fp8_swiglu


def test_a_handoff_is_taken_only_for_its_tensor_and_once():
    hand = Handoff()
    a = torch.randn(4, 8)
    hand.put("forward", a, ("q",))
    assert hand.take("forward", a.clone()) is None  # another tensor: dropped
    assert hand.take("forward", a) is None
    hand.put("forward", a, ("q",))
    assert hand.take("forward", a.view(4, 8)) == ("q",)  # the same storage, shape and strides: a view of it is it
    assert hand.take("forward", a) is None  # taken once
    hand.put("backward", a, ("q",))
    a.add_(1)  # changed in place after it was quantized
    assert hand.take("backward", a) is None
    hand.put("backward", a, ("q",))
    assert hand.take("backward", a[:2]) is None  # another shape
    with torch.inference_mode():  # Lightning's evaluation loops: inference tensors track no version
        b = torch.randn(4, 8)
        hand.put("forward", b, ("q",))
        assert hand.take("forward", b) == ("q",)
    hand.rows = (4, "offs", "gid")
    assert hand.take_rows(5) is None and hand.rows is None  # other rows: dropped
    hand.rows = (4, "offs", "gid")
    assert hand.take_rows(4) == ("offs", "gid") and hand.rows is None


def test_without_the_kernels_it_is_the_plain_swiglu_and_nothing_is_attached():
    torch.manual_seed(0)
    h, p = torch.randn(6, 16, requires_grad=True), torch.rand(6, requires_grad=True)
    hand = Handoff()
    hand.rows = (6, torch.tensor([2, 6]), torch.tensor([0, 0, 1, 1, 1, 1]))
    a = fp8_swiglu(h, p, hand)
    assert torch.equal(a, swiglu(h, p)) and hand.forward is None
    experts = GroupedExperts(2, 32, 256)
    s1, s2 = FP8Spec("rowwise"), FP8Spec("rowwise")
    assert attach(experts, s1, s2, torch.device("cpu")) is None
    assert "_act" not in experts.act.__dict__ and s1.handoff is None and s2.handoff is None


def test_the_rows_weights_reach_fc1_before_it_runs_and_a_premade_copy_is_taken_once():
    """``GroupedExperts`` tells its activation the rows' weights before fc1 (``SwiGLUActivation.prepare``: nothing by
    default); under the per-expert GEMMs ``fp8_swiglu.prepare`` keeps them for fc1's epilogue only where the SwiGLU
    will take its copies (grad mode on, fc2's weight trained). fc1's copies are taken by the SwiGLU for its very h,
    once; the SwiGLU drops them for any other h."""
    from lightning_moe.modules import fp8_swiglu as fs
    torch.manual_seed(0)
    experts = GroupedExperts(2, 32, 64)
    seen = []
    experts.act.prepare = lambda p: seen.append(p)
    x, p = torch.randn(6, 32), torch.rand(6)
    experts(x, torch.tensor([2, 4]), probs_M=p)
    assert len(seen) == 1 and seen[0] is p
    del experts.act.prepare
    experts.act.prepare(p)  # the default: nothing
    w2 = torch.nn.Parameter(torch.randn(2, 8, 4))
    hand = Handoff(both=(None, None, w2))
    fs.prepare(p, hand)
    assert hand.probs[0] is p
    with torch.no_grad():
        fs.prepare(p, hand)
    assert hand.probs is None  # validation: the SwiGLU takes no copies
    w2.requires_grad_(False)
    fs.prepare(None, hand)
    assert hand.probs is None  # fc2's weight frozen: no wgrad, no copies
    h = torch.randn(6, 16)
    hand.put("premade", h, (p, ("q", "qT", "inv_M", "inv_L"), "amax", True))
    hand.rows = None
    fp8_swiglu(h.clone(), p, hand)  # another h: the copies are dropped, the SwiGLU is plain
    assert hand.premade is None


def test_the_permutes_quantize_only_where_their_rows_are_the_experts_own():
    """The dispatcher hands its ``fp8_rows`` to the permutes only on one rank, where the experts mask no tail (a masked
    tail makes new tensors), autocast does not cast x, and no FP8 dispatch rounds the rows; without the kernels (no
    CUDA, no triton) the permutes put nothing and gather as before. The kernels: ``test_triton_fp8_gather.py`` and the
    GPU tests."""
    from lightning_moe import ModelConfig, ParallelContext
    from lightning_moe.modules.dispatcher import DispatchState, build_dispatcher
    from lightning_moe.modules.router import TopKRouter
    cfg = ModelConfig(hidden_size=32, num_experts=4, moe_ffn_hidden_size=16, topk=2)
    d = build_dispatcher(cfg, ParallelContext.single())
    plain = DispatchState(6, None, torch.zeros(6, 2), None, torch.zeros(4))
    tail = DispatchState(6, None, torch.zeros(6, 2), None, torch.zeros(4), has_tail=True)
    assert d._row_quant(plain) is None  # nothing attached
    hand = d.fp8_rows = Handoff()
    assert d.rows_feed_experts() and d._row_quant(plain) is hand and d._row_quant(tail) is None
    d.fp8_dispatch = True
    assert not d.rows_feed_experts() and d._row_quant(plain) is None
    d.fp8_dispatch = False
    x_TD = torch.randn(6, 32, requires_grad=True)
    assert d._row_quant(plain, x_TD) is hand
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16-mixed: fc1 gets x cast, a new tensor
        assert d._row_quant(plain, x_TD) is None
    route = TopKRouter(cfg, ParallelContext.single())(x_TD, num_sequences=1)
    x_ND, st = d.dispatch_preprocess(x_TD, route)
    st.probs_applied = True
    d.combine_postprocess(x_ND * 2, st).sum().backward()
    assert hand.input is None and hand.grad_out is None  # CPU without the interpreter: torch's gathers
    d.fp8_rows = None
    ref_ND, _ = d.dispatch_preprocess(x_TD, route)
    assert torch.equal(x_ND, ref_ND)
