"""``lightning-moe``: LightningCLI over MoELanguageModel and TokenDataModule, plus the Hugging Face export.

    lightning-moe fit --config configs/tiny.yaml
    lightning-moe fit --config configs/tiny.yaml --model.init_from_hf /path/to/hf_model
    lightning-moe export-hf checkpoints/last.ckpt exported_hf/      # any layout's checkpoint, on one process
    lightning-moe plan --model.preset qwen3-30b-a3b --gpus 64 --gpu h100-80gb   # rank the folded layouts
"""

from __future__ import annotations

import argparse
import sys

from lightning.pytorch.cli import LightningCLI

import lightning_moe  # noqa: F401  (registers the "moe_fold" strategy)
from lightning_moe.data import TokenDataModule
from lightning_moe.modules.lm import MoELanguageModel


def build_cli(args=None, run: bool = True) -> LightningCLI:
    return LightningCLI(MoELanguageModel, TokenDataModule, args=args, save_config_kwargs={"overwrite": True},
                        parser_kwargs={"description": "Train Mixture-of-Experts language models."}, run=run)


def export_hf_main(argv) -> None:
    from lightning_moe.hf_interop import export_checkpoint
    p = argparse.ArgumentParser(prog="lightning-moe export-hf",
                                description="Write a moe_fold checkpoint (any parallel layout) as a Hugging Face "
                                            "model directory (config.json + model.safetensors), on one process.")
    p.add_argument("checkpoint", help="the checkpoint directory (e.g. checkpoints/last.ckpt)")
    p.add_argument("out", help="the Hugging Face directory to write")
    p.add_argument("--model-type", default=None, choices=["mixtral", "qwen3_moe", "deepseek_v3"],
                   help="HF architecture (default: inferred from the model config)")
    a = p.parse_args(argv)
    export_checkpoint(a.checkpoint, a.out, a.model_type)
    print(f"exported {a.checkpoint} to {a.out}")


def main(args=None) -> None:
    """Console entry point (its return value becomes the exit status, so it returns None)."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["export-hf"]:
        export_hf_main(argv[1:])
        return
    if argv[:1] == ["plan"]:
        from lightning_moe.planner.cli import main as plan_main
        status = plan_main(argv[1:])
        if status:
            raise SystemExit(status)
        return
    build_cli(args)


if __name__ == "__main__":
    main()
