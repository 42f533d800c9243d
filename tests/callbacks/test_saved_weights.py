"""The saved-tensor hooks of Recompute / ActivationOffload must tell parameters (and their views and casts, which
``F.linear`` saves) from activations: a parameter moved to the host frees nothing, since the module holds it."""

import torch
import torch.nn.functional as F

from lightning_moe.callbacks.saved_tensors import _is_weight


def _saved(fn):
    out = []

    def pack(t):
        out.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return out


def test_linear_weight_views_and_casts_are_weights_and_activations_are_not():
    w = torch.nn.Parameter(torch.randn(8, 16))
    h = torch.randn(2, 3, 16, requires_grad=True) * 2  # an activation: not a leaf
    for fn in (lambda: F.linear(h, w),  # 3-D input: F.linear saves w.t()
               lambda: F.linear(h.bfloat16(), w.bfloat16())):  # and the cast's transpose
        saved = _saved(fn)
        kinds = sorted(_is_weight(t) for t in saved)
        assert kinds == [False, True], [(tuple(t.shape), type(t.grad_fn).__name__) for t in saved]
        assert all(_is_weight(t) == (t.shape == (16, 8)) for t in saved)
    act = _saved(lambda: torch.sigmoid(h.transpose(0, 1)))
    assert not any(_is_weight(t) for t in act)
