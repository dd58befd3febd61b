"""Throughput of ``autotune.fit`` against the classic hand-written accumulation loop, and the cost
of a CPU memory limit (tensors counted) against ``fit`` without one.

Same model, data, micro-batch (32) and accumulation steps (8, target batch 256), same optimizer;
``fit`` gets the plan directly (no probing). "fit" has no memory limit; "fit+limit" enforces one on
the CPU, which counts tensor bytes for each window of a shape not seen before. Runs are
interleaved, rotating which goes first, and the median ratios of samples per second are printed.

    python benchmarks/overhead.py            # about a minute on 2 CPU cores
    python benchmarks/overhead.py --runs 9 --epochs 2
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from quickstart import cnn, digits  # noqa: E402

import autotune  # noqa: E402

MICRO, STEPS = 32, 8


def classic(model, loader, epochs: int) -> int:
    """The loop people write by hand: loss / accumulation_steps, step every N batches."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    samples = 0
    for _ in range(epochs):
        opt.zero_grad(set_to_none=True)
        running = torch.zeros(())
        for i, (x, y) in enumerate(loader):
            loss = F.cross_entropy(model(x), y) / STEPS
            loss.backward()
            running += loss.detach()
            samples += len(y)
            if (i + 1) % STEPS == 0:
                opt.step()
                opt.zero_grad(set_to_none=True)
                running.item()  # logged once per step, as fit records it
                running = torch.zeros(())
    return samples


def with_fit(model, loader, epochs: int, plan: autotune.Plan, limit: str | None = None) -> int:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    result = autotune.fit(model, loader, optimizer=opt, plan=plan, epochs=epochs, progress=False, drop_last=True, memory_limit=limit)
    return result.samples


LIMIT = "64MiB"  # far above what the step needs: the cost measured is the counting, not an OOM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    train, _ = digits()
    n = (len(train) // (MICRO * STEPS)) * MICRO * STEPS  # whole windows only, for both loops
    train = torch.utils.data.Subset(train, range(n))
    loader = DataLoader(train, batch_size=MICRO)
    base = cnn()
    plan = autotune.Plan(
        micro_batch=MICRO, accumulation_steps=STEPS, effective_batch=MICRO * STEPS, world_size=1,
        micro_batches=(MICRO,) * STEPS, lr=1e-3, base_lr=1e-3, lr_scale=1.0, lr_rule="none",
        base_batch=MICRO * STEPS, warmup_steps=None, bn_momentum=None, memory_limit=1, headroom=0.0,
        peak_memory=0, device="cpu", precision="fp32",
    )
    # Warm-up (allocator, thread pools, first-call costs): one short run of each, not counted.
    runners = {
        "classic": lambda model: classic(model, loader, args.epochs),
        "fit": lambda model: with_fit(model, loader, args.epochs, plan),
        "fit+limit": lambda model: with_fit(model, loader, args.epochs, plan, LIMIT),
    }
    classic(copy.deepcopy(base), loader, 1)
    with_fit(copy.deepcopy(base), loader, 1, plan)
    with_fit(copy.deepcopy(base), loader, 1, plan, LIMIT)
    ratios, limit_ratios = [], []
    names = list(runners)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; micro-batch {MICRO} x {STEPS} steps, {n} samples per epoch")
    print(f"{'run':>3} {'classic samples/s':>18} {'fit samples/s':>14} {'fit+limit':>10} {'fit/classic':>12} {'limit/fit':>10}")
    for run in range(args.runs):
        rates = {}
        order = names[run % 3:] + names[: run % 3]
        for name in order:
            model = copy.deepcopy(base)
            start = time.perf_counter()
            samples = runners[name](model)
            rates[name] = samples / (time.perf_counter() - start)
        ratios.append(rates["fit"] / rates["classic"])
        limit_ratios.append(rates["fit"] / rates["fit+limit"])
        print(f"{run:>3} {rates['classic']:>18.0f} {rates['fit']:>14.0f} {rates['fit+limit']:>10.0f} {ratios[-1]:>12.3f} {limit_ratios[-1]:>10.3f}")
    print(f"median fit/classic throughput: {statistics.median(ratios):.3f}")
    print(f"median time of fit with a CPU memory limit / without: {statistics.median(limit_ratios):.3f}")


if __name__ == "__main__":
    main()
