"""A rank of the two-process DDP tests (started by torch.multiprocessing.spawn)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import autotune

PAD = -100
TARGET = 48


class TokenModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(13, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 13)

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def token_data(n=96, length=10):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 13, (n, length), generator=g)
    targets = torch.randint(0, 13, (n, length), generator=g)
    lengths = torch.randint(1, length + 1, (n,), generator=g)
    for i, real in enumerate(lengths):
        targets[i, real:] = PAD
    return TensorDataset(tokens, targets)


def token_loss(model, batch):
    tokens, targets = batch
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), ignore_index=PAD)


def count_tokens(batch):
    return int((batch[1] != PAD).sum())


def run(rank: int, world_size: int, port: int, outdir: str, limits: list[str]) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(1)
        model = DistributedDataParallel(TokenModel())
        syncs = []

        def counting_allreduce(state, bucket):
            syncs.append(bucket.index())
            fut = dist.all_reduce(bucket.buffer().div_(world_size), async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])

        model.register_comm_hook(None, counting_allreduce)
        data = token_data()
        loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False))
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        result = autotune.fit(
            model, loader, TARGET, optimizer=opt, loss_fn=token_loss, count=count_tokens,
            memory_limit=limits[rank], headroom=0, lr_rule="none", progress=False,
        )
        torch.save(
            {
                "params": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
                "plan": result.plan.to_dict(),
                "history": [r.__dict__ for r in result.history],
                "syncs": len(syncs),
            },
            os.path.join(outdir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()
