"""Convergence under low precision: one ~100 M-parameter MoE trained on real text (byte-level tokens of Python's own
standard library, ``lightning_moe.data.default_corpus_path``) for the same steps, data and seed under bf16-true and
each precision callback (every FP8 recipe, emulated NVFP4), in one process. Prints the loss curves and the final
losses (mean of the last 50 steps) against bf16 as JSON; ``--plot PNG`` draws them from a saved JSON (matplotlib).

    python benchmarks/fp8_convergence.py --steps 500 --out conv.json
    python benchmarks/fp8_convergence.py --plot docs/fp8_convergence.png --from conv.json
    python benchmarks/fp8_convergence.py --smoke      # tiny model on CPU, 4 steps per run
"""

from __future__ import annotations

import argparse
import json
import tempfile

import common  # noqa: F401  (puts the repo root on sys.path)
import lightning as L
import torch
from common import emit, env_info, log, pick_device, stdout_to_stderr

RUNS = ["bf16", "fp8-tensorwise", "fp8-delayed", "fp8-rowwise", "fp8-blockwise", "fp8-rowwise-fastall", "nvfp4",
        "fp8-delayed-e4m3-fastall"]
# ~110 M parameters (8 experts of 3 x 512 x 1024 in each of 8 layers), ~35 M active; every dimension a multiple of
# 128 so that the blockwise recipe runs everywhere
MODEL = dict(vocab_size=256, hidden_size=512, num_layers=8, num_attention_heads=8, num_kv_heads=4,
             ffn_hidden_size=2048, moe_ffn_hidden_size=1024, num_experts=8, topk=2, aux_loss_coeff=1e-2)
SMOKE = dict(vocab_size=256, hidden_size=128, num_layers=2, num_attention_heads=4, num_kv_heads=4,
             ffn_hidden_size=256, moe_ffn_hidden_size=128, num_experts=4, topk=2)


class Losses(L.Callback):
    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(outputs["loss"].detach())  # read at the end: no host sync per step


def callback(run: str):
    from lightning_moe import FP8Training, NVFP4Training
    if run.startswith("fp8-"):  # fp8-<recipe>[-e4m3][-fastall]: E4M3 gradients; fast accumulation in dgrad and wgrad
        recipe, *opts = run[4:].split("-")
        return [FP8Training(recipe, fast_accum="all" if "fastall" in opts else "fprop",
                            fp8_format="e4m3" if "e4m3" in opts else None)]
    return [NVFP4Training()] if run == "nvfp4" else []


def train(run: str, args, device, path: str) -> list[float]:
    from lightning_moe import MoEFoldStrategy, MoELanguageModel, TokenDataModule
    L.seed_everything(args.seed, verbose=False)
    rec = Losses()
    trainer = L.Trainer(accelerator="cpu" if device.type == "cpu" else "gpu", devices=1,
                        strategy=MoEFoldStrategy(), precision="32-true" if args.smoke else "bf16-true",
                        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                        gradient_clip_val=1.0, callbacks=[rec, *callback(run)], default_root_dir=tempfile.mkdtemp())
    lm = MoELanguageModel(preset="tiny", overrides=dict(SMOKE if args.smoke else MODEL, seq_length=args.seq),
                          lr=args.lr, warmup_steps=max(1, args.steps // 10), max_steps=args.steps, seed=args.seed,
                          log_expert_load=False)
    with stdout_to_stderr():
        trainer.fit(lm, datamodule=TokenDataModule(path=path, seq_length=args.seq, batch_size=args.batch,
                                                   val_batches=0, num_workers=0, seed=args.seed))
    return [float(v) for v in torch.stack(rec.values).float().cpu()]


def plot(result: dict, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    window = 20
    for run, r in result["runs"].items():
        v = torch.tensor(r["losses"])
        smooth = v.unfold(0, window, 1).mean(1) if len(v) > window else v
        ax.plot(range(len(v) - len(smooth), len(v)), smooth.tolist(),
                label=f"{run}: {r['final_loss']:.4f} ({100 * r['vs_bf16']:+.2f} %)")
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (mean of {window} steps)")
    env = result["env"]
    ax.set_title(f"~100 M MoE, byte-level stdlib text, {env.get('device_name')}, torch {env.get('torch_version')}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(png, dpi=120, bbox_inches="tight")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, from {RUNS}")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 500; 4 with --smoke)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 1024; 32 with --smoke)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None, help="draw the curves of --from JSON into this PNG and exit")
    p.add_argument("--from", dest="source", default=None)
    args = p.parse_args(argv)
    if args.plot:
        with open(args.source) as f:
            plot(json.load(f), args.plot)
        return {}
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if [r for r in runs if r not in RUNS]:
        p.error(f"--runs must come from {RUNS}")
    args.steps = args.steps or (4 if args.smoke else 500)
    args.seq = args.seq or (32 if args.smoke else 1024)
    device = pick_device(args.smoke)
    from lightning_moe.data import default_corpus_path
    path = default_corpus_path()
    out = {}
    result = {"benchmark": "fp8_convergence", "env": env_info(device), "smoke": args.smoke,
              "config": {"model": SMOKE if args.smoke else MODEL, "steps": args.steps, "seq": args.seq,
                         "batch": args.batch, "lr": args.lr, "data": "byte-level tokens of the Python stdlib",
                         "final_loss": "mean of the last 50 steps"},
              "runs": out}
    for run in runs:
        losses = train(run, args, device, path)
        tail = losses[-min(50, len(losses)):]
        out[run] = {"losses": losses, "final_loss": sum(tail) / len(tail)}
        log(f"{run}: final loss {out[run]['final_loss']:.4f}")
        if args.out:  # each run as it ends: a run cut short by a time limit keeps the earlier ones
            with open(args.out, "w") as f:
                json.dump(result, f)
    for r in out.values() if "bf16" in out else ():
        r["vs_bf16"] = r["final_loss"] / out["bf16"]["final_loss"] - 1
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
