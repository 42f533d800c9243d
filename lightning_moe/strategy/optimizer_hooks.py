"""MoEFoldStrategy's side of the optimizer: the gradient sync and fp32 main params or the sharded optimizer
(``optimizer_setup.py``) wired into Lightning's step, clipping, zero_grad, checkpoint and teardown hooks. A mixin of
``MoEFoldStrategy``, which holds the state it uses (``_grad_sync``, ``_main_params``, ``_sharded``, the layout)."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional, Union

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_moe.strategy.grad_sync import clip_grad_norm_global_, global_grad_norm
from lightning_moe.strategy.optimizer_setup import setup_optimizer_state
from lightning_moe.strategy.sharded_optimizer import ShardedOptimizer


class OptimizerHooks:
    def _setup_optimizer_state(self) -> None:
        # main params / optimizer slices replace the optimizer's params: before the optimizer has any state
        self._grad_sync, self._main_params, self._sharded = setup_optimizer_state(
            self.lightning_module, self.optimizers, self.parallel_context, self.optimizer_options,
            self.root_device, self.bucket_size_mb, self.overlap_grad_sync)
        if self._grad_sync.main_grads or self.pp > 1 or self.num_microbatches > 1:
            # zero_grad must also drop the fp32 main grads accumulated so far; pipeline schedules zero before
            # their backwards and skip Lightning's zero_grad, which comes after training_step
            for opt in self.optimizers:
                opt.zero_grad = partial(self._zero_grad, opt.zero_grad)

    def _setup_clipping(self) -> None:
        # global-norm clipping: every parameter counted once across the EP/ETP and DP groups
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm
        if self._sharded is not None:  # the optimizer's tensors are slices: clip the reduced gradient buffers
            self.precision_plugin.clip_grad_by_value = lambda optimizer, clip_val: self._sharded.clip_grad_value_(
                float(clip_val))
        if getattr(self.precision_plugin, "scaler", "absent") is None:
            # bf16 autocast has no grad scaler, so Lightning's refusal to clip with fused optimizers (which unscale
            # fp16 grads internally) does not apply: clip with the base implementation
            self.precision_plugin.clip_gradients = partial(Precision.clip_gradients, self.precision_plugin)

    @property
    def sharded_optimizer(self) -> Optional[ShardedOptimizer]:
        """The distributed / precision-aware / offloaded optimizer driving the user's optimizer (None when off)."""
        return self._sharded

    def _zero_grad(self, zero_grad: Callable, *args, **kwargs):
        if self._skip_zero_grad:  # this step's pipeline schedule zeroed before its backwards
            self._skip_zero_grad = False
            return None
        if self._grad_sync is not None:
            self._grad_sync.discard()
        return zero_grad(*args, **kwargs)

    def on_train_start(self) -> None:
        # after checkpoint restore and the user's/callbacks' on_train_start: weights they wrote into the bf16 model
        # must not be overwritten by stale main copies at the first step
        if self._main_params is not None:
            self._main_params.sync_from_model()
        if self._sharded is not None:
            self._sharded.sync_from_model()

    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        grad_sync = self._grad_sync

        def closure_then_sync():
            # the closure runs the last micro-batch's forward+backward; buckets launch while backward runs
            if grad_sync is not None:
                grad_sync.arm()
            out = closure()
            if grad_sync is not None:
                grad_sync.finish()
                if self._sharded is not None:
                    self._sharded.attach_grads()
                elif self._main_params is not None:
                    self._main_params.attach_grads(grad_sync.had_main_grad)
            return out

        if self.skip_nonfinite_steps is None:
            out = super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)
        else:
            out = self._guarded_step(optimizer, closure_then_sync, model, **kwargs)
        if self._main_params is not None:
            self._main_params.copy_to_model()
        return out

    def _guarded_step(self, optimizer, closure: Callable[[], Any], model, **kwargs: Any) -> Any:
        """``skip_nonfinite_steps``: the optimizer steps only when the global gradient norm is finite (Megatron's
        --check-for-nan-in-loss-and-grad, skipping rather than failing); N skips in a row stop the run."""
        own = vars(optimizer).get("step")
        real_step = optimizer.step

        def guarded(closure=None, **kw):
            loss = closure()  # forward, backward, gradient sync and clipping (which records the norm)
            norm = self._last_grad_norm if self._last_grad_norm is not None else self._grad_norm(optimizer)
            self._last_grad_norm = None
            if bool(torch.isfinite(norm)):  # one host sync per step, only with the guard on
                self._nonfinite_in_a_row = 0
                return real_step(closure=lambda: loss, **kw)
            self._nonfinite_in_a_row += 1
            self.skipped_steps += 1
            rank_zero_warn(f"MoEFoldStrategy: step {self.lightning_module.global_step} skipped, its gradient norm is "
                           f"{float(norm)} ({self._nonfinite_in_a_row} in a row, {self.skipped_steps} in all)")
            if self._nonfinite_in_a_row >= self.skip_nonfinite_steps:
                raise RuntimeError(f"MoEFoldStrategy(skip_nonfinite_steps={self.skip_nonfinite_steps}): "
                                   f"{self._nonfinite_in_a_row} optimizer steps in a row had a non-finite gradient "
                                   "norm; stopping (the weights are those of the last finite step, and the last "
                                   "checkpoint is intact)")
            return loss

        optimizer.step = guarded
        try:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            if own is not None:
                optimizer.step = own
            else:
                del optimizer.step

    def _grad_norm(self, optimizer) -> torch.Tensor:
        if self._sharded is not None:
            return self._sharded.grad_norm()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return global_grad_norm(params, self.parallel_context)

    def _clip_grad_by_norm(self, optimizer, clip_val: Union[int, float]) -> None:
        if self._sharded is not None:
            self._last_grad_norm = self._sharded.clip_grad_norm_(float(clip_val))
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self._last_grad_norm = clip_grad_norm_global_(params, float(clip_val), self.parallel_context)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._sharded is not None:  # the weights in flight to the next forward; the fp32 mains are saved as slices
            self._sharded.wait_all()
        state = super().lightning_module_state_dict()
        if self._main_params is not None:  # the fp32 main weights, not their bf16 rounding
            state.update(self._main_params.state_dict_overrides(self.lightning_module))
        return state

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        if self._main_params is not None:
            self._main_params.load_from_state_dict(self.lightning_module, checkpoint["state_dict"])
        if self._sharded is not None:
            self._sharded.load_from_state_dict(self.lightning_module, checkpoint["state_dict"])

    def load_optimizer_state_dict(self, checkpoint) -> None:
        if checkpoint.get("optimizer_states", ()) is None:  # resharded: keep the fresh optimizer state
            return
        if self._sharded is not None:  # each state tensor straight to its slot's device and stored dtype
            for state in checkpoint["optimizer_states"]:
                self._sharded.load_state(state)
            return
        super().load_optimizer_state_dict(checkpoint)

    def _teardown_optimizer_state(self) -> None:
        if self._sharded is not None:
            self._sharded.release()
        if self._grad_sync is not None:
            self._grad_sync.release()
            self._grad_sync = None
        if self._main_params is not None:  # as Lightning moves the optimizer state: free the GPU
            self._main_params.to(torch.device("cpu"))
