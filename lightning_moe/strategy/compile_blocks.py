"""Regional compilation of the transformer blocks: ``MoEFoldStrategy(compile_blocks=True)``.

What: at setup, each block of the model (``model.layers[i]``, as torchtitan compiles each TransformerBlock) is compiled
in place with ``nn.Module.compile``, which keeps the module, its parameter names and its state-dict keys (checkpoints
load either way). Compilation is lazy: the first training batch traces each block (``dynamic=None``: static shapes
first, symbolic after a shape changes) and inductor fuses what lies between the library's kernels (norms, rotary,
residual adds, casts, the SwiGLU, the router's softmax and losses on the torch path).

How the fused kernels compose:
- the Triton router, permute and expert-order launchers are custom ops under compile (``fused_router.py``,
  ``triton_permute.py``, ``triton_expert_order.py``): opaque to dynamo, with fake kernels for their shapes and the
  router's gradient registered on its op; permute.py's autograd Functions around them are traced as usual;
- ``experts._SwiGLU``, ``router._Fp32Linear`` and ``_Bf16Linear`` are plain torch inside: dynamo traces them;
- the grouped GEMMs are torch's ``grouped_mm`` (a graph op in bf16). Its fake kernel takes bf16 only, so float32
  grouped GEMMs (the CPU tests) run eagerly behind a graph break (``experts._grouped_mm_outside_graph``).
On one device a bf16 block is one graph (on CPU, and with stand-ins for the Triton kernels: tests/strategy/
test_compile_blocks.py; on a GPU: tests/test_gpu_compile.py). Collectives and host syncs inside the blocks (the dropless
all-to-all's split sizes under EP) break the graph where they are (fullgraph=False) and run eagerly; the blocks then
recompile once with symbolic row counts.

CUDA graphs (``cuda_graphs=True``) compose: the compiled forward is what ``capture_blocks`` warms up and captures,
so each block's compiled kernels replay as one graph. For that the blocks switch from ``nn.Module.compile`` to a
compiled ``forward`` just before the capture (``for_capture``): the graphed forward that replaces ``block.forward``
must be called outside dynamo, and the eager fallback (eval, other shapes) is then the compiled forward.

Refused at setup, with the reason: ``Recompute`` and ``ActivationOffload``, whose saved-tensor hooks and checkpoints
act on the block's modules one by one, while a compiled block saves what its own graph decides; ``FP8Training`` and
``NVFP4Training``, not verified under compile yet. The distributed optimizer's per-module waits for its parameter
all-gathers (``overlap_param_gather``) run before the forward instead (as with CUDA graphs): a compiled block would
trace them.

A torch bug to keep in mind: AOTAutograd may recompute in the backward a read of a buffer that the compiled forward
mutated, after the mutation (open PR pytorch/pytorch#197039; torch 2.13 has the bug): silently wrong gradients. The
router's ``global_aux_loss`` window was such a read; it runs outside the graph (``TopKRouter._global_window``, one
graph break per MoE block with that loss). Buffers the blocks mutate otherwise (routing counters) feed no gradient.
"""

from __future__ import annotations

import os
from typing import Iterable

import torch
from torch import nn

# LMOE_COMPILE_BACKEND: tests only (e.g. "aot_eager": dynamo and AOTAutograd without inductor's compile time on CPU)
_BACKEND_ENV = "LMOE_COMPILE_BACKEND"


def options() -> dict:
    """The torch.compile arguments for every block."""
    return dict(backend=os.environ.get(_BACKEND_ENV, "inductor"), fullgraph=False, dynamic=None)


def model_blocks(pl_module) -> list[nn.Module]:
    """The blocks to compile: ``pl_module.model.layers`` (MoELanguageModel's MoETransformer)."""
    layers = getattr(getattr(pl_module, "model", None), "layers", None)
    if layers is None or not all(isinstance(b, nn.Module) for b in layers):
        raise TypeError("MoEFoldStrategy(compile_blocks=True) needs a LightningModule whose .model.layers holds the "
                        "transformer blocks (MoELanguageModel's MoETransformer)")
    return list(layers)


def check_callbacks(callbacks: Iterable) -> None:
    """Raise for callbacks whose work inside the blocks a compiled block would not do as they expect."""
    from lightning_moe.callbacks.activation_offload import ActivationOffload
    from lightning_moe.callbacks.fp8_training import FP8Training
    from lightning_moe.callbacks.nvfp4_training import NVFP4Training
    from lightning_moe.callbacks.recompute import Recompute
    for cb in callbacks:
        if isinstance(cb, (Recompute, ActivationOffload)):
            raise ValueError(f"{type(cb).__name__} cannot be combined with MoEFoldStrategy(compile_blocks=True): its "
                             "saved-tensor hooks and checkpoints act on each module of the block, while a compiled "
                             "block keeps what its own graph saves; use one or the other")
        if isinstance(cb, (FP8Training, NVFP4Training)):
            raise ValueError(f"{type(cb).__name__} cannot be combined with MoEFoldStrategy(compile_blocks=True) yet: "
                             "its quantized GEMMs (and delayed scaling's amax history, state changed inside the "
                             "blocks) have not been verified under torch.compile; use one or the other")


def _prepare(block: nn.Module, device: torch.device) -> None:
    """Build what a block makes lazily at its first call, so that the first trace sees it (no second compile):
    the rotary tables (for the config's sequence length) and the Triton kernel modules (importing them defines the
    custom ops; an import cannot be traced)."""
    from lightning_moe.modules import kernels
    from lightning_moe.modules.attention import RotaryCache
    probe = torch.zeros(1, dtype=torch.long, device=device)
    for m in block.modules():
        for v in list(vars(m).values()):
            if isinstance(v, RotaryCache):
                v(probe, 1)
    for name in ("triton_router", "triton_permute", "triton_expert_order"):
        kernels.load(name, probe)


def compile_blocks(blocks: list[nn.Module], device: torch.device) -> None:
    """``block.compile(...)`` for each block (lazy: each compiles at its first call), after the strategy's optimizer
    setup: the blocks' linears leave gradient-accumulation fusion (``wgrad_fusion.py``), whose backward updates the
    GradSync's bookkeeping in Python and would break each block's graph at every linear; autograd's gradient then
    reaches the main grads through GradSync's hook, as with CUDA graphs. Layers outside the blocks (an untied head)
    keep it."""
    from lightning_moe.modules import wgrad_fusion
    for blk in blocks:
        _prepare(blk, device)
        for p in blk.parameters():
            wgrad_fusion.detach(p)
        blk.compile(**options())


def for_capture(blocks: list[nn.Module]) -> None:
    """Before ``cuda_graphs.capture_blocks``: compile each block's ``forward`` instead of its ``__call__``, so that
    the capture records the compiled kernels and the graphed forward that capture installs runs outside dynamo."""
    for blk in blocks:
        if blk._compiled_call_impl is None:
            continue
        blk._compiled_call_impl = None
        blk.forward = torch.compile(blk.forward, **options())


def release(blocks: list[nn.Module]) -> None:
    """Back to eager blocks (after ``cuda_graphs.release_blocks`` where graphs were captured)."""
    for blk in blocks:
        blk._compiled_call_impl = None
        f = blk.__dict__.get("forward")
        if f is not None and hasattr(f, "_torchdynamo_orig_callable"):
            del blk.forward


def graph_breaks(fn, *args, **kwargs) -> tuple[int, list[str]]:
    """How many times dynamo breaks the graph of ``fn(*args, **kwargs)`` (its forward; backward follows the same
    graphs), and why: ``torch._dynamo.explain``, which runs ``fn`` once."""
    ex = torch._dynamo.explain(fn)(*args, **kwargs)
    return ex.graph_break_count, [r.reason.strip().splitlines()[0][:200] for r in ex.break_reasons]
