"""The cost of FSDP2's out-of-memory agreement (:mod:`autotune.parallel.lockstep`) in ``autotune.fit``.

Two CPU processes (gloo), an MLP of four blocks sharded with ``fully_shard`` (each block, then the
model), fixed-shape data, a memory limit that gives several micro-batches per rank. Three ways to run the same
``fit``, interleaved run by run (the order rotating), on the same data:

- **without**: no agreement ever (the code before it: an out-of-memory error stops every rank);
- **new shapes** (what ``fit`` does): the agreement on windows of shapes not yet run: here the first
  window of each ``fit`` call; every later window is of a shape already run;
- **every window**: the agreement on every window, for what one guarded window costs.

Printed: the median step time over the steps of shapes already run (all but each run's first), and
its ratio to **without** (the goal: within 3%); and the median time of a guarded step, and the
agreements (all-reduces) one guarded micro-batch adds.

    python benchmarks/fsdp_lockstep.py               # about 3 minutes on 2 CPU cores
    python benchmarks/fsdp_lockstep.py --runs 3 --steps 10
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

MODES = ("without", "new shapes", "every window")


def model(width: int) -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(4)]
    return nn.Sequential(nn.Linear(64, width), *blocks, nn.Linear(width, 10))


def data(rank: int, samples: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 64, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(samples // 8)]


def worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    from torch.distributed.fsdp import fully_shard

    import autotune
    from autotune.parallel import lockstep
    from autotune.train import run as run_module

    net = model(args.width)
    for block in net:
        fully_shard(block)
    fully_shard(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    loader = data(rank, args.target // 2 * args.steps)
    loss_fn = lambda m, b: F.cross_entropy(m(b[0]), b[1])  # noqa: E731
    plan = autotune.plan(net, loader, target_batch=args.target, optimizer=opt, loss_fn=loss_fn, memory_limit=args.limit,
                         headroom=0, lr_rule="none", progress=False)
    first_of_shape, recoverable = run_module.Run.first_of_shape, lockstep.recoverable
    agreements = [0]
    agree = lockstep._Guard.agree

    def counted(self: lockstep._Guard) -> None:
        agreements[0] += 1
        agree(self)

    lockstep._Guard.agree = counted  # type: ignore[method-assign]
    times: dict[str, list[float]] = {m: [] for m in MODES}
    guarded: list[float] = []
    micro_batches = 0
    for r in range(args.runs):
        for mode in MODES[r % 3:] + MODES[: r % 3]:
            lockstep.recoverable = (lambda m: False) if mode == "without" else recoverable  # type: ignore[assignment]
            run_module.Run.first_of_shape = (lambda self, w: True) if mode == "every window" else first_of_shape  # type: ignore[method-assign]
            before = agreements[0]
            result = autotune.fit(net, loader, plan=plan, optimizer=opt, loss_fn=loss_fn, lr_rule="none", progress=False)
            seconds = [s.seconds for s in result.history]
            times[mode] += seconds[1:]
            if mode == "every window":
                guarded += seconds
                micro_batches += sum(len(s.micro_batches) for s in result.history)
                per_micro = (agreements[0] - before) / sum(len(s.micro_batches) for s in result.history)
    if rank == 0:
        base = statistics.median(times["without"])
        lines = [f"plan: micro_batch={plan.micro_batch} x {plan.accumulation_steps} per rank, target {plan.effective_batch}, "
                 f"{args.steps} steps x {args.runs} runs per mode, width {args.width}",
                 "| mode | median step (ms), shapes already run | ratio to without |", "|---|---|---|"]
        for mode in MODES:
            med = statistics.median(times[mode])
            lines.append(f"| {mode} | {med * 1e3:.2f} | {med / base:.3f} |")
        lines.append(f"guarded step: median {statistics.median(guarded) * 1e3:.2f} ms "
                     f"({statistics.median(guarded) / base:.2f} x an unguarded one); {per_micro:.0f} agreements per micro-batch")
        Path(out).write_text("\n".join(lines) + "\n")
    dist.barrier()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--target", type=int, default=512)
    parser.add_argument("--limit", default="3900KiB", help="per rank: small enough for several micro-batches")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"fsdp_lockstep_{os.getpid()}.txt"
    torch.multiprocessing.spawn(worker, args=(port, args, str(out)), nprocs=2)
    print(out.read_text(), end="")
    out.unlink()


if __name__ == "__main__":
    sys.exit(main())
