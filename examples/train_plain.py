"""Plain Lightning: MoELanguageModel + MoEFoldStrategy, expert parallelism 2 folded over data parallelism 2, on CPU.

    python examples/train_plain.py
"""

import lightning as L

from lightning_moe import LossReport, MoEFoldStrategy, MoELanguageModel, TokenDataModule

if __name__ == "__main__":
    L.seed_everything(0)
    model = MoELanguageModel(preset="tiny", lr=3e-3, warmup_steps=10)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MoEFoldStrategy(expert_parallel_size=2),
                        max_steps=60, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                        limit_val_batches=0, callbacks=[LossReport(window=10)])
    trainer.fit(model, datamodule=TokenDataModule(batch_size=8))
