"""Parity runs: the same config trained on 1 process and on N gloo ranks through the real Trainer + strategy.

Each run records the loss of every optimizer step, every gradient of the first step (after sync, before clipping),
and every parameter and buffer after the last step. Ranks compare their shards with the matching slices of the
one-process reference (which covers every element of the gathered full tensors across the ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import lightning as L
import numpy as np
import torch
import torch.distributed as dist

import os

# LMOE_PARITY_ACCELERATOR=gpu runs the same cases over NCCL on GPUs (the reference on GPU 0); CI uses gloo on CPU
ACCELERATOR = os.environ.get("LMOE_PARITY_ACCELERATOR", "cpu")
STEPS = 3
SEQ = 32
GLOBAL_BATCH = 8


@dataclass
class Case:
    name: str
    world: int
    ep: int = 1
    etp: int = 1
    model: dict = field(default_factory=dict)
    accumulate: int = 1  # gradient accumulation on both sides
    strategy: dict = field(default_factory=dict)  # extra MoEFoldStrategy arguments
    precision: str = "32-true"  # "bf16-true": bf16 weights with fp32 main params and grads on both sides
    tol: Optional[dict] = None  # per-case tolerances (bf16 compute differs by layout in its rounding)
    lr: float = 1e-2

    @property
    def dropping(self) -> bool:
        return self.model.get("capacity_factor") is not None


def make_tokens(path: str) -> str:
    from lightning_moe.data import write_tokens
    rng = np.random.default_rng(0)
    # a learnable stream (repeated phrases with noise) so that gradients are far from zero
    base = rng.integers(0, 256, size=64)
    toks = np.concatenate([np.roll(base, int(s)) for s in rng.integers(0, 64, size=400)])
    return write_tokens(path, toks.astype(np.uint16))


class Recorder(L.Callback):
    def __init__(self):
        self.losses: list[float] = []
        self._acc = 0.0
        self.grads: Optional[dict] = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._acc += float(outputs["loss"])  # already divided by accumulate_grad_batches
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.losses.append(self._acc)
            self._acc = 0.0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.grads is None:  # with fp32 main params the synced gradient is p.main_grad (p.grad is freed)
            self.grads = {n: (p.grad if p.grad is not None else p.main_grad).detach().clone()
                          for n, p in pl_module.model.named_parameters()}


def model_kwargs(case: Case) -> dict:
    overrides = dict(seq_length=SEQ, num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                     ffn_hidden_size=64, moe_ffn_hidden_size=32, num_experts=8, topk=2, z_loss_coeff=1e-3)
    overrides.update(case.model)
    return dict(preset="tiny", overrides=overrides, lr=case.lr, warmup_steps=1, max_steps=STEPS, seed=7,
                log_expert_load=False)


def train(case: Case, tokens: str, root: str, parallel: bool) -> dict:
    from lightning_moe import MoEFoldStrategy, MoELanguageModel, TokenDataModule
    L.seed_everything(0, verbose=False)
    dp = case.world  # TP = CP = PP = 1 here, so every rank is a data-parallel rank
    if parallel:
        strategy, devices, bs, accumulate = MoEFoldStrategy(expert_parallel_size=case.ep,
                                                            expert_tensor_parallel_size=case.etp,
                                                            timeout=120, **case.strategy), case.world, \
            GLOBAL_BATCH // dp, 1
    elif case.precision != "32-true":
        # the reference also keeps fp32 main params, which plain Lightning bf16-true does not
        strategy, devices, bs, accumulate = MoEFoldStrategy(), 1, GLOBAL_BATCH, 1
    elif case.dropping:
        # capacity is per rank (as in Megatron): the reference runs each DP shard as its own micro-batch
        strategy, devices, bs, accumulate = "auto", 1, GLOBAL_BATCH // dp, dp
    else:
        strategy, devices, bs, accumulate = "auto", 1, GLOBAL_BATCH, 1
    accumulate *= case.accumulate
    rec = Recorder()
    trainer = L.Trainer(accelerator=ACCELERATOR, devices=devices, strategy=strategy, max_steps=STEPS,
                        accumulate_grad_batches=accumulate, gradient_clip_val=0.5, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[rec], default_root_dir=root, precision=case.precision, num_sanity_val_steps=0,
                        limit_val_batches=0)
    model = MoELanguageModel(**model_kwargs(case))
    trainer.fit(model, datamodule=TokenDataModule(path=tokens, seq_length=SEQ, batch_size=bs, seed=3))
    losses = torch.tensor(rec.losses, dtype=torch.float64, device=trainer.strategy.root_device)
    if parallel:
        dist.all_reduce(losses)  # the objective is the mean over data-parallel ranks
        losses /= dp
    state = {n: t.detach().cpu().clone() for n, t in model.model.state_dict().items()}
    main = getattr(trainer.strategy, "_main_params", None)
    if main is not None:  # compare the fp32 main weights, not their bf16 rounding
        for n, p in model.model.named_parameters():
            state[n] = main.main_of(p).detach().cpu().clone()
    grads = {n: g.cpu() for n, g in rec.grads.items()}
    return {"losses": losses.cpu(), "grads": grads, "state": state, "ctx": model.parallel_context}


def reference_slice(name: str, full: torch.Tensor, ctx, num_experts: int) -> torch.Tensor:
    """The part of a full reference tensor that this rank holds (experts by EP rank, FFN columns by ETP rank)."""
    if ".experts." not in name:
        return full
    L_ = num_experts // ctx.ep
    e0 = ctx.rank("ep") * L_
    r, n = ctx.rank("etp"), ctx.etp
    if name.endswith("w13"):
        F = full.shape[-1] // 2
        f = F // n
        gate, up = full[e0:e0 + L_, :, r * f:(r + 1) * f], full[e0:e0 + L_, :, F + r * f:F + (r + 1) * f]
        return torch.cat([gate, up], dim=-1)
    if name.endswith("w2"):
        f = full.shape[1] // n
        return full[e0:e0 + L_, r * f:(r + 1) * f]
    raise KeyError(name)


def _diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    a, b = a.double(), b.double()
    abs_ = (a - b).abs().max().item() if a.numel() else 0.0
    return abs_, abs_ / max(b.abs().max().item(), 1e-12)


def compare(run: dict, ref: dict, num_experts: int) -> dict:
    out = {"loss": _diff(run["losses"], ref["losses"])}
    ctx = run["ctx"]
    for kind in ("grads", "state"):
        worst = (0.0, 0.0, "")
        for name, t in run[kind].items():
            a, r = _diff(t, reference_slice(name, ref[kind][name], ctx, num_experts))
            if r >= worst[1]:
                worst = (a, r, name)
        out[kind] = worst
    bias = {n: t for n, t in run["state"].items() if n.endswith("router.expert_bias")}
    out["expert_bias_exact"] = all(torch.equal(t, ref["state"][n]) for n, t in bias.items())
    out["expert_bias_moved"] = any(t.abs().sum() > 0 for t in bias.values())
    out["losses"] = (run["losses"].tolist(), ref["losses"].tolist())
    return out


def parallel_worker(rank: int, world: int, cases: list, refs_path: str, tokens: str, root: str) -> dict:
    refs = torch.load(refs_path, weights_only=False)  # written by the test process itself
    results = {}
    for case in cases:
        run = train(case, tokens, root, parallel=True)
        results[case.name] = compare(run, refs[case.name], run_num_experts(case))
    return results


def run_num_experts(case: Case) -> int:
    return case.model.get("num_experts", 8)
