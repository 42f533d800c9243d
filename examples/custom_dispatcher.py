"""A custom token dispatcher: subclass one, then name it by class path in the model config.

This one wraps the all-to-all dispatcher and counts the rows it sends to other ranks (a place to add compression,
a different collective, or instrumentation). Every dispatcher implements the same six steps (see
lightning_moe/modules/dispatcher.py), so the MoE layer does not change.

    python examples/custom_dispatcher.py
"""

import lightning as L

from lightning_moe import MoEFoldStrategy, MoELanguageModel, TokenDataModule
from lightning_moe.modules.dispatchers import AllToAllDispatcher


class CountingDispatcher(AllToAllDispatcher):
    rows_sent = 0

    def token_dispatch(self, x_ND, st):
        if "send" in st.extra:  # split sizes per destination rank, computed in dispatch_preprocess
            me = self.ctx.rank("ep")
            CountingDispatcher.rows_sent += sum(n for r, n in enumerate(st.extra["send"]) if r != me)
        return super().token_dispatch(x_ND, st)


class Report(L.Callback):
    def on_train_end(self, trainer, pl_module):
        print(f"rank {trainer.global_rank}: sent {CountingDispatcher.rows_sent} token copies to other EP ranks")


if __name__ == "__main__":
    model = MoELanguageModel(preset="tiny", overrides={"dispatcher": "__main__.CountingDispatcher"}, lr=3e-3)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MoEFoldStrategy(expert_parallel_size=2), max_steps=5,
                        logger=False, enable_checkpointing=False, limit_val_batches=0, callbacks=[Report()])
    trainer.fit(model, datamodule=TokenDataModule(batch_size=4))
