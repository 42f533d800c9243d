#!/usr/bin/env bash
# One H100, issue 19: the blockwise recipe's expert GEMMs on DeepGEMM (modules/fp8_deepgemm.py). Before the call,
# here: bash benchmarks/prepare_deepgemm.sh ... (carry .deepgemm). Builds DeepGEMM, runs the GPU tests, then the
# layer bench (bf16, blockwise on DeepGEMM, blockwise emulated, rowwise with fast accumulation everywhere).
# Usage (repo root): OUT=dir bash THIS [tests|layer|model|wgrad|quant|profile]...
set -uo pipefail
OUT=${OUT:-/tmp/lmoe_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DG_JIT_CACHE_DIR=/tmp/dg_jit PYTHONPATH=$PWD:$PWD/.deepgemm/src${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
bash benchmarks/build_deepgemm.sh .deepgemm/src > "$OUT/build.log" 2>&1 || { tail -5 "$OUT/build.log"; exit 1; }
# a warm machine's DeepGEMM once imported without its kernels: stop rather than time the emulation as DeepGEMM's
python3 -c "import torch, lightning_moe.modules.fp8_deepgemm as d; w = d.unavailable(torch.device('cuda'))
print('DeepGEMM:', w or 'available'); raise SystemExit(1 if w else 0)" || exit 1
for part in "${@:-tests layer}"; do for p in $part; do case "$p" in
tests)
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_fp8_deepgemm.py ${TESTS:-} \
    > "$OUT/tests.log" 2>&1
  echo "tests rc=$?: $(tail -1 "$OUT/tests.log")"; grep -E "^(E   |FAILED)" "$OUT/tests.log" | cut -c1-300 | head -20 ;;
layer)
  timeout "${LAYER_S:-240}" python3 benchmarks/bench_layer.py --shapes ${SHAPES:-qwen3,olmoe,mixtral} \
    --precision ${PRECISIONS:-bf16,fp8-blockwise,fp8-rowwise-fastall} --split-iters 1 --iters 10 --warmup 3 \
    --out "$OUT/layer.json" > /dev/null 2> "$OUT/layer.err"
  echo "layer rc=$?"; tail -3 "$OUT/layer.err" | cut -c1-300
  python3 - "$OUT" <<'PY'
import json, sys
for r in json.load(open(f"{sys.argv[1]}/layer.json"))["records"]:
    if "fp8" not in r:
        print(r.get("shape"), "error", str(r.get("error"))[:300]); continue
    print(r["shape"], f"bf16 block {r['bare']['median_ms']:.3f} ms layer {r['layer']['median_ms']:.3f} ms",
          {k: (round(v["bare"]["median_ms"], 3), round(v["layer"]["median_ms"], 3), round(v["bare_speedup"], 3),
               round(v["layer_speedup"], 3)) for k, v in r["fp8"].items()})
PY
  ;;
wgrad)
  timeout "${WGRAD_S:-300}" python3 benchmarks/bench_fp8_wgrad.py --shapes ${WGRAD_SHAPES:-mixtral,qwen3} \
    --out "$OUT/wgrad.json" > /dev/null 2> "$OUT/wgrad.err"
  echo "wgrad rc=$?"; grep -v "^\[" "$OUT/wgrad.err" | tail -3 | cut -c1-300
  python3 - "$OUT" <<'PY'
import json, sys
for r in json.load(open(f"{sys.argv[1]}/wgrad.json"))["records"]:
    print(r["shape"], r["gemm"], "tiles", r["tiles_ms"], "bf16", r["bf16"], "blockwise", r["blockwise"],
          "rowwise", r["rowwise"])
PY
  ;;
quant)
  timeout "${QUANT_S:-200}" python3 benchmarks/bench_fp8_quant.py --out "$OUT/quant.json" > /dev/null 2> "$OUT/quant.err"
  echo "quant rc=$?"; grep -v "^\[" "$OUT/quant.err" | tail -3 | cut -c1-300
  python3 - "$OUT" <<'PY'
import json, sys
for r in json.load(open(f"{sys.argv[1]}/quant.json"))["records"]:
    of = lambda d: {c: v.get("of_copy") if isinstance(v, dict) else v for c, v in d.items()}
    print(r["shape"], r["operand"], {k: r[k] for k in ("copy", "rowwise")}, "col_amax", of(r["col_amax"]),
          "quant_t", of(r["quant_t"]))
PY
  ;;
profile)
  for v in ${PROFILES:-"mixtral:fp8-blockwise-cached-aligned:0" "mixtral:fp8-blockwise-cached-aligned:1"}; do
    shape=${v%%:*}; rest=${v#*:}; prec=${rest%%:*}; fw=${rest#*:}
    LMOE_DEEPGEMM_FP8_WGRAD=$fw timeout 120 python3 benchmarks/profile_fp8_block.py --shape "$shape" \
      --precision "$prec" --top 14 --out "$OUT/profile_${shape}_${prec}_$fw.json" > /dev/null 2>&1
    python3 -c "import json; r=json.load(open('$OUT/profile_${shape}_${prec}_$fw.json'))['runs']
for k, v in r.items(): print('$shape', k, 'fp8_wgrad=$fw', round(v['median_ms'], 3), round(v['kernel_ms_total'], 3), v['top_kernels_ms'])" \
      || echo "profile $v failed"
  done ;;
model)
  for v in ${VARIANTS:-"mixtral_bf16:mixtral-8x7b:" "mixtral_block:mixtral-8x7b:--fp8 blockwise"}; do
    name=${v%%:*}; rest=${v#*:}; preset=${rest%%:*}; flags=${rest#*:}; flags=${flags//,/ }  # commas: spaces
    if [ "$preset" = mixtral-8x7b ]; then shape="--batch 1 --accumulate 4"; else shape="--batch 2 --accumulate 2"; fi
    timeout 150 python3 benchmarks/bench_model.py --preset "$preset" $shape --steps 5 --warmup-steps 2 $flags \
      --out "$OUT/model_$name.json" > "$OUT/model_$name.log" 2>&1
    python3 -c "import json; r=json.load(open('$OUT/model_$name.json'))['records'][0]; print('$name', {k: r.get(k) for k in ('tokens_per_sec','tflops_per_gpu','mfu','peak_mem_gib')})" \
      2>/dev/null || { echo "$name failed"; tail -3 "$OUT/model_$name.log" | cut -c1-300; }
  done ;;
esac; done; done
