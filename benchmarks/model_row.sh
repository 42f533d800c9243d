# Sourced by the run_*.sh scripts. `model NAME PRESET FLAGS...` runs bench_model.py (5 steps after 2 warm-up steps)
# and prints one line: NAME, the record's fields named in $MODEL_FIELDS, then its speed, MFU, peak memory and
# optimizer time. The JSON and log ($OUT/m_NAME.json, .log) are removed afterwards unless KEEP_JSON=1: a lent GPU
# machine returns only a few files.
model() {
  local name=$1 preset=$2 rc; shift 2
  rm -f "$OUT/m_$name.json"  # a result left from an earlier run must not pass for this one's
  timeout 170 python3 benchmarks/bench_model.py --preset "$preset" --steps 5 --warmup-steps 2 "$@" \
    --out "$OUT/m_$name.json" > "$OUT/m_$name.log" 2>&1
  rc=$?
  [ $rc = 0 ] || { echo "$name failed (exit $rc)"; grep -E "Error|error" "$OUT/m_$name.log" | tail -3 | cut -c1-300; return; }
  python3 - "$OUT/m_$name.json" "$name" ${MODEL_FIELDS:-} <<'PY' || echo "$name: no record"
import json, sys
r = json.load(open(sys.argv[1]))["records"][0]
keys = ("tokens_per_sec", "tflops_per_gpu", "mfu", "peak_mem_gib", "optimizer_step_ms_median")
print(sys.argv[2], *[r[k] for k in sys.argv[3:]],
      {k: round(r[k], 4) if isinstance(r.get(k), float) else r.get(k) for k in keys})
PY
  [ "${KEEP_JSON:-0}" = 1 ] || rm -f "$OUT/m_$name.json" "$OUT/m_$name.log"
}

# `gpu_tests FILE...` runs each file's `gpu` tests (200 s each) into $OUT/tests.log and prints its summary line, then
# the first failures.
gpu_tests() {
  local f
  for f in "$@"; do
    timeout 200 python3 -m pytest -q -s -p no:cacheprovider -m gpu "$f" >> "$OUT/tests.log" 2>&1
    echo "$f: $(tail -1 "$OUT/tests.log")"
  done
  grep -E "^(E   |FAILED)|steps, worst" "$OUT/tests.log" | cut -c1-300 | head -20
}
