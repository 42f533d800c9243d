"""MoEFoldStrategy's side of the optimizer: the gradient sync and fp32 main params or the sharded optimizer
(``optimizer_setup.py``) wired into Lightning's step, clipping, zero_grad, checkpoint and teardown hooks. A mixin of
``MoEFoldStrategy``, which holds the state it uses (``_grad_sync``, ``_main_params``, ``_sharded``, the layout)."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
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

    def on_train_end(self) -> None:
        self._check_router_flags(wait=True)  # a non-finite step at the very end still fails the run
        if self._sharded is not None:  # after the FP8 parameter all-gather: the full weights back in the model
            self._sharded.restore_weights()
        super().on_train_end()

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
            # every micro-batch of the step ran; the expert bias update (next, in on_before_optimizer_step) resets
            # the routers' flags, so take them now
            self._router_flags = self._take_router_flags()
            if self.skip_nonfinite_steps is None:
                self._check_router_flags()
            else:  # a skipped step must not move the expert biases either: keep them to put back
                self._biases_before = [(m.expert_bias, m.expert_bias.clone()) for _, m in self._routers()
                                       if getattr(m, "expert_bias", None) is not None]
            return out

        if self.skip_nonfinite_steps is None:
            out = super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)
        else:
            out = self._guarded_step(optimizer, closure_then_sync, model, **kwargs)
        if self._main_params is not None:
            self._main_params.copy_to_model()
        routers = self._routers()
        if routers:  # also for modules that never call TopKRouter.update_expert_bias
            torch._foreach_zero_([m.nonfinite_logits for _, m in routers])
        return out

    # ------------------------------------------------------------------ non-finite router logits
    def _routers(self) -> list:
        """(name, module) of every router that counts its non-finite logits (TopKRouter.nonfinite_logits)."""
        if self._router_modules is None:
            self._router_modules = [(n, m) for n, m in self.lightning_module.named_modules()
                                    if isinstance(getattr(m, "nonfinite_logits", None), torch.Tensor)]
        return self._router_modules

    def _take_router_flags(self) -> Optional[torch.Tensor]:
        routers = self._routers()
        return torch.stack([m.nonfinite_logits for _, m in routers]) if routers else None

    def _router_names(self, flags: torch.Tensor, agree: bool) -> str:
        """The routers whose flag is set, with their ranks (gathered from every rank when ``agree``): the failure path
        only, so its host syncs and object collective cost nothing in training."""
        mine = [(name, self.global_rank) for (name, _), bad in zip(self._routers(), flags.tolist()) if bad]
        if agree and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            mine = [x for part in every for x in part]
        ranks: dict[str, list[int]] = {}
        for name, rank in mine:
            ranks.setdefault(name, []).append(rank)
        return ", ".join(f"{name} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, sorted(r)))})"
                         for name, r in sorted(ranks.items()))

    def _check_router_flags(self, wait: bool = False) -> None:
        """Without skip_nonfinite_steps: stop the run on a step whose router logits held a NaN or an infinity.

        On the CPU the flags are read at once, before the optimizer step. On CUDA, reading them would make the host
        wait for the GPU once per step (the strategy syncs only with the guard on, whose check takes the flags), so
        they go to pinned host memory without blocking and are read once the copy has landed, usually one step
        later; ``wait`` reads everything pending (before a checkpoint is written, and at the end of training). The
        expert bias never takes such a step either way (TopKRouter.update_expert_bias decides on the device)."""
        flags, self._router_flags = self._router_flags, None
        if flags is not None:
            step = self.lightning_module.global_step
            if flags.device.type != "cuda":
                if bool(flags.any()):
                    raise self._router_error(flags, step, "before its optimizer step")
            else:
                host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
                host.copy_(flags, non_blocking=True)
                landed = torch.cuda.Event()
                landed.record()
                self._router_pending.append((step, host, landed))
        while self._router_pending and (wait or self._router_pending[0][2].query()):
            step, host, landed = self._router_pending.pop(0)
            landed.synchronize()
            if bool(host.any()):
                self._router_pending.clear()
                raise self._router_error(host, step, f"{self.lightning_module.global_step - step} step(s) later "
                                                     "(read without stalling the GPU: the weights took those steps)")

    def _router_error(self, flags: torch.Tensor, step: int, when: str) -> RuntimeError:
        names = self._router_names(flags, agree=False)
        return RuntimeError(f"MoEFoldStrategy: the router logits of {names} held a NaN or an infinity at step {step}, "
                            f"stopping {when}; the expert bias kept its value. Look "
                            "for what made that layer's input non-finite (learning rate, a loss spike, the data), or "
                            "set MoEFoldStrategy(skip_nonfinite_steps=N) to skip such steps")

    def _guarded_step(self, optimizer, closure: Callable[[], Any], model, **kwargs: Any) -> Any:
        """``skip_nonfinite_steps``: the optimizer steps only when the global gradient norm is finite and no router's
        logits held a NaN or an infinity (Megatron's --check-for-nan-in-loss-and-grad, skipping rather than failing);
        a skipped step leaves the weights, the optimizer state and the expert biases as they were. N skips in a row
        stop the run."""
        own = vars(optimizer).get("step")
        real_step = optimizer.step
        self._biases_before = []

        def guarded(closure=None, **kw):
            loss = closure()  # forward, backward, gradient sync and clipping (which records the norm)
            norm = self._last_grad_norm if self._last_grad_norm is not None else self._grad_norm(optimizer)
            self._last_grad_norm = None
            flags, self._router_flags = self._router_flags, None
            if flags is None:
                norm_bad, router_bad = not bool(torch.isfinite(norm)), 0.0  # one host sync per step, guard on only
            else:
                # the router flags join the decision, agreed by every rank: the logits may be non-finite on one rank
                # only, and logits that overflow to infinity under sigmoid scoring can leave the gradients finite
                verdict = torch.stack([torch.isfinite(norm).logical_not().float().reshape(()),
                                       flags.sum().to(torch.float32)])
                if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                    dist.all_reduce(verdict)
                norm_bad, router_bad = verdict.tolist()  # the same single host sync per step
            if not norm_bad and not router_bad:
                self._nonfinite_in_a_row = 0
                return real_step(closure=lambda: loss, **kw)
            for bias, before in self._biases_before:  # the bias update ran (on_before_optimizer_step): undo it
                bias.copy_(before)
            self._nonfinite_in_a_row += 1
            self.skipped_steps += 1
            why = f"its gradient norm is {float(norm)}"
            if router_bad:
                why = f"the router logits of {self._router_names(flags, agree=True)} held a NaN or an infinity; {why}"
            rank_zero_warn(f"MoEFoldStrategy: step {self.lightning_module.global_step} skipped, {why} "
                           f"({self._nonfinite_in_a_row} in a row, {self.skipped_steps} in all)")
            if self._nonfinite_in_a_row >= self.skip_nonfinite_steps:
                raise RuntimeError(f"MoEFoldStrategy(skip_nonfinite_steps={self.skip_nonfinite_steps}): "
                                   f"{self._nonfinite_in_a_row} optimizer steps in a row had a non-finite gradient "
                                   "norm or router logits; stopping (the weights are those of the last finite step, "
                                   "and the last checkpoint is intact)")
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
            if self._sharded.fp8_gathering():  # training did not end normally: no collective may be safe now
                rank_zero_warn("FP8Training(fp8_param_gather=True): training ended early, so the model's weights "
                               "still hold their FP8 values; the checkpoints hold the full ones (the main params)")
            self._sharded.release()
        if self._grad_sync is not None:
            self._grad_sync.release()
            self._grad_sync = None
        if self._main_params is not None:  # as Lightning moves the optimizer state: free the GPU
            self._main_params.to(torch.device("cpu"))
