#!/usr/bin/env bash
# Two GPUs, issue 20: the deepep dispatcher (DeepEP intranode) and the sync-free dispatch.
#   parity over NCCL (deepep cases against one GPU), the no-host-sync Trainer test, the raw transports, the EP2 layer
#   for each dispatcher, and EP2 model weak scaling (qwen3, 4 layers) for alltoall / deepep / deepep sync-free.
# Usage (repo root): OUT=outdir [WHEELS=.whl] bash benchmarks/run_h200x2_dispatch.sh
# WHEELS holds a deep_ep wheel from benchmarks/build_deepep.sh (built on this image; reused if present).
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
WHEELS=${WHEELS:-.whl}
python3 -m pip install -q --no-deps --upgrade --target /tmp/deepep_site "$WHEELS"/deep_ep-*.whl 2>&1 | grep -v WARN
export PYTHONPATH=/tmp/deepep_site${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import deep_ep" || echo "deep_ep does not import: the deepep parts skip"
PART=${PART:-all}
if [[ $PART == all || $PART == a ]]; then
  LMOE_PARITY_ACCELERATOR=gpu LMOE_PARITY_ONLY='deepep|ep2_dedup_dropless|ep2_alltoall_dropless' \
    timeout 300 python3 -m pytest tests/parallel/test_ep_parity.py -q -s -p no:cacheprovider > "$OUT/parity.log" 2>&1
  grep -E "rank[01]:|passed|failed|Error" "$OUT/parity.log" | tail -30 | tee "$OUT/parity_summary.txt"
  timeout 240 python3 -m pytest tests/test_gpu_ep.py -q -s -p no:cacheprovider -k "${GPU_EP_K:-}" > "$OUT/gpu_ep.log" 2>&1
  grep -E "SYNCS|passed|failed|Error" "$OUT/gpu_ep.log" | cut -c1-1500 | tail -12
fi
if [[ $PART == all || $PART == b ]]; then
  timeout 120 torchrun --nproc-per-node 2 benchmarks/bench_a2a_transport.py --rows 131072 --out "$OUT/a2a.json" \
    2>>"$OUT/errors.log" | tail -1
  for d in alltoall alltoall_dedup deepep deepep_sync_free; do
    timeout 150 python3 benchmarks/bench_ep.py --ep 2 --shape qwen3 --dispatcher $d --iters 10 --out "$OUT/ep_$d.json" \
      2>>"$OUT/errors.log" >/dev/null
    python3 - "$OUT/ep_$d.json" $d <<'PY' | tee -a "$OUT/ep.txt"
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print(sys.argv[2], "no result", e); raise SystemExit
for r in d["ranks"]:
    print(sys.argv[2], "rank", r["rank"], {k: {m: round(v, 3) for m, v in r[k].items()} for k in ("ep1", "ep2")})
PY
  done
fi
if [[ $PART == all || $PART == c ]]; then
  for run in "1 alltoall" "2 alltoall" "2 deepep" "2 deepep --sync-free-dispatch"; do
    set -- $run
    timeout 200 python3 benchmarks/bench_model.py --preset qwen3-30b-a3b --accumulate 4 --steps 10 --warmup-steps 4 \
      --devices $1 --ep $1 --dispatcher $2 ${3:-} --out "$OUT/m.json" 2>>"$OUT/errors.log" >/dev/null
    python3 - "$OUT/m.json" <<'PY' | tee -a "$OUT/models.jsonl"
import json, sys
try:
    r = json.load(open(sys.argv[1]))["records"][0]
except Exception as e:
    print(json.dumps({"error": str(e)})); raise SystemExit
print(json.dumps({k: r.get(k) for k in ["preset", "devices", "dispatcher", "precision", "tokens_per_sec",
                                        "tflops_per_gpu", "mfu", "peak_mem_gib", "error"]}))
PY
    rm -f "$OUT/m.json"
  done
fi
