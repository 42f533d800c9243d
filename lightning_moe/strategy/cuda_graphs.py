"""CUDA graphs for whole transformer blocks: ``MoEFoldStrategy(cuda_graphs=True)``.

Why: a fine-grained MoE block (Qwen3: 128 experts, top-8) is hundreds of small kernels, and the host launches them
more slowly than the GPU runs them. A replayed graph launches a block's forward, or its backward, in one call.

What can be captured: blocks with static shapes and no collectives inside, i.e. one rank per attention and MoE group
(TP = CP = EP = ETP = 1; data parallelism is fine, since its gradient all-reduce runs in hooks outside the graphs).
The dropless dispatch on one rank has no host sync, so the whole MoE layer is captured. There is no pipeline
schedule: a graph holds the activations of one micro-batch, so each forward must be followed by its backward.

How: ``torch.cuda.make_graphed_callables`` over all blocks at once (one shared memory pool), at the first training
batch, with that batch's shapes. Calls with another shape, in eval mode, or without grad run eagerly. The warm-up
iterations' writes to buffers (routing counters) are undone. The graphs return their parameter gradients in static
buffers that the next replay overwrites (pytorch/pytorch#181723): with fp32 main grads the strategy's hook consumes
each one at once, and otherwise a hook hands autograd a copy. With gradient-accumulation fusion the captured wgrad
GEMMs add straight into the main grads, which GradSync zeroes at each step's ``zero_grad`` (a replay cannot choose
between writing and adding), and their weights' static gradients are placeholders the hook drops unread. FP8Training's
weight cache is rewritten in place before each step's first batch, so the replayed GEMMs read the current weights.
The deferred expert wgrad keeps each micro-batch's operands in graphs of its own: the blocks are captured once per
micro-batch of its window, in the same pool, and each forward replays the copy its micro-batch needs
(``graph_deferral.py``).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn


def unsupported_layout(tp: int, cp: int, ep: int, etp: int, pp: int, num_microbatches: int) -> Optional[str]:
    """Why a layout cannot run with CUDA graphs, or None."""
    if tp * cp * ep * etp > 1:
        return (f"tp={tp}, cp={cp}, ep={ep}, etp={etp}: collectives and data-dependent all-to-all sizes inside the "
                "blocks (graphs need tp = cp = ep = etp = 1; data parallelism is fine)")
    if pp > 1 or num_microbatches > 1:
        return (f"pipeline_parallel_size={pp}, num_microbatches={num_microbatches}: a graph holds one micro-batch's "
                "activations, so forwards and backwards must alternate (use the Trainer's accumulate_grad_batches)")
    return None


def _guarded(block: nn.Module, graphed: list, eager: Callable, x_shape: torch.Size, dtype: torch.dtype,
             select: Callable[[], int]):
    def forward(x_BSD: torch.Tensor, positions_S: torch.Tensor):
        if block.training and torch.is_grad_enabled() and x_BSD.shape == x_shape and x_BSD.dtype == dtype:
            k = select()
            if not 0 <= k < len(graphed):
                raise RuntimeError(f"CUDA graphs: copy {k} asked for, {len(graphed)} captured")
            return graphed[k](x_BSD, positions_S)
        return eager(x_BSD, positions_S)
    return forward


@torch.no_grad()
def _copy_grad(g: torch.Tensor) -> torch.Tensor:
    return g.clone()


def capture_blocks(blocks: Sequence[nn.Module], x_shape: tuple[int, ...], dtype: torch.dtype,
                   positions_S: torch.Tensor, copy_param_grads: bool, num_warmup_iters: int = 3,
                   copies: Callable[[], int] = lambda: 1, on_copy: Callable[[int], None] = lambda k: None,
                   select: Callable[[], int] = lambda: 0) -> list:
    """Capture ``blocks`` (called in this order as ``block(x_BSD, positions_S) -> (x_BSD, aux)``) for inputs of
    ``x_shape`` and ``dtype``. ``copy_param_grads``: register hooks that give autograd a copy of each parameter
    gradient (needed when ``param.grad`` accumulates). ``copies()``, asked after the first copy's capture (its warm-up
    runs the blocks eagerly): how many copies of the graphs to capture, one after another in one pool (``on_copy(k)``
    before copy k's); ``select()``, at each forward: which copy it replays. Returns the hook handles."""
    device = positions_S.device
    saved = [(b, b.detach().clone()) for blk in blocks for b in blk.buffers()]
    eager = [blk.forward for blk in blocks]
    own = [vars(blk).get("forward") for blk in blocks]  # instance-level forwards, to put back as they were
    samples = tuple((torch.randn(x_shape, device=device, dtype=dtype, requires_grad=True), positions_S)
                    for _ in blocks)
    pool = torch.cuda.graph_pool_handle()
    graphed: list[list] = [[] for _ in blocks]  # per block, its copies' graphed forwards
    k, n = 0, 1
    try:
        while k < n:
            on_copy(k)
            # one pool: a copy runs whole (forward, then backward) before another starts, and what it keeps may lie
            # in an earlier copy's scratch, which is safe while copies replay in order (graph_deferral.py says why)
            torch.cuda.make_graphed_callables(tuple(blocks), samples,
                                              num_warmup_iters=num_warmup_iters if k == 0 else 0,
                                              allow_unused_input=True, pool=pool)
            for blk, copies_of_blk in zip(blocks, graphed):
                copies_of_blk.append(blk.forward)
            _restore(blocks, own)  # the eager forwards again, for the next copy's capture
            n = copies() if k == 0 else n
            k += 1
    except BaseException:
        _restore(blocks, own)
        raise
    finally:
        for b, value in saved:  # the warm-up iterations ran the blocks: undo their writes to routing counters
            b.copy_(value)
    for blk, eager_forward, copies_of_blk in zip(blocks, eager, graphed):
        blk.forward = _guarded(blk, copies_of_blk, eager_forward, torch.Size(x_shape), dtype, select)
    handles = []
    if copy_param_grads:
        handles = [p.register_hook(_copy_grad) for blk in blocks for p in blk.parameters() if p.requires_grad]
    return handles


def _restore(blocks: Sequence[nn.Module], own: list) -> None:
    for blk, forward in zip(blocks, own):
        if forward is None:
            blk.__dict__.pop("forward", None)
        else:
            blk.forward = forward


def release_blocks(blocks: Sequence[nn.Module], handles: list) -> None:
    """Back to eager blocks (the graphs and their memory pool go with the last reference)."""
    for h in handles:
        h.remove()
    for blk in blocks:
        blk.__dict__.pop("forward", None)
