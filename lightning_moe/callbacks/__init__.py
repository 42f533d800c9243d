"""Callbacks: throughput/MFU, expert load, loss report, recomputation, activation offloading, low precision,
dynamic context parallelism."""

from lightning_moe.callbacks.activation_offload import ActivationOffload
from lightning_moe.callbacks.dynamic_cp import DynamicContextParallel
from lightning_moe.callbacks.expert_load import ExpertLoadMonitor
from lightning_moe.callbacks.fp8_training import FP8Training
from lightning_moe.callbacks.nvfp4_training import NVFP4Training
from lightning_moe.callbacks.loss_report import LossReport
from lightning_moe.callbacks.recompute import Recompute
from lightning_moe.callbacks.throughput import MoEThroughput

__all__ = ["ActivationOffload", "DynamicContextParallel", "ExpertLoadMonitor", "FP8Training", "LossReport",
           "MoEThroughput", "NVFP4Training", "Recompute"]
