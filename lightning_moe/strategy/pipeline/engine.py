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
from lightning_moe.strategy.pipeline.schedules import (exchange_plans, merged_pairs, op_messages, simulate,
                                                       simulate_plans)


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
        if overlap_moe_comm and (num_microbatches < 2 or (ctx.pp > 1 and (
                schedule != "interleaved_1f1b" or not overlap_p2p or num_microbatches < 2 * ctx.pp))):
            raise ValueError("overlap_moe_comm needs num_microbatches >= 2 and, with pipeline parallelism, the "
                             "interleaved schedule with overlapped p2p and num_microbatches >= 2 x pp")
        self.overlap_moe_comm = overlap_moe_comm
        # the MoE token exchanges' side stream (overlap_moe_comm on CUDA)
        self.moe_stream = torch.cuda.Stream(device=device) if overlap_moe_comm and device.type == "cuda" else None
        self.pp, self.rank = ctx.pp, ctx.rank("pp")
        self.vpp = ctx.virtual_pipeline_size if ctx.vpp > 1 else None
        self.overlap_p2p = overlap_p2p and self.pp > 1
        # every rank's plan, simulated here: raises if it could deadlock or mismatch messages (the executor follows
        # this rank's plan only)
        self.plans, self.plan_bubble_fraction, self.pairs = {}, None, set()
        for train in (True, False):
            merged = train and overlap_moe_comm  # steady-state (F, B) pairs as one op (moe_overlap.run_merged)
            ops, plans = exchange_plans(schedule, self.pp, self.m, self.vpp, self.overlap_p2p or merged, train,
                                        merged)
            sim = simulate_plans(ops, plans, self.pp, self.vpp)
            self.plans[train] = (ops[self.rank], plans[self.rank])
            if merged:
                self.pairs = set(merged_pairs(ops[self.rank]))
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
                "plan_bubble_fraction": self.plan_bubble_fraction, "overlap_p2p": self.overlap_p2p,
                "merged_pairs": len(self.pairs)}

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
        tapes = train and self.overlap_moe_comm  # every op in steps, pairs merged (strategy/pipeline/moe_overlap.py)
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

        def forward(op, buf, tape=None):
            """The forward of ``op`` (run here, or, given its tape, already run); keeps what its backward needs."""
            nonlocal lm_sum, aux_sum
            _, send_msg = op_messages(op, self.rank, self.pp, self.vpp)
            x = buf.requires_grad_(train) if buf is not None else None
            if tape is None:
                with forward_context():
                    out, aux = module.pipeline_forward(op.chunk, mbs[op.microbatch], x)
            else:
                out, aux = tape.result  # the MoE layers' auxiliary losses are roots of their own steps
            aux_sum += aux.detach().float()
            if model.is_last_chunk(op.chunk):
                lm_sum += out.detach().float()
                if train:
                    loss = out * scale if tape is not None else (out + aux) * scale
                    saved[(op.microbatch, op.chunk)] = (x, (loss,), (None,), tape)
                return
            outputs[send_msg] = out.to(dtype)
            if train:
                roots, grads = [out], ["recv"]
                if tape is None and aux.requires_grad:  # a chunk with MoE layers: its aux loss joins the backward
                    roots.append(aux * scale)
                    grads.append(None)
                saved[(op.microbatch, op.chunk)] = (x, roots, grads, tape)

        def backward_roots(op, buf) -> tuple:
            x, roots, grads, tape = saved.pop((op.microbatch, op.chunk))
            return x, tape, list(roots), [buf if g == "recv" else g for g in grads]

        def backward_done(op, x) -> None:
            if not model.is_first_chunk(op.chunk):
                outputs[op_messages(op, self.rank, self.pp, self.vpp)[1]] = x.grad

        skip: set = set()  # the backward of a merged pair, run with its forward
        for i in range(len(ops) + 1):
            if self.comm is not None and plan.posts[i]:
                sends = [(msg, outputs.pop(msg)) for what, msg in plan.posts[i] if what == "send"]
                recvs = [(msg, torch.empty(shape, dtype=dtype, device=device))
                         for what, msg in plan.posts[i] if what == "recv"]
                inputs.update(recvs)
                self.comm.post(i, sends, recvs)
            if i == len(ops):
                break
            if i in skip:
                continue
            op = ops[i]
            if plan.waits[i] >= 0 and self.comm is not None:
                self.comm.wait(plan.waits[i])
            if timer:
                timer.mark()
            pair = [op] + ([ops[i + 1]] if tapes and i in self.pairs else [])
            if len(pair) == 2:
                skip.add(i + 1)
            bufs = [inputs.pop(m) if (m := op_messages(o, self.rank, self.pp, self.vpp)[0]) else None for o in pair]
            f_op = next((o for o in pair if o.kind == "F"), None)
            b_op = next((o for o in pair if o.kind == "B"), None)
            if b_op is not None and grad_sync is not None and grad_sync.armed and \
                    i + len(pair) - 1 == last_b[b_op.chunk]:
                grad_sync.expect_final(model.chunk_parameters(b_op.chunk))
            if not tapes:
                if f_op is not None:
                    forward(f_op, bufs[0])
                else:
                    x, _, roots, grads = backward_roots(b_op, bufs[0])
                    torch.autograd.backward(roots, grads)
                    backward_done(b_op, x)
            else:
                f_tape = x_f = None
                if f_op is not None:
                    x_f = bufs[0].requires_grad_() if bufs[0] is not None else None
                    f_tape = Tape(module.pipeline_forward_steps(f_op.chunk, mbs[f_op.microbatch], x_f), scale,
                                  forward_context)
                b_tape = x_b = None
                if b_op is not None:
                    x_b, b_tape, roots, grads = backward_roots(b_op, bufs[-1])
                    b_tape.add_roots(roots, grads)
                run_merged(f_tape, b_tape, self.moe_stream)
                if f_op is not None:
                    forward(f_op, x_f, f_tape)
                if b_op is not None:
                    backward_done(b_op, x_b)
            if timer:
                timer.mark()
        if self.comm is not None:
            self.comm.finish()  # the last sends; on CUDA the stream waits, the host does not
        if timer:
            timer.mark()
            self._timer = timer
        lm = self.ctx.all_reduce_(lm_sum / self.m, "pp")  # only the last stage computed it
        return lm, aux_sum / self.m
