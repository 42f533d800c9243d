"""ExpertLoadMonitor: hand-computed load under fixed routing, drops under a capacity factor, and agreement with the
model's own ``expert_load_metrics`` (one rank)."""

from __future__ import annotations

import math
import types

import lightning as L
import pytest
import torch

from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_moe import MoELanguageModel, TokenDataModule
from lightning_moe.callbacks.expert_load import ExpertLoadMonitor, load_stats

SEQ, BATCH, E = 32, 4, 8
T = SEQ * BATCH  # tokens per micro-batch per layer
TINY = dict(seq_length=SEQ, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
            moe_ffn_hidden_size=32, num_experts=E, topk=2)




def route_all_to_experts_0_and_1(model: MoELanguageModel) -> None:
    """Fixed routing: the router sees a constant all-ones input, so its logits are the row sums of its weight;
    rows 0 and 1 are set to sum to 2 and 1, the others to 0, and frozen. Every token then picks experts {0, 1}."""
    model.configure_model()
    h = model.config.hidden_size
    for moe in model.model.moe_layers():
        with torch.no_grad():
            moe.router.weight.zero_()
            moe.router.weight[0].fill_(2.0 / h)
            moe.router.weight[1].fill_(1.0 / h)
        moe.router.weight.requires_grad_(False)
        moe.router.register_forward_pre_hook(lambda mod, args, kwargs: ((torch.ones_like(args[0]),), kwargs),
                                             with_kwargs=True)


def fit(token_file, callbacks, max_steps=4, fixed_routing=False, accumulate=1, logger=False, **overrides):
    model = MoELanguageModel(preset="tiny", overrides={**TINY, **overrides}, warmup_steps=2)
    if fixed_routing:
        route_all_to_experts_0_and_1(model)
    dm = TokenDataModule(path=token_file, seq_length=SEQ, batch_size=BATCH)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, log_every_n_steps=2,
                        accumulate_grad_batches=accumulate, callbacks=callbacks, logger=logger,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    trainer.fit(model, dm)
    return trainer, model


def test_load_stats_by_hand():
    s = load_stats(torch.tensor([[3.0, 1.0, 0.0, 0.0]]), torch.tensor([4.0]))
    # 8 assignments: 4 kept (3 + 1), 4 dropped
    assert torch.allclose(s["fraction"], torch.tensor([[3 / 8, 1 / 8, 0.0, 0.0]]))
    assert s["imbalance"].item() == 3.0  # max 3 / mean 1
    assert s["dropped"].item() == 0.5 and s["min_fraction"].item() == 0.0
    assert s["cv"].item() == pytest.approx(math.sqrt((2**2 + 0 + 1 + 1) / 4))  # population std 1.2247 / mean 1


def test_fixed_routing_dropless(token_file):
    monitor = ExpertLoadMonitor(every_n_steps=2)
    trainer, model = fit(token_file, [monitor], fixed_routing=True)
    # per layer: counts [T, T, 0, 0, 0, 0, 0, 0]; mean 2T/8 = T/4 -> imbalance 4 = E/k;
    # std = sqrt((2 (3T/4)^2 + 6 (T/4)^2) / 8) = sqrt(3) T/4 -> cv = sqrt(3)
    m = trainer.callback_metrics
    for i in (0, 1):
        p = f"expert_load/layer{i}"
        assert m[f"{p}/imbalance"].item() == 4.0
        assert m[f"{p}/imbalance_mean"].item() == 4.0
        assert m[f"{p}/dropped"].item() == 0.0
        assert m[f"{p}/min_fraction"].item() == 0.0
        assert m[f"{p}/cv"].item() == pytest.approx(math.sqrt(3), rel=1e-6)
        assert torch.equal(monitor.last_fractions[i], torch.tensor([0.5, 0.5] + [0.0] * 6))
    assert m["expert_load/max_imbalance"].item() == 4.0


def test_fixed_routing_with_capacity_drops(token_file):
    monitor = ExpertLoadMonitor(every_n_steps=2)
    trainer, model = fit(token_file, [monitor], fixed_routing=True, capacity_factor=1.0)
    # capacity = ceil(T * k / E * 1.0) = 128 * 2 / 8 = 32 per expert: experts 0 and 1 keep 32 of their 128 each;
    # 2T = 256 assignments, 64 kept, 192 dropped -> dropped fraction 3/4; kept counts [32, 32, 0...] -> imbalance 4
    m = trainer.callback_metrics
    for i in (0, 1):
        p = f"expert_load/layer{i}"
        assert m[f"{p}/dropped"].item() == 0.75
        assert m[f"{p}/imbalance"].item() == 4.0
        assert torch.equal(monitor.last_fractions[i], torch.tensor([0.125, 0.125] + [0.0] * 6))


class CheckAgainstModel(L.Callback):
    """After the monitor (next in the callback list) reports, compare with ``pl_module.expert_load_metrics()`` and
    with the counts of every micro-batch of the step, summed here independently."""

    def __init__(self, monitor: ExpertLoadMonitor):
        self.monitor, self.checked, self.sums, self.last = monitor, 0, None, monitor.last_metrics

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        layers = [b for b in pl_module.model.layers if b.is_moe]
        counts = torch.stack([torch.cat([b.ffn.last_stats["tokens_per_expert"], b.ffn.last_stats["num_dropped"][None]])
                              for b in layers])
        self.sums = counts if self.sums is None else self.sums + counts
        stepped = not trainer.fit_loop._should_accumulate()
        if self.monitor.last_metrics is not self.last:  # the monitor reported on this micro-batch
            self.last = self.monitor.last_metrics
            ref = pl_module.expert_load_metrics()  # this micro-batch only, this rank
            summed = load_stats(self.sums[:, :-1], self.sums[:, -1])
            for j, b in enumerate(layers):
                i, p = b.layer_idx, f"expert_load/layer{b.layer_idx}"
                got = self.monitor.last_metrics
                if trainer.accumulate_grad_batches == 1:
                    assert got[f"{p}/imbalance"].item() == pytest.approx(ref[f"load/layer{i}/imbalance"].item())
                    assert got[f"{p}/dropped"].item() == pytest.approx(ref[f"load/layer{i}/dropped"].item())
                    frac = torch.stack([ref[f"load/layer{i}/expert{e}"] for e in range(E)])
                    assert torch.allclose(self.monitor.last_fractions[i], frac)
                    assert got[f"{p}/min_fraction"].item() == pytest.approx(frac.min().item())
                    cv = frac.std(correction=0) / frac.mean()  # the fractions' cv is the counts' cv
                    assert got[f"{p}/cv"].item() == pytest.approx(cv.item(), rel=1e-5)
                for key in ("imbalance", "dropped", "cv", "min_fraction"):
                    assert got[f"{p}/{key}"].item() == pytest.approx(summed[key][j].item(), rel=1e-6)
            self.checked += 1
        if stepped:
            self.sums = None


@pytest.mark.parametrize("accumulate", [1, 2])
def test_matches_model_expert_load_metrics(token_file, accumulate):
    monitor = ExpertLoadMonitor(every_n_steps=2)
    check = CheckAgainstModel(monitor)
    # natural routing with a capacity factor so that both imbalance and drops are non-trivial
    fit(token_file, [monitor, check], max_steps=4, accumulate=accumulate, capacity_factor=1.25)
    assert check.checked == 2  # steps 2 and 4
    assert any(v.item() > 0 for k, v in monitor.last_metrics.items() if k.endswith("/dropped"))


class FakeTwoRankContext:
    """Stands in for a 2-rank ParallelContext: the 'other rank' routed every token to experts 2 and 3."""

    pp = 1  # no pipeline stages

    def __init__(self):
        self.calls = []

    def all_reduce_(self, t, name):
        self.calls.append(name)
        other = torch.zeros_like(t)
        other[:, 2:4] = T  # per layer: T assignments to expert 2 and to expert 3, none dropped
        return t.add_(other)


def test_counts_are_all_reduced_over_tp_dp_cp(token_file):
    monitor = ExpertLoadMonitor(every_n_steps=2)
    ctx = FakeTwoRankContext()

    class SwapContext(L.Callback):
        def on_train_start(self, trainer, pl_module):
            pl_module.parallel_context = ctx  # only the monitor reads it; the model kept its own context

    trainer, model = fit(token_file, [SwapContext(), monitor], fixed_routing=True)
    assert ctx.calls == ["tp_dp_cp", "tp_dp_cp"]  # one all-reduce per logging step (steps 2 and 4), all layers
    # global counts [T, T, T, T, 0, 0, 0, 0]: mean T/2 -> imbalance 2; std T/2 -> cv 1; fractions 1/4 each
    m = trainer.callback_metrics
    for i in (0, 1):
        assert m[f"expert_load/layer{i}/imbalance"].item() == 2.0
        assert m[f"expert_load/layer{i}/cv"].item() == pytest.approx(1.0)
        assert torch.equal(monitor.last_fractions[i], torch.tensor([0.25] * 4 + [0.0] * 4))


class FakeTensorBoard(TensorBoardLogger):
    """A TensorBoardLogger that needs no tensorboard package: it records ``add_histogram`` calls."""

    def __init__(self):  # deliberately skips TensorBoardLogger.__init__ (it requires tensorboard)
        self.histograms = []
        self._fake = types.SimpleNamespace(add_histogram=lambda tag, values, global_step:
                                           self.histograms.append((tag, values, global_step)))

    experiment = property(lambda self: self._fake)
    name = property(lambda self: "fake")
    version = property(lambda self: 0)
    save_dir = property(lambda self: None)
    log_dir = property(lambda self: None)

    def log_metrics(self, metrics, step=None):
        pass

    def log_hyperparams(self, *args, **kwargs):
        pass

    def log_graph(self, *args, **kwargs):
        pass

    def save(self):
        pass

    def finalize(self, status):
        pass


def test_histogram_only_for_tensorboard(token_file, tmp_path):
    tb = FakeTensorBoard()
    fit(token_file, [ExpertLoadMonitor(every_n_steps=2)], fixed_routing=True, logger=[CSVLogger(tmp_path), tb])
    assert [(tag, step) for tag, _, step in tb.histograms] == [
        ("expert_load/layer0/fraction", 2), ("expert_load/layer1/fraction", 2),
        ("expert_load/layer0/fraction", 4), ("expert_load/layer1/fraction", 4)]
    assert torch.equal(tb.histograms[-1][1], torch.tensor([0.5, 0.5] + [0.0] * 6))
