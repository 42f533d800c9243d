#!/usr/bin/env bash
# One H100, issue 19: the persistent per-expert FP8 wgrad (triton_fp8_wgrad.wgrad_into(persistent=True)) against the
# one-tile kernel: its gpu test (the same bits), bench_fp8_wgrad.py's rowwise records (persistent_* against onetile_*,
# written and added into fp32 main grads) at Mixtral's and Qwen3's expert shapes, then bench_layer.py's blocks with the
# one-tile and the persistent wgrad (LMOE_FP8_WGRAD_PERSISTENT=0/1), each against bf16 in its own run; "model": FP8
# rowwise models (gradient accumulation, so the wgrad adds into main grads) with the one-tile kernel everywhere
# (LMOE_FP8_WGRAD_PERSISTENT=0) against the default (persistent where adding), alternating.
# "profile": mixtral-8x7b 2 layers in bf16 and FP8 rowwise (the default kernels), each with bench_model.py's kernel
# table of two optimizer steps, to see where the model's time goes beside the expert blocks.
# Usage (repo root): OUT=dir bash benchmarks/run_h100_fp8_persistent.sh [tests] [wgrad] [layer] [model] [profile]
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi -L
for p in ${@:-tests wgrad layer}; do case "$p" in
tests)
  timeout -k 10 ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fp8.py -k "persistent or wgrad" \
    > "$OUT/tests.log" 2>&1
  tail -1 "$OUT/tests.log"; grep -E "^(E   |FAILED)" "$OUT/tests.log" | cut -c1-300 | head -10 ;;
wgrad)
  timeout -k 10 ${WGRAD_S:-240} python3 benchmarks/bench_fp8_wgrad.py --shapes ${WGRAD_SHAPES:-mixtral,qwen3} \
    --out "$OUT/wgrad.json" 2> "$OUT/wgrad.err" >/dev/null
  echo "wgrad rc=$?"; grep -v "^\[" "$OUT/wgrad.err" | tail -3 | cut -c1-300
  python3 - "$OUT/wgrad.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    rw = r.get("rowwise", {})
    print(r.get("shape"), r.get("gemm"), {k: v[1] if isinstance(v, list) else v for k, v in rw.items()
                                          if k.startswith(("onetile", "persistent"))})
PY
  ;;
layer)
  for pers in 0 1; do
    LMOE_FP8_WGRAD_PERSISTENT=$pers timeout -k 10 ${LAYER_S:-150} python3 benchmarks/bench_layer.py \
      --shapes ${SHAPES:-mixtral,qwen3} --precision bf16,fp8-rowwise-fastall --split-iters 1 --iters 10 --warmup 3 \
      --out "$OUT/layer_p$pers.json" > /dev/null 2> "$OUT/layer_p$pers.err"
    echo "layer persistent=$pers rc=$?"; tail -2 "$OUT/layer_p$pers.err" | cut -c1-300
    python3 - "$OUT/layer_p$pers.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    if "fp8" not in r:
        print(r.get("shape"), "error", str(r.get("error"))[:300]); continue
    print(r["shape"], f"bf16 block {r['bare']['median_ms']:.3f} ms layer {r['layer']['median_ms']:.3f} ms",
          {k: (round(v["bare"]["median_ms"], 3), round(v["layer"]["median_ms"], 3), round(v["bare_speedup"], 3),
               round(v["layer_speedup"], 3)) for k, v in r["fp8"].items()})
PY
  done ;;
model)
  for v in ${VARIANTS:-q3:0 q3:auto q3:0 q3:auto mx:0 mx:auto}; do
    if [ "${v%%:*}" = mx ]; then m="--preset mixtral-8x7b --batch 1 --accumulate 4"
    else m="--preset qwen3-30b-a3b --batch 2 --accumulate 2"; fi
    LMOE_FP8_WGRAD_PERSISTENT=${v#*:} timeout -k 10 ${MODEL_S:-120} python3 benchmarks/bench_model.py $m --steps 5 \
      --warmup-steps 2 --fp8 rowwise ${FP8_FLAGS:-} --out "/tmp/m.json" > "$OUT/model.log" 2>&1
    echo "$v rc=$?"
    python3 benchmarks/record_line.py /tmp/m.json "$v" --keys tokens_per_sec,tflops_per_gpu,mfu,step_time_median_s,\
peak_mem_gib,error | tee -a "$OUT/model.jsonl"
    rm -f /tmp/m.json
  done ;;
profile)
  for prec in bf16 fp8; do
    f=""; [ $prec = fp8 ] && f="--fp8 rowwise"
    timeout -k 10 ${MODEL_S:-120} python3 benchmarks/bench_model.py --preset mixtral-8x7b --batch 1 --accumulate 4 \
      --steps 3 --warmup-steps 1 $f --profile "$OUT/prof_$prec.txt" --out "/tmp/p.json" > "$OUT/prof_$prec.log" 2>&1
    echo "profile $prec rc=$?"
    python3 benchmarks/record_line.py /tmp/p.json "$prec" --keys tflops_per_gpu,step_time_median_s,error
    python3 -c "import json,sys; r=json.load(open('/tmp/p.json')); print(json.dumps(r.get('time_breakdown_per_rank'))[:1500])"
    rm -f /tmp/p.json
  done ;;
esac; done
