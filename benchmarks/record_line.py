"""One JSON line summarising a bench_model.py record, for the multi-GPU run scripts' models.jsonl.

    python3 benchmarks/record_line.py RECORD.json RUN_NAME [--kernel-ms] [--keys KEY,KEY,...]

``--keys``: the record's fields to print instead of the default set (no per-rank breakdown then).
"""

import json
import sys

KEYS = ["preset", "num_layers", "num_experts", "devices", "strategy", "micro_batch_size", "accumulate_grad_batches",
        "tokens_per_step", "tokens_per_sec", "tflops_per_gpu", "mfu", "peak_mem_gib", "step_time_median_s", "pipeline",
        "error"]


def main(argv) -> None:
    path, name = argv[0], argv[1]
    try:
        with open(path) as f:
            r = json.load(f)["records"][0]
    except Exception as e:  # noqa: BLE001 - a crashed run still gets its line
        r = {"error": f"no record: {e}"}
    if "--keys" in argv:
        keys = argv[argv.index("--keys") + 1].split(",")
        print(json.dumps({"run": name, **{k: r.get(k) for k in keys}}))
        return
    out = {"run": name, **{k: r.get(k) for k in KEYS}}
    out["breakdown"] = [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in b.items()
                         if k != "kernel_ms" or "--kernel-ms" in argv}
                        for b in r.get("time_breakdown_per_rank") or []]
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
