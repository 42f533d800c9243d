#!/usr/bin/env bash
# Two GPUs, the session's last checks: overlapped pipeline p2p parity over NCCL (2 ranks against 1), and on the side
# (own processes, correctness and per-process memory only) the activation-offload memory test and the fused
# single-rank dispatch cases.  Usage (repo root): OUT=outdir bash benchmarks/run_h200x2_checks.sh
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=.
( CUDA_VISIBLE_DEVICES=1 timeout 100 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_activations.py \
    -k memory > "$OUT/act.log" 2>&1
  CUDA_VISIBLE_DEVICES=1 timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fused.py \
    -k 'dispatch_matches and 1000' --tb=short > "$OUT/fused.log" 2>&1 ) &
LMOE_PARITY_ACCELERATOR=gpu LMOE_PARITY_TIMEOUT=60 LMOE_PARITY_ONLY='^pp2_1f1b_m4$' \
  timeout 90 python3 -m pytest tests/parallel/test_pp_parity.py -q -s -p no:cacheprovider > "$OUT/pp.log" 2>&1
wait
grep -E "rank[01]:|passed|failed|Error" "$OUT/pp.log" | cut -c1-250 | tail -8
grep -E "held after|passed|failed" "$OUT/act.log" | tail -6
grep -E "AssertionError|Mismatched|Greatest|passed|failed" "$OUT/fused.log" | cut -c1-200 | tail -14
