"""Two processes on the CPU with gloo: DDP training with fit equals single-process big-batch training."""

import socket

import pytest
import torch
import torch.nn.functional as F

import ddp_worker as W

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference(steps):
    """Single process: SGD on consecutive global windows of TARGET samples, exact token means."""
    torch.set_default_dtype(torch.float64)
    try:
        model = W.TokenModel()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        tokens, targets = W.token_data().tensors
        for step in range(steps):
            x, y = tokens[step * W.TARGET : (step + 1) * W.TARGET], targets[step * W.TARGET : (step + 1) * W.TARGET]
            opt.zero_grad()
            real = y != W.PAD
            logits = model(x)
            (F.cross_entropy(logits[real], y[real], reduction="sum") / real.sum()).backward()
            opt.step()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_default_dtype(torch.float32)


def test_ddp_fit_equals_big_batch_and_ranks_agree(tmp_path):
    # Rank 1 has less memory: both ranks must use the micro-batch that fits rank 1.
    limits = ["64MiB", "110KiB"]
    torch.multiprocessing.spawn(W.run, args=(2, free_port(), str(tmp_path), limits), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    p0, p1 = r0["plan"], r1["plan"]

    assert p0["micro_batch"] == p1["micro_batch"]
    assert p0["limiting_rank"] == p1["limiting_rank"] == 1
    own_max_rank0 = max(t["batch_size"] for t in p0["trials"] if t["fits"] and not t["estimate"])
    assert own_max_rank0 > p0["micro_batch"]  # rank 0 alone could have used more
    assert p0["effective_batch"] == W.TARGET and p0["world_size"] == 2
    assert sum(p0["micro_batches"]) + sum(p1["micro_batches"]) == W.TARGET
    assert p0["accumulation_steps"] > 1

    steps = len(r0["history"])
    assert steps == 2 and all(h["samples"] == W.TARGET for h in r0["history"])
    # no_sync: one gradient all-reduce per optimizer step (one bucket), not one per micro-batch
    assert r0["syncs"] == r1["syncs"] == steps

    want = reference(steps)
    for name, value in want.items():
        assert (r0["params"][name] - value).abs().max().item() <= 1e-10, name
        assert torch.equal(r0["params"][name], r1["params"][name])
    # the logged loss is the exact global token mean of the window
    assert r0["history"][0]["loss"] == pytest.approx(r1["history"][0]["loss"], abs=1e-12)
