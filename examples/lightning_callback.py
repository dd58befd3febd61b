"""Lightning with the effective batch kept: the digits that ship with scikit-learn, a small CNN, a target
of 256 samples per optimizer step under a 4 MiB limit that 256 do not fit. The callback sets the
batch size and accumulate_grad_batches when fitting starts, and puts them back when it ends.

    pip install -e ".[lightning,examples]"
    python examples/lightning_callback.py
"""

from __future__ import annotations

import logging

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from quickstart import accuracy, cnn, digits
from torch.utils.data import DataLoader

from autotune.integrations.lightning import AutotuneCallback


class Digits(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = cnn()
        self.batch_size = 256  # what the callback changes (Lightning's convention: the attribute batch_size)
        self.train_set, self.test_set = digits()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)


def main() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.manual_seed(0)
    module = Digits()
    callback = AutotuneCallback(memory_limit="4MiB")  # the target: the 256 of batch_size x accumulation 1
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=10, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    trainer.fit(module)
    print(callback.settings)
    print(f"after fit: batch_size {module.batch_size}, accumulate_grad_batches {trainer.accumulate_grad_batches} (put back)")
    print(f"test accuracy: {accuracy(module.net, module.test_set):.3f}")


if __name__ == "__main__":
    main()
