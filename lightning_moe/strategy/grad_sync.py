"""Gradient synchronisation and clipping for folded layouts.

Loss semantics: the objective is the mean over the dp x cp ranks of each rank's loss. Hence
  * dense gradients are summed over dp x cp and scaled by 1/(dp*cp); parameters replicated over TP whose gradients
    are partial on each TP rank (``grad_sum_over_tp``: norms under sequence parallelism, the router, shared q/k
    norms) are summed over tp x dp x cp in the same single all-reduce, with the same scale;
  * expert gradients already hold the contributions of every rank whose tokens reached the expert (through the
    dispatcher's backward), so they are summed over the expert-data-parallel group and scaled by the same
    1/(dp*cp) -- not 1/edp, the bug class of Megatron-LM #1628.

Buckets are all-reduced asynchronously as soon as backward has produced all of their gradients (post-accumulate-grad
hooks), in a fixed order per group so that every rank issues the same collectives in the same order.

With ``main_grads=True`` (bf16 parameters, Megatron's mixed precision) every parameter gets ``p.main_grad``, an fp32
view into its bucket's flat buffer. Each micro-batch's low-precision gradient is accumulated there and ``p.grad`` is
freed at once, so accumulation is in fp32 and the all-reduce runs in place on the flat buffer (no concatenation).

With ``shard=True`` (the distributed optimizer, ``sharded_optimizer.py``) each bucket is laid out as in
``flat_shards.py`` (aligned parameters, padded to split evenly over its group) and reduce-scattered in place instead:
afterwards each rank holds the reduced gradient of its own slice ``bucket.owned`` only.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from lightning_moe.modules import wgrad_fusion
from lightning_moe.strategy.comm import reduce_scatter_flat
from lightning_moe.strategy.flat_shards import bucket_layout, owned_slice
from lightning_moe.strategy.graph_deferral import HeldCopies
from lightning_moe.strategy.parallel_context import ParallelContext


def _capturing(t: torch.Tensor) -> bool:
    """Whether a GEMM writing ``t`` is being captured in a CUDA graph (``MoEFoldStrategy(cuda_graphs=True)``)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def is_expert_param(p: torch.Tensor) -> bool:
    return bool(getattr(p, "is_expert", False))


def grad_group(p: torch.Tensor, ctx: ParallelContext) -> str:
    """The group a parameter's gradient is summed over."""
    if is_expert_param(p):
        return "edp"
    return "tp_dp_cp" if ctx.tp > 1 and getattr(p, "grad_sum_over_tp", False) else "dp_cp"


def is_tp_sharded(p: torch.Tensor, ctx: ParallelContext) -> bool:
    return ctx.tp > 1 and getattr(p, "tp_shard_dim", None) is not None and not is_expert_param(p)


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    group_name: str
    reduce: bool = True  # False when the group has one rank: the bucket only holds main grads
    ready: int = 0
    buffer: Optional[torch.Tensor] = None  # fp32 flat main grads (main_grads mode) or a per-step concatenation
    handle: Optional[object] = None
    had_grad: list[bool] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # each param's start in ``buffer`` (main_grads mode)
    owned: tuple[int, int] = (0, 0)  # the slice of ``buffer`` this rank reduces and steps (all of it unless shard)


@dataclass
class _GroupState:
    buckets: list[_Bucket] = field(default_factory=list)
    next_launch: int = 0


class GradSync:
    def __init__(self, params: Iterable[torch.nn.Parameter], ctx: ParallelContext, bucket_mb: float = 25.0,
                 overlap: bool = True, main_grads: bool = False, shard: bool = False,
                 grad_dtype: Optional[torch.dtype] = torch.float32, fuse_wgrad: bool = False):
        """``grad_dtype``: of the main-grad buffers (None: each bucket's parameter dtype, e.g. bf16 when the optimizer
        steps bf16 weights). ``shard``: reduce-scatter (needs ``main_grads``). ``fuse_wgrad``: the dense linears'
        weight-gradient GEMMs accumulate into the main grads themselves (``modules/wgrad_fusion.py``)."""
        if shard and not main_grads:
            raise ValueError("GradSync(shard=True) needs main_grads=True (flat gradient buffers)")
        if fuse_wgrad and not main_grads:
            raise ValueError("GradSync(fuse_wgrad=True) needs main_grads=True (the buffers the GEMMs write into)")
        self.ctx, self.overlap, self.main_grads, self.shard = ctx, overlap, main_grads, shard
        self.scale = 1.0 / (ctx.dp * ctx.cp)
        self.params = [p for p in params if p.requires_grad]
        self.groups: dict[str, _GroupState] = {}
        self._bucket_of: dict[int, _Bucket] = {}
        self._armed = False
        # pipeline schedules: the params whose next gradient is their last of the step (None: every param's is)
        self._final: Optional[set[int]] = None
        self._hooks = []
        self._seen: set[int] = set()  # params that received a gradient since the last finish() (main_grads mode)
        self.had_main_grad: set[int] = set()  # the same set, frozen by finish() for the optimizer step
        self._fused: set[int] = set()  # params whose wgrad GEMM wrote main_grad since their hook last fired
        # params whose wgrad GEMM was captured in a CUDA graph: each replay adds into main_grad, zeroed by discard()
        self._graphed: dict[int, torch.nn.Parameter] = {}
        # ... and those whose deferred wgrad was: the graph copies whose operands its replays fill (graph_deferral.py);
        # the micro-batches of a step, set by MoEFoldStrategy before it captures (None: no capture), and the copy
        # being captured
        self._copies: dict[int, HeldCopies] = {}
        self.graph_window: Optional[int] = None
        self.capture_copy: Optional[int] = None  # set from the first copy's warm-up to the end of the last capture
        self._captured: set[int] = set()  # the weights whose deferred wgrad copy ``capture_copy`` captured
        self._replaying = 0  # the copy the last graphed forward replayed
        # the captured fused GEMMs' placeholder gradients: views of one buffer per dtype, made in the capture's warm-up
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}
        # defer_wgrad: param id -> (param, run, held operands of this step's micro-batches), and the params whose
        # hook is due to drop a placeholder without main_grad written
        self._deferred: dict[int, tuple] = {}
        self._holding: set[int] = set()
        # MoEFoldStrategy(defer_expert_wgrad): (defer, window) for the experts' bf16 wgrad (wgrad_fusion.grouped_wgrad);
        # whether anything was deferred yet, and whether the first step's check ran
        self.expert_deferral: tuple[bool, Optional[int]] = (False, None)
        self._deferred_any, self._deferral_checked = False, False
        limit = bucket_mb * 2**20
        by_group: dict[str, list] = {"dp_cp": [], "tp_dp_cp": [], "edp": []}
        for p in reversed(self.params):  # roughly the order in which backward produces gradients
            by_group[grad_group(p, ctx)].append(p)
        for name, plist in by_group.items():
            reduce = ctx.size(name) > 1
            if not plist or not (reduce or main_grads):
                continue
            state = self.groups[name] = _GroupState()
            cur, size = [], 0
            # one dtype per bucket where the buffers take the parameters' dtype (gradients or, sharded, parameters)
            by_dtype = not main_grads or grad_dtype is None or shard
            for p in plist:
                nbytes = p.numel() * (4 if main_grads else p.element_size())
                # sharded: a tied embedding gets a bucket of its own, laid out alike on the two stages it ties
                alone = shard and getattr(p, "pp_tied", False)
                if cur and (size + nbytes > limit or (by_dtype and p.dtype != cur[0].dtype) or alone
                            or getattr(cur[0], "pp_tied", False) and shard):
                    state.buckets.append(_Bucket(cur, name, reduce))
                    cur, size = [], 0
                cur.append(p)
                size += nbytes
            if cur:
                state.buckets.append(_Bucket(cur, name, reduce))
            for b in state.buckets:
                if main_grads:
                    self._make_buffer(b, grad_dtype)
                for p in b.params:
                    self._bucket_of[id(p)] = b
                    if main_grads or overlap:
                        self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        self.fused_params = []
        if fuse_wgrad:
            # not a tied weight: its other use's gradient would be summed with the placeholder before the hook
            self.fused_params = [p for p in self.params if getattr(p, "wgrad_fusable", False)
                                 and not getattr(p, "pp_tied", False) and id(p) in self._bucket_of]
            for p in self.fused_params:
                wgrad_fusion.attach(p, self)

    def _make_buffer(self, b: _Bucket, grad_dtype: Optional[torch.dtype]) -> None:
        numels = [p.numel() for p in b.params]
        size = self.ctx.size(b.group_name) if self.shard and b.reduce else 1
        if self.shard:
            b.offsets, total = bucket_layout(numels, size)
            b.owned = owned_slice(total, size, self.ctx.rank(b.group_name) if size > 1 else 0)
        else:
            b.offsets = [sum(numels[:i]) for i in range(len(numels))]
            total = sum(numels)
            b.owned = (0, total)
        b.buffer = torch.zeros(total, dtype=grad_dtype or b.params[0].dtype, device=b.params[0].device)
        for p, offset in zip(b.params, b.offsets):
            p.main_grad = b.buffer[offset:offset + p.numel()].view_as(p)

    def buckets(self) -> list[_Bucket]:
        """Every bucket, per group in a fixed order (the same on every rank)."""
        return [b for state in self.groups.values() for b in state.buckets]

    @torch.no_grad()
    def discard(self) -> None:
        """Forget the main grads accumulated so far (the optimizer's ``zero_grad``): the next gradient overwrites,
        except a captured GEMM's, which adds: those main grads are zeroed here."""
        for p in self._graphed.values():
            p.main_grad.zero_()
        for copies in self._copies.values():
            copies.reset()
        self._seen.clear()
        self._fused.clear()
        self._deferred.clear()
        self._holding.clear()

    def release(self) -> None:
        """Drop the hooks and the main-grad buffers (end of training)."""
        self.remove_hooks()
        self.graphs_released()
        self.discard()
        for p in self.params:
            wgrad_fusion.detach(p)
            if hasattr(p, "main_grad"):
                del p.main_grad
        for state in self.groups.values():
            for b in state.buckets:
                b.buffer = b.handle = None

    # ------------------------------------------------------------------ backward-time
    @property
    def armed(self) -> bool:
        return self._armed

    def arm(self) -> None:
        """The next backward is the last of this optimizer step: launch buckets as their gradients complete."""
        self._armed, self._final = True, None
        for state in self.groups.values():
            state.next_launch = 0
            for b in state.buckets:
                b.ready, b.handle = 0, None
                if not self.main_grads:
                    b.buffer = None

    def expect_final(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Pipeline schedules run several backwards inside the armed step: only the listed parameters' next gradient
        (the last micro-batch's backward of their model chunk) counts towards launching their buckets. The first
        call switches from "every gradient is final" to "only those listed so far"."""
        if self._final is None:
            self._final = set()
        self._final.update(id(p) for p in params)

    def accumulate_wgrad(self, p: torch.nn.Parameter, write) -> None:
        """A fused GEMM's backward: ``write(p.main_grad, first)`` puts (``first``) or adds this micro-batch's weight
        gradient there; the first gradient of a step overwrites, as the hook's copy would (a weight used twice in one
        backward adds its second). Captured in a CUDA graph it always adds, since every replay repeats it, into a main
        grad that ``discard`` zeroes; p's hook then drops each replay's placeholder gradient."""
        if _capturing(p.main_grad):
            write(p.main_grad, False)
            self._graphed[id(p)] = p
            return
        first = id(p) not in self._seen and id(p) not in self._fused
        write(p.main_grad, first)
        self._fused.add(id(p))

    def placeholder(self, p: torch.nn.Parameter, shape: Optional[torch.Size] = None) -> torch.Tensor:
        """The gradient a fused GEMM's backward hands autograd for p (``accumulate_wgrad``, ``defer_wgrad``), of p's
        shape or ``shape`` (a view of p's numel that the GEMM took), which p's hook drops unread. Inside a capture: a
        view of one buffer that every placeholder shares, made in the warm-up, since a captured one would be a static
        output of each graph, held as long as the graphs (one per weight and graph copy)."""
        shape, n = p.shape if shape is None else torch.Size(shape), p.numel()
        buf = self._placeholders.get(p.dtype)
        if _capturing(p.main_grad):
            if buf is not None and buf.numel() >= n and p.is_contiguous():
                return buf[:n].view(shape)
        elif self.capture_copy is not None and (buf is None or buf.numel() < n):  # the capture's warm-up
            self._placeholders[p.dtype] = torch.empty(n, dtype=p.dtype, device=p.device)
        return torch.empty_like(p) if shape == p.shape else torch.empty(shape, dtype=p.dtype, device=p.device)

    def graphs_released(self) -> None:
        """The captured GEMMs are gone: their weights' wgrads run eagerly again (overwriting at a step's first)."""
        self._graphed.clear()
        self._copies.clear()
        self._placeholders.clear()
        self.graph_window = self.capture_copy = None

    def begin_copy(self, k: int) -> None:
        """MoEFoldStrategy's capture: graph copy k's capture starts (copy 0's with the warm-up)."""
        self.capture_copy = k
        self._captured.clear()

    def graph_copies(self) -> int:
        """After the capture's warm-up: how many copies of the graphs the deferred wgrad needs (its window), else 1."""
        sizes = {c.size for c in self._copies.values()}
        if len(sizes) > 1:
            raise RuntimeError(f"deferred wgrad in CUDA graphs: windows {sorted(sizes)} differ between weights; the "
                               "graphs replay one copy per micro-batch for all of them")
        return sizes.pop() if sizes else 1

    def graph_copy(self) -> int:
        """The graph copy the next forward replays: the replays since the window's last pass (recorded: the weights'
        hooks check that its backward counts as that copy)."""
        self._replaying = max((c.filled for c in self._copies.values()), default=0)
        return self._replaying

    def new_step(self) -> None:
        """Before the forward of an optimizer step's first micro-batch (which picks its graph copy; ``discard`` runs
        after it): forget the replays of a window that an unfinished step left (Lightning skipped the rest of its
        epoch), as ``discard`` forgets eagerly held operands."""
        for copies in self._copies.values():
            copies.reset()

    def defer_wgrad(self, p: torch.nn.Parameter, held, run, window: Optional[int] = None) -> None:
        """A fused GEMM's backward whose weight gradient can wait for the step's last backward: ``held`` (this
        micro-batch's operands) is kept until p's last backward of the step (the armed one; under a pipeline schedule
        the one ``expect_final`` names), where ``run(main, first, helds)`` puts (``first``) or adds every held
        micro-batch's gradient into ``p.main_grad`` in one pass. Until then p's hook drops the placeholder gradient
        and leaves main_grad as it is. ``finish`` runs what is still held (a last backward that never reached p).
        ``window``: hold at most that many micro-batches; the backward that fills it runs them (bounding what is
        held, at one more pass over the main grad per window).

        Inside a CUDA graph capture the operands stay with graph copy ``capture_copy`` (``graph_deferral.py``), one
        copy per micro-batch of ``window``, at most ``graph_window`` (the micro-batches of a step), as the capture's
        warm-up found."""
        copies = self._copies.get(id(p))
        if _capturing(p.main_grad):
            if copies is None or self.capture_copy is None:
                raise RuntimeError("GradSync.defer_wgrad inside a CUDA graph capture without the warm-up that counts "
                                   "its copies (MoEFoldStrategy sets graph_window and capture_copy as it captures)")
            if id(p) in self._captured:  # one copy holds one micro-batch's operands per weight
                raise RuntimeError("CUDA graphs: a weight whose wgrad is deferred runs two GEMMs in one captured "
                                   "backward (used twice in the forward); turn defer_expert_wgrad off under graphs")
            self._captured.add(id(p))
            copies.capture(self.capture_copy, held, run)
            self._deferred_any = True
            return
        if copies is None and self.capture_copy is not None and self.graph_window is not None:  # capture's warm-up
            self._copies[id(p)] = HeldCopies(p, min(window or self.graph_window, self.graph_window))
        self._deferred_any = True
        helds = self._deferred.setdefault(id(p), (p, run, []))[2]
        helds.append(held)
        full = window is not None and len(helds) >= window
        final = self._is_final(p)
        if full or final:
            del self._deferred[id(p)]
            if final and copies is not None and copies.filled:  # graph replays of this step, before its bucket is due
                self._run_copies(copies)
            self.accumulate_wgrad(p, lambda main, first: run(main, first, helds))
        else:
            self._holding.add(id(p))

    def _is_final(self, p: torch.nn.Parameter) -> bool:
        """Whether this backward is p's last of the step (the armed one; under a pipeline schedule, the one named)."""
        return self._armed and (self._final is None or id(p) in self._final)

    def held(self, p: torch.nn.Parameter) -> list:
        """What ``defer_wgrad`` holds for ``p`` this step (in micro-batch order)."""
        entry = self._deferred.get(id(p))
        return entry[2] if entry is not None else []

    def _run_copies(self, copies: HeldCopies) -> None:
        """The pass over the filled graph copies' operands (``defer_wgrad`` under capture), queued after the replay
        that filled the last; then the next forward replays copy 0."""
        helds, run = copies.take(), copies.run
        self.accumulate_wgrad(copies.param, lambda main, first: run(main, first, helds))
        copies.reset()

    def _run_deferred(self) -> None:
        for p, run, helds in self._deferred.values():
            run(p.main_grad, id(p) not in self._seen and id(p) not in self._fused, helds)
            self._fused.discard(id(p))
            self._seen.add(id(p))
        for copies in self._copies.values():  # replays whose weight's last backward of the step never came
            if copies.filled:
                self._run_copies(copies)
                self._fused.discard(id(copies.param))
                self._seen.add(id(copies.param))
        self._deferred.clear()

    def _check_deferral(self) -> None:
        """After the first step: warn (once, on this rank) where ``expert_deferral`` is on and this rank's experts
        deferred nothing: their GEMMs do not take it (an FP8 wgrad that FP8Training does not defer, E5M2 gradients,
        DeepGEMM's blockwise experts, CUDA without triton), so the option did nothing here."""
        if self._deferral_checked or not self.expert_deferral[0]:
            return
        self._deferral_checked = True
        if not self._deferred_any and any(is_expert_param(p) for p in self.params):
            warnings.warn("MoEFoldStrategy(defer_expert_wgrad=...): no expert weight gradient was deferred in the "
                          "first step; this rank's expert GEMMs do not take it (it defers the bf16 expert wgrad: bf16 "
                          "experts with triton on CUDA, or FP8 ones with fp8_wgrad=False), so it has no effect here",
                          stacklevel=2)

    @torch.no_grad()
    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        if self.main_grads:
            if id(p) in self._holding:  # its wgrad waits for a later backward (defer_wgrad): p.grad is a placeholder
                self._holding.discard(id(p))
                if id(p) in self._fused:  # a full window ran in this backward before a later use was held
                    self._fused.discard(id(p))
                    self._seen.add(id(p))
                p.grad = None
                return
            # fp32 accumulation of this micro-batch's gradient; the first one of a step overwrites (no zeroing pass)
            copies = self._copies.get(id(p))
            if copies is not None and copies.run is not None and id(p) not in self._fused:  # a graph replay held it
                if copies.filled != self._replaying:
                    raise RuntimeError(f"CUDA graphs: the backward of graph copy {self._replaying} would count as copy "
                                       f"{copies.filled} of the deferred wgrad's window")
                final = self._is_final(p)
                if copies.replayed() or final:
                    self._run_copies(copies)  # into main_grad now: on to the fused case below
                    entry = self._deferred.pop(id(p), None) if final else None
                    if entry is not None:  # eager calls of this step (another shape) held before the replays
                        self.accumulate_wgrad(p, lambda main, first: entry[1](main, first, entry[2]))
                else:
                    p.grad = None
                    return
            if id(p) in self._fused:  # already in main_grad: p.grad is the fused GEMM's unread placeholder
                self._fused.discard(id(p))
                self._seen.add(id(p))
            elif id(p) in self._graphed:  # a graph replay added it there: p.grad is the graph's placeholder
                self._seen.add(id(p))
            elif id(p) in self._seen:
                p.main_grad.add_(p.grad)
            else:
                p.main_grad.copy_(p.grad)
                self._seen.add(id(p))
            p.grad = None
        if not self._armed or (self._final is not None and id(p) not in self._final):
            return
        b = self._bucket_of[id(p)]
        if not b.reduce or not self.overlap:
            return
        b.ready += 1
        self._launch_ready(self.groups[b.group_name])

    def _launch_ready(self, state: _GroupState, force: bool = False) -> None:
        while state.next_launch < len(state.buckets):
            b = state.buckets[state.next_launch]
            if b.reduce and not force and b.ready < len(b.params):
                return
            self._launch(b)
            state.next_launch += 1

    def _launch(self, b: _Bucket) -> None:
        if self.main_grads:
            b.had_grad = [id(p) in self._seen for p in b.params]
            for p, had in zip(b.params, b.had_grad):
                if not had:  # stale from an earlier step: join with zeros so every rank reduces the same buffer
                    p.main_grad.zero_()
        else:
            # unused params (no grad) join with zeros so every rank issues the same collective; finish() restores
            # None
            b.had_grad = [p.grad is not None for p in b.params]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
            b.buffer = torch.cat([g.reshape(-1) for g in grads])
        if b.reduce and self.shard:  # in place: this rank's slice receives its reduced gradients
            lo, hi = b.owned
            b.handle = reduce_scatter_flat(b.buffer[lo:hi], b.buffer, self.ctx.group(b.group_name))
        elif b.reduce:
            b.handle = dist.all_reduce(b.buffer, group=self.ctx.group(b.group_name), async_op=True)

    # ------------------------------------------------------------------ step-time
    @torch.no_grad()
    def finish(self) -> None:
        """Complete every bucket (launching any not yet launched), write back, and apply the 1/(dp*cp) scale.

        In main_grads mode the result is in ``p.main_grad`` for the params in ``had_main_grad``; ``p.grad`` stays
        None. Otherwise it is in ``p.grad`` (None for params that got no gradient on any rank's view)."""
        self._run_deferred()
        self._check_deferral()
        for state in self.groups.values():
            self._launch_ready(state, force=True)
        for state in self.groups.values():
            for b in state.buckets:
                if b.handle is not None:
                    b.handle.wait()
                if not self.main_grads:
                    offset = 0
                    for p, had_grad in zip(b.params, b.had_grad):
                        n = p.numel()
                        p.grad = b.buffer[offset:offset + n].view_as(p) if had_grad else None
                        offset += n
                    b.buffer = None
                elif self.scale != 1.0:
                    b.buffer[b.owned[0]:b.owned[1]].mul_(self.scale)
                b.handle = None
        if self.main_grads:
            self.had_main_grad, self._seen = self._seen, set()
        elif self.scale != 1.0:
            grads = [p.grad for p in self.params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, self.scale)
        self._sum_tied_embeddings()
        self._armed, self._final = False, None

    def _sum_tied_embeddings(self) -> None:
        """Tied embeddings under PP: the first stage's embedding and the last stage's copy each hold part of the
        gradient of the one logical weight; both get the sum, so they stay identical after every step."""
        pipe = self.ctx.pipeline
        for p in self.params:
            if not getattr(p, "pp_tied", False) or pipe is None:
                continue
            if self.main_grads:
                had = id(p) in self.had_main_grad
                grad = p.main_grad if had else p.main_grad.zero_()
                self.had_main_grad.add(id(p))
                if self.shard:  # alone in its bucket, laid out alike on both stages: sum the owned slices
                    b = self._bucket_of[id(p)]
                    grad = b.buffer[b.owned[0]:b.owned[1]]
            else:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grad = p.grad
            dist.all_reduce(grad, group=pipe.embed)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


@torch.no_grad()
def global_grad_norm(params: Iterable[torch.nn.Parameter], ctx: ParallelContext,
                     norm_type: float = 2.0) -> torch.Tensor:
    """The norm over every distinct parameter of the model, each counted once.

    Dense parameters are replicated over dp x cp (and identical after sync): counted locally, except TP shards,
    which differ across the TP group: summed over tp. Expert shards differ across the etp x ep group and are
    replicated over edp: summed over etp_ep.
    """
    dense, sharded, expert = [], [], []
    params = list(params)
    for p in params:
        if p.grad is not None and not getattr(p, "pp_tied_copy", False):
            (expert if is_expert_param(p) else sharded if is_tp_sharded(p, ctx) else dense).append(p.grad)
    grads = dense or sharded or expert
    device = grads[0].device if grads else (params[0].device if params else torch.device("cpu"))
    inf = math.isinf(norm_type)

    def local(gs):
        if not gs:  # still joins the collectives below: other ranks (e.g. other pipeline stages) wait in them
            return torch.zeros((), device=device, dtype=torch.float32)
        norms = torch.stack([n.float() for n in torch._foreach_norm(gs, norm_type)])
        return norms.max() if inf else norms.pow(norm_type).sum()

    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    expert_part = ctx.all_reduce_(local(expert), "etp_ep", op=op)
    sharded_part = ctx.all_reduce_(local(sharded), "tp", op=op)
    dense_part = torch.maximum(local(dense), sharded_part) if inf else local(dense) + sharded_part
    total = torch.maximum(dense_part, expert_part) if inf else dense_part + expert_part
    total = ctx.all_reduce_(total, "pp", op=op)  # pipeline stages hold disjoint parameters
    return total if inf else total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_global_(params: Iterable[torch.nn.Parameter], max_norm: float, ctx: ParallelContext,
                           norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with the true global norm. No host sync: the coefficient stays a tensor."""
    params = list(params)
    total = global_grad_norm(params, ctx, norm_type)  # collective: also on a rank without gradients
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return total
