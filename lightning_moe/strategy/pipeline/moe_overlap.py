"""Expert-parallel communication overlap (Megatron's ``--overlap-moe-expert-parallel-comm``): the token exchanges of
one micro-batch run while another micro-batch computes.

A micro-batch's forward runs as a generator of steps (``MoELanguageModel.pipeline_forward_steps``): local compute,
a token exchange, local compute, ... Before each step the generator hands over every tensor it still needs, and each
one that requires a gradient is cut from the autograd graph (detached into a new leaf). Each step then has a backward
of its own: its roots are the tensors cut at its end, with the gradients their leaves collected from the later
steps, and it leaves gradients in the leaves cut at its start. The MoE layers' auxiliary losses are roots of the step
that returns them. A tied head takes its own leaf of the embedding's weight, cut in the first step, so that the two
gradients of the weight are summed before they are accumulated, as in one backward.

The merged schedule runs the forward of micro-batch i + 1 with the backward of micro-batch i, pairing each exchange
of one with a compute step of the other (the backward goes first whenever both have the same kind):

    B(i)   head, loss, last layer's combine_postprocess
    F(i+1) embedding, attention 0, router, permute    ||  B(i)   combine of the last layer       (exchange)
    F(i+1) dispatch of layer 0              (exchange) ||  B(i)   experts of the last layer
    F(i+1) experts of layer 0                          ||  B(i)   dispatch of the last layer      (exchange)
    F(i+1) combine of layer 0               (exchange) ||  B(i)   attention of the last layer, ...
    ...

Under pipeline parallelism (interleaved 1F1B only, as in Megatron) the schedule gets one more warmup forward, so
that every steady-state (F, B) pair holds two micro-batches, and each pair runs merged (``schedules.merge_plan``: both
inputs are received before the pair, both outputs sent after it; ``simulate_plans`` checks it for deadlock).

On CUDA the exchange is issued first, on a side stream, and the compute step on the current stream; the current
stream waits for the side stream before the next pair. Every step computes what it computes without the overlap, in
the same order per micro-batch, so the numbers do not change (tests/parallel/test_moe_overlap.py); on gloo the
exchanges block and the schedule only reorders them.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import Callable, Optional

import torch

COMM, COMP = "comm", "comp"


def cut(value, leaves: list, memo: dict, leaves_too: bool = False):
    """``value`` with every tensor that requires a gradient replaced by a detached leaf that requires one; each
    (original, leaf) pair is appended to ``leaves``. Walks tuples, lists, dicts and dataclasses (in place). A leaf
    (a parameter, or a tensor cut before and carried on unchanged) stays itself unless ``leaves_too``: the later
    steps add their gradients to it directly (and on CUDA its gradient accumulator is not created in a backward
    on the exchanges' stream)."""
    if isinstance(value, torch.Tensor):
        if not value.requires_grad or (value.grad_fn is None and not leaves_too):
            return value
        if id(value) not in memo:  # one leaf per tensor, however often it is referenced
            leaf = value.detach().requires_grad_()
            memo[id(value)] = leaf
            leaves.append((value, leaf))
        return memo[id(value)]
    if isinstance(value, (tuple, list)):
        return type(value)(cut(v, leaves, memo, leaves_too) for v in value)
    if isinstance(value, dict):
        return {k: cut(v, leaves, memo, leaves_too) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            setattr(value, f.name, cut(getattr(value, f.name), leaves, memo, leaves_too))
    return value


@dataclasses.dataclass
class _Step:
    kind: str
    roots: list = dataclasses.field(default_factory=list)  # (root, gradient or None): loss terms, the chunk output
    cuts: list = dataclasses.field(default_factory=list)  # (original, leaf) cut at the end of this step
    leaves: list = dataclasses.field(default_factory=list)  # (original, leaf) cut inside it ("leaf": a tied weight)


class Tape:
    """One micro-batch's forward, step by step, and then its backward, step by step in reverse."""

    def __init__(self, steps, loss_scale: float, forward_context: Callable = nullcontext):
        self.gen, self.scale, self.context = steps, loss_scale, forward_context
        self.steps = [_Step(COMP)]
        self.finished, self.result = False, None  # the forward ran; what the generator returned
        self._send = None
        self._next_backward = None  # index of the next step to run backward

    # ------------------------------------------------------------------ forward
    def forward_kind(self) -> Optional[str]:
        return None if self.finished else self.steps[-1].kind

    def forward_step(self) -> None:
        """Run the current step up to the next cut (or to the end of the forward)."""
        step = self.steps[-1]
        with self.context():
            try:
                while True:
                    kind, value = self.gen.send(self._send)
                    if kind == "loss":  # a loss term: a root of this step
                        step.roots.append((value * self.scale, None))
                        self._send = None
                        continue
                    if kind == "leaf":  # cut now, backpropagated with this step (a tied weight used again later)
                        self._send = cut(value, step.leaves, {}, leaves_too=True)
                        continue
                    self._send = cut(value, step.cuts, {})
                    self.steps.append(_Step(kind))
                    return
            except StopIteration as done:
                self.finished, self.result = True, done.value
                self._send, self.gen = None, None

    def add_roots(self, roots: list, grads: Optional[list] = None) -> None:
        """Roots of the last step and their gradients (None: a scalar loss): the micro-batch's loss, or the chunk's
        output with the gradient the next pipeline stage sent. The backward can start."""
        assert self.finished, "the forward has not finished"
        self.steps[-1].roots.extend(zip(roots, grads or [None] * len(roots)))
        self._next_backward = len(self.steps) - 1

    # ------------------------------------------------------------------ backward
    def backward_kind(self) -> Optional[str]:
        i = self._next_backward
        return None if i is None or i < 0 else self.steps[i].kind

    def backward_step(self) -> list:
        """Backward of the next step. Returns the gradients it read, which the caller keeps alive until the stream
        that ran it has been joined."""
        step = self.steps[self._next_backward]
        roots, grads = [r for r, _ in step.roots], [g for _, g in step.roots]
        later = [(o, leaf) for o, leaf in step.leaves if leaf.grad is None]  # used in this step only, if at all
        for original, leaf in step.cuts + step.leaves:
            if leaf.grad is not None:  # a leaf no later step used gets no gradient and adds nothing
                roots.append(original)
                grads.append(leaf.grad)
        if roots:
            torch.autograd.backward(roots, grads)
        for original, leaf in later:  # e.g. a tied head in the same step as the embedding (no MoE layer between)
            if leaf.grad is not None:
                torch.autograd.backward([original], [leaf.grad])
                grads.append(leaf.grad)
        self.steps[self._next_backward] = None  # frees this step's leaves, their gradients and its graph
        self._next_backward -= 1
        return grads


def run_merged(forward: Optional[Tape], backward: Optional[Tape], stream: Optional[torch.cuda.Stream]) -> None:
    """The forward of ``forward`` and the backward of ``backward`` (either may be None), each exchange paired with
    a compute step of the other micro-batch. The pairing depends only on the models' step kinds, so every rank
    issues its collectives in the same order."""
    while True:
        fk = forward.forward_kind() if forward is not None else None
        bk = backward.backward_kind() if backward is not None else None
        if fk is None and bk is None:
            return
        if fk is not None and bk is not None and fk != bk:
            comm, comp = ((forward.forward_step, backward.backward_step) if fk == COMM
                          else (backward.backward_step, forward.forward_step))
            _pair(comm, comp, stream)
        elif bk is not None:  # alone (the backward first: it frees memory)
            backward.backward_step()
        else:
            forward.forward_step()


def _pair(comm: Callable, comp: Callable, stream: Optional[torch.cuda.Stream]) -> None:
    if stream is None:  # gloo: the exchange blocks; the order is what matters
        comm()
        comp()
        return
    main = torch.cuda.current_stream()
    stream.wait_stream(main)  # the exchange's inputs are ready
    with torch.cuda.stream(stream):
        held = comm()  # tensors made on the current stream and read by the exchange stay referenced until the join
    comp()
    main.wait_stream(stream)
    del held
