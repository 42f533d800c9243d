"""What autograd keeps for backward inside chosen modules: the saved-tensor hooks behind ``Recompute``'s
fine-grained modules and ``ActivationOffload``.

Inside a block that a callback selected, every tensor autograd saves for backward passes ``_pack``:

* an output of a module marked for recomputation (``mark_recompute``), wherever it is saved (by the module itself, as
  attention keeps its output, or by the next op, as a linear keeps its input), is not kept: backward rebuilds it from
  the module's inputs, once, under no_grad (Megatron's ``CheckpointWithoutOutput``, here with
  ``torch.autograd.graph.saved_tensors_hooks``);
* a tensor saved inside a module marked for offload (``mark_offload``) goes to host memory (``offload.py``);
* anything else is kept as it is.

Regions recomputed whole (blocks, MoE layers, MLPs) use ``torch.utils.checkpoint``; inside them its own hooks apply.
The counters (``stats``) say how many bytes each mark kept off the device in the last forward.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Optional

import torch
from torch import nn

from lightning_moe.callbacks.wrap_forward import unwrap_forward, wrap_forward
from lightning_moe.modules import replay


# autograd nodes that only re-view or cast their one input: a saved tensor behind a chain of them is a parameter's
_VIEW_OR_CAST = {"ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0",
                 "UnsafeViewBackward0", "ExpandBackward0", "UnsqueezeBackward0", "AliasBackward0"}


def _is_weight(t: torch.Tensor) -> bool:
    """A parameter (a leaf that needs grad), or a view or dtype cast of one (autocast, ``w.to(dtype)``, and the
    ``w.t()`` that ``F.linear`` saves for inputs of more than two dimensions)."""
    if t.requires_grad and t.is_leaf:
        return True
    fn = t.grad_fn
    for _ in range(4):  # a cast and a transpose, at most a few steps
        if fn is None or type(fn).__name__ not in _VIEW_OR_CAST or len(fn.next_functions) != 1:
            return False
        fn = fn.next_functions[0][0]
        if type(fn).__name__ == "AccumulateGrad":
            return True
    return False


def _tensors(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


class _Recipe:
    """How to rebuild a marked module's outputs: its forward on the same inputs, under the same autocast state."""

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict, outputs: list, name: str,
                 kept: Optional[dict]):
        self.module, self.args, self.kwargs, self.name = module, args, kwargs, name
        self.kept = kept  # what its forward kept for the rebuild (``modules/replay.py``: FP8's delayed scales)
        self.layouts = [(o.untyped_storage().nbytes(), o.stride()) for o in outputs]
        dev = outputs[0].device.type
        self.autocast = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        self._outputs: Optional[list] = None
        self.counted: set[int] = set()  # outputs already counted in the stats (several ops may save one tensor)

    def output(self, i: int) -> torch.Tensor:
        if self._outputs is None:  # once for all the saved copies of every output
            dev, enabled, dtype = self.autocast
            with torch.no_grad(), torch.autocast(dev, dtype=dtype, enabled=enabled), replay.replay(self.kept):
                outs = _tensors(self.module.forward(*self.args, **self.kwargs))  # forward: no hooks run again
            if [(o.untyped_storage().nbytes(), o.stride()) for o in outs] != self.layouts:
                raise RuntimeError(f"Recompute: recomputing {self.name} gave outputs of another layout than its "
                                   "forward pass (a non-deterministic module cannot be recomputed)")
            self._outputs = outs
        return self._outputs[i]


class _Saved:
    """What ``_pack`` returns: the tensor itself, or where to rebuild it from."""
    __slots__ = ("tensor", "recipe", "index", "view")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.recipe, self.index, self.view = tensor, None, 0, None

    def drop(self, recipe: _Recipe, index: int, out: torch.Tensor) -> int:
        """Keep the recipe instead of the tensor; the bytes this frees (an output counts once)."""
        t = self.tensor
        self.recipe, self.index = recipe, index
        self.view = (t.shape, t.stride(), t.storage_offset() - out.storage_offset())
        self.tensor = None
        if index in recipe.counted:
            return 0
        recipe.counted.add(index)
        return out.untyped_storage().nbytes()

    def get(self) -> torch.Tensor:
        if self.recipe is None:
            return self.tensor
        out = self.recipe.output(self.index)
        size, stride, delta = self.view
        return out.as_strided(size, stride, out.storage_offset() + delta)


class SavedTensorPolicy:
    """One per model: the marks of both callbacks, and the hooks installed around each selected block's forward."""

    def __init__(self):
        self.offloader = None  # set by ActivationOffload: .pack(tensor, name) -> object with .get()
        self.stats: dict[str, int] = defaultdict(int)  # bytes kept off the device per mark, last forward
        self._outputs: dict[int, list] = {}  # storage address -> [(recipe, index, weakref to the output)]
        self._open: list[list[_Saved]] = []  # saved inside the marked modules now running (their own outputs?)
        self._phases: list = []  # per marked module now running: (its first-pass context, its store) or None
        self._offloading: list[str] = []  # the offload marks now running
        self._handles: list = []
        self._wrapped: list[tuple[nn.Module, Callable]] = []  # (block, our wrapper of its forward)

    # ------------------------------------------------------------------ marks
    def wrap_block(self, block: nn.Module) -> None:
        """Install the hooks for the forward of ``block`` (once per block)."""
        if any(b is block for b, _ in self._wrapped):
            return

        def make(forward):
            def wrapped(*args, **kwargs):
                self._outputs.clear()
                self._open.clear()
                if self.offloader is not None and torch.is_grad_enabled():
                    self.offloader.new_group()  # one group of offloaded tensors per block forward
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                    try:
                        return forward(*args, **kwargs)
                    finally:
                        self._outputs.clear()
                        self._open.clear()
                        self._offloading.clear()
                        self._close_phases()
            return wrapped

        self._wrapped.append((block, wrap_forward(block, make)))
        self._wrapped[-1][1].step_context = self.step_context  # for a block run in steps (Block.steps)

    @contextmanager
    def step_context(self):
        """The hooks around one step of a block that runs in steps (``overlap_moe_comm``, ``Block.steps``): the
        other micro-batch's steps run between them. Each fine-grained module's output is saved in the step that
        makes it, so nothing carries over from one step to the next."""
        if self.offloader is not None:
            raise ValueError("ActivationOffload cannot run with MoEFoldStrategy(overlap_moe_comm=True): its host "
                             "copies follow one micro-batch's blocks in order, which the merged schedule interleaves "
                             "with another's; use Recompute's fine-grained modules, or no overlap")
        self._outputs.clear()
        self._open.clear()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            try:
                yield
            finally:
                self._outputs.clear()
                self._open.clear()
                self._close_phases()

    def mark_recompute(self, module: nn.Module, name: str) -> None:
        def before(mod, args):
            self._open.append([])
            phase = None
            if torch.is_grad_enabled() and not (replay.recorded() or replay.replaying()):
                # its forward is the first pass of its rebuild: what it keeps for that (FP8 delayed scales) goes in
                # a store of its own; inside another region (a nested mark, a checkpoint) that region's holds it
                kept: dict = {}
                phase = (replay.first_pass(kept), kept)
                phase[0].__enter__()
            self._phases.append(phase)

        def after(mod, args, kwargs, out):
            inside = self._open.pop() if self._open else []
            phase = self._phases.pop() if self._phases else None
            if phase is not None:
                phase[0].__exit__(None, None, None)
            outs = _tensors(out)
            if not outs or not torch.is_grad_enabled():
                return
            recipe = _Recipe(mod, args, kwargs, outs, name, phase[1] if phase is not None else None)
            for i, o in enumerate(outs):
                self._outputs.setdefault(o.untyped_storage().data_ptr(), []).append((recipe, i, weakref.ref(o)))
            for saved in inside:  # the module kept its own output (attention does): rebuild that too
                if saved.tensor is not None:
                    hit = self._match(saved.tensor)
                    if hit is not None:
                        self.stats[name] += saved.drop(*hit)

        self._handles += [module.register_forward_pre_hook(before),
                          module.register_forward_hook(after, with_kwargs=True)]

    def _close_phases(self) -> None:
        """The first-pass contexts of marked modules whose forward raised (their forward hooks never ran)."""
        while self._phases:
            phase = self._phases.pop()
            if phase is not None:
                phase[0].__exit__(None, None, None)

    def mark_offload(self, module: nn.Module, name: str) -> None:
        def before(mod, args):
            self._offloading.append(name)

        def after(mod, args, out):
            if self._offloading:
                self._offloading.pop()

        self._handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        for block, wrapper in self._wrapped:
            unwrap_forward(block, wrapper)
        self._handles, self._wrapped = [], []

    # ------------------------------------------------------------------ the hooks
    def _match(self, t: torch.Tensor):
        for recipe, i, ref in self._outputs.get(t.untyped_storage().data_ptr(), ()):
            out = ref()  # alive, so its memory cannot belong to another tensor
            if out is not None and out.untyped_storage().nbytes() == t.untyped_storage().nbytes():
                return recipe, i, out
        return None

    def _pack(self, t: torch.Tensor):
        hit = self._match(t) if self._outputs else None
        if hit is not None:
            saved = _Saved(t)
            self.stats[hit[0].name] += saved.drop(*hit)
            return saved
        weight = _is_weight(t)  # parameters are never moved
        if self.offloader is not None and not weight:
            # one storage may be saved inside and outside the chosen modules (attention's output and the output
            # projection's input): it moves only if every save of it can follow it to the host
            if self._offloading:
                moved, new = self.offloader.pack(t, self._offloading[-1])
            else:
                moved, new = self.offloader.shared(t), False
            if moved is not None:
                if new:
                    self.stats["offload:" + self._offloading[-1]] += t.numel() * t.element_size()
                return moved
            self.offloader.note_kept(t)
        if (not self._open and not self._offloading) or weight:
            return t  # the common case, kept as it is at the least cost
        saved = _Saved(t)
        for inside in self._open:
            inside.append(saved)
        return saved

    @staticmethod
    def _unpack(saved) -> torch.Tensor:
        return saved if isinstance(saved, torch.Tensor) else saved.get()


def policy_of(module: nn.Module) -> SavedTensorPolicy:
    """The model's one policy, shared by ``Recompute`` and ``ActivationOffload`` (nested hooks would hide each
    other's)."""
    policy = getattr(module, "_lmoe_saved_tensors", None)
    if policy is None:
        policy = SavedTensorPolicy()
        object.__setattr__(module, "_lmoe_saved_tensors", policy)
    return policy
