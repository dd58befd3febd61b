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


def reference(samples, steps):
    """Single process: SGD on consecutive global windows of TARGET samples, exact token means."""
    torch.set_default_dtype(torch.float64)
    try:
        model = W.TokenModel()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(steps):
            window = samples[step * W.TARGET : (step + 1) * W.TARGET]
            opt.zero_grad()
            total, items = 0.0, 0
            for x, y in window:  # one sample at a time: lengths may differ
                real = y != W.PAD
                total = total + F.cross_entropy(model(x.unsqueeze(0))[0][real], y[real], reduction="sum")
                items += int(real.sum())
            (total / items).backward()
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
    # no_sync: one all-reduce of the gradients per optimizer step, not one per micro-batch
    assert r0["syncs"] == r1["syncs"] == steps

    want = reference(list(W.token_data()), steps)
    for name, value in want.items():
        assert (r0["params"][name] - value).abs().max().item() <= 1e-10, name
        assert torch.equal(r0["params"][name], r1["params"][name])
    # the logged loss is the exact global token mean of the window
    assert r0["history"][0]["loss"] == pytest.approx(r1["history"][0]["loss"], abs=1e-12)


def test_out_of_memory_on_one_rank_is_retried_by_all(tmp_path):
    # Later samples are three times longer than anything probed; only rank 1's tight limit breaks.
    limits = ["64MiB", "110KiB"]
    torch.multiprocessing.spawn(W.run, args=(2, free_port(), str(tmp_path), limits, "long_tail"), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert any("Out of memory" in w for w in r0["warnings"])  # rank 0 retried for rank 1's sake
    assert any("Out of memory" in w for w in r1["warnings"])
    assert r0["plan"]["micro_batch"] == r1["plan"]["micro_batch"]
    assert sum(h["samples"] for h in r0["history"]) == 96  # every sample once
    want = reference(W.long_tail_data(), len(r0["history"]))
    for name, value in want.items():
        assert (r0["params"][name] - value).abs().max().item() <= 1e-10, name
        assert torch.equal(r0["params"][name], r1["params"][name])


def test_every_rank_getting_the_same_samples_is_warned_about(tmp_path):
    torch.multiprocessing.spawn(W.run, args=(2, free_port(), str(tmp_path), ["64MiB", "64MiB"], "same_samples"), nprocs=2, join=True)
    for r in (0, 1):
        warned = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)["warnings"]
        assert any("Every rank got the same first batch" in w and "DistributedSampler" in w for w in warned)


def test_an_error_on_one_rank_is_raised_on_all(tmp_path):
    # Rank 1's loss raises in the middle of a window: no rank may be left waiting in a collective.
    torch.multiprocessing.spawn(W.run, args=(2, free_port(), str(tmp_path), ["64MiB", "110KiB"], "error"), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r1["error"] == "ValueError: a bug on rank 1"
    assert r0["error"].startswith("AutotuneError: Another rank failed while training")


def test_fsdp_is_refused_with_a_clear_error():
    import os

    from torch import nn

    import autotune

    fully_shard = pytest.importorskip("torch.distributed.fsdp").fully_shard
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        fully_shard(model)
        data = [(torch.randn(4, 4), torch.randint(0, 2, (4,)))]
        with pytest.raises(NotImplementedError, match="FSDP-sharded models are not supported yet"):
            autotune.plan(model, data, target_batch=8)
        with pytest.raises(NotImplementedError, match="use DDP"):
            autotune.fit(model, data, 8, progress=False)
    finally:
        torch.distributed.destroy_process_group()
