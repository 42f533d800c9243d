"""``lightning-moe plan`` and ``lightning_moe.plan``: the ranked table, its JSON, the fit config it writes (parsed by
the real fit parser), and the errors for input no layout can serve."""

from __future__ import annotations

import json
import os
import sys

import pytest
import yaml

import lightning_moe
from lightning_moe import cli
from lightning_moe.modules.config import ModelConfig
from lightning_moe.planner import GPUS, PlanError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QWEN_4L = os.path.join(REPO, "configs", "qwen3-30b-a3b-4layer.yaml")


def _run(capsys, *args: str) -> tuple[int, str, str]:
    try:
        code = cli.main(["plan", *args]) or 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_from_a_fit_config_is_ranked_and_fits(capsys):
    code, out, _ = _run(capsys, "--config", QWEN_4L, "--gpus", "4", "--gpu", "h200-141gb", "--global-batch-size", "32",
                        "--json", "--top", "5")
    rows = json.loads(out)
    assert code == 0 and len(rows) == 5
    for row in rows:
        assert {"tp", "cp", "pp", "vpp", "ep", "etp", "memory_gib", "tflops_per_gpu"} <= set(row)
        assert row["tp"] * row["cp"] * row["pp"] * row["dp"] == 4 and row["etp"] * row["ep"] * row["pp"] * row["edp"] == 4
        assert 0 < row["memory_gib"] <= 0.92 * GPUS["h200-141gb"].memory_gib
        assert row["dominant_cost"] in ("compute", "all-to-all", "TP/CP collectives", "bubble", "optimizer")
        parts = row["memory_breakdown_gib"]
        assert sum(parts.values()) == pytest.approx(row["memory_gib"], abs=0.03)
    tflops = [row["tflops_per_gpu"] for row in rows]
    assert tflops == sorted(tflops, reverse=True) and 100 < tflops[0] < 989.4


def test_table_and_python_api_agree(capsys):
    code, out, _ = _run(capsys, "--model.preset", "qwen3-30b-a3b", "--model.overrides", "{num_layers: 3}",
                        "--model.overrides.num_layers", "4", "--model.overrides.vocab_size=32768", "--gpus", "4",
                        "--gpu", "h200-141gb", "--global-batch-size", "32", "--top", "3")
    best = lightning_moe.plan("qwen3-30b-a3b", {"num_layers": 4, "vocab_size": 32768}, gpus=4, gpu="h200-141gb",
                              global_batch_size=32, top=3)
    lines = out.splitlines()
    assert code == 0 and "2.6 B parameters" in lines[0] and "TFLOPS" in lines[1] and len(lines) == 5
    assert f"{best[0].tflops_per_gpu:7.1f}" in lines[2] and f"{best[0].memory.total:6.1f}" in lines[2]


def test_written_config_parses_with_the_fit_parser(capsys, tmp_path, monkeypatch):
    """The full qwen3-30b-a3b on 8 H100s needs a pipeline, recomputation and optimizer offload: all of it must come
    back from the fit CLI's own parser as planned."""
    path = tmp_path / "best.yaml"
    code, out, _ = _run(capsys, "--model.preset", "qwen3-30b-a3b", "--gpus", "8", "--gpu", "h100-80gb", "--json",
                        "--write-config", str(path))
    top = json.loads(out)[0]
    assert code == 0 and top["pp"] > 1 and top["recompute"] and top["optimizer_cpu_offload"] > 0
    monkeypatch.setattr(sys, "argv", ["lightning-moe"])  # pytest's own arguments are not the CLI's
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", "--config", str(path), "--print_config"])
    assert info.value.code == 0
    conf = yaml.safe_load(capsys.readouterr().out)
    args = conf["trainer"]["strategy"]["init_args"]
    assert conf["trainer"]["strategy"]["class_path"] == "lightning_moe.MoEFoldStrategy"
    assert (args["tensor_parallel_size"], args["pipeline_parallel_size"], args["virtual_pipeline_size"],
            args["expert_parallel_size"]) == (top["tp"], top["pp"], top["vpp"], top["ep"])
    assert args["num_microbatches"] == top["num_microbatches"] and args["distributed_optimizer"] is True
    assert args["optimizer_cpu_offload"] == top["optimizer_cpu_offload"]
    assert conf["trainer"]["accumulate_grad_batches"] == 1 and conf["trainer"]["devices"] == 8
    assert conf["data"]["batch_size"] == top["micro_batch_size"] * top["num_microbatches"]
    recompute = [c for c in conf["trainer"]["callbacks"] if c["class_path"].endswith("Recompute")]
    assert recompute[0]["init_args"]["modules"] == top["recompute"]
    model = conf["model"]
    assert ModelConfig.from_preset(model["preset"], **model["overrides"]) == ModelConfig.from_preset("qwen3-30b-a3b")


@pytest.mark.parametrize("args,message", [
    (["--model.preset", "qwen3-30b-a3b", "--gpus", "8", "--gpu", "h100-40gb"],
     "unknown GPU kind 'h100-40gb'; known kinds: h100-80gb, h800-80gb, h200-141gb, a100-80gb"),
    (["--model.preset", "tiny", "--gpus", "3", "--global-batch-size", "16"],
     "no layout of 3 GPUs splits the global batch of 16 sequences into micro-batches over its data-parallel ranks "
     "(the valid layouts have DP = 3); choose a global batch that one of them divides, e.g. 18"),
    (["--model.preset", "tiny", "--gpus", "0"], "gpus must be an integer >= 1, got 0"),
    (["--model.preset", "deepseek-v3", "--gpus", "8"],
     "the model fits on no layout of 8 x h100-80gb: the smallest peak is 475.2 GiB per GPU (tp=8 cp=1 pp=1 ep=8 "
     "etp=1, micro-batch 1, dist-opt, opt-offload 1, recompute full) against 72.8 GiB usable on a h100-80gb; the "
     "weights alone take 157.9 GiB, 85.1 GiB too many"),
    (["--model.preset", "qwen3-30b-a3b", "--model.overrides.num_layers", "2", "--model.overrides.vocab_size", "32768",
      "--gpus", "1", "--seq-length", "524288", "--global-batch-size", "1"],
     "the activations need 118.1 GiB where 65.1 GiB remain, 53.0 GiB too many"),
    (["--model.preset", "tiny", "--model.overrides.num_layerz", "3", "--gpus", "1"],
     "unknown fields 'num_layerz' (did you mean 'num_layers'?)"),
    (["--model.preset", "tiny", "--model.overrides", "4", "--gpus", "1"],
     "--model.overrides needs a mapping such as '{num_layers: 4}', got '4'"),
], ids=["unknown-gpu", "no-layout", "zero-gpus", "weights-fit-nowhere", "activations-fit-nowhere", "bad-field",
        "bad-overrides"])
def test_bad_input_exits_non_zero_with_the_reason(capsys, args, message):
    code, out, err = _run(capsys, *args)
    assert code == 2 and out == "" and message in err, err


def test_python_api_raises_plan_error():
    with pytest.raises(PlanError, match=r"micro-batches of 2 .*DP = 1, 2, 4\); .* e.g. 4$"):
        lightning_moe.plan("tiny", gpus=4, global_batch_size=3, micro_batch_size=2)
    with pytest.raises(PlanError, match="global_batch_size must be an integer >= 1, got 0"):
        lightning_moe.plan("tiny", gpus=4, global_batch_size=0)
