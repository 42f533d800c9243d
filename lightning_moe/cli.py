"""``lightning-moe``: LightningCLI over MoELanguageModel and TokenDataModule.

    lightning-moe fit --config configs/tiny.yaml
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

import lightning_moe  # noqa: F401  (registers the "moe_fold" strategy)
from lightning_moe.data import TokenDataModule
from lightning_moe.modules.lm import MoELanguageModel


def build_cli(args=None, run: bool = True) -> LightningCLI:
    return LightningCLI(MoELanguageModel, TokenDataModule, args=args, save_config_kwargs={"overwrite": True},
                        parser_kwargs={"description": "Train Mixture-of-Experts language models."}, run=run)


def main(args=None) -> None:
    """Console entry point (its return value becomes the exit status, so it returns None)."""
    build_cli(args)


if __name__ == "__main__":
    main()
