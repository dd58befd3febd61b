"""Data-parallel throughput of ``autotune.fit`` against a hand-written DDP loop with ``no_sync``.

Two CPU processes (gloo), an MLP, micro-batches of 32 samples per rank, ``k`` micro-batches per
optimizer step. The hand-written loop runs DDP's forward under ``no_sync()`` for the first ``k - 1``
micro-batches and syncs on the last (DDP overlaps that all-reduce with the backward); ``fit`` runs
the same micro-batches on the inner module, then one agreement and one gradient sync per step.
Runs are interleaved (alternating which goes first), the same data and steps for both. Printed for
each width and ``k``:

- collectives per optimizer step made by ``fit`` (``torch.distributed`` calls counted over all the
  steps and over the first half: the difference per step), and those made once per ``fit`` call;
  for the first width, also with a BatchNorm1d layer (``bn="adjust"``: one more per step);
- the throughput ratio fit / hand-written **step by step**, the figure to read: in each run ``fit``'s
  callback runs one hand-written step (on a second copy of the model) after each of fit's steps,
  so the two alternate step by step; the time from one callback to the next, less the hand-written
  step, is fit's step. Median over the runs of (hand-written seconds / fit seconds), all steps but
  the first. Slow drifts of the machine (the two ranks and gloo's threads share the cores) fall on
  both alike, which run-by-run timings cannot promise;
- the same ratio over whole runs (call to return; separate runs, interleaved, alternating which goes
  first); over their steps alone (from the end of the first step to the end of the last: what a
  long run sees); and the fixed cost of a ``fit`` call beyond its steps (start-up checks, the
  exchange that finds the epoch over), which whole runs also pay.

    python benchmarks/ddp_overhead.py               # about 15 minutes on 2 CPU cores
    python benchmarks/ddp_overhead.py --runs 5 --steps 10
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

MICRO = 32


def mlp(width: int, *, batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    norm = [nn.BatchNorm1d(width)] if batchnorm else []
    return nn.Sequential(nn.Linear(256, width), *norm, nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def data(rank: int, k: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(MICRO, 256, generator=g), torch.randint(0, 10, (MICRO,), generator=g)) for _ in range(k * steps)]


def hand_step(ddp: nn.Module, opt: torch.optim.Optimizer, micro_batches: list, k: int) -> None:
    """One optimizer step of the hand-written loop: ``no_sync`` but on the last micro-batch."""
    for i, (x, y) in enumerate(micro_batches):
        with ddp.no_sync() if i < k - 1 else contextlib.nullcontext():
            (F.cross_entropy(ddp(x), y) / k).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def hand_written(ddp: nn.Module, opt: torch.optim.Optimizer, batches: list, k: int, stamps: list[float]) -> None:
    for start in range(0, len(batches), k):
        hand_step(ddp, opt, batches[start : start + k], k)
        stamps.append(time.perf_counter())  # the step is over


def with_fit(ddp: nn.Module, opt: torch.optim.Optimizer, batches: list, k: int, plan, stamps: list[float]) -> None:
    import autotune

    # fit's callback comes once the step is over
    autotune.fit(ddp, batches, plan=plan, optimizer=opt, progress=False, callback=lambda _: stamps.append(time.perf_counter()))


def paired(width: int, k: int, batches: list, plan) -> tuple[float, float]:
    """One ``fit`` run whose callback runs one hand-written step after each of fit's steps, so the two
    alternate step by step and any slowdown of the machine falls on both alike.

    Returns (hand-written seconds, fit seconds) over all steps but the first of each.
    """
    import autotune

    fit_ddp, hand_ddp = DistributedDataParallel(mlp(width)), DistributedDataParallel(mlp(width))
    fit_opt, hand_opt = torch.optim.AdamW(fit_ddp.parameters(), lr=1e-3), torch.optim.AdamW(hand_ddp.parameters(), lr=1e-3)
    starts = iter(range(0, len(batches), k))
    seconds = {"hand": 0.0, "fit": 0.0}
    last: list[float] = []

    def callback(_record) -> None:
        now = time.perf_counter()  # fit's step is over
        start = next(starts)
        hand_step(hand_ddp, hand_opt, batches[start : start + k], k)
        done = time.perf_counter()
        if last:  # the first step of each is not counted
            seconds["fit"] += now - last[0]
            seconds["hand"] += done - now
        last[:] = [done]

    dist.barrier()
    autotune.fit(fit_ddp, batches, plan=plan, optimizer=fit_opt, progress=False, callback=callback)
    return seconds["hand"], seconds["fit"]


def count_collectives(make_model, batches: list, k: int, plan, steps: int) -> tuple[float, float]:
    """Collectives made by ``fit`` (counted outside the timed runs) over all the steps and over the
    first half: their difference over the steps between is the count per optimizer step; what is
    left over is made once per call (start-up checks, the exchange that ends the epoch).

    Returns (per optimizer step, per fit call).
    """
    counted = {}
    originals = {name: getattr(dist, name) for name in ("all_reduce", "broadcast", "all_gather_object", "barrier")}
    for n in (steps // 2, steps):
        calls: list[str] = []
        for name, fn in originals.items():
            setattr(dist, name, lambda *a, _fn=fn, _name=name, **kw: (calls.append(_name), _fn(*a, **kw))[1])
        try:
            ddp = DistributedDataParallel(make_model())
            with_fit(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3), batches[: k * n], k, plan, [])
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
        counted[n] = len(calls)
    per_step = (counted[steps] - counted[steps // 2]) / (steps - steps // 2)
    return per_step, counted[steps] - per_step * steps


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    from autotune.planning.plans import Plan

    lines = []
    for width in args.widths:
        for k in args.ks:
            batches = data(rank, k, args.steps)
            plan = Plan(
                micro_batch=MICRO, accumulation_steps=k, effective_batch=MICRO * k * world, world_size=world,
                micro_batches=(MICRO,) * k, lr=1e-3, base_lr=1e-3, lr_scale=1.0, lr_rule="none",
                base_batch=MICRO * k * world, warmup_steps=None, bn_momentum=None, memory_limit=2**40,
                headroom=0.0, peak_memory=0, device="cpu", precision="fp32", rank_micro_batches=(MICRO,) * world,
            )
            runners = {
                "hand": lambda ddp, opt, stamps: hand_written(ddp, opt, batches, k, stamps),
                "fit": lambda ddp, opt, stamps: with_fit(ddp, opt, batches, k, plan, stamps),
            }
            per_step, once = count_collectives(lambda: mlp(width), batches, k, plan, args.steps)
            if width == args.widths[0]:
                bn_step, bn_once = count_collectives(lambda: mlp(width, batchnorm=True), batches, k, plan, args.steps)
                if rank == 0:
                    print(f"with BatchNorm1d (bn='adjust'), k={k}: collectives per step {bn_step:g} (and {bn_once:g} per fit call)", flush=True)
            steady = []
            for run in range(args.runs + 1):  # the first run is a warm-up, not counted
                hand_s, fit_s = paired(width, k, batches, plan)
                if run:
                    steady.append(hand_s / fit_s)  # throughput ratio fit / hand-written, step by step
            whole, steps_only, fixed = [], [], []
            for run in range(args.runs + 1):  # the first run of each is a warm-up, not counted
                seconds, steps_s = {}, {}
                order = ("hand", "fit") if run % 2 == 0 else ("fit", "hand")
                for name in order:
                    ddp = DistributedDataParallel(mlp(width))
                    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
                    stamps: list[float] = []
                    dist.barrier()
                    start = time.perf_counter()
                    runners[name](ddp, opt, stamps)
                    dist.barrier()
                    seconds[name] = time.perf_counter() - start
                    # its steps alone: from the end of the first step to the end of the last
                    steps_s[name] = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
                if run:
                    whole.append(seconds["hand"] / seconds["fit"])
                    steps_only.append(steps_s["hand"] / steps_s["fit"])  # what a long run sees
                    # what a fit call costs beyond its steps (start-up checks, the epoch's last exchange)
                    fixed.append((seconds["fit"] - steps_s["fit"] * args.steps) - (seconds["hand"] - steps_s["hand"] * args.steps))
            lines.append(
                f"width {width:>5}  k={k:<2}  collectives per step {per_step:g} (and {once:g} per fit call)  "
                f"fit/hand-written throughput, step by step: median {statistics.median(steady):.3f} "
                f"(runs {', '.join(f'{r:.2f}' for r in steady)}); whole runs of {args.steps} steps: median "
                f"{statistics.median(whole):.3f}, their steps alone {statistics.median(steps_only):.3f}; "
                f"fixed cost per fit call {statistics.median(fixed) * 1e3:.1f} ms"
            )
            if rank == 0:
                print(lines[-1], flush=True)
    if rank == 0:
        Path(out).write_text("\n".join(lines) + "\n")
    dist.barrier()  # both ranks are done before either closes its connections
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--ks", type=int, nargs="+", default=[8, 1])
    parser.add_argument("--out", default=os.devnull)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"torch {torch.__version__}, 2 ranks (gloo, CPU), 1 thread each; micro-batch {MICRO}, {args.steps} steps per run, {args.runs} runs")
    torch.multiprocessing.spawn(worker, args=(2, port, args, args.out), nprocs=2, join=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
