"""An Accelerate script with the effective batch kept: the digits that ship with scikit-learn, a small
CNN, a target of 256 samples per optimizer step under a 4 MiB limit that 256 do not fit. autotune
gives the micro-batch for the DataLoader and sets the Accelerator's gradient accumulation;
``accelerator.accumulate(model)`` does the rest.

    pip install -e ".[accelerate,examples]"
    python examples/accelerate_script.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from quickstart import accuracy, cnn, digits
from torch.utils.data import DataLoader

from autotune.integrations.accelerate import plan_accumulation


def main() -> None:
    torch.manual_seed(0)
    train, test = digits()
    accelerator = Accelerator(cpu=True)
    model = cnn()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    settings = plan_accumulation(accelerator, model, DataLoader(train, batch_size=64), target_batch=256, optimizer=optimizer,
                                 loss_fn=loss_fn, memory_limit="4MiB")
    print(settings)
    loader = DataLoader(train, batch_size=settings.micro_batch, shuffle=True, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps = 0
    for _ in range(10):
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(loss_fn(model, batch))
                optimizer.step()
                optimizer.zero_grad()
                steps += accelerator.sync_gradients
    print(f"trained {steps} optimizer steps (the last of each epoch shorter)")
    print(f"test accuracy: {accuracy(accelerator.unwrap_model(model), test):.3f}")


if __name__ == "__main__":
    main()
