"""``lightning-moe``: LightningCLI over MoELanguageModel and TokenDataModule, plus the Hugging Face export.

    lightning-moe fit --config configs/tiny.yaml
    lightning-moe fit --config configs/tiny.yaml --model.init_from_hf /path/to/hf_model
    lightning-moe export-hf checkpoints/last.ckpt exported_hf/      # any layout's checkpoint, on one process
    lightning-moe plan --model.preset qwen3-30b-a3b --gpus 64 --gpu h100-80gb   # rank the folded layouts
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import re
import sys
from typing import Iterable, Optional

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_moe  # noqa: F401  (registers the "moe_fold" strategy)
from lightning_moe.data import TokenDataModule
from lightning_moe.modules.lm import MoELanguageModel


def _parser_keys(parser) -> set[str]:
    """Every option key of ``parser`` and of its subcommands' parsers (``trainer.max_steps``, ``model.lr``...)."""
    keys = {a.dest for a in parser._actions if isinstance(a.dest, str) and a.dest not in ("help", "subcommand")}
    sub = getattr(parser, "_subcommands_action", None)
    for child in (sub._name_parser_map.values() if sub is not None else ()):
        keys |= _parser_keys(child)
    return keys


def _class_keys(class_path: str) -> set[str]:
    """The ``init_args`` a class accepts: its ``__init__`` parameters, and its bases' while it takes ``**kwargs``."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return set()
    keys: set[str] = set()
    for klass in inspect.getmro(cls):
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(klass.__init__).parameters.values()
        keys |= {p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return keys


def nearest_key(key: str, keys: Iterable[str]) -> Optional[str]:
    """The valid key closest to ``key`` among its siblings (same dotted prefix), or None when none is close."""
    prefix, _, leaf = key.rpartition(".")
    head = prefix + "." if prefix else ""
    siblings = {k[len(head):].split(".")[0] for k in keys if k.startswith(head)}
    match = difflib.get_close_matches(leaf, sorted(siblings), n=1, cutoff=0.6)
    return head + match[0] if match else None


def unknown_key_hints(message: str, keys: Iterable[str]) -> list[str]:
    """One 'did you mean' line per unknown key that jsonargparse's ``message`` names and a valid key resembles:
    options of the parsers (``keys``) and ``init_args`` of a ``class_path``. jsonargparse itself suggests nothing."""
    keys = set(keys)
    hints = []
    unknown = re.findall(r"does not accept option '([^']+)'", message)
    unknown += re.findall(r"^Option '([^']+)' is not accepted", message, flags=re.M)
    for args in re.findall(r"unrecognized arguments: (.*)", message):
        unknown += [a[2:].split("=")[0] for a in args.split() if a.startswith("--")]
    for key in unknown:
        match = nearest_key(key, keys)
        if match:
            hints.append(f"unknown key '{key}': did you mean '{match}'?")
    for class_path, key in re.findall(r"class_path '([\w.]+)':\s+Option '([^']+)' is not accepted", message):
        match = nearest_key(key, _class_keys(class_path))
        if match:
            hints.append(f"unknown init_args key '{key}' of {class_path}: did you mean '{match}'?")
    return list(dict.fromkeys(hints))


class SuggestingArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, whose errors about an unknown key (in a YAML config or on the command line: trainer,
    model, data, a class's init_args) end with the nearest valid key. Model overrides are checked by ModelConfig,
    which suggests the nearest field itself."""

    def error(self, message: str, ex: Optional[Exception] = None):
        hints = unknown_key_hints(message, _parser_keys(self))
        if hints:
            message = message.rstrip("\n") + "\n" + "\n".join(hints)
        return super().error(message, ex)


def build_cli(args=None, run: bool = True) -> LightningCLI:
    return LightningCLI(MoELanguageModel, TokenDataModule, args=args, save_config_kwargs={"overwrite": True},
                        parser_kwargs={"description": "Train Mixture-of-Experts language models."}, run=run,
                        parser_class=SuggestingArgumentParser)


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
