"""What one layer keeps for backward, tensor by tensor, and what each Recompute / ActivationOffload module takes away.

Runs one forward of a preset shrunk to a few layers (bf16 weights and activations, as ``precision="bf16-true"``) under
saved-tensor hooks that record every distinct storage autograd keeps (parameters excluded), with the innermost module
that saved it. Prints JSON: per module path of one layer, the bytes and the tensors' shapes, and the totals per layer.

    python benchmarks/activation_breakdown.py --preset qwen3-30b-a3b --seq 4096 --batch 2 --layer 1
    python benchmarks/activation_breakdown.py --preset tiny --seq 64 --device cpu      # a smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--layer", type=int, default=1, help="the layer whose saved tensors are listed")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--overrides", default="{}", help="JSON ModelConfig overrides")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()

    from lightning_moe.modules.config import ModelConfig
    from lightning_moe.modules.transformer import MoETransformer
    from lightning_moe.strategy.parallel_context import ParallelContext

    cfg = ModelConfig.from_preset(args.preset, **{"num_layers": args.layers, "vocab_size": args.vocab,
                                                  "seq_length": args.seq, **json.loads(args.overrides)})
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    with torch.device(args.device):
        model = MoETransformer(cfg, ParallelContext.single())
    model.init_weights(seed=0)
    model.to(dtype)  # the router keeps its fp32 weight (TopKRouter._apply), as under bf16-true
    params = {q.untyped_storage().data_ptr() for q in model.parameters()}

    stack: list[str] = []
    names = {m: n for n, m in model.named_modules()}

    def leave(mod, a, o) -> None:  # returns None: the output stays
        stack.pop()

    for m in model.modules():
        m.register_forward_pre_hook(lambda mod, a: stack.append(names[mod]))
        m.register_forward_hook(leave)
    seen: dict[int, tuple[str, int, tuple, str]] = {}

    def pack(t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        if key not in params and key not in seen:
            seen[key] = (stack[-1] if stack else "", t.untyped_storage().nbytes(), tuple(t.shape), str(t.dtype))
        return t

    g = torch.Generator(args.device).manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=args.device, generator=g)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, aux = model.loss(tokens[:, :-1], tokens[:, 1:])
    prefix = f"layers.{args.layer}."
    by_module: dict[str, dict] = defaultdict(lambda: {"bytes": 0, "tensors": []})
    per_layer: dict[str, int] = defaultdict(int)
    for name, nbytes, shape, dt in seen.values():
        layer = name.split(".")[1] if name.startswith("layers.") else name or "(top)"
        per_layer[layer] += nbytes
        if name.startswith(prefix):
            rec = by_module[name[len(prefix):]]
            rec["bytes"] += nbytes
            rec["tensors"].append(f"{list(shape)} {dt.replace('torch.', '')}")
    total = sum(r["bytes"] for r in by_module.values())
    out = {"preset": args.preset, "seq": args.seq, "batch": args.batch, "device": args.device,
           "dtype": str(dtype), "torch": torch.__version__, "layer": args.layer,
           "layer_mib": total / 2**20,
           "modules": {k: {"mib": round(v["bytes"] / 2**20, 2), "share": round(v["bytes"] / total, 4),
                           "tensors": v["tensors"]} for k, v in sorted(by_module.items(), key=lambda kv: -kv[1]["bytes"])},
           "per_layer_mib": {k: round(v / 2**20, 2) for k, v in per_layer.items()}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
