"""DynamicContextParallel: for each micro-batch of packed documents, how many ranks share each row (the report's
dynamic context parallelism).

With ``context_parallel_size = c`` the c ranks of a CP group read the same B rows. Static CP splits every row over
all c ranks: balanced, but every layer exchanges K/V even when the documents are short. Per micro-batch this callback
picks a CP size c' among ``sizes`` (divisors of c): the c / c' sub-groups of c' ranks each take B·c'/c whole rows,
split over their c' ranks (every document in 2·c' zig-zag chunks, ``packed_context_parallel.py``). Long documents
push towards c' = c (one row's attention would overload a small group); short ones towards c' = 1 (more data
parallelism, no K/V exchange). The choice is the smallest c' whose busiest sub-group does at most ``1 + slack`` times
the work of a perfectly balanced split, the work of a row being its documents' training FLOPs (attention grows with
each document's length, the rest with its tokens; ``lightning_moe.flops``).

Every rank of a CP group reads the same rows, so they all make the same choice without communicating. The sub-groups
are created once at setup. Gradients stay those of one process: the loss of packed documents is normalised by the
targets of the whole global batch (``MoETransformer.lm_loss``), and the gradient reduction over DP x CP is unchanged.
"""

from __future__ import annotations

from typing import Optional, Sequence

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_moe.flops import training_flops_per_token


def _divisors(c: int) -> list[int]:
    return [d for d in range(1, c + 1) if c % d == 0]


def choose_cp(row_lengths: Sequence[Sequence[int]], c: int, sizes: Sequence[int], flops_of, slack: float) -> int:
    """The smallest CP size in ``sizes`` whose busiest sub-group's work per rank is within ``1 + slack`` of the
    balanced share; ``row_lengths``: each row's document lengths, ``flops_of(n)``: a document's work."""
    work = [sum(flops_of(n) for n in row) for row in row_lengths]
    balanced = sum(work) / c
    B = len(work)
    for size in sorted(sizes):
        per = B * size // c  # rows of one sub-group
        busiest = max(sum(work[j * per:(j + 1) * per]) for j in range(c // size)) / size
        if busiest <= (1 + slack) * balanced:
            return size
    return max(sizes)


class DynamicContextParallel(L.Callback):
    """Pick the context-parallel size of each micro-batch of packed documents.

    Args:
        sizes: the CP sizes to choose from, divisors of ``context_parallel_size`` (default: all of them).
        slack: how much more work than a balanced split the busiest rank may get before a larger CP size is used.

    Needs ``TokenDataModule(pack_documents=True, document_multiple=2 * context_parallel_size)`` and a per-rank batch
    divisible by ``context_parallel_size``. Under ``context_parallel_size=1`` there is nothing to choose: it says so
    once and leaves the run as it is (``sizes`` then go unchecked, so one configuration serves every layout). Reads
    each micro-batch's document lengths on the host (one small copy).
    Logs ``dynamic_cp/size``.
    """

    def __init__(self, sizes: Optional[Sequence[int]] = None, slack: float = 0.1):
        if slack < 0:
            raise ValueError(f"DynamicContextParallel(slack={slack}): must be >= 0")
        self.sizes, self.slack = (list(sizes) if sizes is not None else None), slack
        self._groups: dict[int, tuple[int, int, Optional[dist.ProcessGroup]]] = {}
        self._restore: Optional[dict] = None
        self._sizes: Optional[list[int]] = None
        self.choices: dict[int, int] = {}  # CP size -> micro-batches it was chosen for

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self._sizes is not None:  # fit, then validate or test: the sub-groups exist already
            return
        ctx = getattr(pl_module, "parallel_context", None)
        c = ctx.cp if ctx is not None else 1
        if c == 1:  # the same callback moves across layouts: on one CP rank there is nothing to choose
            rank_zero_info("DynamicContextParallel: context_parallel_size is 1, so every row stays on its rank")
            self._sizes = [1]
            return
        sizes = self.sizes if self.sizes is not None else _divisors(c)
        bad = [s for s in sizes if s < 1 or c % s]
        if bad:
            raise ValueError(f"DynamicContextParallel(sizes={self.sizes}): {bad} do not divide "
                             f"context_parallel_size={c}; valid: {_divisors(c)}")
        for name, size in (("tensor_parallel_size", ctx.tp), ("pipeline_parallel_size", ctx.pp)):
            if size > 1:
                raise ValueError(f"DynamicContextParallel needs {name}=1 (got {size}): the sub-groups it builds split "
                                 "the context-parallel ranks alone")
        if pl_module.config.load_balancing == "seq_aux_loss":
            raise ValueError("DynamicContextParallel: load_balancing='seq_aux_loss' counts each sequence over the "
                             "ranks that share it, which change per micro-batch; use aux_loss or global_aux_loss")
        self._sizes, self._c = sorted(sizes), c
        # every rank creates every sub-group (collective), keeping its own: consecutive CP ranks, c' at a time
        me = ctx.rank("cp")
        for size in self._sizes:
            if size in (1, c):
                continue
            for members in ctx.layout.groups["cp"]:
                members = list(members)
                for j in range(c // size):
                    sub = members[j * size:(j + 1) * size]
                    group = dist.new_group(sub)
                    if ctx.global_rank in sub:
                        self._groups[size] = (size, me % size, group)
        rank_zero_info(f"DynamicContextParallel: context-parallel size chosen per micro-batch among {self._sizes}")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._sizes == [1]:
            return
        if "document_ids" not in batch:
            raise ValueError("DynamicContextParallel needs packed documents: TokenDataModule(pack_documents=True, "
                             f"document_multiple={2 * self._c})")
        ctx, c = pl_module.parallel_context, self._c
        B = batch["document_ids"].shape[0]
        if B % c:
            raise ValueError(f"DynamicContextParallel: a per-rank batch of {B} rows does not split over "
                             f"context_parallel_size={c} ranks; use a batch_size divisible by {c}")
        doc_BS = batch["document_ids"].cpu()  # the one host copy: the choice needs the lengths on the host
        lengths = [torch.unique_consecutive(row, return_counts=True)[1].tolist() for row in doc_BS]
        cfg = pl_module.model.cfg
        size = choose_cp(lengths, c, self._sizes, lambda n: n * training_flops_per_token(cfg, n), self.slack)
        self.choices[size] = self.choices.get(size, 0) + 1
        pl_module.log("dynamic_cp/size", float(size), on_step=True, logger=True, batch_size=B)
        if size == c:
            return
        j, per = ctx.rank("cp") // size, B * size // c
        for key, value in list(batch.items()):
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == B:
                batch[key] = value[j * per:(j + 1) * per]  # this sub-group's whole rows
        entry = (1, 0, None) if size == 1 else self._groups[size]
        # only attention's group: the router's batch statistics stay over the ranks sharing the micro-batch (tp_cp)
        self._restore = ctx.swap(cp=entry)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._swap_back(pl_module)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._swap_back(pl_module)

    def _swap_back(self, pl_module) -> None:
        if self._restore is not None:
            pl_module.parallel_context.swap(**self._restore)
            self._restore = None
