"""The planner's pieces against what they model: parameter counts against the module, the activation terms against
what docs/PERFORMANCE.md measured them to be, the kernel fit against the measured throughputs, the pipeline shape
against the schedule simulator, and the uneven stage split against the partition rules."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.modules.config import ModelConfig
from lightning_moe.modules.transformer import MoETransformer
from lightning_moe.planner.activations import layer_bytes, layer_terms
from lightning_moe.planner.candidate import pipeline_shape
from lightning_moe.planner.kernels import GROUPED_GEMM_MEASURED, grouped_gemm_efficiency
from lightning_moe.planner.params import model_params
from lightning_moe.planner.search import uneven_split
from lightning_moe.planner.settings import Settings
from lightning_moe.strategy.parallel_context import GROUP_NAMES, ParallelContext
from lightning_moe.strategy.pipeline.partition import partition_layers
from lightning_moe.strategy.pipeline.schedules import build_schedule, simulate

MIB = 2 ** 20


def _context(tp: int, ep: int, etp: int) -> ParallelContext:
    sizes = {n: 1 for n in GROUP_NAMES} | {"tp": tp, "ep": ep, "etp": etp, "tp_cp": tp, "etp_ep": ep * etp}
    return ParallelContext(world_size=tp * ep * etp, sizes=sizes, sequence_parallel=tp > 1,
                           members={n: list(range(sizes[n])) for n in GROUP_NAMES})


@pytest.mark.parametrize("preset,overrides,tp,ep,etp", [
    ("qwen3-30b-a3b", dict(num_layers=2, vocab_size=1024), 1, 1, 1),
    ("mixtral-8x7b", dict(num_layers=2, vocab_size=1024), 2, 4, 1),
    ("deepseek-v3", dict(num_layers=3, vocab_size=1024, first_k_dense=1), 2, 4, 2),
])
def test_parameter_counts_match_the_module(preset, overrides, tp, ep, etp):
    cfg = ModelConfig.from_preset(preset, **overrides)
    with torch.device("meta"):
        module = MoETransformer(cfg, _context(tp, ep, etp))
    expert = sum(p.numel() for p in module.parameters() if getattr(p, "is_expert", False))
    dense = sum(p.numel() for p in module.parameters()) - expert
    assert model_params(cfg).per_rank(tp, ep, etp) == (dense, expert)


def test_activation_terms_are_what_the_recompute_and_offload_runs_measured():
    """docs/PERFORMANCE.md (issue 18), qwen3-30b-a3b with 4 layers at micro-batch 2 x 4096: the SwiGLU output is 96 MB
    per layer, the two norm outputs 64 MB, and the expert inputs 1.07 GB over the 4 layers."""
    cfg = ModelConfig.from_preset("qwen3-30b-a3b", num_layers=4, vocab_size=32768)
    terms, tokens = layer_terms(cfg, 0), 2 * 4096
    assert terms["act_out"] * tokens == 96 * MIB
    assert (terms["attn_norm_out"] + terms["ffn_norm_out"]) * tokens == 64 * MIB
    assert terms["expert_fc1"] * tokens * 4 == pytest.approx(1.07e9, rel=0.01)
    # under TP2 with sequence parallelism the routed rows halve, the gathered attention input does not
    tp2 = layer_terms(cfg, 0, tp=2)
    assert tp2["expert_fc1"] == terms["expert_fc1"] / 2 and tp2["attn_norm_out"] == terms["attn_norm_out"]


def test_layernorm_recompute_also_drops_the_rotated_q_and_k_of_qk_norm_models():
    """Qwen3: the two norm outputs (64 MiB at 2 x 4096 tokens), q (64 MiB) and k (8 MiB) after the q/k norms and RoPE;
    under CP only q (the kept k is the gathered one); with core_attn recomputed q and k stay as its inputs."""
    cfg, tokens = ModelConfig.from_preset("qwen3-30b-a3b", num_layers=4, vocab_size=32768), 2 * 4096

    def dropped(cp=1, *modules):
        return (layer_bytes(cfg, 0, Settings(), cp=cp)[0]
                - layer_bytes(cfg, 0, Settings(recompute=("layernorm", *modules)), cp=cp)[0]) * tokens

    assert dropped() == (64 + 64 + 8) * MIB
    assert dropped(2) == (64 + 64) * MIB
    core_attn = layer_terms(cfg, 0)["attn_out"] * tokens
    assert dropped(1, "core_attn") == 64 * MIB + core_attn
    mixtral = ModelConfig.from_preset("mixtral-8x7b", num_layers=2)  # no q/k norms: the pre-norms' outputs only
    assert (layer_bytes(mixtral, 0, Settings())[0] - layer_bytes(mixtral, 0, Settings(recompute=("layernorm",)))[0]
            ) == 2 * 2 * mixtral.hidden_size


@pytest.mark.parametrize("shape", sorted(GROUPED_GEMM_MEASURED))
def test_grouped_gemm_fit_reproduces_the_measured_kernels(shape):
    h, f, rows = shape
    assert grouped_gemm_efficiency(h, f, rows) * 989.4 == pytest.approx(GROUPED_GEMM_MEASURED[shape], rel=0.03)


@pytest.mark.parametrize("layers,stages,expected", [(61, 32, (1, 0)), (94, 32, (2, 2)), (7, 4, (2, 1)),
                                                    (61, 16, (3, 2)), (5, 2, (2, None))])
def test_uneven_split_gives_the_ends_fewer_layers(layers, stages, expected):
    """DeepSeek-V3's 61 layers over PP8 x VPP4 as Megatron's published layout ``Et|(tt|)*30mL``; Qwen3-235B's 94."""
    assert uneven_split(layers, stages) == expected
    counts = [len(r) for r in partition_layers(layers, stages, None, *expected)]
    assert sum(counts) == layers and max(counts) == max(counts[1:-1] or counts)


@pytest.mark.parametrize("pp,m,vpp", [(4, 32, None), (4, 32, 2), (3, 9, 3), (8, 8, 4)])
def test_pipeline_shape_matches_the_simulator(pp, m, vpp):
    """Extrapolated beyond 2 x pp micro-batches, the bubble and the micro-batches in flight equal a full simulation."""
    schedule = "interleaved_1f1b" if vpp else "1f1b"
    shape = pipeline_shape(pp, m, vpp)
    assert shape.bubble == pytest.approx(simulate(schedule, pp, m, vpp)["bubble_fraction"], rel=1e-12)
    for r in range(pp):
        live = [0]
        for op in build_schedule(schedule, pp, r, m, vpp):
            live.append(live[-1] + (1 if op.kind == "F" else -1))
        assert shape.in_flight[r] == max(live)
    # the first stage keeps the most micro-batches in flight, except with m == pp where Megatron runs every forward
    # first (interleaved), like all-forward-all-backward
    assert shape.in_flight[0] > shape.in_flight[-1] >= 1 if m != pp else set(shape.in_flight) == {m * vpp}
