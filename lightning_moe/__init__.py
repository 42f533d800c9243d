"""lightning-moe: Mixture-of-Experts training for PyTorch Lightning with Megatron-style parallel folding."""

from lightning_moe.callbacks.activation_offload import ActivationOffload
from lightning_moe.callbacks.dynamic_cp import DynamicContextParallel
from lightning_moe.callbacks.expert_load import ExpertLoadMonitor
from lightning_moe.callbacks.fp8_training import FP8Training
from lightning_moe.callbacks.nvfp4_training import NVFP4Training
from lightning_moe.callbacks.loss_report import LossReport
from lightning_moe.callbacks.recompute import Recompute
from lightning_moe.callbacks.throughput import MoEThroughput
from lightning_moe.data import TokenDataModule
from lightning_moe.flops import peak_flops, training_flops_per_token
from lightning_moe.modules.config import ModelConfig
from lightning_moe.modules.dispatcher import DispatchState, TokenDispatcher
from lightning_moe.modules.lm import MoELanguageModel
from lightning_moe.modules.transformer import MoETransformer
from lightning_moe.planner import plan
from lightning_moe.strategy import Layout, MoEFoldStrategy, ParallelContext, build_layout
from lightning_moe.tokenize_documents import tokenize_documents

__all__ = [
    "ActivationOffload", "build_layout", "DispatchState", "DynamicContextParallel", "ExpertLoadMonitor",
    "FP8Training", "Layout", "LossReport",
    "ModelConfig", "MoEFoldStrategy", "MoELanguageModel", "MoEThroughput", "MoETransformer", "NVFP4Training",
    "ParallelContext",
    "peak_flops", "plan", "Recompute", "TokenDataModule", "TokenDispatcher", "tokenize_documents", "training_flops_per_token"
]
__version__ = "0.1.0"
