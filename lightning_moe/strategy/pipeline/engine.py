"""Runs a pipeline schedule for one batch on this rank: micro-batches, forward and backward of every model chunk,
point-to-point transfers, and the timing that gives the measured bubble.

The LightningModule supplies the model pieces (MoELanguageModel implements them):
  ``pipeline_model()``               the chunked model: ``stages``, ``num_stages``, ``is_first_chunk(c)``,
                                     ``is_last_chunk(c)``, ``chunk_parameters(c)``
  ``pipeline_input_shape(mb)``       (B, S, D) of the activations between stages for a micro-batch
  ``pipeline_forward(c, mb, x)``     one chunk's forward: (output, aux loss); on the last stage the output is the
                                     micro-batch's mean loss
Loss semantics are those of gradient accumulation: every micro-batch's (loss + aux) is scaled by 1 / num_microbatches
(and by Lightning's 1 / accumulate_grad_batches), and each stage backpropagates its own chunks' aux losses along with
the gradient arriving from the next stage.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch

from lightning_moe.strategy.pipeline.moe_overlap import Tape, run_merged
from lightning_moe.strategy.pipeline.p2p import OverlappedComm, StageComm
from lightning_moe.strategy.pipeline.schedules import exchange_plans, op_messages, simulate, simulate_plans


def split_microbatches(batch: Any, m: int) -> list:
    """Split every tensor of a (nested) batch into ``m`` equal micro-batches along dim 0."""
    if isinstance(batch, torch.Tensor):
        if batch.shape[0] % m:
            raise ValueError(f"a batch of {batch.shape[0]} samples cannot be split into num_microbatches={m} equal "
                             "micro-batches: make the per-rank batch size a multiple of num_microbatches")
        return list(batch.chunk(m))
    if isinstance(batch, dict):
        parts = {k: split_microbatches(v, m) for k, v in batch.items()}
        return [{k: v[i] for k, v in parts.items()} for i in range(m)]
    if isinstance(batch, (list, tuple)):
        parts = [split_microbatches(v, m) for v in batch]
        return [type(batch)(p[i] for p in parts) for i in range(m)]
    return [batch] * m


class _Timer:
    """Busy time (compute) and wall time of one schedule. On CUDA with events (no host sync; read on request), on
    CPU with the host clock (gloo receives block the host, so its waits are the pipeline's idle time)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def result(self) -> dict:
        """marks: start, then (compute begin, compute end) per op, then end. The begin mark follows the op's wait
        for its input (on CUDA the stream reaches the event only after it), so busy excludes the waiting."""
        if not self.marks:
            return {}
        if self.cuda:
            self.marks[-1].synchronize()
            span = lambda a, b: a.elapsed_time(b) / 1e3  # noqa: E731
        else:
            span = lambda a, b: b - a  # noqa: E731
        wall = span(self.marks[0], self.marks[-1])
        busy = sum(span(a, b) for a, b in zip(self.marks[1:-1:2], self.marks[2:-1:2]))
        return {"wall_s": wall, "busy_s": busy, "bubble_fraction": max(0.0, 1.0 - busy / wall) if wall else 0.0}


class PipelineEngine:
    def __init__(self, ctx, schedule: str, num_microbatches: int, device: torch.device, overlap_p2p: bool = True,
                 overlap_moe_comm: bool = False):
        self.ctx, self.schedule, self.m = ctx, schedule, num_microbatches
        if overlap_moe_comm and (ctx.pp > 1 or num_microbatches < 2):
            raise ValueError("overlap_moe_comm runs without pipeline parallelism and with num_microbatches >= 2")
        self.overlap_moe_comm = overlap_moe_comm
        # the MoE token exchanges' side stream (overlap_moe_comm on CUDA)
        self.moe_stream = torch.cuda.Stream(device=device) if overlap_moe_comm and device.type == "cuda" else None
        self.pp, self.rank = ctx.pp, ctx.rank("pp")
        self.vpp = ctx.virtual_pipeline_size if ctx.vpp > 1 else None
        self.overlap_p2p = overlap_p2p and self.pp > 1
        # every rank's plan, simulated here: raises if it could deadlock or mismatch messages (the executor follows
        # this rank's plan only)
        self.plans, self.plan_bubble_fraction = {}, None
        for train in (True, False):
            ops, plans = exchange_plans(schedule, self.pp, self.m, self.vpp, self.overlap_p2p, train)
            sim = simulate_plans(ops, plans, self.pp, self.vpp)
            self.plans[train] = (ops[self.rank], plans[self.rank])
            if train:
                # the bubble this executor's exchanges allow with free communication (backward = 2 x forward)
                self.plan_bubble_fraction = sim["bubble_fraction"]
        # the schedule's own bubble under the same assumptions (schedules.simulate)
        self.ideal_bubble_fraction = simulate(schedule, self.pp, self.m, self.vpp)["bubble_fraction"]
        self.comm = None
        if self.overlap_p2p:
            self.comm = OverlappedComm(ctx.pipeline)
            ctx.pipeline.warmup_ring(device)
        elif self.pp > 1:
            self.comm = StageComm(ctx.pipeline)
            ctx.pipeline.warmup(device)
        self._timer: Optional[_Timer] = None

    def timing(self) -> dict:
        """The last training schedule on this rank: wall and busy seconds, the measured bubble fraction, the
        schedule's ideal one and the one its exchange plan allows (``plan_bubble_fraction``; above the ideal for the
        synchronous 1F1B, whose steady-state pairs hold their sends until both ops ran). Synchronises with the
        device once (call it when reporting, not every step)."""
        out = self._timer.result() if self._timer is not None else {}
        return {**out, "ideal_bubble_fraction": self.ideal_bubble_fraction,
                "plan_bubble_fraction": self.plan_bubble_fraction, "overlap_p2p": self.overlap_p2p}

    def run(self, module, batch: Any, train: bool, loss_scale: float = 1.0, grad_sync=None,
            forward_context: Callable = nullcontext) -> tuple[torch.Tensor, torch.Tensor]:
        """Every micro-batch through this rank's chunks (and back, when ``train``). Returns the detached mean LM loss
        over micro-batches (the same on every stage) and this rank's chunks' mean auxiliary loss."""
        model = module.pipeline_model()
        mbs = split_microbatches(batch, self.m)
        ops, plan = self.plans[train]
        param = next(p for p in model.parameters() if p.is_floating_point())
        shape, dtype, device = tuple(module.pipeline_input_shape(mbs[0])), param.dtype, param.device
        scale = loss_scale / self.m
        if train and self.overlap_moe_comm:
            return self._run_merged(module, mbs, scale, grad_sync, forward_context, device)
        last_b = {op.chunk: i for i, op in enumerate(ops) if op.kind == "B"}
        if train and grad_sync is not None and grad_sync.armed:
            grad_sync.expect_final([])  # from now on only the last backward of each chunk launches its buckets
        timer = _Timer(device) if train else None
        if timer:
            timer.mark()
        lm_sum = torch.zeros((), device=device, dtype=torch.float32)
        aux_sum = torch.zeros((), device=device, dtype=torch.float32)
        saved: dict = {}
        outputs: dict = {}  # message -> tensor, produced by an op and not posted yet
        inputs: dict = {}  # message -> receive buffer
        for i in range(len(ops) + 1):
            if self.comm is not None and plan.posts[i]:
                sends = [(msg, outputs.pop(msg)) for what, msg in plan.posts[i] if what == "send"]
                recvs = [(msg, torch.empty(shape, dtype=dtype, device=device))
                         for what, msg in plan.posts[i] if what == "recv"]
                inputs.update(recvs)
                self.comm.post(i, sends, recvs)
            if i == len(ops):
                break
            op = ops[i]
            recv_msg, send_msg = op_messages(op, self.rank, self.pp, self.vpp)
            if plan.waits[i] >= 0 and self.comm is not None:
                self.comm.wait(plan.waits[i])
            buf = inputs.pop(recv_msg) if recv_msg else None
            if timer:
                timer.mark()
            key = (op.microbatch, op.chunk)
            if op.kind == "F":
                x = buf.requires_grad_(train) if buf is not None else None
                with forward_context():
                    out, aux = module.pipeline_forward(op.chunk, mbs[op.microbatch], x)
                aux_sum += aux.detach().float()
                if model.is_last_chunk(op.chunk):
                    lm_sum += out.detach().float()
                    if train:
                        saved[key] = (x, ((out + aux) * scale,), (None,))
                else:
                    outputs[send_msg] = out.to(dtype)
                    if train:
                        roots, grads = [out], ["recv"]
                        if aux.requires_grad:  # a chunk with MoE layers: its aux loss joins the backward
                            roots.append(aux * scale)
                            grads.append(None)
                        saved[key] = (x, roots, grads)
            else:
                x, roots, grads = saved.pop(key)
                if grad_sync is not None and grad_sync.armed and i == last_b[op.chunk]:
                    grad_sync.expect_final(model.chunk_parameters(op.chunk))
                grads = [buf if g == "recv" else g for g in grads]
                torch.autograd.backward(list(roots), grads)
                if not model.is_first_chunk(op.chunk):
                    outputs[send_msg] = x.grad
            if timer:
                timer.mark()
        if self.comm is not None:
            self.comm.finish()  # the last sends; on CUDA the stream waits, the host does not
        if timer:
            timer.mark()
            self._timer = timer
        lm = self.ctx.all_reduce_(lm_sum / self.m, "pp")  # only the last stage computed it
        return lm, aux_sum / self.m

    def _run_merged(self, module, mbs: list, scale: float, grad_sync, forward_context: Callable,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``overlap_moe_comm`` (one pipeline stage): F(0), then the forward of each next micro-batch merged with
        the backward of the one before (``moe_overlap.run_merged``), then B(m - 1)."""
        model = module.pipeline_model()
        if grad_sync is not None and grad_sync.armed:
            grad_sync.expect_final([])
        timer = _Timer(device)
        timer.mark()
        lm_sum = torch.zeros((), device=device, dtype=torch.float32)
        aux_sum = torch.zeros((), device=device, dtype=torch.float32)
        previous = None
        for i in range(self.m + 1):
            tape = Tape(module.pipeline_forward_steps(0, mbs[i], None), scale, forward_context) if i < self.m else None
            if tape is None and grad_sync is not None and grad_sync.armed:
                grad_sync.expect_final(model.chunk_parameters(0))  # the last backward launches the buckets
            timer.mark()
            run_merged(tape, previous, self.moe_stream)
            timer.mark()
            if tape is not None:
                loss, aux = tape.result  # the MoE layers' auxiliary losses are roots of their own steps already
                lm_sum += loss.detach().float()
                aux_sum += aux.detach().float()
                tape.add_roots([loss * scale])
            previous = tape
        timer.mark()
        self._timer = timer
        return lm_sum / self.m, aux_sum / self.m
