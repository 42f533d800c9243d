"""The cost model's constants: measured kernel throughputs and overheads, each with where it was measured.

Kernel efficiencies are fractions of the GPU's dense bf16 peak, measured on one H100 (DESIGN.md "measured H100 kernel
limits", docs/PERFORMANCE.md) and assumed to carry over to the other kinds. The overheads were fitted to the
full-model runs of docs/PERFORMANCE.md (tests/planner/measured.py), which the calibration tests check.
"""

from __future__ import annotations

DENSE_GEMM = 791 / 989.4  # dense bf16 matmul, H100 (DESIGN.md)
CORE_ATTENTION = 459 / 989.4  # SDPA causal forward + backward, H100 (DESIGN.md)

# Bare grouped-GEMM SwiGLU block, forward + backward, TFLOP/s on the H100 (docs/PERFORMANCE.md, "One MoE layer"):
# (hidden, expert ffn, rows per expert) -> TFLOP/s. grouped_gemm_efficiency fits them within 2.5 %.
GROUPED_GEMM_MEASURED = {(4096, 14336, 2048): 604, (2048, 768, 1024): 471, (2048, 1024, 2048): 495,
                         (7168, 2048, 512): 552}
_GG_MAX, _GG_HALF = 0.642, 200.0  # efficiency = max * x / (x + half), x = h*f/(h+f) (the GEMMs' smaller side)
_GG_ROWS_HALF = 16.0  # few rows per expert starve the kernel (a guess: every measured shape has >= 512)

ROUTER_S = 1.5e-3  # router forward + backward per MoE layer: latency-bound, ~1.4-1.6 ms at every measured shape
PERMUTE_PASSES = 6  # permute + combine (fwd + bwd) move the routed rows ~6 times (0.7 + 0.6 ms at the Qwen3 shape)
ELEMENTWISE_PASSES = 3.9  # norms, RoPE, SwiGLU, residuals: each kept activation byte is read/written ~4 times
LOSS_PASSES = 3  # the fp32 loss over the logits (forward, backward)
# what the fused RoPE saves against torch's (fp32 upcasts, a cat, four multiplies, casts; forward + backward), in
# passes over q's and k's bf16 bytes at the sustained bandwidth (bench_rope's device times on the H100, in the
# constants above until then): mixtral 0.87 -> 0.066 ms; qwen3 with its q/k norms folded in >= 2.05 -> 0.19 ms
ROPE_FUSION_SAVED_PASSES = 50
QK_NORM_FUSION_SAVED_PASSES = 14
# MLA's fused rope heads against torch's split, rotation and cat of q and k, forward + backward, in passes over q's
# bf16 bytes (bench_rope, deepseek on the H100: 3.49 -> 1.02 ms at 4096 tokens, 128 heads of 192)
MLA_ROPE_FUSION_SAVED_PASSES = 32
HOST_LAYER_S = 0.7e-3  # idle gaps while the host launches one layer's forward + backward (attention, norms)
HOST_MOE_S = 1.1e-3  # more of them in a MoE layer (router, permute: many small kernels)
HOST_MLA_S = 6.6e-3  # and in MLA attention
EP_SYNC_S = 5.2e-3  # dropless EP: the split sizes' host sync drains the queue once per MoE layer (fwd + bwd)
EP_IMBALANCE = 0.30  # per doubling of EP: the most loaded rank's extra expert work (random routing: up to +35 % at EP4)
A2A_EFFICIENCY = 0.42  # all-to-all bandwidth / link bandwidth (Qwen3 EP2: 268 MB in 1.28 ms over NVLink)
A2A_LATENCY_S = 25e-6  # per peer of each all-to-all call (NCCL send/recv pairs)
COLLECTIVE_EFFICIENCY = 0.134  # TP / CP all-gather, reduce-scatter; gradient all-reduce
PP_EXCHANGE_S = 17.8e-3  # per pipeline exchange: the executor synchronises, then waits for the host's launches
MAIN_GRAD_BYTES = {"bf16-true": 10, "bf16-mixed": 24, "32-true": 8}  # per parameter and micro-batch
# the experts' fused wgrad (bf16-true, fp32 main grads): its time over the bf16-output GEMM, in bytes per parameter at
# the sustained bandwidth; bench_grouped_wgrad measured 5.9 on later micro-batches and 2.4 on a step's first (qwen3 fc1)
MAIN_GRAD_FUSED_EXPERT_BYTES = 6
ADAM_BYTES = 34  # fused AdamW on fp32 main params + moments (28) and the bf16 write-back (6), per parameter
# the same in one pass (fused_optimizer_writeback): 30 bytes moved, at 2.98 TB/s where the sustained rate above is
# 2.6 (bench_optimizer, H100: 2.49 B parameters in 25.06 ms, torch's two passes 31.63 ms)
ADAM_FUSED_WRITEBACK_BYTES = 26
ADAM_BF16_MOMENTS_BYTES = 61  # measured 61.3 vs 34.2 ms: each bucket's bf16 state is upcast and rounded back
CPU_ADAM_PARAMS_S = {None: 2.5e9, "bf16": 0.55e9}  # torch's fused CPU AdamW, 16 cores (issue 17 runs)
PCIE_BYTES_S = 50e9  # host copies (measured ~50 GB/s)
OFFLOAD_EXPOSED = 0.13  # activation offload: 87 % of the transfer time hidden (issue 18)
RECOMPUTE_HOOK_S = 1.8e-3  # per layer and micro-batch: moe_act + layernorm recompute cost 7.3 ms per 4 layers (issue 18)
WORKSPACE_GIB = 0.25  # cuBLAS workspace, allocator slack and small buffers


def grouped_gemm_efficiency(hidden: int, ffn: int, rows_per_expert: float) -> float:
    """Fraction of peak of the grouped-GEMM SwiGLU block at this expert shape."""
    x = hidden * ffn / (hidden + ffn)
    return _GG_MAX * x / (x + _GG_HALF) * rows_per_expert / (rows_per_expert + _GG_ROWS_HALF)
