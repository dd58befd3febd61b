"""The batch ramp's saving in optimizer steps at equal held-out loss, on seeds that chose nothing, against fixed
batches trained until they reach the ramp's loss.

The task is ``benchmarks/batch_ramp.py``'s language model (a 2-layer causal transformer trained from scratch on
a synthetic corpus, Adam, the square-root rule from batch 16; its noise scale grows 35-78x over a run). The
default ramp's settings (margin 3, ``lr="peak"``) and its learning-rate multipliers (x4 with a constant rate, x8
with the cosine: those fixed batch 16 did best with) were chosen on seeds 0-5 of that script; this one reports
seeds 6-10 (``HELD_OUT``), which chose nothing. For each seed and schedule:

1. **The ramp**: ``BatchRamp.adaptive(16, 512)`` trains the task's 24,000 samples (4 epochs) as ``fit`` runs it;
   its held-out loss ``L`` and its optimizer steps ``R``.
2. **Every fixed batch** of ``BATCHES``, at each multiplier of a sweep around the ramp's (``TIMES``; learning
   rates above ``MAX_LR`` left out), trains on the same seed (initial weights and data order) until it reaches
   ``L``, at most ``CAP_STEPS x R`` optimizer steps and ``CAP_SAMPLES`` samples:

   - **constant**: the fixed batch gets the late decay the ramp's raises give its ``lr / B`` under the square-root
     rule: its learning rate times ``sqrt(16 / the ramp's target after as many samples)`` (that seed's ramp). Its
     held-out loss is measured every ``max(16 steps, 1,024 samples)``; the steps at ``L`` are read from that
     curve where it first reaches ``L`` (linear between two measurements);
   - **cosine**: the cosine to zero needs the run's length in advance, so each fixed batch is a **sweep of
     horizons**: runs with a cosine over ``H = R x 2^(k/2)`` steps (``k = -4 ... 2``: ``0.25 R`` to ``2 R``),
     shortest first, until one ends at or below ``L``; the steps at ``L`` are interpolated in log ``H`` between
     the last horizon that ended above ``L`` and the first that reached it.

3. **The saving**: ``1 - R / S``, ``S`` the fewest steps at which any fixed batch (any multiplier) reached ``L``,
   per seed; then the mean and the range over the seeds. Within a seed the batches run largest first, and a run
   stops once it has taken more steps than the best so far (it cannot be the fewest any more): such a batch shows
   as "not within" that many steps. A seed where no fixed batch reached ``L`` within the caps gets no saving (its
   line says so); none is printed as a bound.

Every run appends a line of JSON to ``--out``; a run already there (the same settings) is not run again, so an
interrupted measurement continues; ``--report`` prints the tables from such a file alone.

    python benchmarks/ramp_saving.py                 # 5 seeds x 2 schedules (345 runs, about 75 minutes on 2 cores)
    python benchmarks/ramp_saving.py --report ramp_saving.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import autotune  # noqa: E402
from batch_ramp import DEFAULT, evaluate, run, start  # noqa: E402

HELD_OUT = (6, 7, 8, 9, 10)
SCHEDULES = ("constant", "cosine")
RAMP_TIMES = {"constant": 4.0, "cosine": 8.0}  # chosen on seeds 0-2 (batch_ramp.py: fixed 16's best)
TIMES = {"constant": (4.0, 2.0, 8.0), "cosine": (8.0, 4.0, 16.0)}  # the ramp's multiplier first
BATCHES = (512, 256, 128, 64, 32, 16)  # largest first
MAX_LR = 0.03  # 1e-3 x multiplier x sqrt(B / 16) above this left out (batch_ramp.py: 256 and 512 at cosine x8 ended at 1.21, 2.89)
CAP_STEPS = 2.0  # x the ramp's steps
CAP_SAMPLES = 144_000  # 6x the ramp's samples (36 epochs)
HORIZONS = tuple(2 ** (k / 2) for k in range(-4, 3))  # x the ramp's steps
EVAL_SAMPLES, EVAL_STEPS = 1024, 16


class Reached(Exception):
    """Raised from ``fit``'s callback once a run's held-out loss has reached the ramp's."""


def ramp_run(schedule: str, seed: int) -> dict[str, Any]:
    """The default ramp on ``seed`` (``batch_ramp.run``): held-out loss, steps, samples and stages."""
    r = run(("lm", schedule, DEFAULT, RAMP_TIMES[schedule], seed))
    return {"kind": "ramp", "schedule": schedule, "seed": seed, "times": RAMP_TIMES[schedule], "loss": r["test"], "steps": r["steps"],
            "samples": r["samples"], "stages": r["stages"], "seconds": r["seconds"]}


def target_at(stages: list[tuple[int, int]], seen: int, start: int) -> int:
    """The ramp's target after ``seen`` samples."""
    target = start
    for at, new in stages:
        if seen >= at:
            target = new
    return target


def fixed_run(schedule: str, seed: int, batch: int, times: float, ramp: dict[str, Any], max_steps: int, horizon: int | None) -> dict[str, Any]:
    """One fixed batch on ``seed``: with ``horizon`` a cosine over that many steps, run whole (its held-out loss at
    the end); else the constant rate with the ramp's decay of ``lr / B``, until its held-out loss reaches the
    ramp's or ``max_steps`` (its curve)."""
    task, model, optimizer, loader = start("lm", times, seed)
    n = len(task.train)
    per_epoch = math.ceil(n / batch)
    steps = horizon or max_steps

    def seen(step: int) -> int:
        return step // per_epoch * n + min(step % per_epoch * batch, n)

    if horizon is not None:
        scheduler: Any = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=horizon)
    else:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: math.sqrt(task.start / target_at(ramp["stages"], seen(k), task.start)))
    curve: list[tuple[int, float]] = []
    every = max(EVAL_STEPS, math.ceil(EVAL_SAMPLES / batch))

    def measure(record: Any) -> None:  # the constant rate's curve, until it reaches the ramp's loss
        if record.step % every == 0:
            curve.append((record.step, evaluate(model, task.test, task.loss_fn)))
            if curve[-1][1] <= ramp["loss"]:
                raise Reached

    begin = time.perf_counter()
    try:
        autotune.fit(model, loader, batch, optimizer=optimizer, loss_fn=task.loss_fn, epochs=math.ceil(steps / per_epoch), max_steps=steps,
                     lr_rule=task.rule, base_batch=task.start, memory_limit="4GiB", scheduler=scheduler, progress=False,
                     callback=measure if horizon is None else None)
    except Reached:
        pass
    except autotune.AutotuneError:  # a non-finite loss: this learning rate diverges at this batch
        curve.append((0, math.inf))
    if horizon is not None and not curve:
        curve.append((horizon, evaluate(model, task.test, task.loss_fn)))
    return {"kind": "fixed", "schedule": schedule, "seed": seed, "batch": batch, "times": times, "horizon": horizon, "max_steps": max_steps,
            "curve": curve, "seconds": time.perf_counter() - begin}


def crossing(points: list[tuple[int, float]], loss: float, log: bool = False) -> float | None:
    """Where ``(x, held-out loss)`` points first reach ``loss``, linear in ``x`` (``log``: in log ``x``) between
    the last point above it and the first at or below (None: never). A constant rate's curve gives the steps;
    a cosine's horizons with their final losses give the horizon."""
    to, back = (math.log, math.exp) if log else (float, float)
    for i, (x, value) in enumerate(points):
        if value <= loss:
            if i == 0:
                return float(x)
            x0, v0 = points[i - 1]
            return back(to(x0) + (to(x) - to(x0)) * (v0 - loss) / (v0 - value))
    return None


def chain(job: tuple[str, int, dict[str, Any], str, dict[tuple[Any, ...], dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every fixed batch and multiplier of one seed and schedule, largest batch first. A run goes on until it
    reaches the ramp's loss, at most as many steps as the ramp's or the fewest any run needed so far, whichever
    is more (enough to tell the fewest steps and, among the runs within the ramp's steps, the fewest samples),
    within the caps. Runs already in ``done`` (the same settings) are taken from there."""
    schedule, seed, ramp, out, done = job
    best = CAP_STEPS * ramp["steps"]
    records = []

    def run_once(batch: int, times: float, steps: int, horizon: int | None) -> dict[str, Any]:
        key = (schedule, seed, batch, times, horizon, steps)
        if key in done:
            return done[key]
        r = fixed_run(schedule, seed, batch, times, ramp, steps, horizon)
        with open(out, "a") as f:
            f.write(json.dumps(r) + "\n")
        return r

    for batch in BATCHES:
        for times in TIMES[schedule]:
            if 1e-3 * times * math.sqrt(batch / 16) > MAX_LR:
                continue
            cap = min(max(best, ramp["steps"]), CAP_STEPS * ramp["steps"], CAP_SAMPLES / batch)
            if schedule == "constant":
                runs = [run_once(batch, times, math.ceil(cap), None)]
                reached = crossing(runs[0]["curve"], ramp["loss"])
            else:
                runs, ends, reached = [], [], None
                for h in (round(f * ramp["steps"]) for f in HORIZONS):
                    if (ends and ends[-1][0] >= cap) or h * batch > CAP_SAMPLES:
                        break
                    runs.append(run_once(batch, times, h, h))
                    ends.append((h, runs[-1]["curve"][-1][1]))
                    reached = crossing(ends, ramp["loss"], log=True)
                    if reached is not None:
                        break
            records += runs
            if reached is not None and reached < best:
                best = reached
    return records


def load(path: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def reach(runs: list[dict[str, Any]], loss: float) -> tuple[float | None, float]:
    """(the steps at which a fixed batch at one multiplier reached ``loss``, or None; the most steps it was run):
    the first crossing of its curve (constant), or of its horizons' final losses (cosine)."""
    tried = max(r["horizon"] or r["max_steps"] for r in runs)
    if runs[0]["horizon"] is None:
        found = [s for s in (crossing(r["curve"], loss) for r in runs) if s is not None]
        return (min(found) if found else None), tried
    return crossing(sorted((r["horizon"], r["curve"][-1][1]) for r in runs), loss, log=True), tried


def report(records: list[dict[str, Any]]) -> None:
    """The tables: per schedule and seed, the ramp against the fixed batch of equal loss with the fewest steps
    (whatever its samples) and the one with the fewest samples among those within the ramp's steps; per fixed
    batch the steps at which it reached the ramp's loss."""
    ramps = {(r["schedule"], r["seed"]): r for r in records if r["kind"] == "ramp"}
    for schedule in SCHEDULES:
        seeds = sorted(s for (sch, s) in ramps if sch == schedule)
        if not seeds:
            continue
        print(f"\n{schedule} (the ramp at x{RAMP_TIMES[schedule]:g}):\n")
        print("| seed | ramp: held-out loss, steps (raises: samples seen: new target) | fixed batch of equal loss with the fewest steps: "
              "batch, multiplier, steps, samples | ramp's steps saved | within the ramp's steps, the fewest samples: batch, steps, "
              "samples | ramp's samples saved |")
        print("|---|---|---|---|---|---|")
        step_savings, sample_savings = [], []
        per_batch: dict[int, list[str]] = {}
        for seed in seeds:
            ramp = ramps[(schedule, seed)]
            groups: dict[tuple[int, float], list[dict[str, Any]]] = {}
            for r in records:
                if r["kind"] == "fixed" and r["schedule"] == schedule and r["seed"] == seed:
                    groups.setdefault((r["batch"], r["times"]), []).append(r)
            found = {key: reach(runs, ramp["loss"]) for key, runs in groups.items()}  # (batch, multiplier) -> (steps at L, tried)
            reachers = sorted((s, b * s, b, t) for (b, t), (s, _) in found.items() if s is not None)
            for b in BATCHES:
                mine = [(s, t, tried) for (bb, t), (s, tried) in found.items() if bb == b]
                got = [(s, t) for s, t, _ in mine if s is not None]
                per_batch.setdefault(b, []).append(
                    f"{min(got)[0]:.0f} (x{min(got)[1]:g})" if got else f"> {max(tried for *_, tried in mine):.0f}" if mine else "left out")
            stages = ", ".join(f"{seen}: {target}" for seen, target in ramp["stages"]) or "none"
            row = f"| {seed} | {ramp['loss']:.4f}, {ramp['steps']} ({stages}) | "
            if not reachers:
                print(row + "none reached it within the caps | not measured | | |")
                continue
            s, n, b, t = reachers[0]
            step_savings.append(1 - ramp["steps"] / s)
            row += f"{b}, x{t:g}, {s:.0f}, {n:,.0f} | {step_savings[-1]:+.0%} ({ramp['steps'] / s:.2f}x the steps) | "
            within = sorted((n, s, b) for s, n, b, _ in reachers if s <= ramp["steps"])
            if within:
                n, s, b = within[0]
                sample_savings.append(1 - ramp["samples"] / n)
                row += f"{b}, {s:.0f}, {n:,.0f} | {sample_savings[-1]:+.0%} ({ramp['samples'] / n:.2f}x the samples) |"
            else:
                row += "none within its steps | not measured |"
            print(row)
        for name, values in (("steps saved (against the fewest steps)", step_savings), ("samples saved (within the ramp's steps)", sample_savings)):
            if values:
                print(f"\n{name}: {len(values)} of {len(seeds)} seeds, mean {statistics.fmean(values):+.1%}, range "
                      f"{min(values):+.1%} to {max(values):+.1%}; positive on {sum(v > 0 for v in values)}")
        print(f"\nthe steps at which each fixed batch reached that seed's ramp loss (its best multiplier; '> N': not within the N steps "
              f"it ran), seeds {', '.join(map(str, seeds))}:\n")
        print("| batch | " + " | ".join(f"seed {s}" for s in seeds) + " |")
        print("|---|" + "---|" * len(seeds))
        for b in BATCHES:
            print(f"| {b} | " + " | ".join(per_batch.get(b, [])) + " |")
    seconds = sum(r["seconds"] for r in records)
    print(f"\n{len(records)} runs, {seconds / 60:.0f} minutes of one core")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(HELD_OUT))
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--out", default="ramp_saving.jsonl", help="every run's record, a line of JSON each (appended)")
    parser.add_argument("--report", metavar="FILE", help="only print the tables of the records in FILE")
    args = parser.parse_args()
    if args.report:
        report(load(args.report))
        return
    begin = time.perf_counter()
    before = load(args.out) if Path(args.out).exists() else []
    done = {(r["schedule"], r["seed"], r["batch"], r["times"], r["horizon"], r["max_steps"]): r for r in before if r["kind"] == "fixed"}
    had = {(r["schedule"], r["seed"]): r for r in before if r["kind"] == "ramp"}
    with multiprocessing.get_context("spawn").Pool(args.processes) as pool:
        wanted = [(schedule, seed) for schedule in args.schedules for seed in args.seeds]
        new = pool.starmap(ramp_run, [w for w in wanted if w not in had], chunksize=1)
        with open(args.out, "a") as f:
            for r in new:
                f.write(json.dumps(r) + "\n")
        ramps = [had.get(w) or next(r for r in new if (r["schedule"], r["seed"]) == w) for w in wanted]
        chains = [(r["schedule"], r["seed"], r, args.out, done) for r in ramps]
        records = [r for rs in pool.imap_unordered(chain, chains) for r in rs]
    print(f"{len(ramps) + len(records)} runs in {time.perf_counter() - begin:.0f} s")
    report(ramps + records)


if __name__ == "__main__":
    main()
