"""Gradient-accumulation fusion (Megatron's ``--gradient-accumulation-fusion``) for the dense linears and the experts.

With bf16 weights and fp32 main grads (``GradSync(main_grads=True)``), autograd's weight gradient is a bf16 GEMM
output that GradSync's hook then reads back and copies or adds into ``main_grad``: 2 + 2 + 4 (+ 4 on later
micro-batches) bytes per weight element, and one bf16 rounding of every micro-batch's gradient. Here the weight-gradient
GEMM writes its fp32 result straight into ``main_grad`` (first micro-batch of a step) or adds it there (later ones):
4 (+ 4) bytes per element, no bf16 rounding.

Covered:
* every ``ColumnParallelLinear`` / ``RowParallelLinear`` (attention and MLA projections, dense FFN, shared experts, an
  untied head): cuBLAS's ``mm`` into the main grad, or ``addmm`` with beta = 1 in its epilogue;
* the experts' grouped GEMMs (``experts.fc1`` / ``fc2`` in bf16): ``torch.nn.functional.grouped_mm`` has neither an
  output argument nor an accumulating epilogue, so their weight gradient runs on a Triton grouped GEMM that adds its
  fp32 tiles into the main grad (``triton_grouped_wgrad.py``); the forward and the input gradient stay on
  ``grouped_mm``. On the CPU the same arithmetic runs from fp32 copies, as for the dense linears; on CUDA without
  triton the experts keep the plain GEMM.

Not covered:
* a tied head (``F.linear`` on the embedding's weight): the weight also gets the embedding's gradient in the same
  backward, and autograd would add the two before the hook;
* the router (fp32 weight and gradient already) and the norms (vectors);
* GEMMs swapped for FP8 ones (``FP8Training``) whose wgrad is an FP8 kernel with a bf16 output: the dense scaled
  linears and the tensorwise/delayed experts. The blockwise recipe on DeepGEMM (``fp8_deepgemm``) and the rowwise
  experts' Triton wgrad (``fp8_grouped_kernels``) do write into the main grads, through ``sink_for``, and so do the
  dense FP8 linears and the experts with ``fp8_wgrad=False`` (their wgrad is this module's bf16 GEMM).

The weight's autograd gradient is then an uninitialised tensor (as in Megatron): it only fires the post-accumulate
hook that counts the bucket as ready, and GradSync drops it unread.

Shapes: T tokens (all leading dimensions), K input features, N output features; M routed rows, L local experts.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from lightning_moe.modules import kernels


def sink_of(w: torch.Tensor):
    """The GradSync that accumulates ``w``'s gradient itself (``GradSync.fuse_wgrad``), or None."""
    ref = getattr(w, "main_grad_sink", None)
    return ref() if ref is not None else None


def sink_for(w: torch.Tensor, x: torch.Tensor, grouped: bool):
    """The GradSync that takes ``w``'s gradient into its main grad in a GEMM of ``x`` with ``w``, or None: a 16-bit
    weight (an fp32 one's autograd gradient is already fp32) that needs a gradient, not under autocast (``w`` is
    then a cast copy); a grouped GEMM on CUDA needs triton (the fp32 reference's grouped_mm syncs with the host)."""
    sync = sink_of(w)
    if (sync is None or not torch.is_grad_enabled() or not w.requires_grad
            or torch.is_autocast_enabled(x.device.type) or w.dtype not in (torch.bfloat16, torch.float16)):
        return None
    return None if grouped and x.is_cuda and kernels.load("triton_grouped_wgrad", x) is None else sync


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
            dy, x = dy_TN.reshape(-1, N), x_TK.reshape(-1, K)
            ctx.sync.accumulate_wgrad(w_NK, lambda main, first: wgrad_into(main, dy, x, first))
            dw = ctx.sync.placeholder(w_NK)  # never read: it only fires the hook (GradSync drops it)
        return dx_TK, dw, None


def linear(x_TK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)``, with the weight gradient accumulated straight into ``w.main_grad`` where a GradSync asked
    for it. Under autocast, or without gradients, plain ``F.linear``."""
    sync = sink_of(w_NK)
    if (sync is None or not torch.is_grad_enabled() or not w_NK.requires_grad
            or torch.is_autocast_enabled(x_TK.device.type)):
        return F.linear(x_TK, w_NK)
    return _LinearWgradIntoMainGrad.apply(x_TK, w_NK, sync)


@torch.no_grad()
def grouped_wgrad_into(main_LKN: torch.Tensor, x_MK: torch.Tensor, dy_MN: torch.Tensor, offs_L: torch.Tensor,
                       first: bool) -> None:
    """``main[l] (=|+=) x_l^T dy_l`` over each expert's rows (``offs``: cumulative row counts), accumulated in fp32
    and stored in main's dtype."""
    tk = kernels.load("triton_grouped_wgrad", x_MK)
    if tk is not None:  # 16-bit operands: grouped_linear fuses no other
        tk.wgrad_into(main_LKN, x_MK, dy_MN, offs_L, first)
        return
    # the reference: fp32 copies on grouped_mm, whose strides must be 16-byte multiples (K and N padded to 4)
    L, K, N = main_LKN.shape
    Kp, Np = -(-K // 4) * 4, -(-N // 4) * 4
    x32, dy32 = F.pad(x_MK.float(), (0, Kp - K)), F.pad(dy_MN.float(), (0, Np - N))
    prod_LKN = F.grouped_mm(x32.t(), dy32, offs=offs_L.to(torch.int32))[:, :K, :N]
    main_LKN.copy_(prod_LKN) if first else main_LKN.add_(prod_LKN)


@torch.no_grad()
def grouped_wgrad_segments_into(main_LKN: torch.Tensor, segments: list, first: bool) -> None:
    """``grouped_wgrad_into`` over several micro-batches' ``(x, dy, offs)``: one pass over the main grad on the
    kernel (``triton_grouped_wgrad.wgrad_segments_into``), one per segment on the reference."""
    tk = kernels.load("triton_grouped_wgrad", segments[0][0])
    # the interpreter copies each argument to the host on its own: offsets between CUDA tensors would not hold there
    if tk is not None and len(segments) > 1 and not (kernels.interpreting() and segments[0][0].is_cuda):
        tk.wgrad_segments_into(main_LKN, segments, first)
        return
    for i, (x_MK, dy_MN, offs_L) in enumerate(segments):
        grouped_wgrad_into(main_LKN, x_MK, dy_MN, offs_L, first and i == 0)


def grouped_wgrad(sync, param: torch.nn.Parameter, x_MK: torch.Tensor, dy_MN: torch.Tensor, offs_L: torch.Tensor,
                  defer: bool = False, window=None) -> None:
    """The experts' bf16 wgrad into ``param.main_grad`` through ``sync`` (a GradSync): now, or (``defer``) held with
    its operands until the step's last backward or a full ``window`` of micro-batches (``GradSync.defer_wgrad``),
    then run over all of them in one pass over the main grad."""
    if not defer:
        sync.accumulate_wgrad(param, lambda main, first: grouped_wgrad_into(main, x_MK, dy_MN, offs_L, first))
        return

    def run(main, first, helds):
        segments = list(helds)
        helds.clear()  # the operands go with this pass
        grouped_wgrad_segments_into(main, segments, first)
    sync.defer_wgrad(param, (x_MK, dy_MN, offs_L), run, window)


class _GroupedWgradIntoMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_LKN, offs_L, sync):
        ctx.save_for_backward(x_MK, offs_L)
        ctx.weight, ctx.sync = w_LKN, sync  # the parameter itself (see _LinearWgradIntoMainGrad)
        return F.grouped_mm(x_MK, w_LKN, offs=offs_L)

    @staticmethod
    def backward(ctx, dy_MN):
        (x_MK, offs_L), w_LKN = ctx.saved_tensors, ctx.weight
        dy_MN = dy_MN.contiguous()  # a stride-0 gradient (from .sum()) is not a GEMM operand
        dx_MK = F.grouped_mm(dy_MN, w_LKN.transpose(-2, -1), offs=offs_L) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            grouped_wgrad(ctx.sync, w_LKN, x_MK, dy_MN, offs_L, *ctx.sync.expert_deferral)
            dw = ctx.sync.placeholder(w_LKN)  # never read: it only fires the hook (GradSync drops it)
        return dx_MK, dw, None, None


def grouped_linear(x_MK: torch.Tensor, w_LKN: torch.Tensor, offs_L: torch.Tensor):
    """``grouped_mm(x, w, offs)`` with the weight gradient accumulated straight into ``w.main_grad`` where a GradSync
    asked for it; None where it did not (or under autocast, or without gradients): the caller runs its own GEMM."""
    sync = sink_for(w_LKN, x_MK, grouped=True)  # 16-bit weights only: float64 has no grouped_mm
    if sync is None or x_MK.dtype != w_LKN.dtype:
        return None
    return _GroupedWgradIntoMainGrad.apply(x_MK, w_LKN, offs_L, sync)
