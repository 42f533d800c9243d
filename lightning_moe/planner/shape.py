"""A model at one sequence length, as the planner sees it: per layer kind (dense or MoE), since layers of one kind
cost the same. It also holds the caches of one planning run (the search asks the same questions for thousands of
layouts); nothing is cached beyond the run."""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple, Optional

from lightning_moe.flops import layer_flops_per_token
from lightning_moe.modules.config import ModelConfig
from lightning_moe.planner.activations import layer_bytes, layer_terms
from lightning_moe.planner.candidate import pipeline_shape
from lightning_moe.planner.params import Params, embedding_params, head_params, layer_params
from lightning_moe.planner.settings import Settings
from lightning_moe.strategy.memory import optimizer_bytes_per_param
from lightning_moe.strategy.pipeline.partition import local_stages, partition_layers


class RankLayers(NamedTuple):
    kinds: tuple[tuple[int, int], ...]  # (dense, MoE) layers of each model chunk
    params: Params


def _stages(num_layers: int, pp: int, vpp: Optional[int], first: Optional[int], last: Optional[int]) -> list:
    """Per pipeline rank, the layer ranges of its model chunks."""
    ranges = partition_layers(num_layers, pp, vpp, first, last)
    return [[ranges[v] for v in local_stages(pp, r, vpp)] for r in range(pp)]


class ModelShape:
    def __init__(self, cfg: ModelConfig, seq: int):
        self.cfg, self.seq = cfg, seq
        self.flops = layer_flops_per_token(cfg, seq)
        self.is_moe = [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
        index = {moe: self.is_moe.index(moe) for moe in (False, True) if moe in self.is_moe}
        self.params = {moe: layer_params(cfg, i) for moe, i in index.items()}
        self._index = index
        self.terms = lru_cache(maxsize=None)(self._terms)
        self.kept = lru_cache(maxsize=None)(self._kept)
        self.ranks = lru_cache(maxsize=None)(self._ranks)
        self.peak_ranks = lru_cache(maxsize=None)(self._peak_ranks)
        self.pipeline = lru_cache(maxsize=None)(pipeline_shape)
        self.bytes_per_param = lru_cache(maxsize=None)(optimizer_bytes_per_param)

    def kinds(self, layers: range) -> tuple[int, int]:
        """(dense, MoE) layers in ``layers``."""
        moe = sum(self.is_moe[i] for i in layers)
        return len(layers) - moe, moe

    def stage_params(self, layers: list[range], first: bool, last: bool, pp: int) -> Params:
        dense, moe = (sum(k) for k in zip(*(self.kinds(r) for r in layers))) if layers else (0, 0)
        p = Params(*(dense * a + moe * b for a, b in zip(self.params.get(False, Params()),
                                                         self.params.get(True, Params()))))
        if first:
            p = p + embedding_params(self.cfg)
        if last:
            p = p + head_params(self.cfg, pp)
        return p

    def _ranks(self, pp: int, vpp: Optional[int], first: Optional[int], last: Optional[int]) -> list[RankLayers]:
        """Per pipeline rank: the (dense, MoE) layer counts of each of its chunks, and its parameters (before TP/EP
        sharding)."""
        out = []
        for r, chunks in enumerate(_stages(self.cfg.num_layers, pp, vpp, first, last)):
            kinds = tuple(self.kinds(ch) for ch in chunks)
            out.append(RankLayers(kinds, self.stage_params(list(chunks), r == 0, r == pp - 1, pp)))
        return out

    def _peak_ranks(self, pp: int, vpp: Optional[int], first: Optional[int], last: Optional[int]) -> tuple[int, ...]:
        """The pipeline ranks that can hold the peak: of ranks with the same layers the first (the schedules keep
        fewer micro-batches in flight on later ranks), and the last (the loss)."""
        firsts: dict[RankLayers, int] = {}
        for r, rank in enumerate(self.ranks(pp, vpp, first, last)):
            firsts.setdefault(rank, r)
        return tuple(sorted(set(firsts.values()) | {pp - 1}))

    def _terms(self, moe: bool, tp: int, cp: int, etp: int) -> dict[str, float]:
        return layer_terms(self.cfg, self._index[moe], tp, cp, etp)

    def _kept(self, moe: bool, settings: Settings, tp: int, cp: int, etp: int) -> tuple[float, float]:
        return layer_bytes(self.cfg, self._index[moe], settings, tp, cp, etp)
