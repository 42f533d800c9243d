"""``MoEFoldStrategy(fused_optimizer_writeback=...)``: torch's Adam/AdamW stepped by one Triton kernel per parameter
that also writes the bf16 model weight (``modules/triton_adam.py``), in place of the optimizer's step followed by
``MainParams.copy_to_model``. Per step that saves reading every fp32 weight a second time: 34 → 30 bytes per
parameter, about a tenth of the optimizer's time, which on one GPU is a quarter of a step.

The optimizer stays the user's: its state (keys, dtypes, devices: what its own step would create), its step hooks,
the LR scheduler's bookkeeping and its checkpoints are torch's. The distributed optimizer (``sharded_optimizer.py``)
calls ``fused_step`` for its device slices, writing each rank's part of the bf16 weights before their all-gather.
A step whose tensors the kernel cannot take (a non-contiguous or non-fp32 gradient, state loaded in another dtype)
runs torch's own step and copy instead, with a warning naming why."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_moe.modules import kernels

FUSABLE = (torch.optim.Adam, torch.optim.AdamW)


def why_not_fusable(opt: torch.optim.Optimizer, low_of: dict[int, torch.Tensor], device: torch.device
                    ) -> Optional[str]:
    """None where ``opt``'s step can run fused, else what prevents it."""
    if type(opt) not in FUSABLE:  # a subclass may change the update
        return f"the optimizer is {type(opt).__name__}, not torch.optim.Adam or AdamW"
    for name, bad in (("amsgrad=True", lambda g: g.get("amsgrad")),
                      ("differentiable=True", lambda g: g.get("differentiable")),
                      ("a tensor learning rate", lambda g: isinstance(g["lr"], torch.Tensor))):
        if any(bad(g) for g in opt.param_groups):
            return f"the optimizer has {name}"
    if not low_of:
        return "no bf16 weight is stepped through an fp32 main copy (precision='bf16-true' has them)"
    if any(t.dtype != torch.bfloat16 for t in low_of.values()):
        return "the weights are not all bf16 (fp16 weights step under a loss scaler)"
    probe = next(iter(low_of.values()))
    if device.type != "cuda" and not kernels.interpreting():
        return f"the weights are on {device.type}, not CUDA"
    if kernels.load("triton_adam", probe) is None:
        return "Triton is not installed"
    return None


def step_eligible(opt: torch.optim.Optimizer, low_of: dict[int, torch.Tensor]) -> Optional[str]:
    """None where every tensor this step touches suits the kernel, else what does not."""
    for group in opt.param_groups:
        for p in group["params"]:
            g, st = p.grad, opt.state.get(p)
            if g is None:
                continue
            tensors = [p, g, *(st[k] for k in ("exp_avg", "exp_avg_sq") if st and k in st)]
            if any(t.dtype != torch.float32 or not t.is_contiguous() or t.device != p.device for t in tensors):
                return "a parameter, gradient or moment is not a contiguous fp32 tensor on the weight's device"
            low = low_of.get(id(p))
            if low is not None and (not low.is_contiguous() or low.numel() != p.numel()):
                return "a model weight is not contiguous"
    return None


@torch.no_grad()
def fused_step(opt: torch.optim.Optimizer, low_of: dict[int, torch.Tensor]) -> None:
    """``opt``'s Adam(W) step over its param groups' tensors that have a gradient, writing ``low_of[id(p)]`` too: its
    state created as torch's ``Adam._init_group`` creates it, one step-count increment per group, one launch per
    tensor."""
    from lightning_moe.modules.triton_adam import adam_step_
    for group in opt.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        steps = []
        for p in params:
            st = opt.state[p]
            if len(st) == 0:
                on_device = group["capturable"] or group["fused"]
                st["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if on_device
                              else torch.tensor(0.0, dtype=torch.float32))
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            steps.append(st["step"])
        torch._foreach_add_(steps, 1.0)
        beta1, beta2 = group["betas"]
        decoupled = isinstance(opt, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))
        for p in params:
            st = opt.state[p]
            adam_step_(p, p.grad, st["exp_avg"], st["exp_avg_sq"], st["step"], low_of.get(id(p)), lr=group["lr"],
                       beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                       decoupled=decoupled, maximize=group["maximize"])


def warn_unfused(opt: torch.optim.Optimizer, why: str) -> None:
    rank_zero_warn(f"MoEFoldStrategy(fused_optimizer_writeback): {why}; this step runs torch's {type(opt).__name__} "
                   "and copies the weights")


class FusedAdamStep:
    """Replaces ``opt.step``: the closure, then per param group the step count and one kernel launch per parameter.
    ``low_of`` maps a main parameter's id to the bf16 model weight the kernel writes."""

    def __init__(self, opt: torch.optim.Optimizer, low_of: dict[int, torch.Tensor]):
        self.opt, self.low_of = opt, low_of
        self._raw: Optional[Callable] = getattr(type(opt).step, "__wrapped__", None)  # torch's step without its hooks
        self._warned = False
        # torch's wrapper runs the step hooks (global and the optimizer's) around the step, as around its own
        hooked = torch.optim.Optimizer.profile_hook_step(self._step)

        def step(closure=None):
            return hooked(opt, closure)

        if hasattr(opt.step, "_wrapped_by_lr_sched"):  # torch's LR schedulers check that their patch stays
            step._wrapped_by_lr_sched = True
        opt.step = step

    @torch.no_grad()
    def _step(self, opt: torch.optim.Optimizer, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        opt._opt_called = True  # what the LR scheduler's wrapper of the step records
        why = step_eligible(opt, self.low_of)
        if why is None:
            fused_step(opt, self.low_of)
        else:
            self._unfused(why)
        return loss

    def _unfused(self, why: str) -> None:
        if not self._warned:
            warn_unfused(self.opt, why)
            self._warned = True
        if self._raw is not None:
            self._raw(self.opt)
        else:  # a torch without the hook wrapper: its step is the plain function
            type(self.opt).step(self.opt)
        mains = [p for g in self.opt.param_groups for p in g["params"] if id(p) in self.low_of]
        if mains:
            torch._foreach_copy_([self.low_of[id(p)] for p in mains], mains)
