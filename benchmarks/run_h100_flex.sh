#!/usr/bin/env bash
# One H100: the FlexAttention document-mask GPU tests and benchmark (issue 22), and the gradient-accumulation
# fusion GPU test (issue 21). Usage (repo root): OUT=dir bash benchmarks/run_h100_flex.sh
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout 60 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_wgrad_fusion.py > "$OUT/wgrad.log" 2>&1
timeout 240 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_document_mask.py --tb=short > "$OUT/docmask.log" 2>&1
LMOE_BENCH_COMMIT=${LMOE_BENCH_COMMIT:-unknown} timeout 200 \
  python3 benchmarks/bench_document_attention.py --out "$OUT/doc_attn.json" > "$OUT/doc_attn.log" 2>&1
tail -4 "$OUT/wgrad.log"; grep -E "error|GiB|passed|failed" "$OUT/docmask.log" | tail -15; tail -25 "$OUT/doc_attn.log"
