"""Callbacks: throughput/MFU, expert load, loss report, recomputation."""

from lightning_moe.callbacks.expert_load import ExpertLoadMonitor
from lightning_moe.callbacks.loss_report import LossReport
from lightning_moe.callbacks.recompute import Recompute
from lightning_moe.callbacks.throughput import MoEThroughput

__all__ = ["ExpertLoadMonitor", "LossReport", "MoEThroughput", "Recompute"]
