"""NVFP4Training: NVIDIA's NVFP4 training recipe as a callback (``modules/nvfp4.py``, ``nvfp4_linear.py``).

Every dense linear and the experts' grouped GEMMs run their forward, dgrad and wgrad on NVFP4 operands: E2M1 values
with E4M3 scales per 16 elements and an fp32 scale per tensor (per expert), 16 x 16 blocks for weights, a random
Hadamard transform on the wgrad inputs, stochastic rounding of gradients; the last ``bf16_last_layers`` layers (and
the head, the router) stay in their own precision. No GPU here has FP4 tensor cores (Hopper has none; Blackwell's
kernels are not wired in yet): the GEMMs are emulated, quantized then dequantized and multiplied in fp32, which says
what NVFP4 does to the loss, not how fast it runs. It says so once in the log.
"""

from __future__ import annotations

import fnmatch
from functools import partial
from typing import Sequence

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_moe.modules.experts import GroupedMM
from lightning_moe.modules.nvfp4 import BLOCK
from lightning_moe.modules.nvfp4_linear import NVFP4Spec, make_hadamard, nvfp4_grouped_mm, nvfp4_linear
from lightning_moe.modules.tensor_parallel import ColumnParallelLinear, RowParallelLinear

KERNELS = ("emulated", "auto", "real")


class NVFP4Training(L.Callback):
    """Train with (emulated) NVFP4 GEMMs.

    Args:
        bf16_last_layers: the last N transformer layers keep their precision (NVIDIA keeps roughly the last 15 %).
        exclude: module names (``fnmatch`` patterns on the LightningModule's ``named_modules``) kept as they are.
        include_head: also the output head.
        hadamard: the random Hadamard transform of the wgrad inputs (``seed`` draws its signs).
        stochastic_rounding: of the gradients.
        kernels: ``"emulated"`` or ``"auto"`` (emulated: no FP4 kernels here); ``"real"`` is refused where no FP4
            tensor cores exist.
    """

    def __init__(self, bf16_last_layers: int = 1, exclude: Sequence[str] = (), include_head: bool = False,
                 hadamard: bool = True, stochastic_rounding: bool = True, seed: int = 0, kernels: str = "auto"):
        if kernels not in KERNELS:
            raise ValueError(f"NVFP4Training(kernels={kernels!r}): valid: {', '.join(KERNELS)}")
        if not isinstance(bf16_last_layers, int) or bf16_last_layers < 0:
            raise ValueError(f"NVFP4Training(bf16_last_layers={bf16_last_layers!r}): must be an integer >= 0")
        self.bf16_last_layers, self.exclude, self.include_head = bf16_last_layers, list(exclude), include_head
        self.hadamard, self.stochastic, self.seed, self.kernels = hadamard, stochastic_rounding, seed, kernels
        self._swapped: list[tuple[nn.Module, str]] = []

    def on_fit_start(self, trainer, pl_module) -> None:
        device = trainer.strategy.root_device
        if self.kernels == "real":
            what = (torch.cuda.get_device_name(device) if device.type == "cuda" else device.type)
            fp4 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (10, 0)
            raise ValueError(f"NVFP4Training(kernels='real'): {what} " + (
                "has FP4 tensor cores, but their kernels are not wired in yet" if fp4 else
                "has no FP4 tensor cores (Hopper and older)") + "; use kernels='emulated'")
        model = pl_module.model
        total = model.cfg.num_layers
        kept = {f"model.layers.{i}." for i in range(total - self.bf16_last_layers, total)}
        spec = NVFP4Spec(make_hadamard(self.seed, device) if self.hadamard else None, self.stochastic)
        targets, problems = [], []
        for name, m in pl_module.named_modules():
            if (any(name.startswith(k) for k in kept) or any(fnmatch.fnmatch(name, p) for p in self.exclude)
                    or (m is getattr(model, "head", None) and not self.include_head)):
                continue
            if isinstance(m, GroupedMM):
                experts = pl_module.get_submodule(name.rsplit(".", 1)[0])
                w = experts.w13 if name.endswith("fc1") else experts.w2
                K, N = w.shape[1], w.shape[2]
            elif isinstance(m, (ColumnParallelLinear, RowParallelLinear)) or (
                    isinstance(m, nn.Linear) and m.bias is None and "router" not in name):
                N, K = m.weight.shape
            else:
                continue
            if K % BLOCK or N % BLOCK:
                problems.append(f"{name}: {K} x {N} is not a multiple of NVFP4's {BLOCK} x {BLOCK} weight blocks")
            targets.append(m)
        if problems:
            raise ValueError(f"NVFP4Training cannot run these layers: {problems[0]}"
                             + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                             + "; exclude them (exclude=[...])")
        for m in targets:
            self._swap(m, spec)
        rank_zero_info(f"NVFP4Training: {len(targets)} GEMMs run EMULATED (quantize, dequantize, fp32 multiply) on "
                       f"{device.type}: no FP4 tensor cores are used; the last {self.bf16_last_layers} layer(s) and "
                       "the head stay in their precision")

    def _swap(self, m: nn.Module, spec: NVFP4Spec) -> None:
        if isinstance(m, GroupedMM):
            m._mm = partial(nvfp4_grouped_mm, spec=spec)
            self._swapped.append((m, "_mm"))
        elif isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            m._mm = partial(nvfp4_linear, spec=spec)
            self._swapped.append((m, "_mm"))
        else:
            m.forward = lambda x, mod=m: nvfp4_linear(x, mod.weight, spec)
            self._swapped.append((m, "forward"))

    def teardown(self, trainer, pl_module, stage: str) -> None:
        for module, attr in self._swapped:
            module.__dict__.pop(attr, None)
        self._swapped = []

