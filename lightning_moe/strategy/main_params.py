"""fp32 main parameters for bf16/fp16 models: Megatron's mixed precision (``Float16OptimizerWithFloat16Params``).

The model holds bf16 weights, so the forward pass casts nothing (bf16-mixed autocast re-casts every fp32 weight in
every micro-batch). Gradients accumulate in fp32 ``main_grad`` buffers (see ``GradSync(main_grads=True)``). The
optimizer steps fp32 copies of the weights, which are written back to the bf16 weights after each step.

The optimizer's param groups hold the fp32 copies, so gradient clipping, LR schedulers and the optimizer state see fp32
tensors. fp32 parameters (e.g. the router's) are their own main copy.

Known limits (the strategy's automatic-optimization flow is the supported path):
  * the fp32 gradients reach the optimizer's tensors inside ``optimizer_step``. Under manual optimization,
    ``clip_gradients`` before ``opt.step()`` and hooks that read ``p.grad`` of the model (which stays None) see no
    gradient;
  * param groups added after setup (``add_param_group``, e.g. ``BaseFinetuning``) get no main copy.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

LOW_PRECISION = (torch.bfloat16, torch.float16)
PARALLEL_ATTRS = ("is_expert", "tp_shard_dim", "tp_parts", "grad_sum_over_tp", "pp_tied", "pp_tied_copy")


def has_low_precision_params(optimizers: Iterable[torch.optim.Optimizer]) -> bool:
    return any(p.dtype in LOW_PRECISION for opt in optimizers for g in opt.param_groups for p in g["params"])


class MainParams:
    def __init__(self, optimizers: Iterable[torch.optim.Optimizer]):
        self.model_params: list[nn.Parameter] = []  # every optimized param, in optimizer order
        self.main_params: list[torch.Tensor] = []  # its fp32 main copy (the param itself when already fp32)
        self._main_of: dict[int, torch.Tensor] = {}
        for opt in optimizers:
            if any(opt.state.values()):
                raise RuntimeError("MainParams: the optimizer already has state; create main params before the "
                                   "first step (a checkpoint's optimizer state is loaded afterwards)")
            for group in opt.param_groups:
                mains = []
                for p in group["params"]:
                    main = self._main_of.get(id(p))
                    if main is None:
                        main = p.detach().float().clone() if p.dtype in LOW_PRECISION else p
                        if main is not p:  # how the gradient is synced and counted in the global norm
                            for attr in PARALLEL_ATTRS:
                                if hasattr(p, attr):
                                    setattr(main, attr, getattr(p, attr))
                        self._main_of[id(p)] = main
                        self.model_params.append(p)
                        self.main_params.append(main)
                    mains.append(main)
                group["params"] = mains
        self._low = [(p, m) for p, m in zip(self.model_params, self.main_params) if m is not p]
        self._copy = self._low  # the pairs copy_to_model writes: those no fused step writes itself

    def main_of(self, p: nn.Parameter) -> torch.Tensor:
        return self._main_of[id(p)]

    def low_of(self, opt: torch.optim.Optimizer) -> dict[int, torch.Tensor]:
        """``{id(main copy): model weight}`` for the low-precision weights that ``opt`` steps."""
        model_of = {id(m): p for p, m in self._low}
        return {id(m): model_of[id(m)] for g in opt.param_groups for m in g["params"] if id(m) in model_of}

    def written_by_step(self, mains: Iterable[int]) -> None:
        """The main copies (ids) whose optimizer step writes the model weight itself (``fused_adam.py``)."""
        skip = set(mains)
        self._copy = [(p, m) for p, m in self._copy if id(m) not in skip]

    @torch.no_grad()
    def attach_grads(self, had_main_grad: set[int]) -> None:
        """Point each main param's ``.grad`` at its model param's fp32 ``main_grad`` (None when it got none)."""
        for p, main in zip(self.model_params, self.main_params):
            main.grad = p.main_grad if id(p) in had_main_grad else None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Write the stepped fp32 weights back into the bf16 model weights (round to nearest)."""
        if self._copy:
            torch._foreach_copy_([p for p, _ in self._copy], [m for _, m in self._copy])

    @staticmethod
    def _current(p: torch.Tensor, main: torch.Tensor) -> torch.Tensor:
        # the main copy where it still rounds to the model weight; the model weight where someone overwrote it
        # (a callback loading weights, EMA/SWA, load_state_dict): elementwise, no host sync
        return torch.where(main.to(p.dtype) == p, main, p.to(main.dtype))

    @torch.no_grad()
    def sync_from_model(self) -> None:
        """Adopt model weights written since the main copies were made; keep the fp32 bits of the others."""
        for p, main in self._low:
            main.copy_(self._current(p, main))

    def state_dict_overrides(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """``{state-dict key: fp32 main copy}`` for every low-precision param of ``module``: checkpoints keep fp32."""
        out = {}
        for name, p in module.named_parameters():
            main = self._main_of.get(id(p))
            if main is not None and main is not p:
                out[name] = self._current(p.detach(), main.detach())
        return out

    @torch.no_grad()
    def to(self, device: torch.device) -> None:
        """Move the main copies (the optimizer's params, same objects) e.g. to the CPU at teardown."""
        for _, main in self._low:
            main.data = main.data.to(device)

    @torch.no_grad()
    def load_from_state_dict(self, module: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        """Set the main copies from a checkpoint's (fp32) values; params missing from it copy the model weight."""
        for name, p in module.named_parameters():
            main = self._main_of.get(id(p))
            if main is None or main is p:
                continue
            src = state_dict.get(name)
            main.copy_(src if src is not None else p)
