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

from lightning_moe.modules.tensor_parallel import tp_shard

import hashlib
import os

# LMOE_PARITY_ACCELERATOR=gpu runs the same cases over NCCL on GPUs (the reference on GPU 0); CI uses gloo on CPU
ACCELERATOR = os.environ.get("LMOE_PARITY_ACCELERATOR", "cpu")
STEPS = 3
# float32 with different reduction orders: ~1e-7 typical; Adam divides by sqrt(v), so parameters get a looser bound.
# Over NCCL (measured on H200s: params after 3 steps up to 1.4e-4 rel) the reference uses foreach AdamW, moe_fold fused
# AdamW, and CUDA reductions reorder sums.
TOL = {"loss": 1e-5, "grads": 1e-5, "state": 5e-4 if ACCELERATOR == "gpu" else 1e-4}
# bf16 compute: CPU bf16 GEMMs round differently for different row counts. Gradients and loss stay within ~5e-3; the
# parameters after 3 AdamW steps differ by up to ~lr where Adam's sign(g) meets near-zero bf16-rounded gradients, so
# bf16 cases train at lr 1e-3. A missing 1/(dp*cp) or a 1/edp expert-gradient scale is a factor of 2 in the grads.
BF16_TOL = {"loss": 1e-3, "grads": 2e-2, "state": 0.1}
SEQ = 32
GLOBAL_BATCH = 8


@dataclass
class Case:
    name: str
    world: int
    ep: int = 1
    etp: int = 1
    tp: int = 1
    cp: int = 1
    sp: Optional[bool] = None  # sequence parallelism (MoEFoldStrategy's default: on when tp > 1)
    pp: int = 1
    m: int = 1  # num_microbatches (pipeline schedules); the reference accumulates the same micro-batches
    model: dict = field(default_factory=dict)
    accumulate: int = 1  # gradient accumulation on both sides
    strategy: dict = field(default_factory=dict)  # extra MoEFoldStrategy arguments
    precision: str = "32-true"  # "bf16-true": bf16 weights with fp32 main params and grads on both sides
    tol: Optional[dict] = None  # per-case tolerances (bf16 compute differs by layout in its rounding)
    lr: float = 1e-2
    adam_eps: float = 1e-8
    callbacks: tuple = ()  # callback factories (e.g. functools.partial(FP8Training, "rowwise")), on both sides
    data: dict = field(default_factory=dict)  # extra TokenDataModule arguments (PACKED: packed documents)
    nodes: int = 1  # Trainer(num_nodes=...) of the parallel run: world // nodes devices on each

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.cp * self.pp)

    @property
    def dropping(self) -> bool:
        return self.model.get("capacity_factor") is not None


def _base() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=64)


# packed documents over the same stream: one token of the phrase ends a document (once every 64 tokens, so rows of
# SEQ + 1 hold pieces of split documents and whole ones, with boundaries inside them)
PACKED = dict(pack_documents=True, eod_token_id=int(_base()[5]))


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
        # lm_loss + aux_loss (summed over TP): the same number on every layout; outputs["loss"] holds this rank's
        # share of the aux loss under TP
        self._acc += float(outputs["lm_loss"] + outputs["aux_loss"]) / trainer.accumulate_grad_batches
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.losses.append(self._acc)
            self._acc = 0.0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        sharded = getattr(trainer.strategy, "sharded_optimizer", None)
        if self.grads is None and sharded is not None:  # each rank holds its slice: gathered (collective)
            full = sharded.full_grads()
            self.grads = {n: full[id(p)] for n, p in pl_module.model.named_parameters()}
        elif self.grads is None:  # with fp32 main params the synced gradient is p.main_grad (p.grad is freed)
            self.grads = {n: (p.grad if p.grad is not None else p.main_grad).detach().clone()
                          for n, p in pl_module.model.named_parameters()}

    def on_train_end(self, trainer, pl_module):
        sharded = getattr(trainer.strategy, "sharded_optimizer", None)
        self.mains = None
        if sharded is not None:  # the main weights, gathered over their owners (collective)
            full = sharded.full_main_params()
            self.mains = {n: full[id(p)].detach().cpu() for n, p in pl_module.model.named_parameters()}


def model_kwargs(case: Case) -> dict:
    overrides = dict(seq_length=SEQ, num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                     ffn_hidden_size=64, moe_ffn_hidden_size=32, num_experts=8, topk=2, z_loss_coeff=1e-3)
    overrides.update(case.model)
    return dict(preset="tiny", overrides=overrides, lr=case.lr, eps=case.adam_eps, warmup_steps=1, max_steps=STEPS, seed=7,
                log_expert_load=False)


def train(case: Case, tokens: str, root: str, parallel: bool) -> dict:
    from lightning_moe import MoEFoldStrategy, MoELanguageModel, TokenDataModule
    L.seed_everything(0, verbose=False)
    dp = case.dp
    if parallel:
        strategy, devices, bs, accumulate = MoEFoldStrategy(expert_parallel_size=case.ep,
                                                            expert_tensor_parallel_size=case.etp,
                                                            tensor_parallel_size=case.tp,
                                                            context_parallel_size=case.cp, sequence_parallel=case.sp,
                                                            pipeline_parallel_size=case.pp, num_microbatches=case.m,
                                                            timeout=int(os.environ.get("LMOE_PARITY_TIMEOUT", "120")), **case.strategy), case.world // case.nodes, \
            GLOBAL_BATCH // dp, 1
    elif case.dropping or case.m > 1:
        # capacity and the aux loss are per micro-batch and per rank (as in Megatron): the reference runs each DP
        # shard's micro-batches as its own micro-batches (bf16: with fp32 main params, as the parallel side)
        strategy = MoEFoldStrategy() if case.precision != "32-true" else "auto"
        strategy, devices, bs, accumulate = strategy, 1, GLOBAL_BATCH // (dp * case.m), dp * case.m
    elif case.precision != "32-true":
        # the reference also keeps fp32 main params, which plain Lightning bf16-true does not
        strategy, devices, bs, accumulate = MoEFoldStrategy(), 1, GLOBAL_BATCH, 1
    else:
        strategy, devices, bs, accumulate = "auto", 1, GLOBAL_BATCH, 1
    accumulate *= case.accumulate
    rec = Recorder()
    trainer = L.Trainer(accelerator=ACCELERATOR, devices=devices, num_nodes=case.nodes if parallel else 1,
                        strategy=strategy, max_steps=STEPS,
                        accumulate_grad_batches=accumulate, gradient_clip_val=0.5, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[rec, *(make() for make in case.callbacks)], default_root_dir=root,
                        precision=case.precision, num_sanity_val_steps=0,
                        limit_val_batches=0)
    model = MoELanguageModel(**model_kwargs(case))
    trainer.fit(model, datamodule=TokenDataModule(path=tokens, seq_length=SEQ, batch_size=bs, seed=3, **case.data))
    losses = torch.tensor(rec.losses, dtype=torch.float64, device=trainer.strategy.root_device)
    if parallel:
        dist.all_reduce(losses)  # the objective is the mean over dp x cp ranks (TP ranks hold the same value)
        losses /= case.world
    state = {n: t.detach().cpu().clone() for n, t in model.model.state_dict().items()}
    main = getattr(trainer.strategy, "_main_params", None)
    if main is not None:  # compare the fp32 main weights, not their bf16 rounding
        for n, p in model.model.named_parameters():
            state[n] = main.main_of(p).detach().cpu().clone()
    if getattr(rec, "mains", None) is not None:
        state.update(rec.mains)
    grads = {n: g.cpu() for n, g in rec.grads.items()}
    specs = {n: (getattr(p, "tp_shard_dim", None), getattr(p, "tp_parts", 1))
             for n, p in model.model.named_parameters()}
    # where the ranks ran (MoEFoldStrategy only): the launcher's environment, each rank's node, groups across nodes
    placement = {"environment": type(getattr(trainer.strategy, "cluster_environment", None)).__name__,
                 "node_of_rank": getattr(trainer.strategy, "node_of_rank", None),
                 "cross_node_groups": getattr(trainer.strategy, "cross_node_groups", None)}
    pipeline = trainer.strategy.pipeline_timing() if parallel else {}
    digest = {"losses": digest_of({"losses": losses}), "grads": digest_of(grads), "state": digest_of(state)}
    return {"losses": losses.cpu(), "grads": grads, "state": state, "ctx": model.parallel_context, "specs": specs,
            "placement": placement, "pipeline": pipeline, "digest": digest}


def digest_of(tensors: dict) -> str:
    """SHA-256 over the names and bytes of the tensors: equal exactly when the runs are bitwise equal."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def reference_slice(name: str, full: torch.Tensor, ctx, num_experts: int, spec=(None, 1)) -> torch.Tensor:
    """The part of a full reference tensor that this rank holds (experts by EP rank, FFN columns by ETP rank, TP
    shards of dense weights by TP rank)."""
    if ".experts." not in name:
        dim, parts = spec
        return full if dim is None else tp_shard(full, dim, ctx.rank("tp"), ctx.tp, parts)
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


def _diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    """max |a - b|, that over max |b|, and ||a - b|| / ||b|| (bf16 rounding moves single elements of small tensors a
    lot, the norm of the difference little; a wrong scale or a missing part moves both)."""
    a, b = a.double(), b.double()
    if not a.numel():
        return 0.0, 0.0, 0.0
    abs_ = (a - b).abs().max().item()
    return abs_, abs_ / max(b.abs().max().item(), 1e-12), ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def compare(run: dict, ref: dict, num_experts: int) -> dict:
    out = {"loss": _diff(run["losses"], ref["losses"])[:2]}
    ctx = run["ctx"]
    for kind in ("grads", "state"):
        worst, worst_norm = (0.0, 0.0, ""), (0.0, 0.0, "")
        for name, t in run[kind].items():
            a, r, n = _diff(t, reference_slice(name, ref[kind][name], ctx, num_experts,
                                               run["specs"].get(name, (None, 1))))
            if r >= worst[1]:
                worst = (a, r, name)
            if n >= worst_norm[1]:
                worst_norm = (a, n, name)
        out[kind], out[kind + "_norm"] = worst, worst_norm
    bias = {n: t for n, t in run["state"].items() if n.endswith("router.expert_bias")}
    out["expert_bias_exact"] = all(torch.equal(t, ref["state"][n]) for n, t in bias.items())
    out["expert_bias_moved"] = any(t.abs().sum() > 0 for t in bias.values())
    out["losses"] = (run["losses"].tolist(), ref["losses"].tolist())
    out["pipeline"], out["digest"] = run["pipeline"], run["digest"]
    return out


def parallel_worker(rank: int, world: int, cases: list, refs_path: str, tokens: str, root: str) -> dict:
    refs = torch.load(refs_path, weights_only=False)  # written by the test process itself
    results = {}
    for case in cases:
        run = train(case, tokens, root, parallel=True)
        results[case.name] = compare(run, refs[case.name], run_num_experts(case))
    return results


def runnable(cases: list) -> list:
    """The cases this machine has ranks for: all on CPU (gloo), those with world <= the GPU count over NCCL.
    ``LMOE_PARITY_ONLY=regex`` keeps the cases whose names match (a short GPU session runs what it needs)."""
    only = os.environ.get("LMOE_PARITY_ONLY")
    if only:
        import re
        cases = [c for c in cases if re.search(only, c.name)]
    if ACCELERATOR != "gpu":
        return cases
    import torch
    return [c for c in cases if c.world <= torch.cuda.device_count()]


def run_num_experts(case: Case) -> int:
    return case.model.get("num_experts", 8)


def run_cases(cases: list, root) -> dict:
    """References on one process, then every case of each world size on that many spawned ranks. Returns
    ``{"ref": {name: reference run}, name: [per-rank comparison]}``."""
    from tests.parallel.harness import run_ranks
    tokens = make_tokens(str(root / "tokens.bin"))
    refs = {c.name: train(c, tokens, str(root / "ref"), parallel=False) for c in cases}
    for r in refs.values():
        r.pop("ctx")
    refs_path = str(root / "refs.pt")
    torch.save(refs, refs_path)
    out: dict = {"ref": refs}
    for world in sorted({c.world for c in cases}):
        group = [c for c in cases if c.world == world]
        rank_dir = root / f"w{world}"
        rank_dir.mkdir()
        per_rank = run_ranks(parallel_worker, world, group, refs_path, tokens, str(root / f"run{world}"),
                             out_dir=str(rank_dir))
        for c in group:
            out[c.name] = [r[c.name] for r in per_rank]
    return out


def check_case(case: Case, per_rank: list, tol: dict) -> None:
    """Assert every rank's loss, gradients and parameters are within ``case.tol or tol`` of the reference."""
    for rank, res in enumerate(per_rank):
        keys = dict.fromkeys([*tol, *(case.tol or {})])
        print(f"{case.name} rank{rank}: " + ", ".join(f"{k} abs={res[k][0]:.2e} rel={res[k][1]:.2e}" for k in keys))
        for key, bound in (case.tol or tol).items():
            abs_, rel = res[key][:2]
            assert rel <= bound, (f"{case.name} rank {rank}: {key} differs from the 1-process reference: max abs "
                                  f"{abs_:.3e}, rel {rel:.3e} (worst: {res[key][2] if key != 'loss' else ''}); "
                                  f"losses {res['losses']}")
        assert res["expert_bias_exact"], f"{case.name} rank {rank}: expert bias differs from the reference"
        if case.model.get("expert_bias"):
            assert res["expert_bias_moved"], "the expert-bias update never ran: the test would prove nothing"
