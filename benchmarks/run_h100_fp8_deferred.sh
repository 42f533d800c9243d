#!/usr/bin/env bash
# One H100, issue 19 (tenth session of 2026-11-26): the experts' FP8 wgrad once per optimizer step
# (FP8Training(defer_expert_wgrad=True)) and the dense FP8 wgrad quantized straight into its transposed layout.
# Parts, in the order given (default: all):
#   tests    the GPU tests of both (tests/test_gpu_fp8.py, tests/test_gpu_fp8_quant.py)
#   kernel   bench_fp8_wgrad_deferred.py: per micro-batch against deferred, at bench_model's micro-batch shapes
#   mixtral  mixtral-8x7b 2 layers (1 x 4 micro-batches): bf16, FP8 rowwise, FP8 rowwise deferred (ROUNDS=n: n times,
#            alternating; default once), 8 steps each
#   qwen3    qwen3-30b-a3b 4 layers (2 x ACC micro-batches, default 2), attention in bf16: the same three
#   host     profile_fp8_host.py: the host's time and launches per FP8 GEMM (JSON in $OUT/host.json)
# Usage (repo root): OUT=dir bash benchmarks/run_h100_fp8_deferred.sh [tests] [kernel] [mixtral] [qwen3] [host]
set -uo pipefail
set -f  # the exclude pattern below is a glob for FP8Training, not for the shell
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
models() {  # NAME PRESET FLAGS ROUNDS VARIANT...: each variant "name:flags", alternating over ROUNDS
  local name=$1 preset=$2 flags=$3 rounds=$4 r v n f; shift 4
  for r in $(seq 1 "$rounds"); do
    for v in "$@"; do
      n=${v%%:*}; f=${v#*:}
      timeout -k 10 150 python3 benchmarks/bench_model.py --preset "$preset" $flags --steps 8 --warmup-steps 2 $f \
        --out /tmp/m.json > "$OUT/${name}_${n}_$r.log" 2>&1
      echo "$name $n round $r rc=$?"
      python3 benchmarks/record_line.py /tmp/m.json "${name}_${n}_$r" \
        --keys tflops_per_gpu,step_time_median_s,optimizer_step_ms_median,peak_mem_gib,error
      rm -f /tmp/m.json
      pkill -9 -f benchmarks/bench_model.py
    done
  done
}
for p in ${@:-tests kernel mixtral qwen3}; do case "$p" in
tests)
  timeout -k 10 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fp8.py tests/test_gpu_fp8_quant.py \
    > "$OUT/tests.log" 2>&1
  tail -1 "$OUT/tests.log"; grep -E "^(E   |FAILED)" "$OUT/tests.log" | cut -c1-300 | head -10 ;;
kernel)
  timeout -k 10 240 python3 benchmarks/bench_fp8_wgrad_deferred.py --out "$OUT/deferred.json" > "$OUT/kernel.log" 2>&1
  echo "kernel rc=$?"; python3 - "$OUT/deferred.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    print(r["shape"], r["gemm"], {k: v for k, v in r.items() if "_" in k and k not in ("micro_batches",)})
PY
  ;;
mixtral) models mx mixtral-8x7b "--batch 1 --accumulate 4" "${ROUNDS:-1}" "bf16:" "fp8:--fp8 rowwise" \
  "fp8_defer:--fp8 rowwise --fp8-defer-wgrad" ;;
qwen3) models "q3a${ACC:-2}" qwen3-30b-a3b "--batch 2 --accumulate ${ACC:-2}" "${ROUNDS:-1}" "bf16:" \
  "fp8:--fp8 rowwise --fp8-exclude *attn*" "fp8_defer:--fp8 rowwise --fp8-exclude *attn* --fp8-defer-wgrad" ;;
host)
  timeout -k 10 240 python3 benchmarks/profile_fp8_host.py --iters 200 --top 30 --out "$OUT/host.json" \
    > "$OUT/host.log" 2>&1
  echo "host rc=$?"; python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['records'][0]; \
print(r['host_us_per_fwd_bwd'], r['launches_per_fwd_bwd'])" "$OUT/host.json" ;;
esac; done
true
