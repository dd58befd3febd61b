"""Keep your own loop: ``autotune.accumulate`` with two losses per micro-batch.

A shared trunk with two heads (which digit; is it even) on the digits data set. Each head's loss is
backpropagated on its own, multiplied by the micro-batch's weight, so only one graph is held at a
time; the accumulated gradient equals that of the summed loss over the whole 256-sample batch.

    python examples/multitask.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from quickstart import digits
from torch import nn
from torch.utils.data import DataLoader

import autotune


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU())
        self.digit = nn.Linear(128, 10)
        self.parity = nn.Linear(128, 2)


def digit_loss(model: TwoHeads, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model.digit(model.trunk(x)), y)


def parity_loss(model: TwoHeads, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model.parity(model.trunk(x)), y % 2)


def main() -> None:
    torch.manual_seed(0)
    train, test = digits()
    model = TwoHeads()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(train, batch_size=32, shuffle=True)

    # Plan with the heavier of the two losses; the iterator does the rest.
    plan = autotune.plan(model, loader, target_batch=256, optimizer=optimizer, loss_fn=digit_loss, memory_limit="1MiB")
    print(plan, end="\n\n")
    for group in optimizer.param_groups:
        group["lr"] = plan.lr  # apply the planned learning rate in your own loop

    for epoch in range(15):
        for window in autotune.accumulate(loader, plan):
            for micro in window:
                # one graph at a time: build, weight, backward, release; then the next head
                (digit_loss(model, micro.batch) * micro.weight).backward()
                (parity_loss(model, micro.batch) * micro.weight).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    x, y = test.tensors
    with torch.no_grad():
        h = model.trunk(x)
        digit_acc = (model.digit(h).argmax(1) == y).float().mean().item()
        parity_acc = (model.parity(h).argmax(1) == y % 2).float().mean().item()
    print(f"test accuracy: digit {digit_acc:.3f}, parity {parity_acc:.3f}")


if __name__ == "__main__":
    main()
