"""The SwiGLU and the router's float32 GEMM keep less for backward than autograd's composition would (its input only;
the bf16 input, not its float32 copy), with bit-identical values and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.modules.experts import swiglu
from lightning_moe.modules.router import fp32_linear


def _saved_bytes(fn, *inputs, params=()) -> tuple[int, list]:
    """Bytes of the distinct storages autograd keeps for backward while ``fn`` runs (``params`` excluded), and the
    output."""
    seen, weights = {}, {p.untyped_storage().data_ptr() for p in params}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    return sum(seen.values()), out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_keeps_its_input_only_and_matches_autograd(dtype):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(300, 2 * 48, generator=g).to(dtype).requires_grad_()
    gy = torch.randn(300, 48, generator=g).to(dtype)

    def reference(h):
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up

    ref_bytes, y0 = _saved_bytes(reference, h)
    y0.backward(gy)
    g0, h.grad = h.grad, None
    lean_bytes, y1 = _saved_bytes(swiglu, h)
    y1.backward(gy)
    assert torch.equal(y0, y1) and torch.equal(g0, h.grad)
    assert lean_bytes == h.numel() * h.element_size()  # [gate | up] only
    assert ref_bytes == lean_bytes + 300 * 48 * h.element_size()  # autograd also keeps silu(gate)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_gemm_keeps_the_input_not_its_float32_copy(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200, 64, generator=g).to(dtype).requires_grad_()
    w = torch.randn(16, 64, generator=g, requires_grad=True)
    gl = torch.randn(200, 16, generator=g)
    ref_bytes, l0 = _saved_bytes(lambda x, w: F.linear(x.float(), w), x, w, params=[w])
    l0.backward(gl)
    gx0, gw0 = x.grad, w.grad
    x.grad = w.grad = None
    lean_bytes, l1 = _saved_bytes(fp32_linear, x, w, params=[w])
    l1.backward(gl)
    assert l1.dtype == torch.float32
    assert torch.equal(l0, l1) and torch.equal(gx0, x.grad) and torch.equal(gw0, w.grad)
    assert lean_bytes == x.numel() * x.element_size()
    assert ref_bytes == x.numel() * 4  # the float32 copy (for fp32 input: x itself)


def test_bf16_router_gemm_is_the_fp32_gemm_of_bf16_operands():
    """``router_dtype="bf16"``: float32 logits of the bf16-rounded input and weight; input gradient in the input's
    dtype from the gradient rounded to bf16; weight gradient in float32. On CPU the products run in float32."""
    from lightning_moe.modules.router import router_logits
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 32, generator=g).bfloat16().requires_grad_()
    w = torch.randn(8, 32, generator=g, requires_grad=True)
    gl = torch.randn(64, 8, generator=g)
    logits = router_logits(x, w, "bf16")
    logits.backward(gl)
    w16 = w.detach().bfloat16().float()
    assert logits.dtype == torch.float32
    assert torch.equal(logits, x.detach().float() @ w16.t())
    g16 = gl.bfloat16().float()
    assert torch.equal(x.grad, (g16 @ w16).bfloat16())
    assert torch.equal(w.grad, g16.t() @ x.detach().float())
    assert not torch.equal(logits, router_logits(x, w, "fp32"))  # the weight's rounding shows


def test_router_dtype_is_validated():
    from lightning_moe.modules.config import ModelConfig
    with pytest.raises(ValueError, match="router_dtype"):
        ModelConfig(router_dtype="fp16").validate()
