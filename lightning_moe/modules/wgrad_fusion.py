"""Gradient-accumulation fusion (Megatron's ``--gradient-accumulation-fusion``) for the dense linears.

With bf16 weights and fp32 main grads (``GradSync(main_grads=True)``), autograd's weight gradient is a bf16 GEMM
output that GradSync's hook then reads back and copies or adds into ``main_grad``: 2 + 2 + 4 (+ 4 on later
micro-batches) bytes per weight element, and one bf16 rounding of every micro-batch's gradient. Here the weight-gradient
GEMM writes its fp32 result straight into ``main_grad`` (first micro-batch of a step: ``mm`` into it) or adds it there
(later ones: ``addmm`` with beta = 1 in cuBLAS's epilogue): 4 (+ 4) bytes per element, no bf16 rounding.

Covered: every ``ColumnParallelLinear`` / ``RowParallelLinear`` (attention and MLA projections, dense FFN, shared
experts, an untied head). Not covered:
* the experts' grouped GEMMs: ``torch.nn.functional.grouped_mm`` has neither an output argument nor an accumulating
  epilogue, so an fp32 wgrad would be a new buffer plus an add, more bytes than the bf16 gradient it replaces;
* a tied head (``F.linear`` on the embedding's weight): the weight also gets the embedding's gradient in the same
  backward, and autograd would add the two before the hook;
* the router (fp32 weight and gradient already) and the norms (vectors).

The weight's autograd gradient is then an uninitialised tensor (as in Megatron): it only fires the post-accumulate
hook that counts the bucket as ready, and GradSync drops it unread.

Shapes: T tokens (all leading dimensions), K input features, N output features.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F


def sink_of(w: torch.Tensor):
    """The GradSync that accumulates ``w``'s gradient itself (``GradSync.fuse_wgrad``), or None."""
    ref = getattr(w, "main_grad_sink", None)
    return ref() if ref is not None else None


def attach(w: torch.nn.Parameter, sync) -> None:
    # a weak reference: copies of the parameter (deepcopy, checkpoints) never drag the GradSync along
    w.main_grad_sink = weakref.ref(sync)


def detach(w: torch.nn.Parameter) -> None:
    if hasattr(w, "main_grad_sink"):
        del w.main_grad_sink


@torch.no_grad()
def wgrad_into(main_NK: torch.Tensor, dy_TN: torch.Tensor, x_TK: torch.Tensor, first: bool) -> None:
    """``main = dy^T x`` (``first``) or ``main += dy^T x``, accumulated in fp32 (the GEMM's, not a bf16 result)."""
    if dy_TN.is_cuda:  # cuBLAS writes main's dtype from bf16 operands with fp32 accumulation, in place
        if first:
            torch.mm(dy_TN.t(), x_TK, out_dtype=main_NK.dtype, out=main_NK)
        else:
            torch.addmm(main_NK, dy_TN.t(), x_TK, out_dtype=main_NK.dtype, out=main_NK)
        return
    # CPU has no mixed-dtype GEMM: the same arithmetic from fp32 copies of the operands
    prod_NK = dy_TN.t().float() @ x_TK.float()
    main_NK.copy_(prod_NK) if first else main_NK.add_(prod_NK)


class _LinearWgradIntoMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TK, w_NK, sync):
        ctx.save_for_backward(x_TK)
        # the parameter itself, not a saved tensor: under recompute or saved-tensor hooks a saved weight comes back as
        # another tensor object, without main_grad (the weight cannot change before this backward anyway)
        ctx.weight, ctx.sync = w_NK, sync
        return F.linear(x_TK, w_NK)

    @staticmethod
    def backward(ctx, dy_TN):
        (x_TK,), w_NK = ctx.saved_tensors, ctx.weight
        dx_TK = dy_TN @ w_NK if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            N, K = w_NK.shape
            ctx.sync.accumulate_wgrad(w_NK, dy_TN.reshape(-1, N), x_TK.reshape(-1, K))
            dw = torch.empty_like(w_NK)  # never read: it only fires the hook (GradSync drops it)
        return dx_TK, dw, None


def linear(x_TK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)``, with the weight gradient accumulated straight into ``w.main_grad`` where a GradSync asked
    for it. Under autocast, or without gradients, plain ``F.linear``."""
    sync = sink_of(w_NK)
    if (sync is None or not torch.is_grad_enabled() or not w_NK.requires_grad
            or torch.is_autocast_enabled(x_TK.device.type)):
        return F.linear(x_TK, w_NK)
    return _LinearWgradIntoMainGrad.apply(x_TK, w_NK, sync)
