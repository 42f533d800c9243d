#!/usr/bin/env bash
# One GPU (prepared 2026-11-26, not yet run): build DeepGEMM in place and probe its FP8 m-grouped GEMM at our expert
# shapes against torch's kernels. Before the call, here: bash benchmarks/prepare_deepgemm.sh (carry .deepgemm).
# Usage (repo root): OUT=dir bash THIS
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DG_JIT_CACHE_DIR=/tmp/dg_jit
nvidia-smi --query-gpu=name --format=csv,noheader | head -1; nvcc --version | tail -1
( time bash benchmarks/build_deepgemm.sh .deepgemm/src ) 2>&1 | tail -5
PYTHONPATH=.:.deepgemm/src timeout 400 python3 benchmarks/probe_deepgemm.py --out "$OUT/deepgemm.json" 2>&1 \
  | tail -12 | cut -c1-600
