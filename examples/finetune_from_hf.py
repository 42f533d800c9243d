"""Fine-tune a Hugging Face MoE checkpoint (Mixtral, Qwen3-MoE, DeepSeek-V3) with MoEFoldStrategy, then export it.

    python examples/finetune_from_hf.py --hf-dir /path/to/local/hf/model --out exported/
    python examples/finetune_from_hf.py --demo          # a tiny random Qwen3-MoE made here (no hub access), on CPU

Each rank reads only its own TP/EP shards of the safetensors files. The CLI does the same with
``lightning-moe fit --model.init_from_hf DIR --model.overrides '{seq_length: 512}'``.
"""

import argparse
import os
import tempfile

import lightning as L

from lightning_moe import LossReport, MoEFoldStrategy, MoELanguageModel, TokenDataModule
from lightning_moe.hf_interop import save_hf


def tiny_qwen3_moe(path: str) -> str:
    """A random 2-layer Qwen3-MoE with a byte vocabulary, saved as a Hugging Face directory."""
    import torch
    import transformers
    cfg = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=2, intermediate_size=128, moe_intermediate_size=32,
                                      num_experts=8, num_experts_per_tok=2, max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    return path


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", help="local Hugging Face model directory (config.json + *.safetensors)")
    p.add_argument("--demo", action="store_true", help="make a tiny random Qwen3-MoE and fine-tune it on CPU")
    p.add_argument("--out", default=None, help="export the fine-tuned weights here (single process)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    args = p.parse_args()
    hf_dir = tiny_qwen3_moe(tempfile.mkdtemp(prefix="tiny_qwen3_moe_")) if args.demo else args.hf_dir
    if hf_dir is None:
        p.error("give --hf-dir or --demo")
    L.seed_everything(0)
    model = MoELanguageModel(init_from_hf=hf_dir, overrides={"seq_length": args.seq}, lr=1e-3, warmup_steps=5)
    trainer = L.Trainer(accelerator="auto", devices=args.devices, max_steps=args.steps, gradient_clip_val=1.0,
                        strategy=MoEFoldStrategy(expert_parallel_size=args.ep, tensor_parallel_size=args.tp),
                        logger=False, enable_checkpointing=False, limit_val_batches=0,
                        callbacks=[LossReport(window=10)])
    trainer.fit(model, datamodule=TokenDataModule(seq_length=args.seq, batch_size=4))
    if args.out and trainer.world_size == 1:
        save_hf(model.model, args.out)
        print(f"exported to {os.path.abspath(args.out)}")
