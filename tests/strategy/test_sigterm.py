"""The strategy's SIGTERM agreement: a CPU all-reduce per step instead of Lightning's CUDA broadcast + .item()."""

from __future__ import annotations

from types import SimpleNamespace

from tests.parallel.harness import run_ranks


def _agree(rank, world):
    import torch.distributed as dist
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_moe.strategy import sigterm

    dist.init_process_group("gloo")
    trainer = SimpleNamespace(received_sigterm=False,
                              fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_broadcast_sigterm_tensor=None)))
    installed = sigterm.install(trainer)
    out = {"installed": installed}
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()  # nobody was told: every rank goes on
    out["quiet"] = True
    trainer.received_sigterm = rank == world - 1  # only the last rank was told
    try:
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
        out["raised"] = False
    except SIGTERMException:
        out["raised"] = True
    dist.destroy_process_group()
    return out


def test_one_ranks_sigterm_stops_every_rank_at_the_same_step(tmp_path):
    for r in run_ranks(_agree, 2, out_dir=str(tmp_path)):
        assert r == {"installed": True, "quiet": True, "raised": True}


def test_single_process_keeps_lightnings_hook():
    from lightning_moe.strategy import sigterm
    hook = object()
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_broadcast_sigterm_tensor=hook)))
    assert not sigterm.install(trainer)
    assert trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor is hook
