"""What MoEFoldStrategy builds around the user's optimizer at setup: the gradient sync, and either fp32 main params
(``main_params.py``) or the sharded optimizer (``sharded_optimizer.py``: distributed optimizer, precision-aware
state, CPU offload)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lightning_moe.strategy.fused_adam import FusedAdamStep, why_not_fusable
from lightning_moe.strategy.grad_sync import GradSync
from lightning_moe.strategy.main_params import MainParams, has_low_precision_params
from lightning_moe.strategy.optimizer_offload import host_buffer, unregister
from lightning_moe.strategy.optimizer_options import OptimizerOptions
from lightning_moe.strategy.sharded_optimizer import ShardedOptimizer


def check_pinned_memory(device: torch.device, fraction: float) -> None:
    """Offload moves gradients and weights through page-locked host memory: fail at setup, naming the option, where
    it cannot be had."""
    if device.type != "cuda":
        return  # the state is in host memory already; the offloaded part still steps on its own, as on a GPU
    keep: list = []
    try:
        host_buffer(1024, torch.float32, pin=True, keep=keep)
        unregister(keep)
    except (RuntimeError, AttributeError) as e:
        raise RuntimeError(f"MoEFoldStrategy(optimizer_cpu_offload={fraction}) needs pinned host memory for the "
                           f"gradient and weight copies, which this machine cannot provide: {e}") from e


def fuse_steps(optimizers: list, main: Optional[MainParams], asked: Optional[bool], device: torch.device) -> None:
    """``fused_optimizer_writeback``: each optimizer whose step can also write the bf16 weights gets that step
    (``fused_adam.py``); True where one cannot is refused, naming why."""
    if asked is False:
        return
    for opt in optimizers:
        low_of = main.low_of(opt) if main is not None else {}
        why = why_not_fusable(opt, low_of, device)
        if why is None:
            FusedAdamStep(opt, low_of)
            main.written_by_step(low_of)
        elif asked:
            raise ValueError(f"MoEFoldStrategy(fused_optimizer_writeback=True) cannot apply: {why}. Leave it at None "
                             "(on wherever it applies) or set False")


def setup_optimizer_state(module: nn.Module, optimizers: list, ctx, options: OptimizerOptions,
                          device: torch.device, bucket_mb: float, overlap: bool
                          ) -> tuple[GradSync, Optional[MainParams], Optional[ShardedOptimizer]]:
    """Before the optimizer has any state: ``(gradient sync, main params or None, sharded optimizer or None)``."""
    low = has_low_precision_params(optimizers)
    use_main = options.main_params_fp32 if options.main_params_fp32 is not None else low
    options.check_state_dtypes(bf16_main_params=low and not use_main)
    if options.bf16_main_params_asked and not low:
        raise ValueError("MoEFoldStrategy(main_params_dtype='bf16') only applies to bf16 or fp16 weights "
                         "(precision='bf16-true'); this model's optimized weights are fp32")
    if not options.sharded:
        main = MainParams(optimizers) if use_main else None
        fuse_steps(optimizers, main, options.fused_optimizer_writeback, device)
        fuse = options.fuse_wgrad(bool(use_main))
        sync = GradSync(module.parameters(), ctx, bucket_mb, overlap, main_grads=use_main, fuse_wgrad=fuse)
        sync.expert_deferral = options.expert_deferral(fuse)
        return sync, main, None
    if len(optimizers) != 1:
        raise ValueError(f"MoEFoldStrategy's distributed / precision-aware / offloaded optimizer drives one optimizer, "
                         f"got {len(optimizers)}")
    if options.cpu_offload > 0:
        check_pinned_memory(device, options.cpu_offload)
    # flat gradient buffers in the dtype the optimizer steps: fp32 with main params, else the weights' own
    fuse = options.fuse_wgrad(True)
    sync = GradSync(module.parameters(), ctx, bucket_mb, overlap, main_grads=True, shard=options.distributed,
                    grad_dtype=torch.float32 if use_main else None, fuse_wgrad=fuse)
    sync.expert_deferral = options.expert_deferral(fuse)
    sharded = ShardedOptimizer(module, optimizers[0], sync, ctx, options, bool(use_main), device)
    fuse_sharded(sharded, options.fused_optimizer_writeback, device)
    return sync, None, sharded


def fuse_sharded(sharded: ShardedOptimizer, asked: Optional[bool], device: torch.device) -> None:
    """``fused_optimizer_writeback`` for the sharded optimizer: its device slices' step also writes their bf16 weights
    (the host part steps on the CPU as before); True where it cannot apply is refused, naming why."""
    if asked is False:
        return
    low_of = {id(s.tensor): s.weight() for s in sharded.device_slots if not s.is_view}
    why = why_not_fusable(sharded.opt, low_of, device)
    if sharded.state_dtypes:
        why = "the moments are kept in bf16 (exp_avg_dtype / exp_avg_sq_dtype): they are stepped in fp32 copies"
    elif not sharded.device_slots:
        why = "the whole optimizer is on the host (optimizer_cpu_offload=1.0)"
    if why is None:
        sharded.fuse_writeback = True
    elif asked:
        raise ValueError(f"MoEFoldStrategy(fused_optimizer_writeback=True) cannot apply: {why}. Leave it at None "
                         "(on wherever it applies) or set False")
