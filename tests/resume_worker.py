"""One run of ``fit`` with a checkpoint, for tests/test_resume.py: in one process, or one rank under
torchrun (DDP, gloo). ``--kill K`` kills this process (SIGKILL, rank 1 under torchrun) right after
optimizer step K; run again with the same checkpoint, it resumes.

    python tests/resume_worker.py OUT --case plain --limit 20KiB [--kill 7] [--dropout 0.2]
    torchrun --standalone --nproc_per_node=2 tests/resume_worker.py OUT --case plain ...

The run's final parameters and its history are saved to OUT/result-rank<r>.pt.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import autotune

CASES = ("plain", "fixed", "adaptive")


def data(n: int = 100, noise: float = 0.1) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, torch.tanh(x @ torch.randn(8, generator=g)) + noise * torch.randn(n, generator=g))


def model(dropout: float) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(dropout), nn.Linear(32, 1))


def mse(m: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(m(x).squeeze(-1), y)


def target(case: str):
    if case == "fixed":
        return autotune.BatchRamp.fixed([(0, 12), (100, 24)])  # the second epoch on: 24
    if case == "adaptive":
        return autotune.BatchRamp.adaptive(4, 32, windows=1, margin=1.0)
    return 24


def sigterm_while_printed(*exc) -> None:
    """The launcher's SIGTERM as the error is being printed: torch's excepthook (init_process_group) runs
    this one with sys.stderr swapped for a buffer, then writes the buffer out."""
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)  # SIGTERM ends the process before this does


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--case", choices=CASES, default="plain")
    parser.add_argument("--limit", default="20KiB")
    parser.add_argument("--kill", type=int, default=0)
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--fsdp", action="store_true", help="shard each Linear with fully_shard, then the model (FSDP2)")
    parser.add_argument("--term-peer", action="store_true", help="with --kill under torchrun: rank 1 first sends rank 0 SIGTERM, "
                        "as torchrun does when a rank exits, before rank 0 can notice")
    parser.add_argument("--term-late", action="store_true", help="with --kill under torchrun: rank 0 sends itself SIGTERM while "
                        "fit's error is being printed, as torchrun may")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    ranks = "RANK" in os.environ
    if args.term_late:
        sys.excepthook = sigterm_while_printed
    if ranks:
        torch.distributed.init_process_group("gloo")  # its excepthook prints through ours, into a buffer
    rank = torch.distributed.get_rank() if ranks else 0
    dataset = data(noise=3.0 if args.case == "adaptive" else 0.1)  # noisy labels: a noise scale the ramp rises to within the run
    if ranks:
        loader = DataLoader(dataset, batch_size=5, sampler=DistributedSampler(dataset, shuffle=True, seed=0))
    else:
        loader = DataLoader(dataset, batch_size=10, shuffle=True, generator=torch.Generator().manual_seed(0))
    net = model(args.dropout)
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(net)
    elif ranks:
        net = nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=30)

    def stop(record) -> None:
        if record.step == args.kill and (rank == 1 or not ranks):
            if args.term_peer:
                from autotune.parallel.ranks import peers_here

                os.kill(peers_here()[0], signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGKILL)

    result = autotune.fit(net, loader, target(args.case), optimizer=optimizer, loss_fn=mse, epochs=3, scheduler=scheduler,
                          memory_limit=args.limit, headroom=0, lr_rule="none", progress=False, callback=stop,
                          checkpoint=args.checkpoint or str(args.out / "run.pt"), save_every=2)
    inner = net.module if ranks and not args.fsdp else net
    params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in inner.parameters()]
    torch.save({"params": params, "micro": result.plan.micro_batch,
                "history": [(h.step, h.samples, h.loss, h.lr, h.target) for h in result.history]},
               args.out / f"result-rank{rank}.pt")
    if ranks:
        torch.distributed.barrier()
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
