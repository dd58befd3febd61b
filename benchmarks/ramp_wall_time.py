"""What an adaptive batch ramp costs in wall time of its own, against a fixed batch of the same optimizer
steps, measured side by side in one run (interleaved, so that the machine's state weighs on both alike).

The ramp's micro-batch follows its current target (half of each target's share, for the noise meter's
two micro-batches per window, up to what fits). It once stayed at half its first target for the whole
run, so a ramp that had grown 16x trained micro-batches 16x smaller than it could. The comparison:

- ``ramp``: ``autotune.BatchRamp.adaptive(start, maximum)`` on an MLP over synthetic classification
  data, several epochs; its optimizer steps ``S`` and samples ``N`` are recorded;
- ``fixed``: ``fit`` at a fixed target of ``N / S`` (the ramp's mean batch), the same epochs, so that
  it takes about the same optimizer steps over the same samples;
- ``half-first``: the ramp again, with micro-batches held at half its first target, as before
  (``plan=`` a plan whose micro-batch is that), to show what following the target saves.

Prints, per repetition and as medians, the seconds of each, the steps, and the ratios ramp / fixed
and half-first / fixed.

    python benchmarks/ramp_wall_time.py               # 5 repetitions (about two minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autotune
from autotune.train.ramp import plan_for_target

START, MAXIMUM, EPOCHS = 16, 512, 4


def task(n: int = 16384) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 64, generator=g)
    w = torch.randn(64, 10, generator=g)
    return TensorDataset(x, (x @ w + 2.0 * torch.randn(n, 10, generator=g)).argmax(-1))


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def run(target, *, plan=None) -> tuple[float, int, int]:
    """Seconds, optimizer steps and samples of one fit."""
    model = net()
    loader = DataLoader(task(), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    start = time.perf_counter()
    result = autotune.fit(model, loader, None if plan is not None else target, plan=plan, optimizer=optimizer, loss_fn=loss_fn,
                          epochs=EPOCHS, memory_limit="1GiB", lr_rule="none", progress=False)
    return time.perf_counter() - start, len(result.history), sum(h.samples for h in result.history)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ramp = lambda: autotune.BatchRamp.adaptive(START, MAXIMUM, windows=2, margin=1.0)  # noqa: E731
    _, steps, samples = run(ramp())
    mean_batch = round(samples / steps)
    # the ramp with micro-batches held at half its first target, as it ran before: a plan made for its
    # largest target whose micro-batch is that
    model = net()
    base = autotune.plan(model, DataLoader(task(), batch_size=64), target_batch=MAXIMUM, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                         loss_fn=loss_fn, memory_limit="1GiB", lr_rule="none", progress=False)
    held = plan_for_target(base, MAXIMUM, micro_batch=START // 2)
    print(f"ramp {START} -> {MAXIMUM}: {steps} steps over {samples} samples; fixed target {mean_batch} (its mean batch); "
          f"largest micro-batch that fits: {base.micro_batch}")
    rows = []
    for i in range(args.repeats):
        ramp_s, ramp_steps, _ = run(ramp())
        fixed_s, fixed_steps, _ = run(mean_batch)
        held_s, _, _ = run(ramp(), plan=held)
        rows.append((ramp_s, fixed_s, held_s))
        print(f"  repeat {i + 1}: ramp {ramp_s:.2f} s ({ramp_steps} steps), fixed {fixed_s:.2f} s ({fixed_steps} steps), "
              f"half-first {held_s:.2f} s; ramp / fixed {ramp_s / fixed_s:.2f}, half-first / fixed {held_s / fixed_s:.2f}")
    # the median of the ratios of each interleaved repetition
    print(f"median: ramp / fixed {statistics.median(r / f for r, f, _ in rows):.2f}, "
          f"half-first / fixed {statistics.median(h / f for _, f, h in rows):.2f}")


if __name__ == "__main__":
    main()
