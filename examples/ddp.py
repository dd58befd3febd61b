"""DDP with autotune: every rank probes its own device and uses its own micro-batch; training is exact.

Runs on CPUs (gloo) or GPUs (NCCL, one process per GPU):

    torchrun --nproc_per_node=2 examples/ddp.py                  # one machine, two processes
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 \\
             --master_addr=10.0.0.1 --master_port=29500 examples/ddp.py   # and node_rank=1 on the other

``target_batch`` is the global batch: micro_batch x accumulation_steps x world_size samples per
optimizer step, exactly.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import autotune


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)

    x, y = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y))
    # Each rank must see its own shard: DistributedSampler (autotune warns when ranks get the same data).
    loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data, shuffle=True, seed=0))

    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
    model = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    result = autotune.fit(
        model,
        loader,
        target_batch=1024,  # global: over all ranks
        optimizer=optimizer,
        base_batch=32,  # the batch the learning rate was tuned at
        memory_limit="3MiB" if not cuda else None,  # small on purpose on CPUs, to show accumulation
        epochs=10,
        progress=rank == 0,
    )
    if rank == 0:  # only rank 0 reports
        print(result.plan)
        print(f"{len(result.history)} steps, {result.samples} samples, last loss {result.history[-1].loss:.4f}")
    dist.barrier()  # leave together: a rank that exits while another still talks to it aborts it (gloo)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
