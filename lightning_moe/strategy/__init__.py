"""Parallel folding: layout math, process groups, the MoEFoldStrategy and its gradient sync."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_moe.strategy.layout import Layout, build_layout
from lightning_moe.strategy.moe_fold import MoEFoldStrategy
from lightning_moe.strategy.parallel_context import ParallelContext

# Lightning discovers no strategies from other packages: importing lightning_moe registers "moe_fold".
MoEFoldStrategy.register_strategies(StrategyRegistry)

__all__ = ["Layout", "MoEFoldStrategy", "ParallelContext", "build_layout"]
