"""The built-in demo for ``autotune report --demo``: a small CNN with BatchNorm, 10 classes."""

from __future__ import annotations

from torch import nn

__all__ = ["DEMO", "demo_model"]


def demo_model() -> nn.Module:
    """A small CNN with BatchNorm for 3x32x32 images and 10 classes."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, 10),
    )


# The demo's settings: 256 samples per step do not fit in 64 MiB, so the plan accumulates.
DEMO = {"input_shape": "3,32,32", "target_batch": 256, "memory_limit": "64MiB", "base_batch": 32}
