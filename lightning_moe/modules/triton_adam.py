"""Adam/AdamW on an fp32 main parameter with the write-back of its bf16 model copy, in one Triton pass.

torch's fused AdamW reads and writes the fp32 weight and both moments and reads the gradient (28 bytes per parameter);
the write-back of the bf16 model weight then reads the fp32 weight again (6 more). Here the kernel that has the new
weight in registers also stores its bf16 rounding: 30 bytes per parameter, what Transformer Engine's FusedAdam does
with master weights.

The update is torch's fused Adam, term by term and in the same order
(``aten/src/ATen/native/cuda/fused_adam_utils.cuh``), in float32 with IEEE division and square root. The bias
corrections come from the step count: read on the device (``fused=True`` or ``capturable=True``, no host sync), or
given by the host (torch's default, whose step count lives on the CPU).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from lightning_moe.modules.triton_launch import launch

BLOCK = 2048


@triton.jit
def _adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, low_ptr, step_ptr, n, lr, beta1, beta2, eps, weight_decay, ln_beta1,
                 ln_beta2, bc1_host, bc2_sqrt_host, DECAY: tl.constexpr, DECOUPLED: tl.constexpr,
                 MAXIMIZE: tl.constexpr, READ_STEP: tl.constexpr, WRITE_LOW: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if READ_STEP:  # 1 - beta^step = 1 - exp(step ln beta) in float64, no host sync: as exact as torch's float pow
        step = tl.load(step_ptr).to(tl.float64)
        bc1 = (1.0 - tl.exp(step * ln_beta1)).to(tl.float32)
        bc2_sqrt = tl.sqrt_rn((1.0 - tl.exp(step * ln_beta2)).to(tl.float32))
    else:
        bc1 = bc1_host
        bc2_sqrt = bc2_sqrt_host
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    if MAXIMIZE:
        g = -g
    if DECAY:  # torch skips a zero decay (which matters only for a non-finite weight)
        if DECOUPLED:
            p = p - lr * weight_decay * p
        else:
            g = g + p * weight_decay
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    step_size = tl.div_rn(lr, bc1)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - tl.div_rn(step_size * m, denom)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if WRITE_LOW:
        tl.store(low_ptr + offs, p.to(low_ptr.dtype.element_ty), mask=mask)


def adam_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               step: torch.Tensor, low: Optional[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float, decoupled: bool, maximize: bool) -> None:
    """One Adam(W) update of ``param`` (fp32, contiguous) and its moments in place, after ``step`` was incremented;
    ``low`` (contiguous, bf16/fp16, or None) receives the new weight rounded to nearest. A step count on the CPU while
    the weight is elsewhere is read by the host (a CPU tensor: no device sync)."""
    n = param.numel()
    if n == 0:
        return
    read_step = step.device == param.device
    bc1 = bc2_sqrt = 1.0
    if not read_step:  # torch's foreach path computes these on the host from its CPU step count the same way
        s = float(step)
        bc1, bc2_sqrt = 1.0 - beta1 ** s, math.sqrt(1.0 - beta2 ** s)
    launch(_adam_kernel, (triton.cdiv(n, BLOCK),), param, grad, exp_avg, exp_avg_sq, low if low is not None else param,
           step if read_step else param, n, float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
           math.log(beta1), math.log(beta2), bc1, bc2_sqrt, DECAY=weight_decay != 0, DECOUPLED=bool(decoupled),
           MAXIMIZE=bool(maximize), READ_STEP=read_step, WRITE_LOW=low is not None, BLOCK=BLOCK, num_warps=8)
