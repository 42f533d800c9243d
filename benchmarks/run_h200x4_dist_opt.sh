#!/usr/bin/env bash
# Four GPUs (issue 17's multi-GPU half): qwen3-30b-a3b, 4 layers, micro-batch 2 x 4, with and without the distributed
# optimizer at DP4/EP4 (4 GPUs) and DP2/EP2 (GPUs 0-1 and 2-3, the two DP2 runs side by side to save device time):
# TFLOPS per GPU, the optimizer step's time, and the memory held between steps (weights, gradient buffers, optimizer
# state) against the prediction. Ask `status` first.
# Then qwen3 with 8 layers at DP4/EP4, with and without it. A timed-out run is SIGKILLed 15 s later (a rank stuck in a
# collective ignores SIGTERM).
# RUNS selects runs by name (default: all).
# Usage (repo root): OUT=dir bash benchmarks/run_h200x4_dist_opt.sh
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi -L
BASE="--preset qwen3-30b-a3b --layers 4 --batch 2 --accumulate 4 --steps ${STEPS:-6} --warmup-steps 2"
run() {  # name, then bench_model.py flags; one log and one JSON-lines file (a device call returns few files)
  local name=$1; shift
  [[ " ${RUNS:-$name} " == *" $name "* ]] || return 0
  timeout -k 15 ${RUN_TIMEOUT:-150} python3 benchmarks/bench_model.py $BASE "$@" --out "/tmp/dist_opt_$name.json" \
    > "/tmp/dist_opt_$name.log" 2>&1
  echo "$name rc=$?"
  # a rank stuck in a collective outlives the timeout (it kills only the launching rank): sweep between serial runs
  [ "${SWEEP:-0}" = 1 ] && { pkill -9 -f benchmarks/bench_model.py; sleep 2; }
  { echo "=== $name: $*"; cat "/tmp/dist_opt_$name.log"; } >> "$OUT/dist_opt.log"
  python3 benchmarks/record_line.py "/tmp/dist_opt_$name.json" "$name" --keys devices,tokens_per_sec,tflops_per_gpu,\
mfu,step_time_median_s,optimizer_step_ms_median,static_mem_gib,predicted_static_gib,device_bytes_per_param,\
peak_mem_gib,error | tee -a "$OUT/dist_opt.jsonl"
}
run dp4_ep4 --devices 4 --ep 4
run dp4_ep4_distopt --devices 4 --ep 4 --distributed-optimizer
CUDA_VISIBLE_DEVICES=0,1 MASTER_PORT=29511 run dp2_ep2 --devices 2 --ep 2 &
CUDA_VISIBLE_DEVICES=2,3 MASTER_PORT=29522 run dp2_ep2_distopt --devices 2 --ep 2 --distributed-optimizer &
wait
# qwen3 with 8 layers (issue 17's deliverable 6): the distributed optimizer against the plain run on 4 GPUs
SWEEP=1
run q8_dp4_ep4 --devices 4 --ep 4 --layers 8
run q8_dp4_ep4_distopt --devices 4 --ep 4 --layers 8 --distributed-optimizer
