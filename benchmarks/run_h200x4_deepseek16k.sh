#!/usr/bin/env bash
# Four H200s (issue 18's last deliverable). deepseek-v3 with 4 layers (the preset's 3 dense layers first, then one MoE
# layer of all 256 experts), seq 16384, EP4 folded over DP4 with the distributed optimizer: each recompute / offload
# setting's peak memory and throughput, to find the best combination that fits. It needs H200s (about 68 GiB per GPU
# is held before any activation): call with needs_h200. Ask `status` first.
# Usage (repo root): OUT=dir bash benchmarks/run_h200x4_deepseek16k.sh
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi -L
BASE="--preset deepseek-v3 --layers 4 --vocab 32768 --seq 16384 --batch 1 --accumulate 2 --devices 4 --ep 4
      --distributed-optimizer --steps 4 --warmup-steps 2"
for v in "none:" \
         "rc_act_ln:--recompute=moe_act,layernorm" \
         "rc_act_ln_off_fc1:--recompute=moe_act,layernorm --offload-activations=expert_fc1" \
         "rc_act_ln_attn_off_fc1:--recompute=moe_act,layernorm,core_attn --offload-activations=expert_fc1" \
         "rc_moe_mlp:--recompute=moe,mlp"; do
  name=${v%%:*}; flags=${v#*:}
  # One log and one JSON-lines file for all settings (a device call returns few files).
  echo "=== $name: $flags" >> "$OUT/ds16k.log"
  timeout -k 15 ${RUN_TIMEOUT:-170} python3 benchmarks/bench_model.py $BASE $flags --out "/tmp/ds16k_$name.json" \
    >> "$OUT/ds16k.log" 2>&1
  echo "$name rc=$?"
  pkill -9 -f benchmarks/bench_model.py; sleep 2  # a rank stuck in a collective ignores SIGTERM
  python3 benchmarks/record_line.py "/tmp/ds16k_$name.json" "$name" | tee -a "$OUT/ds16k.jsonl" \
    || grep -hE "OutOfMemory|Error" "$OUT/ds16k.log" | tail -2 | cut -c1-300
done
