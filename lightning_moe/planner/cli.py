"""``lightning-moe plan``: the planner's command line (argparse; ``--model.*`` spelled as in ``lightning-moe fit``).

    lightning-moe plan --model.preset qwen3-30b-a3b --gpus 64 --gpu h100-80gb --global-batch-size 512
    lightning-moe plan --config configs/qwen3-30b-a3b-4layer.yaml --gpus 4 --gpu h200-141gb --json
    lightning-moe plan --model.preset mixtral-8x7b --model.overrides.num_layers 8 --gpus 8 --write-config best.yaml
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Optional

import yaml

from lightning_moe.planner.choice import PlanError
from lightning_moe.planner.gpus import GPUS, gpu_kind
from lightning_moe.planner.plan import model_config, plan
from lightning_moe.planner.report import as_json, table, write_fit_config
from lightning_moe.planner.settings import PRECISIONS

OVERRIDE = "--model.overrides."


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-moe plan", description=(
        "Rank the folded layouts (TP, CP, PP, VPP, EP, ETP, micro-batch, recompute/offload) of a model on N GPUs by "
        "estimated step time, with the memory per GPU of each. Model fields: --model.overrides.NAME VALUE."))
    p.add_argument("--config", help="a lightning-moe fit config: its model (preset, overrides) and data.seq_length")
    p.add_argument("--model.preset", dest="preset", help="model preset (as in fit)")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    p.add_argument("--gpu", default="h100-80gb", help=f"GPU kind: {', '.join(GPUS)} (default h100-80gb)")
    p.add_argument("--seq-length", type=int, help="tokens per sequence (default: the model's seq_length)")
    p.add_argument("--micro-batch-size", type=int, help="sequences per micro-batch and data-parallel rank (default: "
                                                         "the best of 1, 2, 4)")
    p.add_argument("--global-batch-size", type=int, help="sequences per optimizer step (default: 8 per GPU)")
    p.add_argument("--precision", default="bf16-true", choices=PRECISIONS,
                   help="bf16-true (default: bf16 weights, fp32 main params), bf16-mixed or 32-true")
    p.add_argument("--top", type=int, default=10, help="rows to show (default 10)")
    p.add_argument("--json", action="store_true", help="print the table as a JSON list")
    p.add_argument("--write-config", metavar="PATH", help="write the top choice as a config for lightning-moe fit")
    return p


def _split_overrides(argv: list[str]) -> tuple[list[str], dict]:
    """``--model.overrides.NAME VALUE`` / ``--model.overrides.NAME=VALUE`` / ``--model.overrides MAPPING`` pulled out
    of ``argv`` (values as text: ModelConfig reads them as YAML, as the fit CLI does)."""
    rest, overrides, i = [], {}, 0
    while i < len(argv):
        arg = argv[i]
        if arg.split("=")[0] == OVERRIDE[:-1]:  # --model.overrides '{num_layers: 4}': a YAML mapping
            value, i = (arg.partition("=")[2], i) if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "", i + 1)
            mapping = yaml.safe_load(value)
            if not isinstance(mapping, dict):
                raise PlanError(f"--model.overrides needs a mapping such as '{{num_layers: 4}}', got {value!r}")
            overrides.update(mapping)
        elif arg.startswith(OVERRIDE):
            name, eq, value = arg[len(OVERRIDE):].partition("=")
            if not eq:
                if i + 1 >= len(argv):
                    raise PlanError(f"{arg} needs a value")
                value, i = argv[i + 1], i + 1
            overrides[name] = value
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


def _from_config(path: str) -> tuple[Optional[str], dict, Optional[int]]:
    with open(path) as f:
        conf = yaml.safe_load(f) or {}
    model = conf.get("model") or {}
    return model.get("preset"), dict(model.get("overrides") or {}), (conf.get("data") or {}).get("seq_length")


def main(argv: list[str]) -> int:
    """Runs the command; returns the exit status (2 with a message on stderr for bad input)."""
    p = _parser()
    try:
        rest, overrides = _split_overrides(list(argv))
        a = p.parse_args(rest)
        preset, seq = a.preset, a.seq_length
        if a.config:
            conf_preset, conf_overrides, conf_seq = _from_config(a.config)
            preset, overrides, seq = preset or conf_preset, {**conf_overrides, **overrides}, seq or conf_seq
        kind = gpu_kind(a.gpu)
        cfg = model_config(preset, overrides)
        seq = seq or cfg.seq_length
        choices = plan(config=cfg, gpus=a.gpus, gpu=a.gpu, seq_length=seq, micro_batch_size=a.micro_batch_size,
                       global_batch_size=a.global_batch_size, precision=a.precision, top=a.top)
    except (PlanError, ValueError, OSError) as e:
        print(f"lightning-moe plan: error: {e}", file=sys.stderr)
        return 2
    gbs = a.global_batch_size or 8 * a.gpus
    print(as_json(choices) if a.json else table(choices, cfg, preset or "model", a.gpus, kind, seq, gbs))
    if a.write_config:
        write_fit_config(a.write_config, choices[0], cfg, preset, kind, seq,
                         "lightning-moe plan " + " ".join(shlex.quote(x) for x in argv))
        if not a.json:
            print(f"wrote the top choice to {a.write_config} (lightning-moe fit --config {a.write_config})")
    return 0
