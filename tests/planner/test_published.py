"""The published large runs of the Megatron Core MoE report, as its companion recipes give them
(github.com/yanring/Megatron-MoE-ModelZoo: best_practice/DeepSeekV3/run.sh, best_practice/qwen3/run_h100_235b.sh,
runtime_configs/benchmarking/runtime.conf), planned for the published GPU count.

Mixtral-8x22B's layout is in the planner's top 10 (5th before the experts weighted their rows with the router
probabilities; since, the memory the combine no longer keeps lets PP16 layouts skip recomputation and it is 6th,
0.4 % behind the 5th; with the fused RoPE, which takes the same time off every layout's step, it is 9th, 6.2 %
behind the first, from 5.3 %). DeepSeek-V3's and Qwen3-235B's are not, and cannot be for this
library's planner: their EP64 / EP32 groups span 8 / 4 nodes, and lightning-moe's dropless all-to-all copies its
split sizes to the host every layer and sends every routed copy in bf16. Megatron runs those layouts with DeepEP's
node-deduplicated dispatch overlapped with the other micro-batch's compute; lightning-moe has the overlap now
(``overlap_moe_comm``), but it is not measured across nodes, so the planner does not count on it. The tests pin that
explanation: the published layouts fit, the all-to-all is their dominant cost, and the planner's top 5
keep EP x ETP inside one node (docs/PERFORMANCE.md, "Planner calibration")."""

from __future__ import annotations

import pytest

from lightning_moe.planner import plan

QWEN3_235B = dict(hidden_size=4096, num_layers=94, num_attention_heads=64, num_kv_heads=4, ffn_hidden_size=12288,
                  moe_ffn_hidden_size=1536)  # Qwen/Qwen3-235B-A22B config.json (128 experts, top-8 as qwen3-30b-a3b)
MIXTRAL_8X22B = dict(hidden_size=6144, num_layers=56, num_attention_heads=48, num_kv_heads=8, ffn_hidden_size=16384,
                     moe_ffn_hidden_size=16384)  # the ModelZoo's Mixtral-8x22B.yaml (Llama-2 tokenizer: vocab 32000)
# name: (plan arguments, published (tp, cp, pp, vpp, ep, etp))
PUBLISHED = {
    "deepseek-v3-1024xh100": (dict(preset="deepseek-v3", gpus=1024, global_batch_size=8192, micro_batch_size=1),
                              (2, 1, 8, 4, 64, 1)),
    "qwen3-235b-256xh100": (dict(preset="qwen3-30b-a3b", overrides=QWEN3_235B, gpus=256, global_batch_size=2048,
                                 micro_batch_size=1), (2, 1, 8, 4, 32, 1)),
    "mixtral-8x22b-128xh100": (dict(preset="mixtral-8x7b", overrides=MIXTRAL_8X22B, gpus=128, global_batch_size=256,
                                    micro_batch_size=1), (2, 1, 8, None, 8, 1)),
}


def _ranked(name: str):
    kwargs, published = PUBLISHED[name]
    choices = plan(**kwargs, gpu="h100-80gb", seq_length=4096, top=10 ** 6)
    keys = [(c.layout.tp, c.layout.cp, c.layout.pp, c.layout.vpp, c.layout.ep, c.layout.etp) for c in choices]
    return choices, keys, published


def test_mixtral_8x22b_published_layout_is_in_the_top_10():
    choices, keys, published = _ranked("mixtral-8x22b-128xh100")
    assert published in keys[:10], keys[:10]
    assert choices[keys.index(published)].time.seconds < 1.07 * choices[0].time.seconds


@pytest.mark.parametrize("name", ["deepseek-v3-1024xh100", "qwen3-235b-256xh100"])
def test_cross_node_ep_layouts_lose_to_the_synchronous_all_to_all(name):
    choices, keys, published = _ranked(name)
    assert published in keys  # valid, and it fits (with the settings the planner gives it)
    mine = choices[keys.index(published)]
    assert mine.time.dominant == "all-to-all" and mine.time.parts["all-to-all"] > 0.4 * mine.time.seconds
    assert all(c.layout.ep * c.layout.etp <= 8 for c in choices[:5])
