"""A batch that grows with the critical batch, against fixed batches, at an equal budget of samples.

Two tasks of different kinds, each trained three ways with the same optimizer (Adam, square-root LR
rule from the small batch) on the same number of samples, over several seeds:

- ``small``: a fixed small batch (many optimizer steps);
- ``large``: a fixed large batch, the ramp's maximum (few steps);
- ``ramp``: ``autotune.BatchRamp.adaptive(small, large)``, raised x2 when the measured noise scale's
  lower end is at least twice the batch (the default margin) for 10 measured windows in a row;
- ``ramp-4``: the same with ``margin=4`` (the batch stays further below the noise scale: more steps,
  fewer samples wasted per step).

Tasks: ``digits``, an MLP on the 8x8 digits that ship with scikit-learn; ``lm``, a 2-layer causal
transformer language model on a synthetic corpus (sequences that count in steps of 1 to 3, 10% noise).
Prints, per task and run, the final training loss, the held-out loss, the optimizer steps and the wall
time, as mean and spread (min to max) over the seeds, and the ramp's stages.

    python benchmarks/batch_ramp.py                  # both tasks, 3 seeds (a few minutes on 2 cores)
    python benchmarks/batch_ramp.py --tasks digits --seeds 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autotune


@dataclass
class Task:
    name: str
    train: TensorDataset
    test: TensorDataset
    make: Any
    loss_fn: Any
    small: int
    large: int
    epochs: int
    lr: float


def digits() -> Task:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(x), generator=g)
    x, y = x[order], y[order]

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]), batch[1])

    return Task("digits (MLP classifier)", TensorDataset(x[:1500], y[:1500]), TensorDataset(x[1500:], y[1500:]), make, loss_fn,
                small=16, large=256, epochs=12, lr=1e-3)


VOCAB, LENGTH = 32, 24


def corpus(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    step = torch.randint(1, 4, (n, 1), generator=g)
    seq = (start + step * torch.arange(LENGTH)) % VOCAB
    noise = torch.rand(n, LENGTH, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, VOCAB, (n, LENGTH), generator=g), seq)


class TinyLM(nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.position = nn.Parameter(torch.randn(LENGTH, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(LENGTH - 1), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.blocks(h, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True))


def lm() -> Task:
    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        tokens = batch[0]
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    train, test = corpus(6000, 1), corpus(1000, 2)
    return Task("lm (2-layer transformer)", TensorDataset(train), TensorDataset(test), TinyLM, loss_fn,
                small=16, large=256, epochs=4, lr=1e-3)


def evaluate(model: nn.Module, data: TensorDataset, loss_fn: Any) -> float:
    model.eval()
    with torch.no_grad():
        total = sum(float(loss_fn(model, b)) * len(b[0]) for b in DataLoader(data, batch_size=512))
    model.train()
    return total / len(data)


def run(task: Task, how: str, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = task.make()
    optimizer = torch.optim.Adam(model.parameters(), lr=task.lr)
    loader = DataLoader(task.train, batch_size=task.small, shuffle=True, generator=torch.Generator().manual_seed(seed))
    target: Any = {"small": task.small, "large": task.large}.get(how) or autotune.BatchRamp.adaptive(
        task.small, task.large, margin=4.0 if how == "ramp-4" else 2.0)
    start = time.perf_counter()
    result = autotune.fit(model, loader, target, optimizer=optimizer, loss_fn=task.loss_fn, epochs=task.epochs, lr_rule="sqrt",
                          base_batch=task.small, memory_limit="4GiB", progress=False)
    seconds = time.perf_counter() - start
    stages = [(c.seen, c.target) for c in result.ramp_changes]
    return {"train": evaluate(model, task.train, task.loss_fn), "test": evaluate(model, task.test, task.loss_fn),
            "steps": len(result.history), "seconds": seconds, "samples": result.samples, "stages": stages}


def spread(values: list[float], digits: int = 3) -> str:
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["digits", "lm"], choices=["digits", "lm"])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print("| task | run | final training loss | held-out loss | optimizer steps | wall time (s) |")
    print("|---|---|---|---|---|---|")
    notes = []
    for name in args.tasks:
        task = {"digits": digits, "lm": lm}[name]()
        rows = {how: [run(task, how, seed) for seed in range(args.seeds)] for how in ("small", "large", "ramp", "ramp-4")}
        for how, runs in rows.items():
            label = {"small": f"fixed {task.small}", "large": f"fixed {task.large}", "ramp": f"ramp {task.small} -> {task.large}",
                     "ramp-4": f"ramp {task.small} -> {task.large}, margin 4"}[how]
            print(f"| {task.name} | {label} | {spread([r['train'] for r in runs])} | {spread([r['test'] for r in runs])} | "
                  f"{spread([r['steps'] for r in runs], 0)} | {spread([r['seconds'] for r in runs], 1)} |")
        small_steps = statistics.fmean(r["steps"] for r in rows["small"])
        for how in ("ramp", "ramp-4"):
            steps = statistics.fmean(r["steps"] for r in rows[how])
            notes.append(f"{task.name}, {how}: {sum(r['samples'] for r in rows['small']) // args.seeds:,} samples a run, "
                         f"{1 - steps / small_steps:.0%} fewer optimizer steps than the fixed small batch; stages "
                         f"(samples seen, new target) per seed: " + "; ".join(str(r["stages"]) for r in rows[how]))
    print()
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
