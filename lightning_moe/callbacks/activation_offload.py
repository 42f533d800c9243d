"""ActivationOffload: fine-grained activation offloading as a callback (Megatron's ``--fine-grained-activation-offloading
--offload-modules``, with its module names).

The tensors that the chosen modules save for backward go to pinned host memory as the forward pass produces them, on
a side stream, and come back on another in backward: when backward first needs a block's tensors it also starts
loading the block before it, so each reload overlaps the previous block's backward (two blocks in flight at most).
Only stream events order the copies: the host never waits for the GPU.
"""

from __future__ import annotations

import weakref
from typing import Optional, Sequence, Union

import lightning as L
import torch

from lightning_moe.callbacks.recompute import parse_layers, parse_modules, refuse_cuda_graphs, selected_layers
from lightning_moe.callbacks.saved_tensors import policy_of

MODULES = ("attn_norm", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")


def _targets(block) -> list[tuple[str, torch.nn.Module]]:
    out = [("attn_norm", block.attn_norm), ("core_attn", block.attn.core_attn), ("attn_proj", block.attn.wo),
           ("mlp_norm", block.ffn_norm)]
    if block.is_moe:
        out += [("expert_fc1", block.ffn.experts.fc1), ("moe_act", block.ffn.experts.act)]
    return out


class _Offloaded:
    """A saved storage that lives on the host until backward reloads it."""
    __slots__ = ("store", "group", "host", "copied", "device", "loaded", "handed")

    def __init__(self, store: "HostActivations", group: int, host: torch.Tensor, copied: torch.cuda.Event):
        self.store, self.group, self.host, self.copied = store, group, host, copied
        self.device: Optional[torch.Tensor] = None
        self.loaded: Optional[torch.cuda.Event] = None
        self.handed = None  # weakref to the reloaded bytes while backward still holds them


class _View:
    """One saved tensor: a view (shape, stride, offset, dtype) onto an offloaded storage."""
    __slots__ = ("item", "shape", "stride", "offset", "dtype")

    def __init__(self, item: _Offloaded, t: torch.Tensor):
        self.item, self.shape, self.stride, self.offset, self.dtype = item, t.shape, t.stride(), t.storage_offset(), t.dtype

    def get(self) -> torch.Tensor:
        buf = self.item.store.reload(self.item)
        return torch.empty(0, dtype=self.dtype, device=buf.device).set_(buf.untyped_storage(), self.offset, self.shape,
                                                                         self.stride)


class HostActivations:
    """The offloaded tensors of the forward passes since the last ``clear``, grouped by block in forward order."""

    def __init__(self, device: torch.device, min_bytes: int):
        self.device, self.min_bytes = device, min_bytes
        self.out, self.back = torch.cuda.Stream(device), torch.cuda.Stream(device)
        self.groups: list[list[_Offloaded]] = []
        self._used: set[int] = set()  # groups backward has started on
        self._seen: dict = {}
        self._kept: dict = {}

    def new_group(self) -> None:
        self.groups.append([])
        self._seen = {}  # (storage address, bytes) -> (weakrefs to its saved views, its item), this block's
        self._kept: dict = {}  # (storage address, bytes) -> weakrefs to its views saved on the device, this block's

    @staticmethod
    def _key(t: torch.Tensor) -> tuple[int, int]:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()

    def shared(self, t: torch.Tensor) -> Optional[_View]:
        """A tensor saved outside the chosen modules: a view onto the host copy if its storage was moved already in
        this block (so that the device memory is really freed), else None."""
        seen = self._seen.get(self._key(t)) if self.groups else None
        if seen is None or not any(ref() is not None for ref in seen[0]):
            return None
        seen[0].append(weakref.ref(t))
        return _View(seen[1], t)

    def note_kept(self, t: torch.Tensor) -> None:
        """``t`` stays on the device: a later save of its storage inside a chosen module would free nothing, so it
        stays too (attention keeps its output, which may be the storage of the output projection's input)."""
        if self.groups and t.device.type == "cuda":
            self._kept.setdefault(self._key(t), []).append(weakref.ref(t))

    def pack(self, t: torch.Tensor, name: str) -> tuple[Optional[_View], bool]:
        """``(view, new)``: ``t`` as a view onto the host copy of its storage (None: kept on the device), and whether
        this call made the copy. Whole storages move, so that every saved view of one goes with it and its device
        memory is freed: attention saves its output as a transposed view of the buffer that the output projection
        saves as its input, and offloading only one of them would keep the buffer on the device."""
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        spans = t.numel() * t.element_size() == nbytes  # the view covers its storage once (any dim order)
        if t.device.type != "cuda" or not spans or nbytes < self.min_bytes or not self.groups:
            return None, False  # kept on the device
        key = (storage.data_ptr(), nbytes)
        if any(ref() is not None for ref in self._kept.get(key, ())):
            return None, False  # an earlier save outside the chosen modules keeps this storage on the device
        seen = self._seen.get(key)
        if seen is not None and any(ref() is not None for ref in seen[0]):  # a view alive: the memory is that storage
            seen[0].append(weakref.ref(t))
            return _View(seen[1], t), False
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # torch's caching host allocator: reused
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)  # the storage as bytes
        self.out.wait_stream(torch.cuda.current_stream(self.device))  # after the op that produced it
        with torch.cuda.stream(self.out):
            host.copy_(src, non_blocking=True)
        t.record_stream(self.out)  # its device memory is reused only after the copy
        item = _Offloaded(self, len(self.groups) - 1, host, self.out.record_event())
        self.groups[-1].append(item)
        self._seen[key] = ([weakref.ref(t)], item)
        return _View(item, t), True

    def _load(self, items) -> None:
        """Start copying back the items not on their way yet (``loaded`` is None: never loaded, or handed out)."""
        for item in items:
            if item.loaded is not None:
                continue
            with torch.cuda.stream(self.back):
                self.back.wait_event(item.copied)
                item.device = torch.empty(item.host.shape, dtype=item.host.dtype, device=self.device)  # bytes
                item.device.copy_(item.host, non_blocking=True)
            item.loaded = self.back.record_event()

    def reload(self, item: _Offloaded) -> torch.Tensor:
        """The storage's bytes on the device (a uint8 tensor)."""
        handed = item.handed() if item.handed is not None else None
        if handed is not None:  # another view of this storage brought it back, and backward still holds it
            return handed
        if item.group in self._used:
            self._load([item])  # prefetched (a no-op), or handed out before and needed again
        else:  # a group's first use loads all of it, and prefetches the last earlier group, which backward reaches next
            self._used.add(item.group)
            self._load(self.groups[item.group])
            earlier = next((g for g in range(item.group - 1, -1, -1) if self.groups[g]), None)
            if earlier is not None:
                self._load(self.groups[earlier])
        current = torch.cuda.current_stream(self.device)
        current.wait_event(item.loaded)
        t, item.device, item.loaded = item.device, None, None  # handed out (once freed, a second unpack reloads it)
        t.record_stream(current)  # allocated on the reload stream, used and freed on the compute stream
        item.handed = weakref.ref(t)
        return t

    def clear(self) -> None:
        self.groups, self._used, self._seen, self._kept = [], set(), {}, {}


class ActivationOffload(L.Callback):
    """Move what the chosen ``modules`` save for backward to pinned host memory, in the chosen ``layers``.

    Args:
        modules: any of ``attn_norm``, ``core_attn``, ``attn_proj`` (the attention output projection's input),
            ``mlp_norm``, ``expert_fc1`` (the experts' input), ``moe_act``. Default: ``expert_fc1``.
        layers: ``"all"``, N (the first N layers of each pipeline stage) or a list of global layer indices.
        min_bytes: smaller saved tensors stay on the device (not worth a copy).

    Needs CUDA. Composes with ``Recompute``: a tensor that is recomputed is not offloaded. Logs
    ``memory/offloaded_gib`` (the last micro-batch's).
    """

    def __init__(self, modules: Sequence[str] = ("expert_fc1",), layers: Union[str, int, Sequence[int]] = "all",
                 min_bytes: int = 1 << 16):
        self.modules = parse_modules(modules, MODULES, "ActivationOffload")
        self.layers = parse_layers(list(layers) if isinstance(layers, tuple) else layers, "ActivationOffload")
        self.min_bytes = int(min_bytes)
        self.store: Optional[HostActivations] = None

    def on_fit_start(self, trainer, pl_module) -> None:
        device = trainer.strategy.root_device
        if device.type != "cuda":
            raise ValueError(f"ActivationOffload needs CUDA devices (it moves activations to pinned host memory on "
                             f"side streams); this run is on {device.type}")
        refuse_cuda_graphs(trainer, "ActivationOffload")
        chosen, mine = selected_layers(pl_module, self.layers, "ActivationOffload")
        cfg = pl_module.model.cfg
        if {"expert_fc1", "moe_act"} & set(self.modules) and not any(cfg.is_moe_layer(i) for i in chosen):
            raise ValueError(f"ActivationOffload(modules={self.modules}): the selected layers have no MoE layer")
        policy = policy_of(pl_module)
        self.store = policy.offloader = HostActivations(device, self.min_bytes)
        for i in mine:
            block = pl_module.model.layers[i]
            for name, module in _targets(block):
                if name in self.modules:
                    policy.mark_offload(module, name)
            policy.wrap_block(block)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        policy_of(pl_module).stats.clear()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.store is not None:
            self.store.clear()  # every backward of the batch has run
        stats = policy_of(pl_module).stats
        moved = sum(v for k, v in stats.items() if k.startswith("offload:"))
        pl_module.log("memory/offloaded_gib", torch.tensor(moved / 2**30), on_step=True, logger=True)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        policy = getattr(pl_module, "_lmoe_saved_tensors", None)
        if policy is not None:
            policy.offloader = None
            policy.remove()
            object.__delattr__(pl_module, "_lmoe_saved_tensors")
        self.store = None
