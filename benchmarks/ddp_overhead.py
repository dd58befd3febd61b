"""Data-parallel throughput of ``autotune.fit`` against a hand-written DDP loop with ``no_sync``.

Two CPU processes (gloo), an MLP, micro-batches of 32 samples per rank, ``k`` micro-batches per
optimizer step. The hand-written loop runs DDP's forward under ``no_sync()`` for the first ``k - 1``
micro-batches and syncs on the last (DDP overlaps that all-reduce with the backward); ``fit`` runs
the same micro-batches on the inner module, then one agreement and one gradient sync per step.
Runs are interleaved (alternating which goes first), the same data and steps for both; printed:
collectives per optimizer step made by ``fit`` (``torch.distributed`` calls counted) and the median
throughput ratio fit / hand-written for each width and ``k``.

    python benchmarks/ddp_overhead.py               # a few minutes on 2 CPU cores
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


def mlp(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def data(rank: int, k: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(MICRO, 256, generator=g), torch.randint(0, 10, (MICRO,), generator=g)) for _ in range(k * steps)]


def hand_written(ddp: nn.Module, opt: torch.optim.Optimizer, batches: list, k: int) -> None:
    for start in range(0, len(batches), k):
        for i, (x, y) in enumerate(batches[start : start + k]):
            with ddp.no_sync() if i < k - 1 else contextlib.nullcontext():
                (F.cross_entropy(ddp(x), y) / k).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def with_fit(ddp: nn.Module, opt: torch.optim.Optimizer, batches: list, k: int, plan) -> None:
    import autotune

    autotune.fit(ddp, batches, plan=plan, optimizer=opt, progress=False)


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    import autotune
    from autotune.plans import Plan

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
                "hand": lambda ddp, opt: hand_written(ddp, opt, batches, k),
                "fit": lambda ddp, opt: with_fit(ddp, opt, batches, k, plan),
            }
            # collectives per optimizer step made by fit (counted once, outside the timed runs)
            calls: list[str] = []
            originals = {name: getattr(dist, name) for name in ("all_reduce", "broadcast", "all_gather_object", "barrier")}
            for name, fn in originals.items():
                setattr(dist, name, lambda *a, _fn=fn, _name=name, **kw: (calls.append(_name), _fn(*a, **kw))[1])
            ddp = DistributedDataParallel(mlp(width))
            with_fit(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3), batches, k, plan)
            for name, fn in originals.items():
                setattr(dist, name, fn)
            per_step = (calls.count("all_reduce") - 1) / args.steps  # less the exchange that ends the epoch
            ratios = []
            for run in range(args.runs + 1):  # the first run of each is a warm-up, not counted
                seconds = {}
                order = ("hand", "fit") if run % 2 == 0 else ("fit", "hand")
                for name in order:
                    ddp = DistributedDataParallel(mlp(width))
                    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
                    dist.barrier()
                    start = time.perf_counter()
                    runners[name](ddp, opt)
                    dist.barrier()
                    seconds[name] = time.perf_counter() - start
                if run:
                    ratios.append(seconds["hand"] / seconds["fit"])  # throughput ratio fit / hand-written
            lines.append(
                f"width {width:>5}  k={k:<2}  collectives per step {per_step:.0f} (all-reduce calls; other calls: "
                f"{len(calls) - calls.count('all_reduce')} once)  fit/hand-written throughput: median "
                f"{statistics.median(ratios):.3f} (runs {', '.join(f'{r:.2f}' for r in ratios)})"
            )
            if rank == 0:
                print(lines[-1], flush=True)
    if rank == 0:
        Path(out).write_text("\n".join(lines) + "\n")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
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
