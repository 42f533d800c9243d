#!/usr/bin/env bash
# One GPU: gpu-marked tests, then where the idle time of a one-GPU step goes (bench_model.py --profile --gaps) for
# qwen3 (4 layers, 128 experts) and deepseek-v3 (2 layers, 32 experts), with the allocator's default and with
# expandable segments, and with the blocks in CUDA graphs (--cuda-graphs).
# Usage (repo root): OUT=outdir bash benchmarks/run_h100_gaps.sh   (TESTS=0 skips the tests; RUNS="a b" picks runs)
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/lmoe_work}; mkdir -p "$WORK"
export PYTHONUNBUFFERED=1
nvidia-smi -L
if [ "${TESTS:-1}" = 1 ]; then
  python3 -m pytest tests/test_gpu.py tests/modules/test_triton_permute.py -q -p no:cacheprovider -rs 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -4
fi
model() {  # name, then bench_model.py arguments
  local name=$1; shift
  if [ -n "${RUNS:-}" ] && [[ " $RUNS " != *" $name "* ]]; then return; fi
  timeout 240 python3 benchmarks/bench_model.py "$@" --out "$WORK/$name.json" 2>>"$OUT/errors.log" >/dev/null
  python3 benchmarks/record_line.py "$WORK/$name.json" "$name" | tee -a "$OUT/models.jsonl" | cut -c1-400
  python3 - "$WORK/$name.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["records"][0]
for b in r.get("time_breakdown_per_rank") or []:
    g = b.get("idle_gaps") or {}
    if g:
        print(f"  idle {g['idle_ms']:.1f} of {g['window_ms']:.1f} ms (short gaps {g['idle_in_short_gaps_ms']:.1f})")
        for row in g["by_next_launch"][:15]:
            print(f"    {row['idle_ms']:8.2f} ms {row['gaps']:5d}  {row['where'][:150]}")
        for row in g["blocking_calls"][:8]:
            print(f"    block {row['ms']:8.2f} ms {row['count']:5d}  {row['call']}  {row['where'][:120]}")
PY
  tar czf "$OUT/runs.tgz" -C "$WORK" .
}
Q="--preset qwen3-30b-a3b --layers 4 --vocab 32768 --batch 2 --accumulate 4 --steps 8 --warmup-steps 3"
D="--preset deepseek-v3 --layers 2 --vocab 32768 --batch 1 --accumulate 4 --first-k-dense 1 --experts 32 --steps 8 --warmup-steps 3"
model qwen3 $Q --profile "$WORK/p_qwen3.txt"
model qwen3_gaps $Q --profile "$WORK/p_qwen3_gaps.txt" --gaps
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True model qwen3_expandable $Q --profile "$WORK/p_qwen3_exp.txt"
model deepseek $D --profile "$WORK/p_deepseek.txt"
model deepseek_gaps $D --profile "$WORK/p_deepseek_gaps.txt" --gaps
model qwen3_graphs $Q --profile "$WORK/p_qwen3_graphs.txt" --cuda-graphs
model deepseek_graphs $D --profile "$WORK/p_deepseek_graphs.txt" --cuda-graphs
model qwen3_graphs_gaps $Q --profile "$WORK/p_qwen3_graphs_gaps.txt" --cuda-graphs --gaps
# a host-bound shape: 2 x 1024 tokens per micro-batch
S="--preset qwen3-30b-a3b --layers 4 --vocab 32768 --seq 1024 --batch 2 --accumulate 4 --steps 12 --warmup-steps 4"
model qwen3_short $S --profile "$WORK/p_qwen3_short.txt"
model qwen3_short_graphs $S --profile "$WORK/p_qwen3_short_graphs.txt" --cuda-graphs
