"""MoEFoldStrategy: Lightning strategy for MoE Parallel Folding (attention TPxCPxDPxPP, MoE ETPxEPxEDPxPP).

The strategy owns the process groups (one ParallelContext handed to the LightningModule before
``configure_model``), data sharding over attention-DP ranks, gradient sync (dense over dp x cp, experts over edp,
bucketed and overlapped with the last backward of each step) and global-norm gradient clipping.

Several nodes: ``Trainer(num_nodes=N, devices=D)`` under torchrun or srun (Lightning's TorchElasticEnvironment or
SLURMEnvironment). The launch must be N x D processes; the groups that cross nodes are found from each rank's node at
setup (``placement.py``), and rank 0 warns when TP, CP, ETP or EP groups do.
"""

from __future__ import annotations

import os
import shutil
import sys
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor

from lightning_moe.strategy.checkpoint import load_sharded, save_sharded
from lightning_moe.strategy.checkpoint_state import fill_checkpoint, split_checkpoint
from lightning_moe.strategy.cuda_graphs import capture_blocks, release_blocks, unsupported_layout
from lightning_moe.strategy.manual_gc import ManualGC, check_interval
from lightning_moe.strategy.reshard import load_pieces, save_pieces
from lightning_moe.strategy.grad_sync import GradSync, is_expert_param
from lightning_moe.strategy.layout import Layout, build_layout
from lightning_moe.strategy.liveness import Liveness, lost_after_for
from lightning_moe.strategy.main_params import MainParams
from lightning_moe.strategy.optimizer_options import OptimizerOptions
from lightning_moe.strategy.optimizer_hooks import OptimizerHooks
from lightning_moe.strategy.sharded_optimizer import ShardedOptimizer
from lightning_moe.strategy import sigterm
from lightning_moe.strategy.parallel_context import ParallelContext
from lightning_moe.strategy.placement import crossing_groups, placement_warning
from lightning_moe.strategy.pipeline.engine import PipelineEngine
from lightning_moe.strategy.pipeline.schedules import check_schedule, simulate


def _batch_args(args: tuple, kwargs: dict) -> tuple[Any, int]:
    batch = args[0] if args else kwargs["batch"]
    batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
    return batch, batch_idx


def _is_collective_error(e: BaseException) -> bool:
    """A failed or timed-out collective (NCCL raises DistError subclasses, gloo plain RuntimeErrors)."""
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and any(
        s in str(e) for s in ("gloo", "NCCL", "Connection closed by peer", "Connection reset by peer", "Timed out")))


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def _check_overlap_moe_comm(on, pp: int, num_microbatches: int, ep: int, etp: int, cuda_graphs: bool,
                            schedule: str, overlap_p2p: bool) -> None:
    if not isinstance(on, bool):
        raise ValueError(f"MoEFoldStrategy: overlap_moe_comm must be True or False, got {on!r}")
    if not on:
        return
    why = (f"it needs num_microbatches >= 2 (got {num_microbatches}): one micro-batch's exchanges overlap another's "
           "compute" if num_microbatches < 2 else
           "expert_parallel_size x expert_tensor_parallel_size = 1 has no token exchange to overlap"
           if ep * etp == 1 else
           "CUDA graphs capture whole blocks, which the merged schedule runs in steps" if cuda_graphs else
           f"with pipeline parallelism it needs the interleaved schedule (virtual_pipeline_size >= 2), not "
           f"{schedule!r}: merged 1F1B pairs would wait for each other stage by stage, as in Megatron"
           if pp > 1 and schedule != "interleaved_1f1b" else
           "with pipeline parallelism it needs overlap_p2p_comm=True (the merged pairs' exchange plan)"
           if pp > 1 and not overlap_p2p else
           f"with pipeline parallelism it needs num_microbatches >= 2 x pipeline_parallel_size = {2 * pp} (got "
           f"{num_microbatches}): with fewer the schedule has no steady state to merge"
           if pp > 1 and num_microbatches < 2 * pp else None)
    if why:
        raise ValueError(f"MoEFoldStrategy(overlap_moe_comm=True): {why}")


class MoEFoldStrategy(OptimizerHooks, ParallelStrategy):
    """Train MoE models with attention and MoE layers on separate, folded process groups.

    Args:
        tensor_parallel_size, context_parallel_size, pipeline_parallel_size: attention layout (DP is derived).
        expert_parallel_size, expert_tensor_parallel_size: MoE layout (EDP is derived).
        virtual_pipeline_size: model chunks per pipeline rank for the interleaved schedule (None: one).
        num_microbatches: each rank's batch is split into this many micro-batches, which the pipeline schedule runs
            through the stages inside one training step (gradients accumulate over them; the Trainer's
            ``accumulate_grad_batches`` still multiplies on top). Without PP this is gradient accumulation within
            the step.
        pipeline_schedule: ``"1f1b"`` (default), ``"interleaved_1f1b"`` (default with ``virtual_pipeline_size``)
            or ``"afab"`` (all forwards, then all backwards).
        pipeline_first_stage_layers, pipeline_last_stage_layers: layer counts of the first and last (virtual)
            pipeline stages; the other layers split evenly over the other stages (default: an even split).
        overlap_p2p_comm: pipeline transfers run while the stages compute (Megatron's ``overlap_p2p_comm``): each
            op's output is sent right after it, receives are posted ahead as one batch per step on one group per
            pipeline, and an op waits on the GPU only for its own input (``schedules.overlap_plan``; every plan is
            checked for deadlocks by ``schedules.simulate_plans`` before training). On by default: bitwise the same
            numbers as the synchronous exchanges on gloo and over NCCL, and 1.83x the tokens/s of them for qwen3 in
            PP2 on 2 H200s (docs/PERFORMANCE.md). False: the synchronous exchanges, each completed with a device
            synchronisation before the stage computes again.
        overlap_moe_comm: Megatron's ``--overlap-moe-expert-parallel-comm``: with ``num_microbatches`` >= 2, the
            forward of one micro-batch runs merged with the backward of another, so that every MoE token exchange
            (dispatch, combine and their backwards) of one runs on a side stream while the other computes
            (``strategy/pipeline/moe_overlap.py``). Without PP: F(0), then F(i+1) with B(i), then the last B. With
            PP: the interleaved schedule's steady-state pairs, one warmup forward more, as Megatron's combined 1F1B
            (needs ``virtual_pipeline_size`` >= 2, ``overlap_p2p_comm`` and ``num_microbatches`` >= 2 x pp). Needs
            an MoE layout with token exchanges (ep x etp > 1); the same numbers as without it. Composes with
            ``Recompute``'s fine-grained modules; CUDA graphs, ``Recompute(["full"])`` / ``["moe"]`` and
            ``ActivationOffload`` are refused.
        sequence_parallel: shard activations over TP outside the TP regions (default: on when TP > 1).
        bucket_size_mb: gradient all-reduce bucket size.
        overlap_grad_sync: launch bucket all-reduces during the last backward of each step.
        fp32_main_params: with bf16/fp16 weights (``Trainer(precision="bf16-true")``), accumulate gradients in fp32
            and let the optimizer step fp32 copies of the weights, as Megatron does with ``--bf16``. The default
            (None) turns this on whenever the optimizer holds bf16/fp16 parameters; False steps them in their own
            precision (plain Lightning ``bf16-true``). Checkpoints then hold the fp32 weights.
        timeout: seconds (or timedelta) a collective may wait before failing, e.g. when another rank hangs. A rank
            whose process or host is gone is noticed sooner, after ``min(timeout / 2, 60 s)`` without a heartbeat
            (``strategy/liveness.py``): every other rank then stops, naming it.
        process_group_backend: defaults to NCCL on CUDA and gloo on CPU.
        cuda_graphs: capture every transformer block's forward and backward in CUDA graphs at the first training
            batch (``strategy/cuda_graphs.py``): no host launch overhead inside the blocks. Needs CUDA, bf16 weights
            (``precision="bf16-true"``, not autocast), and a layout without collectives inside the blocks
            (tp = cp = ep = etp = 1, no pipeline schedule). Data parallelism is allowed (its all-reduce runs in
            hooks outside the graphs) but so far was tested on one GPU only.
        distributed_optimizer: Megatron's distributed optimizer (ZeRO-1, ``strategy/sharded_optimizer.py``): gradient
            buckets are reduce-scattered (dense over dp x cp, experts over edp), each rank keeps and steps only its
            slice of the main params and optimizer state, and the new weights are all-gathered bucket by bucket.
            Needs an elementwise optimizer (SGD, Adam, AdamW, ...).
        overlap_param_gather: with the distributed optimizer, each bucket's weight all-gather overlaps the next
            forward (a module waits only for its own weights' buckets); False waits for all right after the step.
        main_params_dtype: ``"fp32"`` or ``"bf16"``, the dtype the optimizer steps bf16 weights in (the precision-aware
            optimizer's name for ``fp32_main_params``; give one of the two).
        exp_avg_dtype, exp_avg_sq_dtype: ``"fp32"`` or ``"bf16"``: the dtype Adam's first and second moments are
            stored in (Megatron's precision-aware optimizer; computed in the main params' dtype, one bucket at a
            time). Default: the main params' dtype.
        optimizer_cpu_offload: the fraction (0..1) of each rank's optimizer slice (main params and state) kept on the
            host and stepped there by torch's fused CPU kernel (Megatron's ``--optimizer-cpu-offload`` with
            ``--optimizer-offload-fraction``). Gradients go to the host and new weights back on side streams.
        skip_nonfinite_steps: N: skip the optimizer step whenever the global gradient norm is NaN or infinite (the
            weights and optimizer state stay those of the last finite step; a warning says so), and stop the run with
            an error after N such steps in a row. None (default): step whatever the norm. Not with the distributed
            optimizer yet.
        gradient_accumulation_fusion: Megatron's ``--gradient-accumulation-fusion``: the weight-gradient GEMMs of the
            dense linears (attention and MLA projections, dense FFN, shared experts, an untied head) and of the experts
            write their fp32 result straight into the main grads, first micro-batch of a step, or add it there
            (cuBLAS's epilogue for the linears, a Triton grouped GEMM's for the experts), so no bf16 gradient is
            written and read back (``modules/wgrad_fusion.py``, which says what it does not cover and why). Inside
            CUDA graphs the captured GEMMs always add, into main grads zeroed at the step's ``zero_grad``. None
            (default): on wherever main grads exist (``precision="bf16-true"``). True where it cannot apply is
            refused.
        fused_optimizer_writeback: torch's Adam/AdamW on the fp32 main params and the write-back of the bf16 weights in
            one Triton kernel per parameter (``strategy/fused_adam.py``; Transformer Engine's FusedAdam with master
            weights): 30 instead of 34 bytes per parameter and step. The optimizer's state, hooks, LR schedulers and
            checkpoints stay torch's. With the distributed optimizer each rank's device slices write their part of
            the bf16 weights before the all-gather (not with bf16 moments, nor for the slices stepped on the host).
            None (default): on wherever it applies (CUDA, Triton, bf16 weights with fp32 main params,
            torch.optim.Adam/AdamW without amsgrad or a tensor LR); True where it cannot apply is refused, naming
            why.
        defer_expert_wgrad: the experts' bf16 weight gradient (bf16 experts, and FP8 ones with
            ``FP8Training(fp8_wgrad=False)``) once per optimizer step, at its last backward, over every micro-batch's
            held operands in one pass (``triton_grouped_wgrad.wgrad_segments_into``), instead of a read, add and
            write of the fp32 main grads at every micro-batch: at fine-grained experts under gradient accumulation
            that traffic bounds the wgrad (docs/PERFORMANCE.md). An int N >= 2 holds at most N micro-batches (one
            pass per window). Costs memory: the GEMMs' bf16 inputs and output gradients stay held until their window
            runs (2 bytes per routed token and feature of both expert GEMMs, per micro-batch). Float32 sums in another
            order, not the same bits. Held inputs stay on the GPU until their window runs, so they also cancel what
            ``ActivationOffload("expert_fc1")`` or ``Recompute(["moe_act"])`` would save on them. Needs
            gradient-accumulation fusion (bf16 weights); refused, naming why, where it is off. Under ``cuda_graphs``
            the blocks are captured once per micro-batch of the window, each copy's graphs keeping its operands
            (``strategy/graph_deferral.py``): the capture takes that many times longer, and each copy's static
            tensors (about three activations per block) stay in memory besides the operands (all of the step's
            micro-batches without an N; on an 80 GB H100 Qwen3's 4 layers at 2 x 8 need N = 4).
            ``FP8Training(defer_expert_wgrad=...)`` sets the FP8 experts' own (their FP8 wgrad); FP8Training refuses
            this option where its experts' wgrad would not take it, and a rank whose experts deferred nothing in the
            first step warns.
        manual_gc: Megatron's ``--manual-gc`` with ``--manual-gc-interval N``: Python's automatic garbage collector
            is off while training runs (what is alive when it starts is frozen out of collections), and a full
            collection runs every N optimizer steps, at the same step on every rank (``strategy/manual_gc.py``), so
            that no rank's collection lands in a random step. 0: no collection during training (garbage with
            reference cycles then stays until it ends). None (default): Python's own collector. On one H200 it did not
            change Qwen3's step (docs/PERFORMANCE.md): the automatic collector made no full collection there.
    """

    strategy_name = "moe_fold"

    def __init__(self, tensor_parallel_size: int = 1, context_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1, expert_parallel_size: int = 1,
                 expert_tensor_parallel_size: int = 1, virtual_pipeline_size: Optional[int] = None,
                 num_microbatches: int = 1, sequence_parallel: Optional[bool] = None,
                 pipeline_schedule: Optional[str] = None, pipeline_first_stage_layers: Optional[int] = None,
                 pipeline_last_stage_layers: Optional[int] = None, overlap_p2p_comm: bool = True,
                 overlap_moe_comm: bool = False, bucket_size_mb: float = 25.0,
                 overlap_grad_sync: bool = True, fp32_main_params: Optional[bool] = None,
                 timeout: Union[float, timedelta] = 1800.0,
                 process_group_backend: Optional[str] = None, cuda_graphs: bool = False,
                 distributed_optimizer: bool = False, overlap_param_gather: bool = True,
                 main_params_dtype: Optional[str] = None, exp_avg_dtype: Optional[str] = None,
                 exp_avg_sq_dtype: Optional[str] = None, optimizer_cpu_offload: float = 0.0,
                 skip_nonfinite_steps: Optional[int] = None,
                 gradient_accumulation_fusion: Optional[bool] = None,
                 fused_optimizer_writeback: Optional[bool] = None,
                 defer_expert_wgrad: Union[bool, int] = False, manual_gc: Optional[int] = None, accelerator=None,
                 parallel_devices: Optional[list[torch.device]] = None,
                 cluster_environment: Optional[ClusterEnvironment] = None, checkpoint_io: Optional[CheckpointIO] = None,
                 precision_plugin: Optional[Precision] = None) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        sizes = dict(tensor_parallel_size=tensor_parallel_size, context_parallel_size=context_parallel_size,
                     pipeline_parallel_size=pipeline_parallel_size, expert_parallel_size=expert_parallel_size,
                     expert_tensor_parallel_size=expert_tensor_parallel_size, num_microbatches=num_microbatches)
        for name, v in sizes.items():
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"MoEFoldStrategy: {name} must be a positive integer, got {v!r}")
        if virtual_pipeline_size is not None and (not isinstance(virtual_pipeline_size, int)
                                                  or virtual_pipeline_size < 1):
            raise ValueError(f"MoEFoldStrategy: virtual_pipeline_size must be a positive integer or None, got "
                             f"{virtual_pipeline_size!r}")
        if virtual_pipeline_size is not None and pipeline_parallel_size == 1:
            raise ValueError(f"MoEFoldStrategy(virtual_pipeline_size={virtual_pipeline_size}) needs "
                             "pipeline_parallel_size > 1")
        if pipeline_schedule is None:
            pipeline_schedule = "interleaved_1f1b" if (virtual_pipeline_size or 1) > 1 else "1f1b"
        vpp = virtual_pipeline_size if (virtual_pipeline_size or 1) > 1 else None
        check_schedule(pipeline_schedule, pipeline_parallel_size, num_microbatches, vpp)  # ValueError naming why
        if not isinstance(overlap_p2p_comm, bool):
            raise ValueError(f"MoEFoldStrategy: overlap_p2p_comm must be True or False, got {overlap_p2p_comm!r}")
        if pipeline_parallel_size > 1 and num_microbatches < pipeline_parallel_size:
            bubble = simulate(pipeline_schedule, pipeline_parallel_size, num_microbatches, vpp)["bubble_fraction"]
            rank_zero_warn(f"MoEFoldStrategy: num_microbatches={num_microbatches} < pipeline_parallel_size="
                           f"{pipeline_parallel_size} leaves the pipeline idle {bubble:.0%} of the time; use at "
                           "least as many micro-batches as stages (Megatron uses >= 4x)")
        _check_overlap_moe_comm(overlap_moe_comm, pipeline_parallel_size, num_microbatches, expert_parallel_size,
                                expert_tensor_parallel_size, cuda_graphs, pipeline_schedule, overlap_p2p_comm)
        self.overlap_moe_comm = overlap_moe_comm
        if cuda_graphs:
            why = unsupported_layout(tensor_parallel_size, context_parallel_size, expert_parallel_size,
                                     expert_tensor_parallel_size, pipeline_parallel_size, num_microbatches)
            if why:
                raise ValueError(f"MoEFoldStrategy(cuda_graphs=True) cannot capture this layout: {why}")
        self.cuda_graphs = bool(cuda_graphs)
        self._graphs: Optional[tuple] = None  # (captured blocks, hook handles)
        if sequence_parallel and tensor_parallel_size == 1:
            rank_zero_warn("MoEFoldStrategy(sequence_parallel=True) has no effect without tensor parallelism "
                           "(tensor_parallel_size=1); it is turned off.")
            sequence_parallel = False
        self.tp, self.cp, self.pp = tensor_parallel_size, context_parallel_size, pipeline_parallel_size
        self.ep, self.etp, self.vpp = expert_parallel_size, expert_tensor_parallel_size, virtual_pipeline_size
        self.num_microbatches = num_microbatches
        self.pipeline_schedule = pipeline_schedule
        self.overlap_p2p_comm = overlap_p2p_comm
        self.pipeline_first_stage_layers, self.pipeline_last_stage_layers = (pipeline_first_stage_layers,
                                                                             pipeline_last_stage_layers)
        self._pipeline: Optional[PipelineEngine] = None
        self._pipeline_backward_done = False
        self._skip_zero_grad = False
        # Megatron's recommendation: with TP, shard norms/residuals over the sequence too (less memory and compute)
        self.sequence_parallel = bool(sequence_parallel) if sequence_parallel is not None else self.tp > 1
        self.bucket_size_mb, self.overlap_grad_sync = bucket_size_mb, overlap_grad_sync
        self.optimizer_options = OptimizerOptions.parse(distributed_optimizer, overlap_param_gather, fp32_main_params,
                                                        main_params_dtype, exp_avg_dtype, exp_avg_sq_dtype,
                                                        optimizer_cpu_offload, gradient_accumulation_fusion,
                                                        fused_optimizer_writeback, defer_expert_wgrad)
        self.fp32_main_params = self.optimizer_options.main_params_fp32
        self.manual_gc = check_interval(manual_gc)
        self._gc: Optional[ManualGC] = None
        self._main_params: Optional[MainParams] = None
        self._sharded: Optional[ShardedOptimizer] = None
        if skip_nonfinite_steps is not None and (not isinstance(skip_nonfinite_steps, int) or skip_nonfinite_steps < 1):
            raise ValueError(f"MoEFoldStrategy: skip_nonfinite_steps must be a positive integer or None, got "
                             f"{skip_nonfinite_steps!r}")
        if skip_nonfinite_steps is not None and distributed_optimizer:
            raise ValueError("MoEFoldStrategy(skip_nonfinite_steps=...) does not work with distributed_optimizer=True "
                             "yet (a skipped step would leave the sharded optimizer's buckets half-way); use one")
        self.skip_nonfinite_steps, self.skipped_steps = skip_nonfinite_steps, 0
        self._nonfinite_in_a_row, self._last_grad_norm = 0, None
        # routers' non-finite-logits flags: (name, module) list, this step's flags, and CUDA copies not read yet
        self._router_modules: Optional[list] = None
        self._router_flags: Optional[Tensor] = None
        self._router_pending: list = []
        self._biases_before: list = []  # (expert bias, its value before this step's update), with the guard on
        self._timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
        self._process_group_backend = process_group_backend
        self._liveness: Optional[Liveness] = None
        self.num_nodes = 1
        self.layout: Optional[Layout] = None
        # set up by setup_environment: the node of each global rank, the groups of each kind that span nodes
        self.node_of_rank: Optional[tuple[int, ...]] = None
        self.cross_node_groups: dict[str, tuple[tuple[int, ...], ...]] = {}
        self._placement_warned = False
        self.parallel_context: Optional[ParallelContext] = None
        self._grad_sync: Optional[GradSync] = None

    # ------------------------------------------------------------------ layout and processes
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # data is sharded over attention-DP ranks only: TP/CP ranks see the same samples
        ctx = self.parallel_context
        if ctx is None:
            return {"num_replicas": self.world_size, "rank": self.global_rank}
        return {"num_replicas": ctx.dp, "rank": ctx.rank("dp")}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    def _make_layout(self, world_size: int) -> Layout:
        return build_layout(world_size, tp=self.tp, cp=self.cp, pp=self.pp, ep=self.ep, etp=self.etp, vpp=self.vpp)

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # validate the layout now, in the launching process, before any worker or process group exists
        self._make_layout(self.num_nodes * self.num_processes)
        if self.cluster_environment.creates_processes_externally:
            self._check_external_launch()
        else:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def _check_external_launch(self) -> None:
        """torchrun, srun or another launcher started the processes: they must be the ``num_nodes x devices`` the
        Trainer was given, with ``devices`` processes on each node (otherwise ranks would wait for each other forever
        or build another layout than the one checked)."""
        env = self.cluster_environment
        name = type(env).__name__
        asked = f"Trainer(num_nodes={self.num_nodes}, devices={self.num_processes})"
        world = env.world_size()
        if world != self.num_nodes * self.num_processes:
            raise ValueError(f"MoEFoldStrategy: the launcher ({name}) started {world} processes in all, but {asked} "
                             f"expects num_nodes x devices = {self.num_nodes * self.num_processes}. Launch "
                             f"{self.num_processes} processes on each of {self.num_nodes} nodes (torchrun --nnodes "
                             f"{self.num_nodes} --nproc-per-node {self.num_processes}; srun --nodes {self.num_nodes} "
                             f"--ntasks-per-node {self.num_processes}), or change num_nodes / devices.")
        # the launcher's count of processes on this node
        var = next((v for cls, v in ((TorchElasticEnvironment, "LOCAL_WORLD_SIZE"),
                                     (SLURMEnvironment, "SLURM_NTASKS_PER_NODE")) if isinstance(env, cls)), None)
        value = os.environ.get(var, "") if var else ""
        if value.isdigit() and int(value) != self.num_processes:
            raise ValueError(f"MoEFoldStrategy: {var}={value} processes run on this node, but {asked} expects "
                             f"devices={self.num_processes} per node; set devices={value} or launch "
                             f"{self.num_processes} per node.")
        if not 0 <= self.node_rank < self.num_nodes:
            raise ValueError(f"MoEFoldStrategy: this process is on node {self.node_rank} ({name}), but {asked} has "
                             f"nodes 0..{self.num_nodes - 1}.")

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self.layout = self._make_layout(self.world_size)  # raises before any process group is created
        check = getattr(self.lightning_module, "check_layout", None)
        if check is not None:  # the model's own divisibility checks (and the stage split), before any process group
            check(self.layout, self.pipeline_first_stage_layers, self.pipeline_last_stage_layers)
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device)
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type == "cuda":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        self._check_placement()
        self._start_liveness()
        self.parallel_context = ParallelContext.from_layout(
            self.layout, self.global_rank, sequence_parallel=self.sequence_parallel, timeout=self._timeout,
            pipeline_first_layers=self.pipeline_first_stage_layers,
            pipeline_last_layers=self.pipeline_last_stage_layers)
        # handed to the LightningModule before configure_model (Lightning calls that after setup_environment)
        if self.lightning_module is not None:
            self.lightning_module.parallel_context = self.parallel_context

    def _check_placement(self) -> None:
        """Record the node of every rank (``node_of_rank``) and which groups cross nodes (``cross_node_groups``); warn
        once when a TP, CP, ETP or EP group does. One all-gather of the node ranks, only with several nodes."""
        world = self.layout.world_size
        if self.num_nodes == 1:
            self.node_of_rank = (0,) * world
        else:
            mine = torch.tensor([self.node_rank], dtype=torch.int64, device=self.root_device)
            nodes = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(nodes, mine)
            self.node_of_rank = tuple(int(n.item()) for n in nodes)
        self.cross_node_groups = {k: g for k, g in crossing_groups(self.layout, self.node_of_rank).items() if g}
        message = placement_warning(self.layout, self.node_of_rank)
        if message is not None and not self._placement_warned:
            self._placement_warned = True
            rank_zero_warn(message)

    def _start_liveness(self) -> None:
        """Heartbeats through the rendezvous store (strategy/liveness.py): a lost rank is named, and no rank waits for
        it in a collective until the timeout."""
        if self.world_size < 2 or self._liveness is not None:
            return
        try:
            store = dist.distributed_c10d._get_default_store()
            gen = store.add(f"moe_fold/liveness/activations/{self.global_rank}", 1)  # the same count on every rank
            worker_store = store.clone()  # its own connection, used by the liveness worker thread alone
        except (AttributeError, RuntimeError, NotImplementedError) as e:  # a store that cannot be shared so
            rank_zero_warn(f"MoEFoldStrategy: no liveness heartbeats ({type(e).__name__}: {e}); a lost rank is "
                           "noticed only when a collective fails or times out")
            return
        # torchrun's agent hosts the store itself; otherwise rank 0's process does (init_process_group's env://)
        host = None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0
        self._liveness = Liveness(worker_store, self.global_rank, self.world_size, gen,
                                  lost_after_for(self._timeout.total_seconds()), store_host_rank=host)
        self._liveness.start()

    def on_train_start(self) -> None:
        super().on_train_start()
        if self.overlap_moe_comm:  # after the callbacks' on_fit_start: refuse their whole-block wrappers now
            pipeline_model = getattr(self.lightning_module, "pipeline_model", None)
            for block in getattr(pipeline_model() if pipeline_model else None, "layers", []):
                if getattr(block, "is_moe", False):
                    with block._step_context()():  # raises for Recompute full/moe and ActivationOffload
                        pass
        if self.manual_gc is not None:  # last: what the setup and the callbacks made is frozen with the model
            self._gc = ManualGC(self.manual_gc)
            self._gc.start()

    def on_train_end(self) -> None:
        super().on_train_end()
        self._stop_manual_gc()

    def _stop_manual_gc(self) -> None:
        if self._gc is not None:
            self._gc.stop()
            self._gc = None

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._gc is not None:  # after every optimizer step, skipped ones included: the same step on every rank
            self._gc.step()
        return out

    def setup(self, trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self._router_modules, self._router_flags, self._router_pending = None, None, []
        self.accelerator.setup(trainer)
        self.model_to_device()
        self.model = self.precision_plugin.convert_module(self.model)
        self._broadcast_parameters()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._setup_optimizer_state()
        self.setup_precision_plugin()
        if self.pp > 1 or self.num_microbatches > 1:
            self._setup_pipeline(trainer)
        if self.cuda_graphs and trainer.state.fn == TrainerFn.FITTING:
            self._check_cuda_graphs()
        self._setup_clipping()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
            sigterm.install(trainer, self._timeout)  # Lightning's per-step SIGTERM broadcast syncs with the GPU

    def _setup_pipeline(self, trainer) -> None:
        module = self.lightning_module
        needed = ("pipeline_model", "pipeline_input_shape", "pipeline_forward", "pipeline_step_end") + \
            (("pipeline_forward_steps",) if self.overlap_moe_comm else ())
        missing = [n for n in needed if not callable(getattr(module, n, None))]
        if missing:
            raise TypeError(f"MoEFoldStrategy: pipeline schedules (pipeline_parallel_size={self.pp}, num_microbatches="
                            f"{self.num_microbatches}) need the LightningModule to implement {', '.join(missing)} "
                            "(see lightning_moe/strategy/pipeline/engine.py; MoELanguageModel does)")
        if trainer.state.fn == TrainerFn.FITTING and not module.automatic_optimization:
            raise ValueError("MoEFoldStrategy: pipeline schedules run the backward passes themselves and need "
                             "automatic optimization (LightningModule.automatic_optimization = True)")
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError("MoEFoldStrategy: pipeline schedules do not support fp16 loss scaling (precision="
                             "'16-mixed'); use 'bf16-mixed' or 'bf16-true'")
        self._pipeline = PipelineEngine(self.parallel_context, self.pipeline_schedule, self.num_microbatches,
                                        self.root_device, overlap_p2p=self.overlap_p2p_comm,
                                        overlap_moe_comm=self.overlap_moe_comm)

    def _check_cuda_graphs(self) -> None:
        if self.root_device.type != "cuda":
            raise ValueError(f"MoEFoldStrategy(cuda_graphs=True) needs CUDA devices, not {self.root_device.type}")
        if isinstance(self.precision_plugin, MixedPrecision):
            raise ValueError("MoEFoldStrategy(cuda_graphs=True) cannot capture autocast (precision='bf16-mixed' or "
                             "'16-mixed'): use precision='bf16-true' (fp32 main params)")
        if any(getattr(p, "is_expert", False) and p.dtype not in (torch.bfloat16, torch.float16)
               for p in self.lightning_module.parameters()):
            raise ValueError("MoEFoldStrategy(cuda_graphs=True) needs bf16 expert weights (precision='bf16-true'): "
                             "torch's float32 grouped GEMM copies its group offsets to the host, which a graph "
                             "cannot capture")
        if not callable(getattr(self.lightning_module, "cuda_graph_blocks", None)):
            raise TypeError("MoEFoldStrategy(cuda_graphs=True) needs the LightningModule to implement "
                            "cuda_graph_blocks(batch) -> (blocks, input shape, dtype, positions); MoELanguageModel "
                            "does")

    def _capture_cuda_graphs(self, batch) -> None:
        blocks, x_shape, dtype, positions_S = self.lightning_module.cuda_graph_blocks(batch)
        sync = self._grad_sync
        # the deferred expert wgrad's window (graph_deferral.py), found in the warm-up: at most a step's micro-batches
        sync.graph_window = max(1, self.lightning_module.trainer.accumulate_grad_batches)
        try:
            with self.precision_plugin.train_step_context():
                # fp32 main grads: GradSync's hook consumes each gradient at once, so the graphs' static gradient
                # buffers can go to autograd as they are; otherwise param.grad accumulates and must get a copy
                handles = capture_blocks(blocks, x_shape, dtype, positions_S, copy_param_grads=not sync.main_grads,
                                         copies=sync.graph_copies, on_copy=sync.begin_copy, select=sync.graph_copy)
        except BaseException:
            sync.discard()  # the warm-up's writes and held operands
            sync.graphs_released()  # nothing captured stays referenced: the blocks run eagerly
            raise
        sync.capture_copy = None
        # the warm-up's writes to main grads and its held operands: a capture at a step's later micro-batch (a fit
        # resumed mid-step) has no zero_grad before this micro-batch's backward to drop them
        sync.discard()
        self._graphs = (blocks, handles)

    def pipeline_timing(self) -> dict:
        """The last pipeline schedule on this rank: ``wall_s``, ``busy_s``, the measured ``bubble_fraction``
        (1 - busy/wall; idle time waiting for other stages or transfers), the schedule's ``ideal_bubble_fraction``,
        ``plan_bubble_fraction`` (what the executor's exchanges allow with free communication) and ``overlap_p2p``.
        Empty without pipeline schedules. Synchronises with the device once."""
        return self._pipeline.timing() if self._pipeline is not None else {}

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @torch.no_grad()
    def _broadcast_parameters(self) -> None:
        """Make replicas identical whatever the module's init did (as DDP does): dense params from the first rank
        of dp x cp, expert shards from the first rank of edp."""
        ctx = self.parallel_context
        for p in list(self.model.parameters()) + list(self.model.buffers()):
            name = "edp" if is_expert_param(p) else "dp_cp"
            if ctx.size(name) > 1:
                dist.broadcast(p.data, src=ctx.members[name][0], group=ctx.group(name))

    # ------------------------------------------------------------------ the training step
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            if self.cuda_graphs and self._sharded is not None:
                self._sharded.wait_all()  # the blocks' forward pre-hooks do not run inside graph replays
            if self.cuda_graphs and self._graphs is None:
                self._capture_cuda_graphs(_batch_args(args, kwargs)[0])
            trainer = self.lightning_module.trainer
            if self.cuda_graphs and trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0:
                self._grad_sync.new_step()  # the step's first forward replays graph copy 0 (graph_deferral.py)
            return super().training_step(*args, **kwargs)
        batch, batch_idx = _batch_args(args, kwargs)
        module = self.lightning_module
        trainer = module.trainer
        # the index Lightning's own zero_grad decision uses (also when training_step takes no batch_idx)
        loop_idx = trainer.fit_loop.epoch_loop.batch_idx
        self._skip_zero_grad = False  # never carried over from a step whose zero_grad Lightning did not call
        if loop_idx % trainer.accumulate_grad_batches == 0:
            # Lightning zeroes gradients between training_step and backward; the schedule's backwards run inside
            # training_step, so zero now and skip Lightning's zero_grad of this step
            for opt in self.optimizers:
                opt.zero_grad()
            self._skip_zero_grad = True
        lm_loss, aux = self._pipeline.run(module, batch, train=True, loss_scale=1.0 / trainer.accumulate_grad_batches,
                                          grad_sync=self._grad_sync,
                                          forward_context=self.precision_plugin.train_step_context)
        self._pipeline_backward_done = True  # Lightning's closure calls backward next: nothing left to do
        return module.pipeline_step_end(batch, batch_idx, lm_loss, aux, "train")

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().validation_step(*args, **kwargs)
        return self._forward_only(args, kwargs, "val", self.precision_plugin.val_step_context)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().test_step(*args, **kwargs)
        return self._forward_only(args, kwargs, "test", self.precision_plugin.test_step_context)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().predict_step(*args, **kwargs)
        raise NotImplementedError("MoEFoldStrategy: predict under pipeline parallelism is not supported; run "
                                  "predictions without PP (checkpoints load on other layouts of the same PP size)")

    def _forward_only(self, args, kwargs, stage: str, context) -> Any:
        batch, batch_idx = _batch_args(args, kwargs)
        module = self.lightning_module
        lm_loss, aux = self._pipeline.run(module, batch, train=False, forward_context=context)
        return module.pipeline_step_end(batch, batch_idx, lm_loss, aux, stage)

    def backward(self, closure_loss: Tensor, optimizer, *args: Any, **kwargs: Any) -> Tensor:
        if not self._pipeline_backward_done:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # the schedule already ran every micro-batch's backward; still fire on_before/after_backward hooks
        self._pipeline_backward_done = False
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        return self.precision_plugin.post_backward(closure_loss, module)

    # ------------------------------------------------------------------ checkpoints
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # load into the model after it is on its device and replicas were broadcast

    def _layout_dict(self) -> dict:
        lay = self.layout
        out = {k: getattr(lay, k) for k in ("tp", "cp", "dp", "pp", "etp", "ep", "edp", "vpp")}
        if self._sharded is not None:  # how the optimizer's tensors are sliced (their order in the shard files)
            o = self.optimizer_options
            out["optimizer_slices"] = {"distributed": o.distributed, "cpu_offload": o.cpu_offload,
                                       "bucket_size_mb": self.bucket_size_mb}
        return out

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Optional[Any] = None) -> None:
        """Every rank writes its own blocks of every model and optimizer tensor (DCP, global shapes) and a small shard
        of the rest; atomic, see strategy/checkpoint.py."""
        if storage_options is not None:
            raise TypeError("MoEFoldStrategy.save_checkpoint does not take storage_options")
        self._check_router_flags(wait=True)  # never write the weights of a step with non-finite router logits
        path = self.broadcast(str(filepath))
        # the checkpoint's state_dict holds the fp32 main weights when in use (lightning_module_state_dict)
        pieces, rest = split_checkpoint(checkpoint, self.lightning_module, self.parallel_context, self.optimizers,
                                        self._sharded or self._main_params)
        save_sharded(rest, path, self.global_rank, self.world_size, self._layout_dict(), self.barrier,
                     write_tensors=lambda directory: save_pieces(pieces, str(directory)))

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict:
        path = self.broadcast(str(checkpoint_path))
        restored = []

        def fill(checkpoint, directory, same_layout) -> dict:
            checkpoint, ok = fill_checkpoint(checkpoint, str(directory), self.lightning_module, self.parallel_context,
                                             self.optimizers, self._sharded or self._main_params, same_layout,
                                             load_pieces)
            restored.append(ok)
            return checkpoint

        def agree(error):
            if not _distributed_is_initialized():
                return error
            errors = [None] * self.world_size
            dist.all_gather_object(errors, error)
            return next((e for e in errors if e), None)

        checkpoint = load_sharded(path, self.global_rank, self.world_size, self._layout_dict(), fill=fill, agree=agree)
        if restored and not restored[0] and self.optimizers:
            rank_zero_warn(f"MoEFoldStrategy: {path} was written under another layout with an optimizer whose state "
                           "is not shaped like its parameters; the weights, progress and LR schedule were restored, "
                           "the optimizer state starts afresh.")
        return checkpoint

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            shutil.rmtree(filepath, ignore_errors=True)

    # ------------------------------------------------------------------ collectives
    def barrier(self, name: Optional[str] = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj, src: int = 0):
        if not _distributed_is_initialized():
            return obj
        obj = [obj]
        dist.broadcast_object_list(obj, src, group=_group.WORLD)
        return obj[0]

    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Union[Tensor, Any]:
        """In-place all-reduce for ``self.log(sync_dist=True)``: Lightning's ``_sync_ddp`` without its barrier. The
        all-reduce already waits for every rank, and on NCCL a barrier is a host sync that drains the GPU queue once per
        logged value (once per optimizer step for ``train_loss``)."""
        if not isinstance(tensor, Tensor) or not _distributed_is_initialized():
            return tensor
        group = dist.group.WORLD if group is None else group
        mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
        if reduce_op is None or mean:
            op = ReduceOp.SUM
        else:
            op = getattr(ReduceOp, reduce_op.upper()) if isinstance(reduce_op, str) else reduce_op
        dist.all_reduce(tensor, op=op, group=group)
        if not mean:
            return tensor
        n = dist.get_world_size(group)
        return tensor.div_(n) if torch.is_floating_point(tensor) else tensor.copy_(tensor / n)

    def on_exception(self, exception: BaseException) -> None:
        self._stop_manual_gc()
        comm = _is_collective_error(exception)
        if self._liveness is not None:
            # this rank failed rather than got lost; its own error (not a collective's) is the others' root cause
            self._liveness.failed(f"{type(exception).__name__}: {_first_line(exception)}", root_cause=not comm)
            if comm:  # which rank is gone (or failed first): a few heartbeat intervals at most
                note = f"[moe_fold rank {self.global_rank}] {self._liveness.diagnose()}."
                if exception.args and isinstance(exception.args[0], str):
                    # Lightning re-raises this same exception object: its message now starts with the diagnosis
                    exception.args = (f"{note} The collective's error: {exception.args[0]}", *exception.args[1:])
                print(note, file=sys.stderr, flush=True)
        elif comm and _distributed_is_initialized():
            print(f"[moe_fold rank {self.global_rank}] training failed: {type(exception).__name__}: {exception}\n"
                  f"  If a collective failed or timed out (timeout={self._timeout.total_seconds():.0f}s), another "
                  "rank probably died first: look at its log.", file=sys.stderr, flush=True)

    def teardown(self) -> None:
        self._stop_manual_gc()
        if self._liveness is not None:
            self._liveness.stop()
            self._liveness = None
        if self._graphs is not None:
            release_blocks(*self._graphs)
            self._graphs = None
            if self._grad_sync is not None:
                self._grad_sync.graphs_released()
        self._teardown_optimizer_state()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls,
                                       description="MoE Parallel Folding: attention TPxCPxDPxPP, MoE ETPxEPxEDPxPP")
