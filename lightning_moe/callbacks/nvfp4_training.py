"""NVFP4Training: NVIDIA's NVFP4 training recipe as a callback (``modules/nvfp4.py``, ``nvfp4_linear.py``).

Every dense linear and the experts' grouped GEMMs run their forward, dgrad and wgrad on NVFP4 operands: E2M1 values
with E4M3 scales per 16 elements and an fp32 scale per tensor (per expert), 16 x 16 blocks for weights, a random
Hadamard transform on the wgrad inputs, stochastic rounding of gradients; the last ``bf16_last_layers`` layers (and
the head, the router) stay in their own precision. No GPU here has FP4 tensor cores (Hopper has none; Blackwell's
kernels are not wired in yet): the GEMMs are emulated, quantized then dequantized and multiplied in fp32, which says
what NVFP4 does to the loss, not how fast it runs. It says so once in the log.
"""

from __future__ import annotations

from typing import Sequence

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning_moe.callbacks.gemm_swap import gemms, swap, unswap
from lightning_moe.modules.nvfp4 import BLOCK
from lightning_moe.modules.nvfp4_linear import NVFP4Spec, make_hadamard, nvfp4_grouped_mm, nvfp4_linear

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
        self._swapped: list = []

    def on_fit_start(self, trainer, pl_module) -> None:
        device = trainer.strategy.root_device
        if self.kernels == "real":
            what = (torch.cuda.get_device_name(device) if device.type == "cuda" else device.type)
            fp4 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (10, 0)
            raise ValueError(f"NVFP4Training(kernels='real'): {what} " + (
                "has FP4 tensor cores, but their kernels are not wired in yet" if fp4 else
                "has no FP4 tensor cores (Hopper and older)") + "; use kernels='emulated'")
        total = pl_module.model.cfg.num_layers
        kept = [f"model.layers.{i}." for i in range(total - self.bf16_last_layers, total)]
        spec = NVFP4Spec(make_hadamard(self.seed, device) if self.hadamard else None, self.stochastic)
        targets = list(gemms(pl_module, self.exclude, self.include_head, skip_prefixes=kept))
        problems = [f"{g.name}: {g.K} x {g.N} is not a multiple of NVFP4's {BLOCK} x {BLOCK} weight blocks"
                    for g in targets if g.K % BLOCK or g.N % BLOCK]
        if problems:
            raise ValueError(f"NVFP4Training cannot run these layers: {problems[0]}"
                             + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                             + "; exclude them (exclude=[...])")
        for g in targets:
            swap(g, nvfp4_linear, nvfp4_grouped_mm, spec, self._swapped)
        rank_zero_info(f"NVFP4Training: {len(targets)} GEMMs run EMULATED (quantize, dequantize, fp32 multiply) on "
                       f"{device.type}: no FP4 tensor cores are used; the last {self.bf16_last_layers} layer(s) and "
                       "the head stay in their precision")

    def teardown(self, trainer, pl_module, stage: str) -> None:
        unswap(self._swapped)
