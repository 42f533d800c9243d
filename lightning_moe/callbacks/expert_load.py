"""ExpertLoadMonitor: global per-layer expert load (imbalance, dropped fraction, spread) every N optimizer steps."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torchmetrics.aggregation import MeanMetric


def _mean_metric() -> MeanMetric:
    # the values are global already (all-reduced below), so no torchmetrics sync; "disable" also skips the NaN
    # check, which would read the value on the host (torchmetrics < 1.6 lacks it: "ignore" then)
    try:
        return MeanMetric(nan_strategy="disable", sync_on_compute=False)
    except ValueError:
        return MeanMetric(nan_strategy="ignore", sync_on_compute=False)


def load_stats(counts_LE: torch.Tensor, dropped_L: torch.Tensor) -> dict[str, torch.Tensor]:
    """Load statistics of ``L`` layers from kept assignments per expert (L, E) and dropped assignments (L,).

    ``fraction`` (L, E): kept assignments of each expert over all assignments (kept + dropped), so it sums to
    ``1 - dropped`` per layer; ``imbalance``: max / mean of the kept counts (1 when balanced, E/k when every token
    goes to the same k experts); ``min_fraction``; ``dropped``: dropped / all assignments; ``cv``: the coefficient of
    variation std / mean of the kept counts (population std, 0 when balanced).
    """
    counts_LE, dropped_L = counts_LE.float(), dropped_L.float()
    total_L = (counts_LE.sum(-1) + dropped_L).clamp(min=1)
    mean_L = counts_LE.mean(-1).clamp(min=1e-9)
    fraction_LE = counts_LE / total_L.unsqueeze(-1)
    return {"fraction": fraction_LE,
            "imbalance": counts_LE.amax(-1) / mean_L,
            "min_fraction": fraction_LE.amin(-1),
            "dropped": dropped_L / total_L,
            "cv": counts_LE.std(-1, correction=0) / mean_L}


class ExpertLoadMonitor(L.Callback):
    """Every ``every_n_steps`` optimizer steps, logs for each MoE layer ``i`` (the model's layer index):
    ``expert_load/layer{i}/imbalance``, ``.../dropped``, ``.../cv``, ``.../min_fraction`` and
    ``.../imbalance_mean`` (a torchmetrics ``MeanMetric`` of the imbalance over the logged steps of this fit), plus
    ``expert_load/max_imbalance`` over layers. With a ``TensorBoardLogger`` it also adds a histogram of the per-expert
    token fractions of each layer.

    The counts are those of the logged optimizer step: every micro-batch of it, summed, then all-reduced (SUM) over
    the attention layout's ``tp_dp_cp`` group, so the numbers describe the global batch: TP ranks route disjoint
    shares of their tokens and CP ranks disjoint chunks of each sequence, so every token is counted once. All counters
    stay on the device: the one all-reduce and the host reads happen at logging steps only. Under pipeline
    parallelism the stages' layers are gathered (one more all-reduce over ``pp``), so every rank, rank 0's logger
    included, logs every MoE layer.

    Attributes:
        last_metrics: the metrics of the last logged step, as device tensors keyed like the logged names.
        last_fractions: ``{layer_idx: fraction_E}`` of the last logged step.
    """

    def __init__(self, every_n_steps: int = 10, log_histogram: bool = True, prog_bar: bool = False):
        if every_n_steps < 1:
            raise ValueError(f"ExpertLoadMonitor: every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps, self.log_histogram, self.prog_bar = every_n_steps, log_histogram, prog_bar
        self.last_metrics: dict[str, torch.Tensor] = {}
        self.last_fractions: dict[int, torch.Tensor] = {}
        self._running: dict[int, MeanMetric] = {}
        self._acc_LX: Optional[torch.Tensor] = None
        self._seen_step = 0

    def on_train_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        self._seen_step = trainer.global_step
        self._acc_LX = None
        self._running = {}

    @staticmethod
    def _moe_layers(pl_module: "L.LightningModule") -> list[tuple[int, Any]]:
        return [(blk.layer_idx, blk.ffn) for blk in pl_module.model.layers if blk.is_moe]

    def on_train_batch_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        stepped = trainer.global_step != self._seen_step  # this micro-batch ended an optimizer step
        self._seen_step = trainer.global_step
        step = trainer.global_step if stepped else trainer.global_step + 1  # 1-based number of this step
        if step % self.every_n_steps:
            return
        layers = self._moe_layers(pl_module)
        pipelined = pl_module.parallel_context.pp > 1  # every stage joins the pp all-reduce, MoE layers or not
        if not pipelined and (not layers or not layers[0][1].last_stats):
            return
        # (L, E + 1): kept assignments per expert, then dropped assignments; summed over the step's micro-batches
        stats_LX = torch.stack([torch.cat([m.last_stats["tokens_per_expert"].float(),
                                           m.last_stats["num_dropped"].float().reshape(1)]) for _, m in layers]
                               ) if layers else torch.zeros(0, pl_module.model.cfg.num_experts + 1,
                                                            device=pl_module.device)
        self._acc_LX = stats_LX if self._acc_LX is None else self._acc_LX + stats_LX
        if stepped:
            acc_LX, self._acc_LX = self._acc_LX, None
            self._report(trainer, pl_module, layers, acc_LX)

    @torch.no_grad()
    def _report(self, trainer: "L.Trainer", pl_module: "L.LightningModule", layers: list, acc_LX: torch.Tensor) -> None:
        ctx = pl_module.parallel_context
        ctx.all_reduce_(acc_LX, "tp_dp_cp")
        if ctx.pp > 1:  # a table of every MoE layer of the model, each stage filling its rows
            cfg = pl_module.model.cfg
            ids = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
            full_LX = acc_LX.new_zeros(len(ids), acc_LX.shape[1])
            full_LX[[ids.index(i) for i, _ in layers]] = acc_LX
            acc_LX, layers = ctx.all_reduce_(full_LX, "pp"), [(i, None) for i in ids]
        s = load_stats(acc_LX[:, :-1], acc_LX[:, -1])
        metrics: dict[str, torch.Tensor] = {}
        self.last_fractions = {}
        for j, (i, _) in enumerate(layers):
            if i not in self._running:
                self._running[i] = _mean_metric().to(acc_LX.device)
            self._running[i].update(s["imbalance"][j])
            p = f"expert_load/layer{i}"
            metrics.update({f"{p}/imbalance": s["imbalance"][j], f"{p}/dropped": s["dropped"][j],
                            f"{p}/cv": s["cv"][j], f"{p}/min_fraction": s["min_fraction"][j],
                            f"{p}/imbalance_mean": self._running[i].compute()})
            self.last_fractions[i] = s["fraction"][j]
        metrics["expert_load/max_imbalance"] = s["imbalance"].max()
        self.last_metrics = metrics
        for name, value in metrics.items():
            bar = self.prog_bar and name == "expert_load/max_imbalance"
            # a progress-bar value goes to the host here, once per report: Lightning would read a device tensor back
            # with .item() after every batch (a host sync per micro-batch)
            pl_module.log(name, value.cpu() if bar else value, on_step=True, on_epoch=False, batch_size=1,
                          prog_bar=bar)
        if self.log_histogram and trainer.is_global_zero:  # only rank 0's logger has a real experiment
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    for i, frac_E in self.last_fractions.items():
                        logger.experiment.add_histogram(f"expert_load/layer{i}/fraction", frac_E.float().cpu(),
                                                        global_step=trainer.global_step)
