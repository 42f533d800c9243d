"""The distributed / precision-aware / offloaded optimizer on one process: the flat-slice index math, the option checks
(each bad input fails with the option's name), bf16 state stored exactly as fp32 Adam's rounded moments, the offload
split, and checkpoint blocks of flat slices."""

from __future__ import annotations

import math
import random

import lightning as L
import pytest
import torch

from lightning_moe.strategy.flat_shards import (bucket_layout, flat_boxes, owned_ranges, owned_slice,
                                                split_for_host)
from lightning_moe.strategy.grad_sync import GradSync
from lightning_moe.strategy.optimizer_options import OptimizerOptions
from lightning_moe.strategy.parallel_context import ParallelContext
from lightning_moe.strategy.sharded_optimizer import ShardedOptimizer


# ---------------------------------------------------------------------------------------------- index math
def test_flat_boxes_cover_exactly_the_range():
    rng = random.Random(0)
    for _ in range(2000):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        n = math.prod(shape)
        lo = rng.randint(0, n)
        hi = rng.randint(lo, n)
        boxes = flat_boxes(shape, lo, hi)
        flat = torch.arange(n).view(shape)
        covered = torch.zeros(n, dtype=torch.int64)
        for off, size, start in boxes:
            view = flat
            for d, (o, s) in enumerate(zip(off, size)):
                view = view.narrow(d, o, s)
            assert view.reshape(-1).tolist() == list(range(start, start + view.numel()))  # contiguous in flat order
            covered[view.reshape(-1)] += 1
        assert covered[lo:hi].eq(1).all() and covered[:lo].eq(0).all() and covered[hi:].eq(0).all()
        assert len(boxes) <= max(1, 2 * len(shape) - 1)


def test_bucket_layout_aligns_and_splits_evenly():
    offsets, total = bucket_layout([10, 100, 3], group_size=4)
    assert offsets == [0, 64, 192] and total == 256
    assert [owned_slice(total, 4, r) for r in range(4)] == [(0, 64), (64, 128), (128, 192), (192, 256)]
    # rank 1 owns 64 elements of the second parameter; rank 3 owns the third and padding
    assert [(r.index, r.lo, r.hi) for r in owned_ranges(offsets, [10, 100, 3], 64, 128)] == [(1, 0, 64)]
    assert [(r.index, r.lo, r.hi) for r in owned_ranges(offsets, [10, 100, 3], 128, 192)] == [(1, 64, 100)]
    assert [(r.index, r.lo, r.hi) for r in owned_ranges(offsets, [10, 100, 3], 192, 256)] == [(2, 0, 3)]
    with pytest.raises(ValueError, match="not divisible"):
        owned_slice(100, 3, 0)


def test_split_for_host_takes_the_fraction():
    assert split_for_host([10, 20, 30], 0.5) == [(0, 10), (0, 20), (30, 0)]
    assert split_for_host([10, 20, 30], 0.25) == [(0, 10), (15, 5), (30, 0)]
    assert split_for_host([10, 20], 0.0) == [(10, 0), (20, 0)]
    assert split_for_host([10, 20], 1.0) == [(0, 10), (0, 20)]


# ---------------------------------------------------------------------------------------------- bad input
def _opts(**kw):
    base = dict(distributed_optimizer=False, overlap_param_gather=True, fp32_main_params=None, main_params_dtype=None,
                exp_avg_dtype=None, exp_avg_sq_dtype=None, optimizer_cpu_offload=0.0)
    base.update(kw)
    return OptimizerOptions.parse(**base)


@pytest.mark.parametrize("kw,match", [
    (dict(exp_avg_dtype="fp8"), r"exp_avg_dtype='fp8'.*'fp32', 'bf16'"),
    (dict(exp_avg_sq_dtype=torch.float16), r"exp_avg_sq_dtype"),
    (dict(main_params_dtype="half"), r"main_params_dtype='half'"),
    (dict(optimizer_cpu_offload=1.5), r"optimizer_cpu_offload=1.5.*\[0, 1\]"),
    (dict(optimizer_cpu_offload=-0.1), r"optimizer_cpu_offload"),
    (dict(optimizer_cpu_offload=True), r"optimizer_cpu_offload=True"),
    (dict(optimizer_cpu_offload="half"), r"optimizer_cpu_offload='half'"),
    (dict(distributed_optimizer="yes"), r"distributed_optimizer='yes'"),
    (dict(main_params_dtype="bf16", fp32_main_params=True), r"contradicts"),
])
def test_bad_options_name_the_option(kw, match):
    with pytest.raises(ValueError, match=match):
        _opts(**kw)


def test_strategy_refuses_bad_options_at_construction():
    from lightning_moe import MoEFoldStrategy
    with pytest.raises(ValueError, match="optimizer_cpu_offload=2"):
        MoEFoldStrategy(optimizer_cpu_offload=2)
    with pytest.raises(ValueError, match="exp_avg_dtype='int8'"):
        MoEFoldStrategy(exp_avg_dtype="int8")


class _Factored(torch.optim.Optimizer):  # like Adafactor: row/column statistics need whole tensors
    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})


def test_refuses_optimizers_that_need_whole_tensors():
    p = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"distributed_optimizer=True.*_Factored.*elementwise_step"):
        _opts(distributed_optimizer=True).check_optimizer(_Factored([p]))
    with pytest.raises(ValueError, match="LBFGS"):
        _opts(optimizer_cpu_offload=0.5).check_optimizer(torch.optim.LBFGS([p]))
    _Factored.elementwise_step = True  # a user's declaration that it is elementwise
    try:
        _opts(distributed_optimizer=True).check_optimizer(_Factored([p]))
    finally:
        del _Factored.elementwise_step
    with pytest.raises(ValueError, match=r"exp_avg_dtype.*exp_avg.*SGD"):
        _opts(exp_avg_dtype="bf16").check_optimizer(torch.optim.SGD([p], lr=0.1, momentum=0.9))
    _opts(distributed_optimizer=True).check_optimizer(torch.optim.SGD([p], lr=0.1))  # elementwise: fine


# ---------------------------------------------------------------------------------------------- one process
class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _sharded(net, opt, **kw):
    ctx = ParallelContext.single()
    options = _opts(**kw)
    sync = GradSync(net.parameters(), ctx, bucket_mb=0.001, overlap=True, main_grads=True,
                    shard=options.distributed)
    return sync, ShardedOptimizer(net, opt, sync, ctx, options, main_fp32=True, device=torch.device("cpu"))


def _train(net, opt, sync, sharded, steps=4):
    torch.manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 16)
        if sync is not None:
            sync.arm()
        net(x).pow(2).mean().backward()
        if sync is not None:
            sync.finish()
            sharded.attach_grads()
        opt.step()
        opt.zero_grad()
        if sync is not None:
            sync.discard()


def test_sharded_steps_equal_whole_tensor_adamw():
    ref, net = _Net(), _Net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    sync, sharded = _sharded(net, opt, distributed_optimizer=True, optimizer_cpu_offload=0.3)
    assert len(sharded.slots) > len(list(net.parameters()))  # small buckets: parameters split over slots
    host = sum(s.hi - s.lo for s in sharded.slots if s.host)
    total = sum(s.hi - s.lo for s in sharded.slots)
    assert host == round(0.3 * total)
    _train(ref, ref_opt, None, None)
    _train(net, opt, sync, sharded)
    for a, b in zip(ref.parameters(), net.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_bf16_moments_are_fp32_adam_rounded_each_step():
    """bf16 state: each step computes in fp32 from the stored bf16 moments and stores them rounded to nearest. A
    hand-written fp32 AdamW with the same rounding gives the same weights, bit for bit."""
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    sync, sharded = _sharded(net, opt, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    ref = _Net()
    m = [torch.zeros_like(p) for p in ref.parameters()]
    v = [torch.zeros_like(p) for p in ref.parameters()]
    torch.manual_seed(1)
    for step in range(1, 4):
        x = torch.randn(8, 16)
        sync.arm()
        net(x).pow(2).mean().backward()
        sync.finish()
        sharded.attach_grads()
        opt.step()
        opt.zero_grad()
        sync.discard()
        ref.zero_grad()
        ref(x).pow(2).mean().backward()
        with torch.no_grad():
            for p, mi, vi in zip(ref.parameters(), m, v):
                p.mul_(1 - 1e-2 * 0.1)
                mi.lerp_(p.grad, 0.1)
                vi.mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                denom = (vi.sqrt() / math.sqrt(1 - 0.999 ** step)).add_(1e-8)
                p.addcdiv_(mi, denom, value=-1e-2 / (1 - 0.9 ** step))
                mi.copy_(mi.bfloat16().float())
                vi.copy_(vi.bfloat16().float())
    for s in sharded.slots:
        st = opt.state[s.tensor]
        assert st["exp_avg"].dtype == torch.bfloat16 and st["exp_avg_sq"].dtype == torch.bfloat16
    for a, b in zip(ref.parameters(), net.parameters()):
        torch.testing.assert_close(b, a, rtol=2e-6, atol=1e-7)


def test_trainer_one_process_with_every_option(tmp_path):
    """A one-process Trainer run: with the distributed optimizer and half the state offloaded, the clipped, stepped
    weights match plain AdamW's on whole tensors."""
    from lightning_moe import MoEFoldStrategy, MoELanguageModel, TokenDataModule
    from tests.parallel.parity import make_tokens
    tokens = make_tokens(str(tmp_path / "t.bin"))
    runs = {}
    for name, kw in (("plain", {}), ("sharded", dict(distributed_optimizer=True, optimizer_cpu_offload=0.5))):
        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=MoEFoldStrategy(**kw), max_steps=4,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0, gradient_clip_val=0.5,
                            default_root_dir=str(tmp_path))
        model = MoELanguageModel(preset="tiny", overrides=dict(seq_length=32, num_layers=1, hidden_size=32,
                                                               moe_ffn_hidden_size=32), lr=1e-2, warmup_steps=1)
        trainer.fit(model, datamodule=TokenDataModule(path=tokens, seq_length=32, batch_size=4))
        runs[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
        if kw:
            assert trainer.strategy.sharded_optimizer is not None
    for n, p in runs["plain"].items():
        torch.testing.assert_close(runs["sharded"][n], p, rtol=1e-5, atol=1e-6)


def test_range_pieces_map_slices_to_logical_blocks():
    """A flat slice of a 2-D weight, written as rectangular blocks, covers exactly its elements of the logical
    tensor (the distributed optimizer's checkpoint pieces)."""
    from lightning_moe.strategy.reshard import range_pieces
    net = _Net()
    ctx = ParallelContext.single()
    shape = tuple(net.a.weight.shape)
    full = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    lo, hi = 5, 70
    pieces = range_pieces(net, ctx, "a.weight", shape, lo, hi, full.reshape(-1)[lo:hi].clone())
    rebuilt = torch.full(shape, -1.0)
    for p in pieces:
        view = rebuilt
        for d, (o, s) in enumerate(zip(p.offsets, p.local.shape)):
            view = view.narrow(d, o, s)
        view.copy_(p.local)
    assert torch.equal(rebuilt.reshape(-1)[lo:hi], full.reshape(-1)[lo:hi])
    assert rebuilt.reshape(-1)[:lo].eq(-1).all() and rebuilt.reshape(-1)[hi:].eq(-1).all()
    assert {p.key for p in pieces} == {"a.weight"} and len(pieces) == 3  # partial row, full rows, partial row


def test_bytes_per_parameter():
    """Megatron's table: 18 bytes for bf16 weights with fp32 main grads, main weights and Adam moments; 6 + 12/d with
    the distributed optimizer over d ranks; bf16 moments save 4; offload moves the owned 12 to the host."""
    from lightning_moe.strategy.memory import optimizer_bytes_per_param as b
    assert b()["device"] == 18 and b()["host"] == 0
    assert b(distributed_optimizer=True, shard=4)["device"] == 6 + 12 / 4
    assert b(shard=4)["device"] == 18  # the shard count matters only with the distributed optimizer
    assert b(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")["device"] == 14
    assert b(optimizer_cpu_offload=1.0)["device"] == 6
    assert b(optimizer_cpu_offload=0.5)["device"] == 12 and b(optimizer_cpu_offload=0.5)["host_grads"] == 2
    assert b(fp32_main_params=False)["device"] == 2 + 2 + 4  # plain bf16: bf16 grads and moments
    assert b(weight_bytes=4)["device"] == 16  # fp32 weights are their own main params


def test_bf16_main_params_refused_for_fp32_weights(tmp_path):
    """main_params_dtype='bf16' would do nothing for fp32 weights: refused at setup, naming the option."""
    from lightning_moe import MoEFoldStrategy, MoELanguageModel, TokenDataModule
    from tests.parallel.parity import make_tokens
    tokens = make_tokens(str(tmp_path / "t.bin"))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=MoEFoldStrategy(main_params_dtype="bf16"), max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=str(tmp_path))
    model = MoELanguageModel(preset="tiny", overrides=dict(seq_length=32, num_layers=1, hidden_size=32))
    with pytest.raises(ValueError, match="main_params_dtype='bf16'.*fp32"):
        trainer.fit(model, datamodule=TokenDataModule(path=tokens, seq_length=32, batch_size=2))


def test_offload_without_pinned_memory_fails_naming_the_option(monkeypatch):
    """On a GPU whose host memory cannot be page-locked, offload fails at setup with the option's name."""
    from lightning_moe.strategy import optimizer_offload
    from lightning_moe.strategy.optimizer_setup import check_pinned_memory

    class NoPinning:
        @staticmethod
        def cudaHostRegister(ptr, size, flags):
            return 3  # cudaErrorInitializationError

    monkeypatch.setattr(optimizer_offload.torch.cuda, "cudart", lambda: NoPinning)
    with pytest.raises(RuntimeError, match=r"optimizer_cpu_offload=0.5.*pinned host memory.*CUDA error 3"):
        check_pinned_memory(torch.device("cuda"), 0.5)
    check_pinned_memory(torch.device("cpu"), 0.5)  # CPU devices: the state is on the host already


def test_fp32_moments_with_bf16_main_params_refused():
    """Decided where the weights' dtype is known: bf16 main params step bf16 moments; for fp32 weights it is fine."""
    options = _opts(main_params_dtype="bf16", exp_avg_dtype="fp32")
    with pytest.raises(ValueError, match=r"exp_avg_dtype='fp32'.*fp32 main params"):
        options.check_state_dtypes(bf16_main_params=True)
    options.check_state_dtypes(bf16_main_params=False)
    assert not _opts(exp_avg_dtype="fp32").sharded and _opts(exp_avg_dtype="bf16").sharded
