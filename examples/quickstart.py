"""Quickstart: train a small CNN on the digits data set with a target batch of 256.

The memory limit is set low on purpose, so that 256 samples do not fit at once: autotune finds the
largest micro-batch that does, accumulates gradients over several micro-batches per step, scales
the learning rate for the larger batch and adjusts BatchNorm. Runs in seconds on a laptop CPU.

    python examples/quickstart.py
"""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autotune


def digits() -> tuple[TensorDataset, TensorDataset]:
    """The 8x8 digits that ship with scikit-learn, scaled to [0, 1], split 80/20."""
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    cut = int(0.8 * len(y))
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 4 * 4, 10),
    )


def accuracy(model: nn.Module, data: TensorDataset) -> float:
    model.eval()
    x, y = data.tensors
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def main() -> None:
    torch.manual_seed(0)
    train, test = digits()
    model = cnn()
    loader = DataLoader(train, batch_size=32, shuffle=True)  # the LR below was tuned at 32
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    result = autotune.fit(
        model,
        loader,
        target_batch=256,
        optimizer=optimizer,
        memory_limit="4MiB",  # too small for 256 samples at once: forces accumulation
        epochs=20,
        progress=False,
    )
    print(result.plan)
    print()
    print(f"trained {len(result.history)} optimizer steps on {result.samples} samples; last loss {result.history[-1].loss:.4f}")
    print(f"test accuracy: {accuracy(model, test):.3f}")


if __name__ == "__main__":
    main()
