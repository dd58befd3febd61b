"""FSDP2 with autotune: a model sharded with ``fully_shard``, planned and trained in lockstep.

Each rank holds a shard of the weights, gradients and AdamW state. autotune runs every trial on
all ranks together (a size fits when it fits on every rank), then trains with gradient sync on
each window's last micro-batch only; the result equals one big batch of ``target_batch`` samples.

Runs on CPUs (gloo) or GPUs (NCCL, one process per GPU):

    torchrun --nproc_per_node=2 examples/fsdp.py

Before sharding, ``autotune.shard_plan`` (or ``autotune report --shard N``) estimates what each
rank would hold over N devices, from the unsharded model.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import autotune


def model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    x, y = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y))
    loader = DataLoader(data, batch_size=64, sampler=DistributedSampler(data, shuffle=True, seed=0))
    limit = None if cuda else "6.5MiB"  # small on purpose on CPUs, to show accumulation

    if rank == 0:  # what one rank would hold, estimated from the unsharded model
        whole = model()
        (estimate,) = autotune.shard_plan(whole, loader, target_batch=1024, ranks=world_size, device=device,
                                          memory_limit=limit or torch.cuda.get_device_properties(device).total_memory)
        print(f"estimate: {estimate}")

    net = model().to(device)
    for layer in net:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)  # each block its own unit: gathered only while it runs
    fully_shard(net)  # then the model itself
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)

    result = autotune.fit(
        net,
        loader,
        target_batch=1024,  # global: over all ranks
        optimizer=optimizer,
        base_batch=64,  # the batch the learning rate was tuned at
        memory_limit=limit,
        epochs=5,
        progress=rank == 0,
    )
    if rank == 0:
        print(result.plan)
        print(f"{len(result.history)} steps, {result.samples} samples, last loss {result.history[-1].loss:.4f}")
    dist.barrier()  # leave together: a rank that exits while another still talks to it aborts it (gloo)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
