"""A batch that grows, against the whole fixed-batch frontier, at an equal budget of samples.

For each task and learning-rate schedule (constant; cosine to zero; warmup-stable-decay: constant for
80% of the run, then linear to zero), every fixed batch of a sweep and
every ramp trains on the same samples, over several seeds (digits 5, lm 3). Every fixed batch runs at
several learning rates: the rule's (square root, from the first batch) times each of ``lr_times``. The
ramps run at the multiplier that was best for the first fixed batch (tuned at the small batch, as a user
would). Two frontiers, each the fixed batches' mean held-out loss against their optimizer steps, linear
in log steps between two batches and made non-increasing (the best loss a fixed batch reaches within
that many steps):

- **A**: every fixed batch at the ramps' multiplier (the same learning rates the ramp steps through);
- **B**: every fixed batch at its own best multiplier (a learning-rate sweep per batch).

For each ramp the table gives its mean held-out loss and steps, its loss **above each frontier at its
step count** (negative: below it), and the **steps of the fixed batch of equal loss** on it
(interpolated the same way), with the ramp's saving against them.

Tasks:

- ``digits``: an MLP on the 8x8 digits that ship with scikit-learn, Adam; its noise scale stays flat;
- ``lm``: a 2-layer causal transformer language model trained from scratch on a synthetic corpus, Adam;
  its noise scale grows many-fold over the run (``--curve`` measures it);
- ``digits-wide`` and ``digits-small``: the digits set up otherwise (other widths, batches and
  learning-rate grids), to check that a ramp stays out of the way where the noise scale stays flat.

This script compares at an equal budget of samples: where a ramp ends below every fixed batch, there
is no fixed batch of equal loss in it. ``benchmarks/ramp_saving.py`` measures the saving at equal loss,
with fixed batches trained until they reach the ramp's loss.

Ramps (``autotune.BatchRamp.adaptive(16, maximum, ...)``): the default, and the variants in ``RAMPS``,
each differing from it in one or two settings; and fixed stages chosen with hindsight (``STAGES``: when
to raise, fixed in advance at fractions of the run), which bound what a rule deciding when to raise could
reach with the same learning-rate coupling.

    python benchmarks/batch_ramp.py                          # both tasks (1,008 runs; with --meter both 1,320: 77 minutes on 2 cores)
    python benchmarks/batch_ramp.py --tasks digits --seeds 1 --ramps "default (margin 3, lr peak)"
    python benchmarks/batch_ramp.py --tasks lm --first-seed 3                # lm on three other seeds
    python benchmarks/batch_ramp.py --meter both --tasks lm --ramps "default (margin 3, lr peak)" "margin 2"   # also every window measured
    python benchmarks/batch_ramp.py --curve --tasks lm --schedules constant --times 4   # the noise scale over a run
    python benchmarks/batch_ramp.py --tasks digits digits-wide digits-small --schedules constant cosine \\
        --ramps "default (margin 3, lr peak)" --first-seed 6 --seeds 10 --records digits.jsonl   # seeds that chose nothing
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autotune
from autotune.train.ramp import SPLIT_EVERY


@dataclass
class Task:
    name: str
    train: TensorDataset
    test: TensorDataset
    make: Any
    loss_fn: Any
    fixed: tuple[int, ...]
    start: int
    maximum: int
    epochs: int
    optimizer: str
    lr: float
    rule: str
    lr_times: tuple[float, ...] = (2.0, 4.0, 8.0, 16.0)  # every fixed batch at its rule's learning rate times these
    seeds: int = 3


def xent(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def digits_data() -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's 8x8 digits, shuffled once: 1,500 training and 297 held-out images."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    return TensorDataset(x[:1500], y[:1500]), TensorDataset(x[1500:], y[1500:])


def mlp(*widths: int) -> Any:
    """A maker of an MLP with ReLUs between layers of these widths."""
    def make() -> nn.Module:
        layers: list[nn.Module] = []
        for a, b in zip(widths, widths[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers[:-1])
    return make


def digits() -> Task:
    """An MLP (64-128-10) on scikit-learn's 8x8 digits: 1,500 training and 297 held-out images, 12
    epochs, Adam at 1e-3 for batch 16, the square-root rule."""
    train, test = digits_data()
    return Task("digits", train, test, mlp(64, 128, 10), xent,
                fixed=(16, 24, 32, 48, 64, 96, 128, 256), start=16, maximum=256, epochs=12, optimizer="adam", lr=1e-3, rule="sqrt", seeds=5)


def digits_wide() -> Task:
    """The digits set up otherwise: a wider, deeper MLP (64-512-512-10), batches from 32 to 512, 16
    epochs, Adam at 3e-4 for batch 32 times 1, 2, 4 or 8."""
    train, test = digits_data()
    return Task("digits-wide", train, test, mlp(64, 512, 512, 10), xent, fixed=(32, 48, 64, 96, 128, 256, 512), start=32,
                maximum=512, epochs=16, optimizer="adam", lr=3e-4, rule="sqrt", lr_times=(1.0, 2.0, 4.0, 8.0), seeds=5)


def digits_small() -> Task:
    """The digits set up otherwise: a narrow MLP (64-32-10), batches from 8 to 128, 8 epochs, Adam at
    2e-3 for batch 8 times 0.5, 1, 2 or 4."""
    train, test = digits_data()
    return Task("digits-small", train, test, mlp(64, 32, 10), xent, fixed=(8, 12, 16, 24, 32, 64, 128), start=8,
                maximum=128, epochs=8, optimizer="adam", lr=2e-3, rule="sqrt", lr_times=(0.5, 1.0, 2.0, 4.0), seeds=5)


VOCAB, LENGTH = 32, 24


def corpus(n: int, seed: int) -> torch.Tensor:
    """Sequences of 24 tokens counting in steps of 1 to 3 modulo 32, each token replaced at random
    with probability 0.1."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    step = torch.randint(1, 4, (n, 1), generator=g)
    seq = (start + step * torch.arange(LENGTH)) % VOCAB
    noise = torch.rand(n, LENGTH, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, VOCAB, (n, LENGTH), generator=g), seq)


class TinyLM(nn.Module):
    """A 2-layer causal transformer (width 64, 4 heads)."""

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


def next_token(model: nn.Module, batch: Any) -> torch.Tensor:
    tokens = batch[0]
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def lm() -> Task:
    """A 2-layer causal transformer language model trained from scratch on :func:`corpus`: 6,000
    training and 1,000 held-out sequences, 4 epochs, Adam at 1e-3 for batch 16, the square-root rule."""
    return Task("lm", TensorDataset(corpus(6000, 1)), TensorDataset(corpus(1000, 2)), TinyLM, next_token,
                fixed=(16, 32, 64, 128, 256, 512), start=16, maximum=512, epochs=4, optimizer="adam", lr=1e-3, rule="sqrt")


TASKS = {"digits": digits, "digits-wide": digits_wide, "digits-small": digits_small, "lm": lm}


def make_optimizer(task: Task, model: nn.Module, times: float) -> torch.optim.Optimizer:
    """The task's optimizer at its learning rate times ``times``."""
    return (torch.optim.Adam if task.optimizer == "adam" else torch.optim.SGD)(model.parameters(), lr=task.lr * times)


def evaluate(model: nn.Module, data: TensorDataset, loss_fn: Any) -> float:
    model.eval()
    with torch.no_grad():
        total = sum(float(loss_fn(model, b)) * len(b[0]) for b in DataLoader(data, batch_size=2048))
    model.train()
    return total / len(data)


# ramp variants: name -> BatchRamp.adaptive's keyword arguments (the default: none)
DEFAULT = "default (margin 3, lr peak)"
RAMPS: dict[str, dict[str, Any]] = {
    DEFAULT: {},
    "margin 2": {"margin": 2.0},
    "margin 4": {"margin": 4.0},
    "lr follow": {"lr": "follow"},  # the rule at every raise, whatever the schedule (the default before)
    "lr hold": {"lr": "hold"},  # the first target's learning rate all run (Smith et al. 2018)
    "lr linear": {"lr": "linear"},  # the first target's learning rate times target / start
    "margin 2, lr linear": {"margin": 2.0, "lr": "linear"},
    "lr restore": {"lr": "restore"},  # the rule, plus what the schedule decayed, up to linear
}

# fixed stages chosen with hindsight (not by a measurement): name -> ((fraction of the run's samples, target), ...) and
# BatchRamp.fixed's keyword arguments; what any rule that decides when to raise could at best have picked among
STAGES: dict[str, tuple[tuple[tuple[float, int], ...], dict[str, Any]]] = {
    "stages x2 each quarter": (((0, 16), (0.25, 32), (0.5, 64), (0.75, 128)), {}),
    "stages x2 each quarter, lr follow": (((0, 16), (0.25, 32), (0.5, 64), (0.75, 128)), {"lr": "follow"}),
    "stages x2 each quarter, lr linear": (((0, 16), (0.25, 32), (0.5, 64), (0.75, 128)), {"lr": "linear"}),
    "stages 16, then 64 from half": (((0, 16), (0.5, 64)), {}),
    "stages early: 32 from 1/12, 64 from 1/4": (((0, 16), (1 / 12, 32), (0.25, 64)), {}),
}


SCHEDULES = ("constant", "cosine", "wsd")


def stable_then_decay(total: int, step: int) -> float:
    """The "wsd" schedule's factor: 1 for the first 80% of ``total`` steps, then linear to 0."""
    return min(1.0, max(0.0, (total - step) / (0.2 * total)))


def make_schedule(optimizer: torch.optim.Optimizer, schedule: str, total: int) -> Any:
    """The scheduler of ``schedule`` over ``total`` scheduler steps (None: a constant learning rate)."""
    if schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
    if schedule == "wsd":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(stable_then_decay, total))
    return None


EVERY = " [every window]"  # a ramp's name with this suffix: its meter sees every window (--meter)


def measure(every: bool) -> None:
    """How the ramp's meter measures in this run: one window in eight (as ``fit`` does in one process
    when the target fits in one micro-batch) or, with ``every``, every window (each cut in halves), as it
    does when the target takes several micro-batches, or under data parallelism."""
    from autotune.train import ramp

    ramp.SPLIT_EVERY = 1 if every else SPLIT_EVERY


def start(task_name: str, times: float, seed: int) -> tuple[Task, nn.Module, torch.optim.Optimizer, DataLoader]:
    """A run's beginning, on one thread: the task, its model made on ``seed``, its optimizer at the task's
    learning rate times ``times``, and a loader of its first batch's size shuffled by ``seed``."""
    torch.set_num_threads(1)
    task = TASKS[task_name]()
    torch.manual_seed(seed)
    model = task.make()
    loader = DataLoader(task.train, batch_size=task.start, shuffle=True, generator=torch.Generator().manual_seed(seed))
    return task, model, make_optimizer(task, model, times), loader


def run(job: tuple[str, str, str, float, int]) -> dict[str, Any]:
    """One training run: (task, schedule, what: 'fixed N' or a ramp's name, learning-rate multiplier, seed)."""
    task_name, schedule, what, times, seed = job
    measure(what.endswith(EVERY))
    what = what.removesuffix(EVERY)
    task, model, optimizer, loader = start(task_name, times, seed)
    if what.startswith("fixed "):
        target: Any = int(what.split()[1])
    elif what in STAGES:
        stages, options = STAGES[what]
        total = task.epochs * len(task.train)
        target = autotune.BatchRamp.fixed([(round(f * total), b) for f, b in stages], **options)
    else:
        target = autotune.BatchRamp.adaptive(task.start, task.maximum, **RAMPS[what])
    per_step = target if isinstance(target, int) else task.start  # a ramp steps its scheduler once per `start` samples
    scheduler = make_schedule(optimizer, schedule, math.ceil(task.epochs * len(task.train) / per_step))
    begin = time.perf_counter()
    try:
        result = autotune.fit(model, loader, target, optimizer=optimizer, loss_fn=task.loss_fn, epochs=task.epochs, lr_rule=task.rule,
                              base_batch=task.start, memory_limit="4GiB", scheduler=scheduler, progress=False)
    except autotune.AutotuneError:  # a non-finite loss: this learning rate diverges at this batch
        return {"job": job, "test": math.inf, "steps": math.inf, "samples": math.inf, "seconds": time.perf_counter() - begin, "stages": []}
    return {"job": job, "test": evaluate(model, task.test, task.loss_fn), "steps": len(result.history),
            "samples": sum(h.samples for h in result.history), "seconds": time.perf_counter() - begin,
            "stages": [(c.seen, c.target) for c in result.ramp_changes]}


def frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(log steps, loss) of the fixed batches, by steps, the loss made non-increasing."""
    out: list[tuple[float, float]] = []
    for steps, loss in sorted(points):
        out.append((math.log(steps), min(loss, out[-1][1]) if out else loss))
    return out


def loss_at(front: list[tuple[float, float]], steps: float) -> float | None:
    """The frontier's loss at ``steps`` (None outside the fixed batches' range)."""
    x = math.log(steps)
    for (x0, y0), (x1, y1) in zip(front, front[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else min(y0, y1)
    return None


def steps_for(front: list[tuple[float, float]], loss: float) -> float | None:
    """The fewest steps at which the frontier reaches ``loss`` (None: it never does; at most its first
    point's steps when every fixed batch reaches it)."""
    if front[0][1] <= loss:
        return math.exp(front[0][0])
    for (x0, y0), (x1, y1) in zip(front, front[1:]):
        if y1 <= loss < y0:
            return math.exp(x0 + (x1 - x0) * (y0 - loss) / (y0 - y1))
    return None


def mean(values: list[float]) -> float:
    return statistics.fmean(values)


def spread(values: list[float], digits: int = 3) -> str:
    return f"{mean(values):.{digits}f}" + (f" ({min(values):.{digits}f}-{max(values):.{digits}f})" if len(values) > 1 else "")


def versus(loss: float, steps: float, front: list[tuple[float, float]]) -> tuple[str, str]:
    """(loss above the frontier at ``steps``, the steps of the fixed batch of equal loss and the saving).
    When no fixed batch reached the ramp's loss within the samples every run had, there is no fixed batch
    of equal loss in the sweep, and no saving is printed (``benchmarks/ramp_saving.py`` trains the fixed
    batches until they reach it)."""
    at, equal = loss_at(front, steps), steps_for(front, loss)
    above = f"{loss - at:+.4f}" if at is not None else "outside the sweep"
    if equal is None:
        return above, f"below every fixed batch (the longest, {math.exp(front[-1][0]):.0f} steps): not measured here"
    return above, f"{equal:.0f}: {1 - steps / equal:.0%}"


def curve(name: str, schedule: str, times: float = 1.0, points: int = 8) -> list[str]:
    """The noise scale over a run at the task's first batch (its learning rate times ``times``): measured by
    ``autotune.noise_scale`` (40 windows of 4 micro-batches of that batch, at the current weights) at
    ``points`` evenly spaced moments, with the held-out loss."""
    task = TASKS[name]()
    torch.manual_seed(0)
    model = task.make()
    optimizer = make_optimizer(task, model, times)
    loader = DataLoader(task.train, batch_size=task.start, shuffle=True, generator=torch.Generator().manual_seed(0))
    probe = DataLoader(task.train, batch_size=task.start, shuffle=True, generator=torch.Generator().manual_seed(1))
    total = task.epochs * len(loader)
    scheduler = make_schedule(optimizer, schedule, total)
    due = {round(i * (total - 1) / (points - 1)) for i in range(points)}
    out, step = [], 0
    for _ in range(task.epochs):
        for batch in loader:
            if step in due:
                noise = autotune.noise_scale(model, probe, micro_batch=task.start, micro_batches=4, windows=40, loss_fn=task.loss_fn)
                out.append(f"step {step} ({step * task.start:,} samples): held-out {evaluate(model, task.test, task.loss_fn):.3f}, "
                           f"noise scale {noise}")
            optimizer.zero_grad()
            task.loss_fn(model, batch).backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            step += 1
    return out


def recorded(pool: Any, jobs: list[tuple[Any, ...]], path: str | None) -> list[dict[str, Any]]:
    """The results of ``jobs``: those in the file ``path`` taken from it, the others run (and appended to it)."""
    have: dict[tuple[Any, ...], dict[str, Any]] = {}
    if path and os.path.exists(path):
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                have[tuple(r["job"])] = {**r, "job": tuple(r["job"])}
    new = pool.map(run, [j for j in jobs if j not in have], chunksize=1)
    if path:
        with open(path, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in new)
    have.update({r["job"]: r for r in new})
    return [have[j] for j in jobs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["digits", "lm"], choices=list(TASKS))
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--ramps", nargs="+", default=[*RAMPS, *STAGES], choices=[*RAMPS, *STAGES])
    parser.add_argument("--seeds", type=int, default=None, help="default: each task's (digits 5, lm 3)")
    parser.add_argument("--first-seed", type=int, default=0, help="the seeds run are FIRST_SEED onwards (3: a second set "
                        "of seeds for lm, to check a choice made on the first)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--meter", default="eighth", choices=("eighth", "every", "both"), help="the ramps' meter sees one window "
                        "in eight (as here, the target fitting in one micro-batch), every window (as with several micro-batches per "
                        "target, or under data parallelism), or both (each ramp run both ways)")
    parser.add_argument("--records", metavar="FILE", help="append every run's result to FILE (a line of JSON each) and take "
                        "the runs already there from it, so that a measurement continues or grows by seeds")
    parser.add_argument("--curve", action="store_true", help="only measure the noise scale over a run at the first batch")
    parser.add_argument("--times", type=float, default=1.0, help="with --curve: the learning rate's multiplier")
    args = parser.parse_args()
    if args.curve:
        for name in args.tasks:
            for schedule in args.schedules:
                print(f"{name}, {schedule} learning rate x{args.times:g}, batch {TASKS[name]().start}:")
                for line in curve(name, schedule, args.times):
                    print(f"- {line}")
        return
    tasks = {name: TASKS[name]() for name in args.tasks}
    ramps = {"eighth": args.ramps, "every": [r + EVERY for r in args.ramps], "both": [*args.ramps, *(r + EVERY for r in args.ramps)]}[args.meter]
    seeds = {name: range(args.first_seed, args.first_seed + (args.seeds or task.seeds)) for name, task in tasks.items()}
    begin = time.perf_counter()
    by: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    with multiprocessing.get_context("spawn").Pool(args.processes) as pool:
        # first the fixed batches, each at several learning rates; then the ramps at the learning rate
        # that was best for the fixed batch they start from (tuned at the small batch, as a user would)
        jobs = [(name, schedule, f"fixed {b}", times, seed) for name, task in tasks.items() for schedule in args.schedules
                for b in task.fixed for times in task.lr_times for seed in seeds[name]]
        for r in recorded(pool, jobs, args.records):
            by.setdefault(r["job"][:4], []).append(r)
        best = {(name, schedule, b): min(task.lr_times, key=lambda t: mean([r["test"] for r in by[(name, schedule, f"fixed {b}", t)]]))
                for name, task in tasks.items() for schedule in args.schedules for b in task.fixed}
        ramp_jobs = [(name, schedule, what, best[(name, schedule, task.start)], seed) for name, task in tasks.items()
                     for schedule in args.schedules for what in ramps for seed in seeds[name]]
        for r in recorded(pool, ramp_jobs, args.records):
            by.setdefault(r["job"][:4], []).append(r)
    print(f"{len(jobs) + len(ramp_jobs)} runs in {time.perf_counter() - begin:.0f} s\n")
    print("Frontier A: every fixed batch at the learning rate the ramps use (the rule's, from the multiplier best for the first "
          "batch); frontier B: every fixed batch at its own best multiplier.\n")
    print("| task | LR | run | held-out loss | optimizer steps | above frontier A | fixed batch of equal loss on A: steps, ramp's saving "
          "| above frontier B | on B: steps, saving |")
    print("|---|---|---|---|---|---|---|---|---|")
    stages = []
    for name, task in tasks.items():
        for schedule in args.schedules:
            times = best[(name, schedule, task.start)]
            fronts = []
            for pick in (lambda b: times, lambda b: best[(name, schedule, b)]):
                rows = [by[(name, schedule, f"fixed {b}", pick(b))] for b in task.fixed]
                fronts.append(frontier([(mean([r["steps"] for r in rs]), mean([r["test"] for r in rs])) for rs in rows]))
            for b in task.fixed:
                a_runs, b_runs = by[(name, schedule, f"fixed {b}", times)], by[(name, schedule, f"fixed {b}", best[(name, schedule, b)])]
                print(f"| {name} | {schedule} | fixed {b} | A (x{times:g}): {spread([r['test'] for r in a_runs])}; B (x{best[(name, schedule, b)]:g}): "
                      f"{spread([r['test'] for r in b_runs])} | {spread([r['steps'] for r in a_runs], 0)} | | | | |")
            for what in ramps:
                rs = by[(name, schedule, what, times)]
                loss, steps = mean([r["test"] for r in rs]), mean([r["steps"] for r in rs])
                (above_a, need_a), (above_b, need_b) = versus(loss, steps, fronts[0]), versus(loss, steps, fronts[1])
                print(f"| {name} | {schedule} | {what} (x{times:g}) | {spread([r['test'] for r in rs])} | {spread([r['steps'] for r in rs], 0)} | "
                      f"{above_a} | {need_a} | {above_b} | {need_b} |")
                stages.append(f"{name}, {schedule}, {what}: " + "; ".join(str(r["stages"]) for r in rs))
    print()
    print("Stages (samples seen, new target), per seed:")
    for line in stages:
        print(f"- {line}")


if __name__ == "__main__":
    main()
