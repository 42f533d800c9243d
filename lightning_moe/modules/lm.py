"""MoELanguageModel: the LightningModule. Trains on one device under ``strategy="auto"`` and unchanged under
``strategy="moe_fold"``, which hands it a ParallelContext before ``configure_model``."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import lightning as L
import torch

from lightning_moe.modules.config import ModelConfig
from lightning_moe.modules.transformer import MoETransformer, check_model_layout
from lightning_moe.strategy.parallel_context import ParallelContext


def warmup_cosine(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup from 1/warmup to 1, then cosine decay to ``min_lr_ratio`` at ``max_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class MoELanguageModel(L.LightningModule):
    """A decoder-only MoE language model.

    Args:
        config: the model config; or give ``preset`` (and ``overrides``) instead.
        preset: a ``ModelConfig`` preset name (``tiny``, ``mixtral-8x7b``, ``qwen3-30b-a3b``, ``deepseek-v3``).
        overrides: fields to override on the preset, e.g. ``{"num_layers": 2}``.
        lr, weight_decay, betas, eps: AdamW. Norms, biases and the router get no weight decay.
        warmup_steps, min_lr_ratio, max_steps: linear warmup then cosine decay; ``max_steps`` defaults to the
            Trainer's estimated stepping batches.
        seed: weight-initialisation seed; the same seed gives the same full weights on every layout.
        log_expert_load: log per-layer load (token fraction per expert when E <= 16, imbalance, dropped fraction).
        init_from_hf: a local Hugging Face directory (config.json + safetensors) of a Mixtral, Qwen3-MoE or
            DeepSeek-V3 model. Without ``config``/``preset`` the model config comes from it (``overrides`` still apply,
            e.g. ``seq_length``); its weights replace the seeded initialisation at ``configure_model``, each rank
            reading only its own shards. A checkpoint given to ``fit(ckpt_path=...)`` still overrides them.
    """

    def __init__(self, config: Optional[ModelConfig] = None, preset: Optional[str] = None,
                 overrides: Optional[dict] = None, lr: float = 3e-4, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, warmup_steps: int = 100,
                 min_lr_ratio: float = 0.1, max_steps: Optional[int] = None, seed: int = 1234,
                 log_expert_load: bool = True, init_from_hf: Optional[str] = None):
        super().__init__()
        if config is not None and preset is not None:
            raise ValueError("MoELanguageModel: give either config or preset (with overrides), not both")
        if isinstance(config, dict):  # as stored in checkpoints' hyper_parameters
            config = ModelConfig(**config)
        if config is None and preset is None and init_from_hf is not None:
            from lightning_moe.hf_interop import config_from_hf, read_hf_config
            config = config_from_hf(read_hf_config(init_from_hf), **(overrides or {}))
        elif config is None:
            config = ModelConfig.from_preset(preset or "tiny", **(overrides or {}))
        elif overrides:
            config = config.replace(**overrides)
        if warmup_steps < 0 or lr <= 0:
            raise ValueError(f"MoELanguageModel: need lr > 0 and warmup_steps >= 0, got lr={lr}, "
                             f"warmup_steps={warmup_steps}")
        self.config = config
        # the resolved config is stored as a plain dict (loadable with weights_only=True); preset and overrides are
        # folded into it, so load_from_checkpoint rebuilds exactly this model
        self.save_hyperparameters(ignore=["config", "preset", "overrides"])
        self.hparams["config"] = dataclasses.asdict(config)
        self.parallel_context: ParallelContext = ParallelContext.single()
        self.model: Optional[MoETransformer] = None
        self._pipeline_load: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> counts over micro-batches
        self._pbar_copy: Optional[tuple] = None  # (pinned host loss, CUDA event of its copy): see _progress_bar_loss
        # the optimizer step's [lm, aux, load-balancing, z] losses times micro-batch sizes, summed on the device, and
        # the sizes' sum: logged once per step (_report_train)
        self._step_sums: Optional[tuple[torch.Tensor, int]] = None

    # ------------------------------------------------------------------ model
    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = MoETransformer(self.config, self.parallel_context)
        self.model.init_weights(self.hparams.seed)
        if self.hparams.init_from_hf is not None:
            from lightning_moe.hf_interop import load_hf_weights
            load_hf_weights(self.model, self.hparams.init_from_hf)

    def setup(self, stage: str) -> None:
        from lightning_moe.data import TokenDataModule
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if isinstance(dm, TokenDataModule):  # token ids past the vocabulary: one clear error before any step
            dm.check_vocab(self.config.vocab_size)

    def check_layout(self, layout, pipeline_first_layers: Optional[int] = None,
                     pipeline_last_layers: Optional[int] = None) -> None:
        """Called by MoEFoldStrategy before any process group exists: a model that cannot be split over the layout
        (heads, kv heads, FFN sizes, vocab or experts not divisible; sequence length not divisible by 2 x CP; layers
        not divisible over the pipeline stages) fails here with a ValueError naming the numbers."""
        check_model_layout(self.config, layout, pipeline_first_layers, pipeline_last_layers)

    def forward(self, tokens_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model(tokens_BS)

    def _lm_loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        # the model shards tokens and labels over CP and computes a vocab-parallel cross-entropy under TP
        return self.model.loss(batch["input_ids"], batch["labels"], batch.get("position_ids"),
                               batch.get("document_ids"))

    def training_step(self, batch: dict, batch_idx: int) -> dict:
        """Returns ``loss`` (LM + auxiliary, what backward runs on), and detached ``lm_loss`` and ``aux_loss``.

        Under TP each rank's auxiliary loss covers its share of the tokens (their router gradients are summed over
        TP): the reported ``aux_loss`` is summed over TP (one scalar all-reduce) so it is the same on every layout."""
        lm_loss, aux = self._lm_loss(batch)
        out = self._report_train(batch, lm_loss.detach(), aux.detach())
        out["loss"] = lm_loss + aux
        return out

    def _report_train(self, batch: dict, lm_loss: torch.Tensor, aux: torch.Tensor, over: tuple = ("tp",)) -> dict:
        """Log train_loss / aux_loss / z_loss (and expert load) once per optimizer step, as their means over its
        micro-batches weighted by micro-batch size (Megatron reports the step's mean loss); return this micro-batch's
        detached ``lm_loss`` and ``aux_loss``. Each micro-batch adds to a device-side sum instead: Lightning's
        ``self.log`` costs about 1.5 ms of host time per value (a 2-core CPU), three values per micro-batch."""
        bs = batch["input_ids"].shape[0]
        # [total aux, load-balancing part, z part], summed over TP (and PP stages) in scalar all-reduces
        parts = [aux]
        stats = [m.last_stats for m in self.model.moe_layers()]
        if self.config.num_moe_layers:
            parts += [torch.stack([s[k] for s in stats]).sum().to(aux.dtype) if stats else aux.new_zeros(())
                      for k in ("aux_loss", "z_loss")]
        reported = torch.stack(parts)
        for name in over:
            reported = self.model.ctx.all_reduce_(reported, name)
        row = torch.cat([lm_loss.reshape(1).float(), reported.float()]) * bs
        if self._step_sums is not None:
            row, bs = row + self._step_sums[0], bs + self._step_sums[1]
        self._step_sums = (row, bs)
        t = self._trainer
        if t is not None and t.fit_loop._should_accumulate():  # not the step's last micro-batch
            return {"lm_loss": lm_loss, "aux_loss": reported[0]}
        self._step_sums = None
        mean = row / bs
        # the mean over data-parallel ranks: the same number on every layout (one small all-reduce, no host sync)
        self.log("train_loss", mean[0], batch_size=bs, sync_dist=True)
        self._progress_bar_loss(mean[0], bs)
        if len(parts) > 1:
            self.log("aux_loss", mean[2], batch_size=bs)
            self.log("z_loss", mean[3], batch_size=bs)
            if stats and self.hparams.log_expert_load and self._writes_logs_now():
                self.log_dict(self.expert_load_metrics(), batch_size=bs)
        return {"lm_loss": lm_loss, "aux_loss": reported[0]}

    def on_train_start(self) -> None:
        self._step_sums = None  # nothing carried over from an interrupted step

    def _progress_bar_loss(self, lm_loss: torch.Tensor, bs: int) -> None:
        """The progress bar's ``loss``, without a host sync. Lightning turns every progress-bar value into a Python
        number after every batch (``.item()`` drains the GPU queue, and exposes the host's data loading and launches),
        so the bar gets a host copy of a recent step's loss once its non-blocking copy has landed (on CUDA usually one
        step late). ``train_loss`` itself (loggers, ``callback_metrics``) is exact."""
        t = self._trainer
        if t is None or t.progress_bar_callback is None:
            return
        if not lm_loss.is_cuda:
            self.log("loss", lm_loss.detach().cpu(), prog_bar=True, logger=False, batch_size=bs)
            return
        if self._pbar_copy is None:
            self._pbar_copy = (torch.empty((), dtype=lm_loss.dtype, pin_memory=True), None)
        host, landed = self._pbar_copy
        if landed is not None and landed.query():  # query() does not block
            self.log("loss", host, prog_bar=True, logger=False, batch_size=bs)  # Lightning clones it
            landed = None
        if landed is None:
            host.copy_(lm_loss.detach(), non_blocking=True)
            landed = torch.cuda.Event()
            landed.record()
        self._pbar_copy = (host, landed)

    def cuda_graph_blocks(self, batch: dict) -> tuple[list, tuple[int, int, int], torch.dtype, torch.Tensor]:
        """For ``MoEFoldStrategy(cuda_graphs=True)``: the blocks in call order, and their input shape, dtype and
        positions for this batch."""
        if "document_ids" in batch:
            raise ValueError("MoEFoldStrategy(cuda_graphs=True) captures blocks for shared positions and no mask: "
                             "packed documents (pack_documents=True) need cuda_graphs=False")
        shape, dtype, positions_S = self.model.block_inputs(batch["input_ids"])
        return list(self.model.layers), shape, dtype, positions_S

    # ------------------------------------------------------------------ pipeline parallelism (MoEFoldStrategy)
    def pipeline_model(self) -> MoETransformer:
        """The chunked model: its stages, chunk parameters and inter-stage shapes (see strategy/pipeline)."""
        return self.model

    def pipeline_input_shape(self, micro_batch: dict) -> tuple[int, ...]:
        return self.model.chunk_input_shape(tuple(micro_batch["input_ids"].shape))

    def pipeline_forward(self, chunk: int, micro_batch: dict,
                         x_BSD: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One model chunk on one micro-batch: (hidden states for the next stage, or on the last stage the mean LM
        loss of the micro-batch; the chunk's auxiliary loss)."""
        out, aux = self.model.forward_chunk(chunk, micro_batch["input_ids"], x_BSD, micro_batch.get("position_ids"),
                                            micro_batch.get("document_ids"))
        return self._pipeline_forward_end(chunk, micro_batch, out, aux)

    def pipeline_forward_steps(self, chunk: int, micro_batch: dict, x_BSD: Optional[torch.Tensor]):
        """``pipeline_forward`` as a generator cut at the MoE layers' token exchanges, for
        ``MoEFoldStrategy(overlap_moe_comm=True)`` (``MoETransformer.forward_chunk_steps``)."""
        out, aux = yield from self.model.forward_chunk_steps(
            chunk, micro_batch["input_ids"], x_BSD, micro_batch.get("position_ids"), micro_batch.get("document_ids"),
            steps=True)
        return self._pipeline_forward_end(chunk, micro_batch, out, aux)

    def _pipeline_forward_end(self, chunk: int, micro_batch: dict, out: torch.Tensor,
                              aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.training:  # each MoE layer's routing counts, summed over the step's micro-batches (see below)
            for i in self.model.chunk_layers[chunk]:
                stats = self.model.layers[i].ffn.last_stats if self.model.layers[i].is_moe else None
                if stats:
                    prev = self._pipeline_load.get(i)
                    now = (stats["tokens_per_expert"], stats["num_dropped"])
                    self._pipeline_load[i] = now if prev is None else (prev[0] + now[0], prev[1] + now[1])
        if self.model.is_last_chunk(chunk):
            out = self.model.lm_loss(out, micro_batch["labels"], micro_batch.get("document_ids"))
        return out, aux

    def pipeline_step_end(self, batch: dict, batch_idx: int, lm_loss: torch.Tensor, aux: torch.Tensor,
                          stage: str):
        """After a pipeline schedule ran every micro-batch (and, in training, its backward): ``lm_loss`` is the mean
        over micro-batches (on every stage), ``aux`` this rank's chunks' mean auxiliary loss. The auxiliary parts
        logged are those of the last micro-batch; the expert load (``last_stats`` counts, read by
        ``expert_load_metrics`` and ``ExpertLoadMonitor``) is that of all the step's micro-batches, as without PP."""
        if stage == "train":
            for i, (tokens_E, dropped) in self._pipeline_load.items():
                ffn = self.model.layers[i].ffn
                ffn.last_stats = {**ffn.last_stats, "tokens_per_expert": tokens_E, "num_dropped": dropped}
            self._pipeline_load = {}
            out = self._report_train(batch, lm_loss, aux, over=("tp", "pp"))
            out["loss"] = out["lm_loss"] + out["aux_loss"]  # detached: the schedule already ran backward
            return out
        self.log(f"{stage}_loss", lm_loss, prog_bar=True, sync_dist=True, batch_size=batch["input_ids"].shape[0])
        return lm_loss

    def _writes_logs_now(self) -> bool:
        # per-layer load is (2 + E) scalars per MoE layer: compute and log them only when Lightning writes logs
        t = self._trainer
        return t is None or (t.global_step + 1) % max(1, t.log_every_n_steps) == 0 or t.global_step == 0

    def validation_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        lm_loss, _ = self._lm_loss(batch)
        self.log("val_loss", lm_loss, prog_bar=True, sync_dist=True, batch_size=batch["input_ids"].shape[0])
        return lm_loss

    @torch.no_grad()
    def expert_load_metrics(self) -> dict[str, torch.Tensor]:
        """Token fraction per expert (E <= 16), max/mean imbalance and dropped fraction of each MoE layer.

        Counts are this rank's routing decisions (ExpertLoadMonitor gives global ones); tensors stay on the device.
        """
        from lightning_moe.callbacks.expert_load import load_stats
        blocks = [blk for blk in self.model.layers if blk.is_moe]
        if not blocks:  # a pipeline stage without MoE layers
            return {}
        stats = load_stats(torch.stack([blk.ffn.last_stats["tokens_per_expert"] for blk in blocks]),
                           torch.stack([blk.ffn.last_stats["num_dropped"] for blk in blocks]))
        out = {}
        for i, blk in enumerate(blocks):
            out[f"load/layer{blk.layer_idx}/imbalance"] = stats["imbalance"][i]
            out[f"load/layer{blk.layer_idx}/dropped"] = stats["dropped"][i]
            if stats["fraction"].shape[1] <= 16:
                for e in range(stats["fraction"].shape[1]):
                    out[f"load/layer{blk.layer_idx}/expert{e}"] = stats["fraction"][i, e]
        return out

    # ------------------------------------------------------------------ optimisation
    def on_before_optimizer_step(self, optimizer) -> None:
        # once per optimizer step, after every micro-batch of the step ran: aux-loss-free bias update (counts are
        # all-reduced inside) and the end of the global-aux-loss accumulation window
        for moe in self.model.moe_layers():
            moe.router.update_expert_bias()
            moe.router.reset_global_aux_state()

    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            (no_decay if p.ndim < 2 or "norm" in name or "router" in name else decay).append(p)
        hp = self.hparams
        # fused AdamW when everything is on CUDA; Lightning's AMP plugin refuses to clip fused optimizers, which
        # MoEFoldStrategy lifts for bf16 (no grad scaler), so other strategies with clipping get foreach AdamW
        from lightning_moe.strategy.moe_fold import MoEFoldStrategy
        trainer = self._trainer
        clipping = bool(trainer.gradient_clip_val) if trainer is not None else False
        clip_ok = (trainer is not None and isinstance(trainer.strategy, MoEFoldStrategy)
                   and getattr(trainer.precision_plugin, "scaler", None) is None)
        fused = (all(p.is_cuda for p in decay + no_decay) and (clip_ok or not clipping)) or None
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps, fused=fused)
        max_steps = hp.max_steps or int(self.trainer.estimated_stepping_batches)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: warmup_cosine(s, hp.warmup_steps, max_steps, hp.min_lr_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
