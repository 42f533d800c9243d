#!/usr/bin/env bash
# One H100, issue 21 deliverable 4: torch.compile of the blocks (MoEFoldStrategy(compile_blocks=True)).
#   1. tests/test_gpu_compile.py: graph breaks of each kind of block (expected: none), compiled (and compiled + CUDA
#      graphs) training against eager in bf16 with the fused router and permutes;
#   2. bench_model.py eager vs --compile, then --cuda-graphs vs --cuda-graphs --compile, for qwen3-30b-a3b (4 layers)
#      and mixtral-8x7b (2 layers), with the flags of the earlier H100 runs (run_h100.sh SUITE=fp8's Q4 and M2).
# One JSON line per run in $OUT/models.jsonl (tokens/s, MFU, memory, first-step time = compilation, graph breaks).
# Runs stop being started when the next would pass LIMIT_S (default 450 s): the script ends within ~8 minutes.
# Usage (repo root): OUT=outdir [WHEELS=.whl] [LIMIT_S=450] bash benchmarks/run_h100_compile.sh
#   TESTS=0 skips the tests; RUNS="qwen3_4_graphs qwen3_4_graphs_compile" runs only the named bench runs (e.g. those
#   a first call had to skip; the inductor cache in /tmp of the same machine makes their compilation shorter).
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/lmoe_work}; mkdir -p "$WORK"
LIMIT_S=${LIMIT_S:-450}
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
WHEELS=${WHEELS:-.whl}  # wheels missing from the image (e.g. jsonargparse), if the directory holds any
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --upgrade --target /tmp/lmoe_site "$WHEELS"/*.whl 2>&1 | grep -v WARN
  export PYTHONPATH=/tmp/lmoe_site:$PYTHONPATH
fi
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

if [ "${TESTS:-1}" = 1 ]; then
  timeout 210 python3 -m pytest -q -s -rs -p no:cacheprovider tests/test_gpu_compile.py > "$OUT/gpu_compile.log" 2>&1
  echo "tests exit $?"
  grep -E "graph\(s\)|graphs=|passed|failed|Error|error" "$OUT/gpu_compile.log" | cut -c1-400 | tail -25
fi

model() {  # name, seconds it may take, then bench_model.py arguments
  local name=$1 need=$2; shift 2
  if [ -n "${RUNS:-}" ] && [[ " $RUNS " != *" $name "* ]]; then return; fi
  local left=$((LIMIT_S - SECONDS))
  if [ "$left" -lt "$need" ]; then echo "{\"run\": \"$name\", \"skipped\": \"${left}s left of LIMIT_S\"}" \
    | tee -a "$OUT/models.jsonl"; return; fi
  timeout "$left" python3 benchmarks/bench_model.py "$@" --out "$WORK/$name.json" 2>>"$OUT/errors.log" >/dev/null
  python3 - "$WORK/$name.json" "$name" <<'PY' | tee -a "$OUT/models.jsonl"
import json, sys
try:
    r = json.load(open(sys.argv[1]))["records"][0]
except Exception as e:  # a crashed or timed-out run still gets its line
    r = {"error": f"no record: {e}"}
c = r.get("compile") or {}
times = c.get("times_s") if isinstance(c.get("times_s"), dict) else {}
print(json.dumps({"run": sys.argv[2], **{k: r.get(k) for k in [
    "preset", "num_layers", "compile_blocks", "cuda_graphs", "micro_batch_size", "accumulate_grad_batches",
    "tokens_per_sec", "tokens_per_sec_median_step", "tflops_per_gpu", "mfu", "step_time_s", "step_time_median_s",
    "first_step_s", "peak_mem_gib", "peak_mem_reserved_gib", "loss_first", "loss_last", "error"]},
    "graph_breaks": c.get("graph_breaks"), "unique_graphs": c.get("unique_graphs"),
    "break_reasons": c.get("break_reasons"), "dynamo_compile_s": times.get("_compile.compile_inner")}))
PY
}
Q4="--preset qwen3-30b-a3b --batch 2 --accumulate 2 --steps 8 --warmup-steps 3"
M2="--preset mixtral-8x7b --layers 2 --batch 1 --accumulate 4 --steps 8 --warmup-steps 3"
model qwen3_4_eager 50 $Q4
model qwen3_4_eager_nofusion 50 $Q4 --no-wgrad-fusion
model qwen3_4_compile 150 $Q4 --compile
model mixtral2_eager 50 $M2
model mixtral2_eager_nofusion 50 $M2 --no-wgrad-fusion
model mixtral2_compile 150 $M2 --compile
model qwen3_4_graphs 50 $Q4 --cuda-graphs
model qwen3_4_graphs_compile 90 $Q4 --cuda-graphs --compile
model mixtral2_graphs 50 $M2 --cuda-graphs
model mixtral2_graphs_compile 90 $M2 --cuda-graphs --compile
tail -5 "$OUT/errors.log" 2>/dev/null | cut -c1-300
echo "total ${SECONDS}s"
