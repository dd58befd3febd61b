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


def long_tail_data():
    """64 samples of 10 tokens, then 32 of 30: the probe sees only the short ones."""
    g = torch.Generator().manual_seed(4)
    out = []
    for i in range(96):
        length = 10 if i < 64 else 30
        out.append((torch.randint(0, 13, (length,), generator=g), torch.randint(0, 13, (length,), generator=g)))
    return out


def run(rank: int, world_size: int, port: int, outdir: str, limits: list[str], case: str = "basic") -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(1)
        model = DistributedDataParallel(TokenModel())
        n_params = sum(p.numel() for p in model.parameters())
        syncs = []  # all-reduces of the whole gradient (flags and counts are a few numbers)
        original = dist.all_reduce

        def counting_all_reduce(tensor, *args, **kwargs):
            if tensor.numel() == n_params:
                syncs.append(tensor.numel())
            return original(tensor, *args, **kwargs)

        dist.all_reduce = counting_all_reduce
        data = long_tail_data() if case == "long_tail" else token_data()
        sampler = None if case == "same_samples" else DistributedSampler(data, shuffle=False)
        loader = DataLoader(data, batch_size=4, sampler=sampler)
        warned = []
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        import warnings

        calls = []

        def loss_fn(model, batch):
            calls.append(1)
            if case == "error" and rank == 1 and len(calls) == 2:  # the first window's second micro-batch
                raise ValueError("a bug on rank 1")
            return token_loss(model, batch)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                plan = None
                if case == "error":  # plan first, so that the failure comes while training
                    plan = autotune.plan(model, loader, target_batch=TARGET, optimizer=opt, loss_fn=token_loss,
                                         memory_limit=limits[rank], headroom=0, lr_rule="none")
                result = autotune.fit(
                    model, loader, None if plan else TARGET, optimizer=opt, loss_fn=loss_fn, count=count_tokens,
                    memory_limit=limits[rank], headroom=0, lr_rule="none", progress=False, plan=plan,
                )
            except Exception as exc:
                torch.save({"error": f"{type(exc).__name__}: {exc}"}, os.path.join(outdir, f"rank{rank}.pt"))
                return
        warned = [str(w.message) for w in caught if issubclass(w.category, autotune.AutotuneWarning)]
        torch.save(
            {
                "params": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
                "plan": result.plan.to_dict(),
                "history": [r.__dict__ for r in result.history],
                "syncs": len(syncs),
                "warnings": warned,
            },
            os.path.join(outdir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()
