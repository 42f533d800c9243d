#!/usr/bin/env bash
# One H100, issue 19: the persistent per-expert FP8 wgrad (triton_fp8_wgrad.wgrad_into(persistent=True)) against the
# one-tile kernel: its gpu test (the same bits), then bench_fp8_wgrad.py's rowwise records (persistent_* against
# onetile_*, written and added into fp32 main grads) at Mixtral's and Qwen3's expert shapes.
# Usage (repo root): OUT=dir bash benchmarks/run_h100_fp8_persistent.sh
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi -L
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fp8.py -k "persistent or wgrad" \
  > "$OUT/tests.log" 2>&1
tail -1 "$OUT/tests.log"; grep -E "^(E   |FAILED)" "$OUT/tests.log" | cut -c1-300 | head -10
timeout 300 python3 benchmarks/bench_fp8_wgrad.py --shapes mixtral,qwen3 --out "$OUT/wgrad.json" 2> "$OUT/wgrad.err" \
  >/dev/null
python3 - "$OUT/wgrad.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    rw = r.get("rowwise", {})
    print(r.get("shape"), r.get("gemm"), {k: v for k, v in rw.items() if k.startswith(("onetile", "persistent"))})
PY
