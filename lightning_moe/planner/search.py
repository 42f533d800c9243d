"""The layouts the planner considers: every folded layout that the strategy and the model accept, with pruning that
keeps large GPU counts to seconds.

Pruned, with the reason: TP no larger than a node (its collectives run in every layer); ETP no larger than TP (it
all-gathers the expert inputs of its group: only worth it where TP's already are, as Megatron's folding recipes
keep it); CP only when each rank keeps >= 1,024 tokens of a sequence (shorter chunks starve the attention kernels);
at most ``MAX_CHUNKS`` virtual chunks per rank.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Iterator, Optional

from lightning_moe.modules.config import ModelConfig
from lightning_moe.modules.transformer import check_model_layout
from lightning_moe.planner.candidate import Candidate
from lightning_moe.strategy.layout import check_sizes
from lightning_moe.strategy.pipeline.schedules import check_schedule

MAX_CHUNKS = 8
MIN_CP_TOKENS = 1024
MICRO_BATCHES = (1, 2, 4)  # tried when the user gives none


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def uneven_split(num_layers: int, stages: int) -> Optional[tuple[Optional[int], Optional[int]]]:
    """(first, last) stage layer counts when ``stages`` does not divide the layers evenly: the stages in between take
    the smallest even share that leaves the first and last (which also hold the embedding and the head) no more, e.g.
    DeepSeek-V3's 61 layers over 32 stages as 1, 30 x 2, 0 (Megatron's ``Et|(tt|)*30mL``). None: no such split."""
    if stages == 2:
        return num_layers // 2, None
    for share in range(1, num_layers // (stages - 2) + 1):
        ends = num_layers - share * (stages - 2)
        if 0 <= ends <= 2 * share:
            return -(-ends // 2), ends // 2
    return None


def layouts(cfg: ModelConfig, gpus: int, gpus_per_node: int, seq: int) -> Iterator[tuple[int, ...]]:
    """(tp, cp, pp, vpp, ep, etp, first, last) of every valid folded layout on ``gpus`` GPUs."""
    node = min(gpus, gpus_per_node)
    cfg = cfg.replace(seq_length=seq) if cfg.seq_length != seq else cfg
    for pp in (p for p in divisors(gpus) if p <= cfg.num_layers):
        for vpp in [None] + [v for v in range(2, MAX_CHUNKS + 1) if pp > 1 and cfg.num_layers >= pp * v]:
            stages = pp * (vpp or 1)
            first, last = (None, None) if cfg.num_layers % stages == 0 else (
                uneven_split(cfg.num_layers, stages) or (-1, -1))
            if first == -1:
                continue
            for tp in (t for t in divisors(gpus // pp) if t <= node):
                for cp in (c for c in divisors(gpus // (pp * tp)) if c == 1 or seq // c >= MIN_CP_TOKENS):
                    for etp in (e for e in divisors(gpus // pp) if e <= tp):
                        for ep in divisors(gpus // (pp * etp)):
                            sizes = SimpleNamespace(tp=tp, cp=cp, pp=pp, vpp=vpp, ep=ep, etp=etp)
                            try:
                                check_sizes(gpus, tp, cp, pp, ep, etp, vpp)
                                check_model_layout(cfg, sizes, first, last)
                            except ValueError:
                                continue
                            yield tp, cp, pp, vpp, ep, etp, first, last


def candidates(cfg: ModelConfig, gpus: int, gpus_per_node: int, seq: int, global_batch: int,
               micro_batch: Optional[int] = None) -> Iterator[Candidate]:
    """Every valid layout with every micro-batch size that splits ``global_batch`` evenly over its DP ranks."""
    for tp, cp, pp, vpp, ep, etp, first, last in layouts(cfg, gpus, gpus_per_node, seq):
        dp = gpus // (tp * cp * pp)
        for mb in (micro_batch,) if micro_batch else MICRO_BATCHES:
            if global_batch % (mb * dp):
                continue
            m = global_batch // (mb * dp)
            if pp > 1:
                try:
                    check_schedule("interleaved_1f1b" if vpp else "1f1b", pp, m, vpp)
                except ValueError:
                    continue
            yield Candidate(gpus, tp, cp, pp, vpp, ep, etp, mb, m, first, last)
