"""What an adaptive batch ramp costs in wall time of its own, against a fixed batch of the same optimizer
steps, measured side by side in one run (interleaved, so that the machine's state weighs on both alike).

An adaptive ramp trains the micro-batches that fit, as a fixed target does; its noise meter compares a
window's first micro-batch with the whole window, so when a window fits in one micro-batch, one window
in ``autotune.train.ramp.SPLIT_EVERY`` (8) is cut in two halves for it. The comparison:

- ``ramp``: ``autotune.BatchRamp.adaptive(start, maximum)`` on an MLP over synthetic classification
  data, several epochs; its optimizer steps ``S`` and samples ``N`` are recorded;
- ``fixed``: ``fit`` at a fixed target of ``N / S`` (the ramp's mean batch), the same epochs, so that
  it takes about the same optimizer steps over the same samples;
- ``halves``: the ramp with every window cut in two halves (``SPLIT_EVERY = 1``), as it ran before,
  against a fixed target of its own mean batch (its meter sees more windows, so it raises sooner);
- ``half-first``: the ramp with micro-batches held at half its first target, as it ran at first
  (``plan=`` a plan whose micro-batch is that).

Prints, per repetition and as medians, the seconds of each, the steps, and the ratios to ``fixed``.

    python benchmarks/ramp_wall_time.py               # 9 repetitions (about two minutes on 2 cores)
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
import autotune.train.ramp as ramps
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
    parser.add_argument("--repeats", type=int, default=9)
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
    every = ramps.SPLIT_EVERY

    def halves() -> tuple[float, int, int]:
        ramps.SPLIT_EVERY = 1
        try:
            return run(ramp())
        finally:
            ramps.SPLIT_EVERY = every

    _, halves_steps, halves_samples = halves()
    halves_batch = round(halves_samples / halves_steps)
    print(f"halves: {halves_steps} steps; fixed target {halves_batch} (its mean batch)")
    rows = []
    for i in range(args.repeats):
        ramp_s, ramp_steps, _ = run(ramp())
        fixed_s, fixed_steps, _ = run(mean_batch)
        halves_s, _, _ = halves()
        fixed_h, fixed_h_steps, _ = run(halves_batch)
        held_s, _, _ = run(ramp(), plan=held)
        rows.append((ramp_s / fixed_s, halves_s / fixed_h, held_s / fixed_s))
        print(f"  repeat {i + 1}: ramp {ramp_s:.2f} s ({ramp_steps} steps), fixed {fixed_s:.2f} s ({fixed_steps} steps); halves "
              f"{halves_s:.2f} s, its fixed {fixed_h:.2f} s ({fixed_h_steps} steps); half-first {held_s:.2f} s; ratios "
              f"{rows[-1][0]:.2f}, {rows[-1][1]:.2f}, {rows[-1][2]:.2f}")
    # the median of the ratios of each interleaved repetition, and their range
    for k, name in enumerate(("ramp / fixed", "halves / its fixed", "half-first / fixed")):
        ratios = [r[k] for r in rows]
        print(f"{name}: median {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
