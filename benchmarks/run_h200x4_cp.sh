#!/usr/bin/env bash
# Four GPUs (issue 22's benchmarks): qwen3-30b-a3b shrunk to 2 layers, vocab 32k, bf16-true.
#   1. Mixed lengths: lognormal documents (median 4,096) packed into 64k rows, 256k tokens per step, static CP 4, 2
#      and 1 (DP 1, 2, 4) against DynamicContextParallel over CP 4.
#   2. Causal rows of 32k, 64k and 128k tokens over CP4: tokens/s and memory per GPU.
# One JSON line per run in $OUT/cp.jsonl, logs in $OUT/cp.log. Ask `status` first. The first try (2026-11-26, 4xH100,
# 110 s per run) timed out in the first run, whose one stuck rank then held 52 GiB through the next runs: the runs now
# get 240 s, SIGKILL 15 s after the timeout, and a sweep for leftovers. About 10 minutes in all: split it over two
# calls with RUNS (default: all, in this order). The second try (4xH100): the dynamic run finished its steps, then
# its ranks did not exit (SIGKILLed). A third, with DynamicContextParallel destroying its NCCL sub-groups at
# teardown, hung in the teardown instead, before the record was written (so that change was dropped).
# Usage (repo root): OUT=dir bash benchmarks/run_h200x4_cp.sh
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
B="--preset qwen3-30b-a3b --layers 2 --vocab 32768 --accumulate 1 --devices 4 --steps ${STEPS:-6} --warmup-steps 2"
run() {  # name, then bench_model.py flags
  local name=$1; shift
  [[ " ${RUNS:-$name} " == *" $name "* ]] || return 0
  echo "=== $name: $*" >> "$OUT/cp.log"
  timeout -k 15 ${RUN_TIMEOUT:-240} python3 benchmarks/bench_model.py $B "$@" --out "/tmp/cp_$name.json" \
    >> "$OUT/cp.log" 2>&1
  echo "$name rc=$?"
  # a rank stuck in a collective ignores SIGTERM (Lightning only flags it): clear leftovers before the next run
  pkill -9 -f benchmarks/bench_model.py; sleep 2
  python3 benchmarks/record_line.py "/tmp/cp_$name.json" "$name" --keys seq_length,micro_batch_size,strategy,\
pack_documents,dynamic_cp_choices,tokens_per_sec,step_time_median_s,step_time_median_warm_s,\
tokens_per_sec_median_step,tokens_per_sec_median_warm_step,dynamic_cp_sizes_per_step,step_times_s,peak_mem_gib,error \
    | tee -a "$OUT/cp.jsonl"
}
P="--seq 65536 --pack-documents --doc-median 4096"
# each CP size's first micro-batch compiles FlexAttention for its shapes (about 20 s; the first try's median was 13 s
# a step against 0.64 s static): more steps, and the median over steps whose sizes all ran before (*_warm_*)
run mixed_dynamic_cp4 $P --cp 4 --batch 4 --dynamic-cp --steps ${DYN_STEPS:-16} --warmup-steps 4
run mixed_static_cp4 $P --cp 4 --batch 4
run mixed_static_cp1 $P --cp 1 --batch 1
run mixed_static_cp2 $P --cp 2 --batch 2
run causal_128k_cp4 --seq 131072 --cp 4 --batch 1
run causal_64k_cp4 --seq 65536 --cp 4 --batch 1
run causal_32k_cp4 --seq 32768 --cp 4 --batch 1
