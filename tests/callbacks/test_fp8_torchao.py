"""FP8Training(grouped_kernels="torchao") on CPU, without torchao or CUDA: each refusal before training with one clear
error (torchao's presence and the SM 9.0 check simulated), and the glue (``modules/fp8_torchao.py``) with a CPU
stand-in for torchao's kernel that checks its contract (B column-major, int32 offsets, 16-row groups, bf16 output).
The real kernel is ``tests/test_gpu_fp8_torchao.py``."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from lightning_moe import FP8Training, MoELanguageModel
from lightning_moe.modules import fp8_grouped_kernels, fp8_torchao
from lightning_moe.modules.experts import GroupedMM, grouped_mm
from lightning_moe.modules.fp8_grouped import fp8_grouped_mm
from lightning_moe.modules.fp8_linear import FP8Spec

MODEL = dict(seq_length=32, num_layers=2, hidden_size=128, num_attention_heads=4, num_kv_heads=4, ffn_hidden_size=256,
             moe_ffn_hidden_size=128, num_experts=8, topk=2, first_k_dense=1, vocab_size=256)


@pytest.fixture
def torchao(monkeypatch):
    """torchao importable, and the device taken for an SM 9.0 GPU: what is left to refuse is the model's."""
    monkeypatch.setattr(fp8_torchao, "available", lambda: True)
    monkeypatch.setattr(fp8_grouped_kernels, "available", lambda device: True)


def _lm(**overrides):
    lm = MoELanguageModel(preset="tiny", overrides={**MODEL, **overrides})
    lm.configure_model()
    return lm


def _start(cb, lm, device="cpu"):
    cb.on_fit_start(SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device))), lm)


def test_unknown_value_and_missing_torchao_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"grouped_kernels='cutlass'\): valid: 'torch', 'torchao'"):
        FP8Training("rowwise", grouped_kernels="cutlass")
    monkeypatch.setattr(fp8_torchao, "available", lambda: False)
    with pytest.raises(ValueError, match=r"needs torchao \(and Triton\).*pip install torchao"):
        FP8Training("rowwise", grouped_kernels="torchao")
    FP8Training("rowwise")  # the default path never looks for torchao


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
def test_other_recipes_refused(torchao, recipe):
    with pytest.raises(ValueError, match=rf"recipe='{recipe}', grouped_kernels='torchao'\).*use recipe='rowwise'"):
        FP8Training(recipe, grouped_kernels="torchao")


def test_emulate_refused(torchao):
    with pytest.raises(ValueError, match=r"emulate=True, grouped_kernels='torchao'\): torchao's kernels do not"):
        FP8Training("rowwise", emulate=True, grouped_kernels="torchao")


def test_device_other_than_sm90_refused(monkeypatch):
    monkeypatch.setattr(fp8_torchao, "available", lambda: True)
    cb = FP8Training("rowwise", grouped_kernels="torchao")
    with pytest.raises(ValueError, match=r"compute capability 9.0 .* not a cpu device; use grouped_kernels='torch'"):
        _start(cb, _lm(expert_rows_align=16))
    monkeypatch.setattr(fp8_grouped_kernels, "available", lambda device: False)  # e.g. an A100 or a B200
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"compute capability 9.0 .* not NVIDIA A100-SXM4-80GB"):
        _start(cb, _lm(expert_rows_align=16), "cuda")


@pytest.mark.parametrize("align", [1, 8, 24])
def test_unaligned_expert_rows_refused(torchao, align):
    cb = FP8Training("rowwise", grouped_kernels="torchao")
    lm = _lm(expert_rows_align=align)
    with pytest.raises(ValueError, match=rf"expert_rows_align={align}: set ModelConfig.expert_rows_align=16"):
        _start(cb, lm)
    assert not any("_mm" in vars(m) for m in lm.modules())  # refused before any swap


def test_etp_refused(torchao):
    lm = _lm(expert_rows_align=16)
    lm.parallel_context = SimpleNamespace(etp=2)  # only its size is read before the refusal
    with pytest.raises(ValueError, match=r"not reduced over the expert-tensor-parallel group .* \(etp=2\); use "
                                         "expert_tensor_parallel_size=1"):
        _start(FP8Training("rowwise", grouped_kernels="torchao"), lm)


def test_expert_dims_not_multiple_of_16_refused(torchao):
    lm = _lm(expert_rows_align=16, moe_ffn_hidden_size=72)
    with pytest.raises(ValueError, match=r"experts.fc2 is 72 x 128, not multiples of 16"):
        _start(FP8Training("rowwise", grouped_kernels="torchao"), lm)
    _start(FP8Training("rowwise", grouped_kernels="torchao", exclude=["*.experts.*"]), lm)  # excluded: fine


def _stand_in(calls: list):
    """torchao's ``_to_fp8_rowwise_then_scaled_grouped_mm`` contract, on CPU, in high precision."""
    def kernel(A, B_t, offs, out_dtype, pad_token_groups_for_grouped_mm):
        L, K, N = B_t.shape
        assert A.stride() == (K, 1) and B_t.stride() == (K * N, 1, K), "A row-major, B column-major"
        assert offs.dtype == torch.int32 and offs.shape == (L,)
        assert (torch.diff(offs, prepend=offs.new_zeros(1)) % 16 == 0).all(), "groups of multiples of 16 rows"
        assert out_dtype == torch.bfloat16 and pad_token_groups_for_grouped_mm is False
        calls.append((A.shape, B_t.shape))
        return grouped_mm(A, B_t, offs).to(out_dtype)
    return kernel


def test_glue_calls_torchao_with_its_layouts(monkeypatch):
    calls = []
    monkeypatch.setattr(fp8_torchao, "_kernel", lambda: _stand_in(calls))
    g = torch.Generator().manual_seed(0)
    L, K, N = 4, 64, 96
    offs = torch.tensor([32, 32, 80, 112])  # int64 on purpose; one empty expert; 8 tail rows past the last
    x, w, dy = torch.randn(120, K, generator=g), torch.randn(L, K, N, generator=g), torch.randn(120, N, generator=g)
    out = []
    for spec in (FP8Spec("rowwise", grouped_kernels="torchao"), None):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_grouped_mm(xx, ww, offs, spec) if spec else grouped_mm(xx, ww, offs.to(torch.int32))
        y.backward(dy)
        out.append((y.detach()[:112], xx.grad[:112], ww.grad))
    assert len(calls) == 1 and out[0][0].dtype == torch.float32
    for got, ref in zip(*out):
        assert ((got - ref).norm() / ref.norm()).item() < 1e-2  # the bf16 output rounding
    fp8_grouped_mm(x, w, offs.to(torch.int32), FP8Spec("rowwise", emulate=True, grouped_kernels="torchao"))
    assert len(calls) == 1  # emulate wins


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_swap_log_and_a_step(torchao, monkeypatch, caplog, dispatcher):
    calls = []
    monkeypatch.setattr(fp8_torchao, "_kernel", lambda: _stand_in(calls))
    lm = _lm(expert_rows_align=16, dispatcher=dispatcher)
    cb = FP8Training("rowwise", grouped_kernels="torchao")
    with caplog.at_level(logging.INFO):
        _start(cb, lm)
    assert "2 expert grouped GEMMs (on torchao's rowwise MoE grouped GEMM)" in caplog.text
    grouped = [m for m in lm.modules() if isinstance(m, GroupedMM)]
    assert all(m._mm.keywords["spec"].grouped_kernels == "torchao" for m in grouped)
    logits, aux = lm.model(torch.randint(0, 256, (2, 32)))
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.randint(0, 256, (64,))) + aux
    loss.backward()
    assert len(calls) == 2 and all(torch.isfinite(p.grad).all() for p in lm.parameters() if p.grad is not None)
    cb.teardown(None, lm, "fit")
    assert not any("_mm" in vars(m) for m in lm.modules())
