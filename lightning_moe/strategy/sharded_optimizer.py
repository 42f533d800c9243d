"""The distributed optimizer (Megatron's ``--use-distributed-optimizer``, ZeRO-1), its precision-aware state and
optimizer CPU offload, driven by MoEFoldStrategy around the user's own torch optimizer.

``GradSync(shard=True)`` reduce-scatters every gradient bucket, so each rank holds the reduced gradient of its own
slice of each bucket (``flat_shards.py``). Here the optimizer steps only those slices:

* its param groups hold one 1-D tensor per (parameter, owned range), a ``Slot``: a view of the weight itself when the
  optimizer steps the weight's own dtype, else an fp32 main copy of those elements (Megatron's shard main params).
  Its ``.grad`` is the matching slice of the gradient buffer. An optimizer that updates every element on its own
  (SGD, Adam, AdamW, ...) gives what it gives on whole tensors;
* after the step the new weights go into each bucket's flat weight buffer (the parameters are views into it), which
  is all-gathered over the bucket's group asynchronously. A module's forward pre-hook waits only for the buckets up
  to its own weights (Megatron's ``--overlap-param-gather``): the gathers overlap the next forward;
* state may be stored in bf16 (``exp_avg_dtype``, ``exp_avg_sq_dtype``: Megatron's precision-aware optimizer). The
  step upcasts it one bucket at a time, so only one bucket's fp32 state exists at once;
* a fraction of the slots may live on the host (``optimizer_cpu_offload``): their fp32 main weights in pinned
  memory, their state in host memory (it never crosses the bus), stepped by torch's fused CPU kernel. Their gradients
  go to the host and their new weights back on side streams, while the GPU steps the rest;
* the weights of FP8 GEMMs may be all-gathered in FP8 (``gather_fp8``, ``fp8_param_gather.py``: Megatron's
  ``--fp8-param-gather``).

Without the distributed optimizer every rank owns whole buckets (all-reduced): the same code then gives the
precision-aware state and the offload alone. Parameters that got no gradient in a step still step with a zero
gradient, as in Megatron (decay applies).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from lightning_moe.strategy import fp8_param_gather as fp8_gather
from lightning_moe.strategy.comm import all_gather_flat
from lightning_moe.strategy.flat_shards import owned_ranges, split_for_host
from lightning_moe.strategy.fused_adam import fused_step, step_eligible, warn_unfused
from lightning_moe.strategy.grad_sync import GradSync, is_expert_param, is_tp_sharded
from lightning_moe.strategy.main_params import LOW_PRECISION
from lightning_moe.strategy.optimizer_offload import HostCopies
from lightning_moe.strategy.optimizer_options import CPU_FUSED, OptimizerOptions


@dataclass
class Slot:
    """Elements ``[lo, hi)`` of ``param`` (flattened) as one tensor of the optimizer."""
    param: nn.Parameter
    name: str
    lo: int
    hi: int
    bucket: int  # position in ShardedOptimizer.buckets (forward order)
    grad: torch.Tensor  # the reduced gradient, a slice of the bucket's gradient buffer (device)
    tensor: torch.Tensor  # what the optimizer steps
    group: int  # its param group
    is_view: bool = True  # ``tensor`` is the weight's own memory (device, same dtype)
    host: bool = False
    host_grad: Optional[torch.Tensor] = None  # pinned, for host slots
    staging: Optional[torch.Tensor] = None  # pinned weights in the model's dtype, for host slots of bf16 weights
    norm_group: Optional[str] = None  # the group over which its squared gradient norm is summed ("": excluded)

    def weight(self) -> torch.Tensor:
        return self.param.detach().view(-1)[self.lo:self.hi]


@dataclass
class _Bucket:
    sync: object  # the GradSync bucket
    gather: bool  # its weights are all-gathered after each step
    weights: Optional[torch.Tensor] = None  # flat weight buffer (gathered buckets)
    has_host: bool = False
    pending: list = field(default_factory=list)  # work handles or CUDA events the next forward waits for
    fp8: Optional[fp8_gather.BucketPlan] = None  # its FP8 weights travel in FP8 (gather_fp8)


def _step_hooks(opt: torch.optim.Optimizer, pre: bool):
    """The step hooks torch runs around ``Optimizer.step`` (global and this optimizer's), in torch's order; None where
    this torch keeps them elsewhere."""
    from torch.optim import optimizer as torch_optimizer
    glob = getattr(torch_optimizer, "_global_optimizer_pre_hooks" if pre else "_global_optimizer_post_hooks", None)
    own = getattr(opt, "_optimizer_step_pre_hooks" if pre else "_optimizer_step_post_hooks", None)
    if glob is None or own is None:
        return None
    return [*glob.values(), *own.values()] if pre else [*own.values(), *glob.values()]


class ShardedOptimizer:
    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, grad_sync: GradSync, ctx,
                 options: OptimizerOptions, main_fp32: bool, device: torch.device):
        options.check_optimizer(optimizer)
        if any(optimizer.state.values()):
            raise RuntimeError("ShardedOptimizer: the optimizer already has state; shard it before the first step")
        self.opt, self.grad_sync, self.ctx, self.options, self.device = optimizer, grad_sync, ctx, options, device
        self.main_fp32 = main_fp32
        self.state_dtypes = options.state_dtypes()
        self.cuda = device.type == "cuda"
        names = {id(p): n for n, p in module.named_parameters()}
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self._in_optimizer = set(group_of)
        order = {id(p): i for i, p in enumerate(grad_sync.params)}
        # forward order: the bucket whose first parameter comes first in the model runs first
        syncs = sorted(grad_sync.buckets(), key=lambda b: min(order[id(p)] for p in b.params))
        self.buckets = [_Bucket(b, gather=grad_sync.shard and b.reduce) for b in syncs]
        for bk in self.buckets:
            if bk.gather:
                bk.weights = self._flatten_weights(bk.sync)
        # the owned ranges of optimized parameters; the last ones in forward order go to the host first
        owned = [(i, r) for i, bk in enumerate(self.buckets)
                 for r in owned_ranges(bk.sync.offsets, [p.numel() for p in bk.sync.params], *bk.sync.owned)
                 if id(bk.sync.params[r.index]) in group_of]
        split = split_for_host([r.numel for _, r in reversed(owned)], options.cpu_offload)[::-1]
        self.slots: list[Slot] = []
        for (i, r), (n_dev, n_host) in zip(owned, split):
            p = self.buckets[i].sync.params[r.index]
            parts = [(r.lo, r.lo + n_dev, False), (r.lo + n_dev, r.hi, True)]
            for lo, hi, host in parts:
                if lo < hi:
                    grad = self.buckets[i].sync.buffer[r.buf_lo + lo - r.lo:r.buf_lo + hi - r.lo]
                    self.slots.append(Slot(p, names[id(p)], lo, hi, i, grad, grad, group_of[id(p)], host=host,
                                           norm_group=self._norm_group(p, self.buckets[i].sync.group_name)))
                    self.buckets[i].has_host |= host
        self._make_tensors()
        for gi, g in enumerate(optimizer.param_groups):
            g["params"] = [s.tensor for s in self.slots if s.group == gi]
        self.device_slots = [s for s in self.slots if not s.host]
        self.host_slots = [s for s in self.slots if s.host]
        self._orig_step = optimizer.step
        raw = getattr(type(optimizer).step, "__wrapped__", None)  # torch's step without its hook wrapper
        # the step runs in parts (device, host, one bucket at a time): its hooks are run once around them, by us
        self._hooks_outside = raw is not None and _step_hooks(optimizer, True) is not None
        self._raw_step = (lambda: raw(optimizer)) if self._hooks_outside else self._orig_step

        def step(closure=None):
            return self._step_with_closure(closure)

        if hasattr(self._orig_step, "_wrapped_by_lr_sched"):  # torch's LR schedulers check that their patch stays
            step._wrapped_by_lr_sched = True
        optimizer.step = step
        # fused_optimizer_writeback: the device slots' step also writes their bf16 weights (fused_adam.py); set by
        # optimizer_setup where it applies
        self.fuse_writeback, self._written, self._warned = False, set(), False
        self.fp8_amaxes: Optional[fp8_gather.WeightAmaxes] = None  # set by gather_fp8
        self._next = 0  # the first bucket the next forward may still have to wait for
        self._hooks = self._register_waits(module) if any(b.gather or b.has_host for b in self.buckets) else []

    # ------------------------------------------------------------------ setup
    @torch.no_grad()
    def _flatten_weights(self, b) -> torch.Tensor:
        """One flat buffer per gathered bucket, laid out like its gradient buffer; the parameters become views."""
        flat = torch.zeros(b.buffer.numel(), dtype=b.params[0].dtype, device=b.params[0].device)
        for p, off in zip(b.params, b.offsets):
            view = flat[off:off + p.numel()].view_as(p)
            view.copy_(p.detach())
            p.data = view
        return flat

    def _norm_group(self, p, bucket_group: str) -> str:
        """The group over which this slot's squared gradient norm is summed so that each distinct element counts
        once: owned slices differ across the bucket's group (sharded); TP shards across tp; experts across etp x ep.
        ``""``: excluded (the last pipeline stage's copy of a tied embedding)."""
        if getattr(p, "pp_tied_copy", False):
            return ""
        if not self.grad_sync.shard or self.ctx.size(bucket_group) == 1:
            return "etp_ep" if is_expert_param(p) else "tp" if is_tp_sharded(p, self.ctx) else "local"
        if bucket_group == "dp_cp" and not is_tp_sharded(p, self.ctx):
            return "dp_cp"  # replicated over tp
        return "tp_dp_cp"  # the whole pipeline stage: dp_cp x tp, or edp x etp x ep for experts

    @torch.no_grad()
    def _make_tensors(self) -> None:
        for s in self.slots:
            main = torch.float32 if s.param.dtype in LOW_PRECISION and self.main_fp32 else s.param.dtype
            if s.grad.dtype != main:
                raise RuntimeError(f"ShardedOptimizer: gradient buffer dtype {s.grad.dtype} != stepped dtype {main}")
            if not s.host:
                s.is_view = main == s.param.dtype
                s.tensor = s.weight() if s.is_view else s.weight().to(main)
        self.host = HostCopies([s for s in self.slots if s.host], self.device)

    def _register_waits(self, module: nn.Module) -> list:
        where = {id(p): i for i, bk in enumerate(self.buckets) for p in bk.sync.params}
        hooks = []
        for m in module.modules():
            mine = [where[id(p)] for p in m.parameters(recurse=False) if id(p) in where]
            if mine:
                last = max(mine)
                hooks.append(m.register_forward_pre_hook(lambda _m, _a, last=last: self.wait_until(last)))
        return hooks

    # ------------------------------------------------------------------ the step
    def attach_grads(self) -> None:
        """After the gradient sync: the device slots see their reduced gradients (for hooks and clipping); host slots
        get theirs in ``step`` once copied."""
        for s in self.slots:
            s.tensor.grad = None if s.host else s.grad

    def _step_with_closure(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step()
        return loss

    @torch.no_grad()
    def step(self) -> None:
        if not self.grad_sync.had_main_grad:  # no backward ran in this step (e.g. training_step returned None)
            return
        self.wait_all()  # a bucket no forward waited for (weights used outside their module): before rewriting it
        self._weights_change()
        opt = self.opt
        with torch.autograd.profiler.record_function(f"Optimizer.step#{type(opt).__name__}.step"):
            # the optimizer's step hooks run once around all the partial steps below, as around one step
            for hook in _step_hooks(opt, pre=True) if self._hooks_outside else ():
                hook(opt, (opt,), {})
            self.host.grads_out()  # after clipping, the compute stream's last work on the gradients
            self._written = set()
            self._run(self.device_slots, host=False)
            sep = [s for s in self.device_slots if not s.is_view and id(s.tensor) not in self._written]
            if sep:
                torch._foreach_copy_([s.weight() for s in sep], [s.tensor for s in sep])
            if self.host_slots:
                self.host.wait_grads()
                self._run(self.host_slots, host=True)
                self.host.weights_in()
            opt._opt_called = True  # what the LR scheduler's wrapper of the step records
            for hook in _step_hooks(opt, pre=False) if self._hooks_outside else ():
                hook(opt, (opt,), {})
        self._publish()

    def _run(self, slots: list[Slot], host: bool) -> None:
        """The user's optimizer step over ``slots`` only (its param groups swapped for theirs), one bucket at a time
        when state is kept in another dtype."""
        if not slots:
            return
        groups = self.opt.param_groups
        saved = [(g["params"], g.get("fused"), g.get("foreach")) for g in groups]
        chunks = [slots]
        if self.state_dtypes:
            by_bucket: dict[int, list[Slot]] = {}
            for s in slots:
                by_bucket.setdefault(s.bucket, []).append(s)
            chunks = list(by_bucket.values())
        try:
            for g in groups:
                if host and isinstance(self.opt, CPU_FUSED):  # torch's fused CPU kernels
                    g["fused"], g["foreach"] = True, False
                elif host and "foreach" in g:
                    g["foreach"] = False
            for chunk in chunks:
                for gi, g in enumerate(groups):
                    g["params"] = [s.tensor for s in chunk if s.group == gi]
                stash = self._upcast(chunk)
                if not (self.fuse_writeback and not host and self._fused(chunk)):
                    self._raw_step()
                self._downcast(chunk, stash)
        finally:
            for g, (params, fused, foreach) in zip(groups, saved):
                g["params"] = params
                for k, v in (("fused", fused), ("foreach", foreach)):
                    if k in g:
                        g[k] = v

    def _fused(self, chunk: list[Slot]) -> bool:
        """Step ``chunk`` (in the param groups now) with the fused kernel, writing the bf16 weights of the slots with
        an fp32 copy; False where its tensors do not suit the kernel (torch's step then runs, and the copy)."""
        low_of = {id(s.tensor): s.weight() for s in chunk if not s.is_view}
        why = step_eligible(self.opt, low_of)
        if why is not None:
            if not self._warned:
                warn_unfused(self.opt, why)
                self._warned = True
            return False
        fused_step(self.opt, low_of)
        self._written.update(low_of)
        return True

    def _upcast(self, chunk: list[Slot]) -> list:
        stash = []
        for s in chunk:
            st = self.opt.state.get(s.tensor)
            for k in self.state_dtypes if st else ():
                v = st.get(k)
                if isinstance(v, torch.Tensor) and v.dtype != s.tensor.dtype:
                    stash.append((st, k, v))
                    st[k] = v.to(s.tensor.dtype)
        return stash

    def _downcast(self, chunk: list[Slot], stash: list) -> None:
        for st, k, low in stash:  # round to nearest into the stored state
            low.copy_(st[k])
            st[k] = low
        for s in chunk:  # state the optimizer just created in the stepped dtype
            st = self.opt.state.get(s.tensor)
            for k, dtype in self.state_dtypes.items() if st else ():
                v = st.get(k)
                if isinstance(v, torch.Tensor) and v.dtype != dtype:
                    st[k] = v.to(dtype)

    # ------------------------------------------------------------------ the weights after the step
    def _publish(self) -> None:
        """Start each bucket's all-gather (or note its host copies), in forward order."""
        fp8 = [bk for bk in self.buckets if bk.gather and bk.fp8 is not None]
        # the FP8 buckets on one stream: the offload side stream if any of them has host slots (their weights arrive
        # there), whose amaxes are reduced for all of them before the first gather starts
        fp8_side = self.host.stream if any(bk.has_host for bk in fp8) else None
        if fp8:
            with torch.cuda.stream(fp8_side) if fp8_side is not None else nullcontext():
                fp8_gather.reduce_amaxes([bk.fp8 for bk in fp8], [bk.weights for bk in fp8],
                                         [self.ctx.rank(bk.sync.group_name) for bk in fp8])
        for bk in self.buckets:
            side = fp8_side if bk.gather and bk.fp8 is not None else self.host.stream if bk.has_host else None
            if bk.gather:
                lo, hi = bk.sync.owned
                name = bk.sync.group_name
                with torch.cuda.stream(side) if side is not None else nullcontext():
                    if bk.fp8 is not None:
                        bk.pending.append(fp8_gather.start(bk.fp8, bk.weights, self.ctx.rank(name),
                                                           self.ctx.size(name)))
                    else:
                        bk.pending.append(all_gather_flat(bk.weights, bk.weights[lo:hi], self.ctx.group(name)))
            elif side is not None:
                bk.pending.append(self.host.weights_done)
        self._next = 0
        if not self.options.overlap_param_gather:
            self.wait_all()

    def wait_until(self, last: int) -> None:
        """Make the current stream wait for every bucket up to position ``last`` (a module's forward pre-hook)."""
        while self._next <= last:
            bk = self.buckets[self._next]
            for w in bk.pending:
                if isinstance(w, torch.cuda.Event):
                    torch.cuda.current_stream(self.device).wait_event(w)
                else:
                    w.wait()
            bk.pending.clear()
            if bk.fp8 is not None and bk.fp8.out is not None:
                fp8_gather.finish(bk.fp8, bk.weights, self.fp8_amaxes)
            self._next += 1

    def wait_all(self) -> None:
        self.wait_until(len(self.buckets) - 1)

    # ------------------------------------------------------------------ FP8 parameter all-gather
    def gather_fp8(self, weights: list, amaxes: fp8_gather.WeightAmaxes) -> int:
        """All-gather ``weights`` (``fp8_param_gather.FP8Weight``) in FP8 from the next step on, wherever their
        bucket is all-gathered; their amaxes go to ``amaxes``. Returns how many are. Needs main params: the model's
        weights then hold FP8 values between steps."""
        if not self.main_fp32 or not self.grad_sync.shard:
            raise ValueError("the FP8 parameter all-gather needs the distributed optimizer with fp32 main params")
        # only weights with a main copy: the dequantized values must not overwrite what the optimizer steps
        by_id = {id(w.param): w for w in weights if id(w.param) in self._in_optimizer
                 and w.param.dtype in LOW_PRECISION}
        count = 0
        for bk in self.buckets:
            b = bk.sync
            fp8 = {i: by_id[id(p)] for i, p in enumerate(b.params) if id(p) in by_id}
            if bk.gather and fp8:
                bk.fp8 = fp8_gather.plan_bucket(b.params, b.offsets, b.buffer.numel(), self.ctx.size(b.group_name),
                                                fp8, bk.weights.element_size(), self.ctx.group(b.group_name))
                count += len(fp8)
        self.fp8_amaxes = amaxes
        return count

    def fp8_gathering(self) -> bool:
        """Whether some bucket's weights travel (and so are held) in FP8 now."""
        return any(bk.fp8 is not None for bk in self.buckets)

    def _weights_change(self) -> None:
        """The weights are about to be rewritten: the published FP8 amaxes no longer describe them."""
        if self.fp8_amaxes is not None:
            self.fp8_amaxes.clear()

    @torch.no_grad()
    def restore_weights(self) -> None:
        """End of training with the FP8 parameter all-gather: the model's weights back from the main params (their
        bf16 rounding, as without it), gathered in bf16; the FP8 gather is off from here on."""
        plans = [bk for bk in self.buckets if bk.fp8 is not None]
        if not plans:
            return
        self.wait_all()
        self._weights_change()
        for s in self.slots:
            if not s.is_view and self.buckets[s.bucket].fp8 is not None:
                w = s.weight()
                w.copy_(s.tensor.to(w.device))
        for bk in plans:
            bk.fp8 = None
            lo, hi = bk.sync.owned
            all_gather_flat(bk.weights, bk.weights[lo:hi], self.ctx.group(bk.sync.group_name)).wait()

    # ------------------------------------------------------------------ clipping
    @torch.no_grad()
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The global gradient norm over every distinct element, from the reduced gradients (each owned once)."""
        inf = math.isinf(norm_type)
        names = ["local", "tp", "etp_ep", "dp_cp", "tp_dp_cp"]
        parts = {n: [s.grad for s in self.slots if s.norm_group == n] for n in names}
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        total = zero.clone()
        for n in names:  # the same collectives on every rank, in the same order (empty parts join with zero)
            gs = parts[n]
            local = zero.clone()
            if gs:
                norms = torch.stack(torch._foreach_norm(gs, norm_type, dtype=torch.float32))
                local = norms.max() if inf else norms.pow(norm_type).sum()
            if n != "local":
                local = self.ctx.all_reduce_(local, n, op=torch.distributed.ReduceOp.MAX if inf else
                                             torch.distributed.ReduceOp.SUM)
            total = torch.maximum(total, local) if inf else total + local
        total = self.ctx.all_reduce_(total, "pp", op=torch.distributed.ReduceOp.MAX if inf else
                                     torch.distributed.ReduceOp.SUM)
        return total if inf else total.pow(1.0 / norm_type)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the owned gradients so that the global norm is at most ``max_norm``. No host sync."""
        total = self.grad_norm(norm_type)
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        owned = [bk.sync.buffer[bk.sync.owned[0]:bk.sync.owned[1]] for bk in self.buckets]
        for dtype in {t.dtype for t in owned}:
            torch._foreach_mul_([t for t in owned if t.dtype == dtype], coef.to(dtype))
        return total

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        for bk in self.buckets:
            bk.sync.buffer[bk.sync.owned[0]:bk.sync.owned[1]].clamp_(-clip_value, clip_value)

    # ------------------------------------------------------------------ main weights and checkpoints
    def main_weight_slots(self) -> list[Slot]:
        """The slots whose main copy is more precise than the model's weight: checkpoints store those values."""
        return [s for s in self.slots if s.tensor.dtype != s.param.dtype]

    def main_weight_names(self, module: nn.Module) -> set[str]:
        """Every parameter whose checkpoint values come from main copies (on whichever rank owns them)."""
        stepped = {id(p) for bk in self.buckets for p in bk.sync.params}  # in the optimizer and trained
        return {n for n, p in module.named_parameters()
                if p.dtype in LOW_PRECISION and self.main_fp32 and id(p) in self._in_optimizer and id(p) in stepped}

    def load_templates(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """fp32 tensors to load the checkpoint's values of ``main_weight_names`` into (whole, local shapes)."""
        names = self.main_weight_names(module)
        return {n: p.detach().float().cpu() for n, p in module.named_parameters() if n in names}

    @torch.no_grad()
    def load_from_state_dict(self, module: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        """Set every main copy from a checkpoint's (fp32) values."""
        self.wait_all()  # a gather still in flight must not land on the loaded weights
        self._weights_change()
        for s in self.slots:
            if s.is_view:
                continue
            src = state_dict.get(s.name)
            src = src.detach().reshape(-1)[s.lo:s.hi] if src is not None else s.weight()
            s.tensor.copy_(src.to(s.tensor.device))

    @torch.no_grad()
    def sync_from_model(self) -> None:
        """Adopt model weights written since the main copies were made (a callback, a loaded state dict); keep the
        main bits where they still round to the model's weight."""
        self.wait_all()
        self._weights_change()
        for s in self.slots:
            if s.is_view:
                continue
            w = s.weight().to(s.tensor.device)
            s.tensor.copy_(torch.where(s.tensor.to(w.dtype) == w, s.tensor, w.to(s.tensor.dtype)))

    @torch.no_grad()
    def load_state(self, state_dict: dict) -> None:
        """The optimizer's ``state_dict`` back, each state tensor going straight to its slot's device and stored dtype
        (``Optimizer.load_state_dict`` would cast it to the stepped dtype on the slot's device, and Lightning then
        moves all of it to the GPU: a full fp32 copy of the state on the GPU at resume, what offload avoids)."""
        self.opt.load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})  # groups, checked
        order = [(t, bool(g.get("fused"))) for g in self.opt.param_groups for t in g["params"]]
        for idx, st in state_dict["state"].items():
            t, fused = order[int(idx)]
            self.opt.state[t] = {k: (v.to(device=t.device, dtype=self.state_dtypes.get(k, t.dtype))
                                     if isinstance(v, torch.Tensor) and v.ndim > 0
                                     else v.to(device=t.device, dtype=torch.float32) if k == "step" and fused
                                     and isinstance(v, torch.Tensor) else v)
                                 for k, v in st.items()}

    @torch.no_grad()
    def release(self) -> None:
        """End of training: hooks off and the optimizer's own step back; the optimizer's tensors and state move to the
        host (as Lightning moves a plain optimizer's state), gradient views and flat weight buffers are dropped, and
        the host buffers are unpinned, so that nothing of it holds GPU or page-locked memory after ``fit``."""
        self.wait_all()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.opt.step = self._orig_step
        cpu = torch.device("cpu")
        for s in self.slots:
            s.tensor.grad = None
            s.grad = None
            if s.tensor.device != cpu:  # a view of the weights or a device main copy: an own host copy now
                s.tensor.data = s.tensor.data.to(cpu)
        for bk in self.buckets:
            bk.weights, bk.pending = None, []
        self.host.release()

    # ------------------------------------------------------------------ whole tensors (tests, debugging)
    @torch.no_grad()
    def full_grads(self) -> dict[int, torch.Tensor]:
        """``{id(param): reduced gradient}`` of every parameter, gathered over the owners (collective)."""
        return self._gather(grads=True)

    @torch.no_grad()
    def full_main_params(self) -> dict[int, torch.Tensor]:
        """``{id(param): main weight}`` (fp32 where kept), gathered over the owners (collective)."""
        return self._gather(grads=False)

    def _gather(self, grads: bool) -> dict[int, torch.Tensor]:
        self.wait_all()
        out = {}
        for i, bk in enumerate(self.buckets):
            b = bk.sync
            if grads:
                flat = b.buffer.clone()
            else:
                # the same dtype on every rank of the group (a rank may own no slot of the bucket)
                dtype = torch.float32 if self.main_fp32 and b.params[0].dtype in LOW_PRECISION else b.params[0].dtype
                flat = torch.zeros(b.buffer.numel(), dtype=dtype, device=b.buffer.device)
                for p, off in zip(b.params, b.offsets):
                    flat[off:off + p.numel()] = p.detach().reshape(-1)
                start = {id(p): off for p, off in zip(b.params, b.offsets)}
                for s in self.slots:
                    if s.bucket == i and not s.is_view:
                        at = start[id(s.param)]
                        flat[at + s.lo:at + s.hi] = s.tensor.to(flat.device, flat.dtype)
            if self.grad_sync.shard and b.reduce:
                lo, hi = b.owned
                all_gather_flat(flat, flat[lo:hi].clone(), self.ctx.group(b.group_name)).wait()
            for p, off in zip(b.params, b.offsets):
                out[id(p)] = flat[off:off + p.numel()].view_as(p).clone()
        return out
