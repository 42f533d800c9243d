#!/usr/bin/env bash
# Four GPUs: gpu-marked tests, the TP/CP/EP folding parity cases over NCCL, and folded-layout model throughput
# against one GPU of the same machine. Usage (repo root): OUT=outdir PART=a|b bash benchmarks/run_h200x4.sh
#   PART=a: tests, parity, qwen3-30b-a3b (4 layers) on 1 GPU and three 4-GPU layouts
#   PART=b: mixtral-8x7b (2 layers) on 1 GPU and two 4-GPU layouts; TP2 layouts again with the 1-GPU tokens/GPU
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
PART=${PART:-a}
export PYTHONUNBUFFERED=1
nvidia-smi -L
model() {  # name, then bench_model.py arguments
  local name=$1; shift
  python3 benchmarks/bench_model.py "$@" --accumulate 4 --steps 8 --warmup-steps 3 --out "$OUT/m.json" \
    2>>"$OUT/errors.log" >/dev/null
  python3 - "$OUT/m.json" "$name" <<'PY' | tee -a "$OUT/models.jsonl"
import json, sys
r = json.load(open(sys.argv[1]))["records"][0]
keys = ["preset", "devices", "strategy", "tokens_per_sec", "tflops_per_gpu", "mfu", "peak_mem_gib", "error"]
print(json.dumps({"run": sys.argv[2], **{k: r.get(k) for k in keys}}))
PY
  rm -f "$OUT/m.json"
}
if [ "$PART" = a ]; then
  python3 -m pytest tests/test_gpu.py tests/modules/test_triton_permute.py tests/modules/test_context_parallel.py \
    -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -2
  LMOE_PARITY_ACCELERATOR=gpu python3 -m pytest tests/parallel/test_tp_cp_parity.py -q -s -p no:cacheprovider \
    2>&1 | tee "$OUT/parity_tpcp_nccl.log" | grep -E "rank0:|passed|failed"
  Q="--preset qwen3-30b-a3b"
  model qwen3_1gpu $Q --devices 1
  model qwen3_dp4_ep4 $Q --devices 4 --ep 4
  model qwen3_tp2dp2_ep4 $Q --devices 4 --tp 2 --ep 4
  model qwen3_tp2cp2_ep2etp2 $Q --devices 4 --tp 2 --cp 2 --ep 2 --etp 2
else
  M="--preset mixtral-8x7b"
  model mixtral_1gpu $M --devices 1
  model mixtral_dp4_ep4 $M --devices 4 --ep 4
  model mixtral_tp2dp2_ep4_b2 $M --devices 4 --tp 2 --ep 4 --batch 2  # the 1-GPU tokens per GPU
  model qwen3_tp2dp2_ep4_b4 --preset qwen3-30b-a3b --devices 4 --tp 2 --ep 4 --batch 4
fi
