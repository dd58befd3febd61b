"""Ranks of the multi-process tests (gloo, CPU, float64), started by ``launch`` with a hard timeout (or
by torchrun, running this file: see the end).

Each scenario builds its model and data on every rank, trains with ``autotune.fit`` and saves what
the test compares: the parameters, the plan, the history, BatchNorm buffers, the collectives made.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    Subset,
    TensorDataset,
)

import autotune

PAD = -100


# --- models ----------------------------------------------------------------------------------


class TokenModel(nn.Module):
    """Per-token: each token's logits depend on that token only (padding never changes a loss)."""

    def __init__(self, vocab: int = 13, dim: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


class WithUnused(TokenModel):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.unused = nn.Linear(16, 16)  # never called: no rank ever has its gradient


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8, momentum=0.3)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.lin(x))))


class Outer(nn.Module):
    """A module holding a DDP-wrapped block: DDP nested inside the model."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.block = inner

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.block(tokens)


# --- data ------------------------------------------------------------------------------------


def token_samples(n: int, *, lengths: tuple[int, int] = (10, 10), seed: int = 3, empty_every: int = 0,
                  by_parity: list[tuple[int, int]] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sequences of random length in ``lengths`` (or, with ``by_parity``, in ``by_parity[i % 2]``:
    strided shards then give each rank its own length distribution), targets padded with PAD after
    a random real length."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        low, high = by_parity[i % 2] if by_parity else lengths
        length = int(torch.randint(low, high + 1, (1,), generator=g))
        tokens = torch.randint(0, 13, (length,), generator=g)
        targets = torch.randint(0, 13, (length,), generator=g)
        real = int(torch.randint(1, length + 1, (1,), generator=g))
        targets[real:] = PAD
        if empty_every and i % empty_every == 0:
            targets[:] = PAD  # no item in this sample
        out.append((tokens, targets))
    return out


class Samples(Dataset):
    def __init__(self, samples: list[Any], bad: int | None = None) -> None:
        self.samples, self.bad = samples, bad

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Any:
        if i == self.bad:
            raise ValueError(f"a bad sample at index {i}")
        return self.samples[i]


def pad_collate(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic padding: each loader batch padded to its own longest sample."""
    longest = max(t.shape[0] for t, _ in batch)
    tokens = torch.zeros(len(batch), longest, dtype=torch.long)
    targets = torch.full((len(batch), longest), PAD, dtype=torch.long)
    for i, (t, y) in enumerate(batch):
        tokens[i, : t.shape[0]] = t
        targets[i, : y.shape[0]] = y
    return tokens, targets


def token_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    tokens, targets = batch
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), ignore_index=PAD)


def count_tokens(batch: Any) -> int:
    return int((batch[1] != PAD).sum())


def rank_indices(n: int, rank: int, world: int, how: str) -> list[int]:
    """The indices of the samples each rank sees, in order (the tests' reference uses the same)."""
    if how == "strided":  # shards of different lengths
        return list(range(rank, n, world))
    if how == "all":  # no sampler: every rank loads the whole dataset (a common mistake)
        return list(range(n))
    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=False)
    return list(sampler)


# --- launching -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, outdir: str, scenario: str, config: dict[str, Any], *, timeout: float = 60.0) -> float:
    """Run ``scenario`` on ``world`` ranks; fail (and kill them) if they take longer than ``timeout``.

    Returns the wall time. A hang or a collective mismatch fails the test in seconds instead of
    blocking: every rank's process group has a 20 s timeout too.
    """
    import torch.multiprocessing as mp

    port = free_port()
    start = time.perf_counter()
    ctx = mp.start_processes(run, args=(world, port, outdir, scenario, config), nprocs=world, join=False, start_method="spawn")
    deadline = start + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.perf_counter())):
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{scenario} on {world} ranks did not finish within {timeout:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return time.perf_counter() - start


def launch_cases(world: int, outdir: str, cases: dict[str, tuple[str, dict[str, Any]]], *, timeout: float) -> dict[str, list[dict[str, Any]]]:
    """Several scenarios in one launch of ``world`` ranks (:func:`run_cases`): every rank's result of
    each, by name, after asserting that none failed. ``timeout`` bounds the whole launch."""
    outs = launched_cases(world, outdir, cases, timeout=timeout)
    for name, ranks in outs.items():
        for r, out in enumerate(ranks):
            assert "error" not in out, f"case {name}, rank {r}: {out.get('traceback', out.get('error'))}"
    return outs


def launched_cases(world: int, outdir: str, cases: dict[str, tuple[str, dict[str, Any]]], *, timeout: float) -> dict[str, list[dict[str, Any]]]:
    """:func:`launch_cases` without the assertion: a case that failed, and each one after it (never run),
    has an ``error`` on every rank."""
    launch(world, outdir, "cases", {"cases": cases}, timeout=timeout)
    ranks = [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    failed = next((out["error"] for out in ranks if "error" in out), None)
    return {name: [out["cases"].get(name, {"error": f"not run: {failed}"}) for out in ranks] for name in cases}


class Launches:
    """The cases of a test module that succeed on every rank, launched together: registered when the module
    is imported (:meth:`add`), launched the first time a test asks for one of them (:meth:`results`), one
    launch per world size for every case of that size not yet run, the results kept for the other tests.
    A case that fails fails its test and those of the cases after it in the launch (never run), naming it. Under pytest-xdist the tests that
    use one ``Launches`` go to one worker (``pytest.mark.xdist_group``), so that each case runs once."""

    def __init__(self, *, seconds_per_case: float = 15.0) -> None:
        self.cases: dict[str, tuple[int, str, dict[str, Any]]] = {}
        self.done: dict[str, list[dict[str, Any]]] = {}
        self.seconds_per_case = seconds_per_case

    def add(self, name: str, world: int, scenario: str, config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Register a case; its name and config, for the test that checks it."""
        assert name not in self.cases, name
        self.cases[name] = (world, scenario, config)
        return name, config

    def results_in(self, root: Any) -> Any:
        """:meth:`results` with each launch in a folder of its own under ``root`` (a module-scoped fixture's)."""

        def results(name: str) -> list[dict[str, Any]]:
            os.makedirs(os.path.join(root, name), exist_ok=True)
            return self.results(name, os.path.join(root, name))

        return results

    def results(self, name: str, outdir: str) -> list[dict[str, Any]]:
        """Every rank's result of case ``name`` (launching its world size's pending cases into ``outdir``)."""
        if name not in self.done:
            world = self.cases[name][0]
            pending = {n: (scenario, config) for n, (w, scenario, config) in self.cases.items() if w == world and n not in self.done}
            try:
                self.done.update(launched_cases(world, outdir, pending, timeout=30 + self.seconds_per_case * len(pending)))
            except Exception as exc:  # a hang or a crashed rank: every case of the launch fails with it, none relaunched
                self.done.update({n: [{"error": f"the launch failed: {type(exc).__name__}: {exc}"}] * world for n in pending})
        ranks = self.done[name]
        for r, out in enumerate(ranks):
            assert "error" not in out, f"case {name}, rank {r}: {out.get('traceback', out.get('error'))}"
        return ranks


def run(rank: int, world: int, port: int, outdir: str, scenario: str, config: dict[str, Any]) -> None:
    """One rank: run the scenario, save what it returned (or its error) for the test to check, leave.

    The rank leaves with ``os._exit``, skipping the interpreter's teardown: gloo sometimes aborts a
    process while its process group is torn down ("terminate called without an active exception",
    SIGABRT), after the results are saved, which would fail a test whose results are right. A real
    failure of this function still exits with 1 and prints its traceback.
    """
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    code = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=20))
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(1)
        if scenario == "cases":
            out = run_cases(rank, world, config)
        else:
            out = run_one(rank, world, outdir, scenario, config)
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
        if "error" not in out:
            # Every rank is done before any leaves. After an error the ranks may be anywhere, and the
            # failing rank's exit is what frees the others. The results are saved: a peer that left
            # first is no failure.
            try:
                dist.barrier()
            except Exception:
                pass
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_one(rank: int, world: int, outdir: str, scenario: str, config: dict[str, Any]) -> dict[str, Any]:
    """One scenario on this rank: what it returned, or its error, with the warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = SCENARIOS[scenario](rank, world, config)
        except Exception as exc:
            out = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(), "at": time.time()}
            if config.get("linger"):  # a failing process that does not exit: its exit must not be what frees the others
                torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
                # it stays until every other rank has saved what it ended with (or `linger` seconds)
                others = [os.path.join(outdir, f"rank{r}.pt") for r in range(world) if r != rank]
                deadline = time.time() + config["linger"]
                while time.time() < deadline and not all(os.path.exists(f) for f in others):
                    time.sleep(0.1)
    out["warnings"] = [str(w.message) for w in caught]
    return out


def run_cases(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    """Several scenarios in one launch (``config["cases"]``: name -> [scenario, config]), one after the other in
    the same process group, each planning from nothing (no estimate kept), with the functions a scenario
    may patch put back after it and a barrier between them; the first that fails ends the launch (the ranks may then be anywhere): its error is the
    launch's. Only for scenarios that succeed on every rank; one that makes a rank fail runs alone."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fsdp

    from autotune.probe.estimate import forget
    from autotune.train.noise import NoiseMeter

    patched = [(dist, name) for name in ("all_reduce", "broadcast", "all_gather_object", "all_gather", "barrier")]
    patched += [(NoiseMeter, "add"), (fsdp, "foreach_all_gather")]
    originals = [(owner, name, getattr(owner, name)) for owner, name in patched]
    out: dict[str, Any] = {"cases": {}}
    seed = torch.initial_seed()
    for name, (scenario, case) in config["cases"].items():
        # each case as in a process of its own: the same random state and default dtype, planning from nothing
        torch.manual_seed(seed)
        torch.set_default_dtype(torch.float64)
        _TRAINING_FORWARDS.clear()
        forget()
        done = out["cases"][name] = run_one(rank, world, "", scenario, case)
        for owner, attr, original in originals:
            setattr(owner, attr, original)
        if "error" in done:
            out["error"], out["traceback"] = f"case {name}: {done['error']}", done["traceback"]
            break
        dist.barrier()
    return out


# --- scenarios -------------------------------------------------------------------------------


def _counting_collectives() -> list[str]:
    calls: list[str] = []
    for name in ("all_reduce", "broadcast", "all_gather_object", "all_gather", "barrier"):
        original = getattr(dist, name)

        def counted(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            calls.append(_name)
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    return calls


def train_tokens(rank: int, world: int, c: dict[str, Any]) -> dict[str, Any]:
    """Token data, per-rank limits, optional wrappers, injected OOM, bad samples; everything exact."""
    samples = token_samples(c["n"], lengths=tuple(c.get("lengths", (10, 10))), empty_every=c.get("empty_every", 0),
                            by_parity=c.get("by_parity"))
    data = Samples(samples, bad=c.get("bad") if rank == c.get("bad_rank") else None)
    indices = rank_indices(len(samples), rank, world, c.get("shards", "sampler"))
    loader = DataLoader(Subset(data, indices), batch_size=c.get("loader_batch", 4), collate_fn=pad_collate)
    model: nn.Module = WithUnused() if c.get("unused") else TokenModel(dim=c["dims"][rank]) if "dims" in c else TokenModel()
    wrap = c.get("wrap", "ddp")
    if wrap == "ddp":
        model = DistributedDataParallel(model, gradient_as_bucket_view=c.get("bucket_view", False))
    elif wrap == "compiled":
        model = torch.compile(DistributedDataParallel(model), backend="eager")
    elif wrap == "nested":
        model = Outer(DistributedDataParallel(model))
    elif wrap == "plain-perturbed":  # different starting weights: fit makes them rank 0's, as DDP would
        with torch.no_grad():
            for p in model.parameters():
                p.add_(rank * 0.1)
    inner = model.block.module if wrap == "nested" else getattr(getattr(model, "_orig_mod", model), "module", model)
    opt = (torch.optim.AdamW(inner.parameters(), lr=0.05, weight_decay=0.1) if c.get("optimizer") == "adamw"
           else torch.optim.SGD(inner.parameters(), lr=0.5))
    if c.get("zero_in_place"):
        opt = ZeroesInPlace(inner.parameters(), lr=0.5)
    if c.get("keep_grads"):
        opt = KeepsGradients(inner.parameters(), lr=0.5)
    if c.get("step_oom_rank") == rank:  # out of memory inside this rank's n-th optimizer step while training
        steps_taken, step = [], opt.step

        def failing_step(*args: Any, **kwargs: Any) -> Any:
            if not autotune.is_planning():
                steps_taken.append(1)
                if len(steps_taken) == c["step_oom_at"]:
                    raise torch.OutOfMemoryError("injected: out of memory in the optimizer's step")
            return step(*args, **kwargs)

        opt.step = failing_step  # type: ignore[method-assign]
    calls = []

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        calls.append(batch[0].shape[0])
        if rank == c.get("oom_rank") and len(calls) == c.get("oom_at"):
            raise torch.OutOfMemoryError("injected: out of memory on this rank")
        exit_if_asked(rank, c)
        return token_loss(model, batch)

    plan = None
    pad = autotune.pad_to_longest if c.get("pad") else None
    if "oom_rank" in c:  # plan first, so that the injected failure comes while training
        # plan_headroom: a plan with room for what the count of a loaded run moves (gloo's buffers), where a test
        # needs no rank but the injected one to go over
        plan = autotune.plan(model, loader, target_batch=c["target"], optimizer=opt, loss_fn=token_loss,
                             memory_limit=c["limits"][rank], headroom=c.get("plan_headroom", 0), lr_rule="none")
        calls.clear()
    measured: list[int] = []  # the windows (1-based) the noise meter measured
    steps: list[int] = []
    if "noise_every" in c:
        from autotune.train.noise import NoiseMeter

        add = NoiseMeter.add
        NoiseMeter.add = lambda self, *a: (measured.append(len(steps) + 1), add(self, *a))[1]  # type: ignore[method-assign]
    collectives = _counting_collectives()
    target = autotune.BatchRamp.fixed(c["ramp"]) if "ramp" in c else c["targets"][rank] if "targets" in c else c["target"]
    if "adaptive" in c:
        target = autotune.BatchRamp.adaptive(*c["adaptive"], margin=1.0)
    result = autotune.fit(
        model, loader, None if plan else target, optimizer=opt, loss_fn=loss_fn, count=count_tokens if c.get("count", True) else None,
        memory_limit=c["limits"][rank], headroom=0, lr_rule="none", progress=False, epochs=c.get("epochs", 1), plan=plan,
        pad=pad, noise_scale=c["noise_every"][rank] if "noise_every" in c else True, callback=lambda r: steps.append(r.step),
    )
    kept = getattr(opt, "kept", [])[-len(steps):] if steps else []  # planning may have stepped before
    return {
        "params": {k: v.detach().clone() for k, v in inner.state_dict().items()},
        "grads_none": [n for n, p in inner.named_parameters() if p.grad is None],
        "plan": result.plan.to_dict(),
        "history": [r.__dict__ for r in result.history],
        "collectives": collectives,
        "indices": indices,
        "noise_measured": measured,
        # the gradients of every training step, as the optimizer kept them, still what they were then
        "kept_intact": all(torch.equal(a, b) for grads, copies in kept for a, b in zip(grads, copies)),
        "kept_steps": len(getattr(opt, "kept", [])),
    }


class ZeroesInPlace(torch.optim.SGD):
    """SGD whose zero_grad keeps the gradient tensors (zeroed) whatever it is asked."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=False)


class KeepsGradients(torch.optim.SGD):
    """SGD that keeps a reference to each step's gradients, as optimizers that remember the last
    gradient may; and a copy, to tell whether they were written over later."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kept: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        self.kept.append((grads, [g.clone() for g in grads]))
        return super().step(closure)


def train_bn(rank: int, world: int, c: dict[str, Any]) -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(c["n"], 6, generator=g) * 2 + 1, torch.randint(0, 3, (c["n"],), generator=g)
    indices = rank_indices(c["n"], rank, world, "strided")
    loader = DataLoader(Subset(TensorDataset(x, y), indices), batch_size=5)
    model: nn.Module = shard(BNNet()) if c.get("fsdp") else DistributedDataParallel(BNNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = autotune.plan(model, loader, target_batch=c["target"], optimizer=opt, memory_limit=c["limits"][rank],
                         headroom=0, lr_rule="none")
    if "micro" in c:
        # The layout the test is about, whatever the plan found: at limits of a few KiB, gloo's threads
        # free a collective buffer at racing times and the count the plan reads moves by about 2 KiB.
        import dataclasses
        import math

        from autotune.planning.plans import rotated_share, split_evenly

        share = rotated_share(c["target"], world, rank, 0)
        sizes = split_evenly(share, math.ceil(share / c["micro"]))
        plan = dataclasses.replace(plan, micro_batch=c["micro"], micro_batches=sizes, accumulation_steps=len(sizes))
    collectives = _counting_collectives()
    result = autotune.fit(model, loader, plan=plan, optimizer=opt, bn=c["bn"], progress=False, max_steps=c.get("steps"))
    return {
        "params": full_state(model) if c.get("fsdp") else {k: v.detach().clone() for k, v in model.module.state_dict().items()},
        "plan": result.plan.to_dict(),
        "history": [r.__dict__ for r in result.history],
        "collectives": collectives,
        "indices": indices,
    }


def train_epochs(rank: int, world: int, c: dict[str, Any]) -> dict[str, Any]:
    """Shuffled DistributedSampler over two epochs: once fit(epochs=2), once fit(epochs=1) twice."""
    samples = token_samples(c["n"])
    out: dict[str, Any] = {}
    for name, calls in (("one", [2]), ("two", [1, 1])):
        sampler = DistributedSampler(Samples(samples), num_replicas=world, rank=rank, shuffle=True, seed=7)
        loader = DataLoader(Samples(samples), batch_size=4, sampler=sampler, collate_fn=pad_collate)
        model = DistributedDataParallel(TokenModel())
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        plan = autotune.plan(model, loader, target_batch=c["target"], optimizer=opt, loss_fn=token_loss, memory_limit="64MiB", lr_rule="none")
        for epochs in calls:
            autotune.fit(model, loader, plan=plan, optimizer=opt, loss_fn=token_loss, count=count_tokens, epochs=epochs, progress=False)
        out[name] = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        out[f"{name}_epoch"] = sampler.epoch
    return out


def comm_hook(rank: int, world: int, c: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = DistributedDataParallel(TokenModel())
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    loader = [(torch.randint(0, 13, (4, 5)), torch.randint(0, 13, (4, 5)))]
    autotune.fit(model, loader, 8, loss_fn=token_loss, progress=False)
    return {}


def exchange(rank: int, world: int, c: dict[str, Any]) -> dict[str, Any]:
    """GradientSync on its own: random gradients per rank, held in each of the three ways the
    exchange takes them; what it writes back, whether as views of its buffer, and its mul_ calls."""
    from autotune.parallel.exchange import GradientSync

    params = list(TokenModel().parameters())
    sync = GradientSync(params, bucket_bytes=c["bucket_bytes"])
    g = torch.Generator().manual_seed(10 + rank)
    local = [torch.randn(p.shape, generator=g) for p in params]  # this rank's mean gradient
    items = 3 + 2 * rank  # N_r
    expected = float(sum(3 + 2 * r for r in range(world)))  # the global count N
    cases = {}
    muls: list[int] = []
    mul_ = torch.Tensor.mul_
    torch.Tensor.mul_ = lambda self, *a, **k: (muls.append(1), mul_(self, *a, **k))[1]  # type: ignore[method-assign]
    try:
        for name, unit in (("local mean", 0.0), ("share of the count expected", expected), ("share of another count", 5.0)):
            for p, grad in zip(params, local):
                p.grad = grad * (items / unit) if unit else grad.clone()
            muls.clear()
            agreed = sync.exchange(status=0, items=items, samples=items, loss_sum=0.0, had_data=True, unit=unit)
            kept = sync._buffers.get(0)
            cases[name] = {
                "synced": agreed.synced,
                "grads": [p.grad.clone() for p in params],
                "views": [kept is not None and p.grad.untyped_storage().data_ptr() == kept.untyped_storage().data_ptr() for p in params],
                "muls": len(muls),
            }
            for p in params:
                p.grad = None  # as the optimizer's zero_grad does
    finally:
        torch.Tensor.mul_ = mul_  # type: ignore[method-assign]
    return {"items": items, "local": local, "buckets": len(sync.buckets), "cases": cases}


def shard(model: nn.Module, blocks: tuple[str, ...] | None = None) -> nn.Module:
    """FSDP2: each child block sharded (only ``blocks`` when given: the rest, such as the embedding and
    the head, then belongs to the root, as a language model's does), then the model itself."""
    from torch.distributed.fsdp import fully_shard

    for name, child in model.named_children():
        if blocks is None or name in blocks:
            fully_shard(child)
    return fully_shard(model)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole parameters and buffers of a sharded model (gathered from every rank)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()}


_TRAINING_FORWARDS: list[int] = []


def exit_if_asked(rank: int, c: dict[str, Any]) -> None:
    """Leave the process at once (``os._exit``: no error, no teardown) at this rank's ``exit_at``-th
    forward while training, when ``exit_rank`` is this rank: a process killed or crashed mid-step."""
    if rank != c.get("exit_rank") or autotune.is_planning():
        return
    _TRAINING_FORWARDS.append(1)
    if len(_TRAINING_FORWARDS) == c["exit_at"]:
        os._exit(0)


class _RaiseInBackward(torch.autograd.Function):
    """The identity, whose backward runs out of memory."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("injected: out of memory in a backward")


def inject_out_of_memory(module: nn.Module, where: str, call: int, *, planning: bool = False, every: bool = False) -> None:
    """An out-of-memory error at the start of ``module``'s forward (``where="pre_forward"``), at its end
    (``"forward"``) or in the backward of its output (``"backward"``), at its
    ``call``-th forward while training (or while planning), as a CUDA allocation would raise it; or
    (``where="all_gather"``) in FSDP2's own code, allocating its ``call``-th all-gather."""
    calls: list[int] = []
    if where == "all_gather":
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fsdp

        all_gather = fsdp.foreach_all_gather

        def failing(*args: Any, **kwargs: Any) -> Any:
            if autotune.is_planning() == planning:
                calls.append(1)
                if len(calls) == call:
                    raise torch.OutOfMemoryError("injected: out of memory allocating an all-gather")
            return all_gather(*args, **kwargs)

        fsdp.foreach_all_gather = failing
        return

    def due() -> bool:
        if autotune.is_planning() != planning:
            return False
        calls.append(1)
        return len(calls) == call or (every and len(calls) >= call)

    def before(mod: nn.Module, args: Any) -> None:
        if due():
            raise torch.OutOfMemoryError("injected: out of memory at the start of a forward")

    def hook(mod: nn.Module, args: Any, output: torch.Tensor) -> Any:
        if not due():
            return None
        if where == "forward":
            raise torch.OutOfMemoryError("injected: out of memory in a forward")
        return _RaiseInBackward.apply(output)

    if where == "pre_forward":  # the module's own code, before it (or FSDP2 under it) runs anything
        module.register_forward_pre_hook(before)
    else:
        module.register_forward_hook(hook)


def train_fsdp(rank: int, world: int, c: dict[str, Any]) -> dict[str, Any]:
    """Token data on a model sharded with fully_shard: per-rank limits, a limit lowered on one rank
    while training (its window goes over: every rank redoes it), the plan's peak against a ledger."""
    from autotune.memory.ledger import TensorLedger

    samples = token_samples(c["n"], lengths=tuple(c.get("lengths", (10, 10))), by_parity=c.get("by_parity"))
    indices = rank_indices(len(samples), rank, world, c.get("shards", "sampler"))
    data = Samples(samples, bad=c.get("bad") if rank == c.get("bad_rank") else None)
    loader: Any = DataLoader(Subset(data, indices), batch_size=c.get("loader_batch", 4), collate_fn=pad_collate)
    if c.get("preloaded"):
        # Batches made before counting starts: the ledger then counts the training's tensors, not the data's.
        loader = list(loader)
    estimate = None
    if c.get("estimate"):
        # What autotune.planning.sharding estimates from the unsharded model, per rank at micro-batch `estimate`.
        from autotune.planning.sharding import estimated
        from autotune.probe.trial import Workload

        whole = TokenModel()
        whole_opt = torch.optim.AdamW(whole.parameters(), lr=0.05, weight_decay=0.1)
        first = next(iter(loader))
        parts, activations = estimated(Workload(model=whole, optimizer=whole_opt, loss_fn=token_loss, batch=first, device=torch.device("cpu")), 1)
        estimate = parts.peak(world, activations(c["estimate"]), accumulating=True)
    model = shard(TokenModel(), blocks=("mix",) if c.get("root_owned") else c.get("blocks"))
    opt = (torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1) if c.get("optimizer") == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.5))
    loss_fn = token_loss
    if c.get("fail_rank") == rank:  # an error inside this rank's forward, at its n-th training (or planning) micro-batch
        calls: list[int] = []

        def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:  # noqa: F811
            if autotune.is_planning() == bool(c.get("fail_in_plan")):
                calls.append(1)
                if len(calls) == c["fail_call"]:
                    raise ValueError("a failure inside the forward")
            return token_loss(model, batch)

    if c.get("exit_rank") == rank:
        fsdp_loss = loss_fn

        def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:  # noqa: F811
            exit_if_asked(rank, c)
            return fsdp_loss(model, batch)

    if c.get("oom_rank") == rank and c.get("oom_module") == "loss":  # out of memory in the loss, after the model's forward
        oom_loss, loss_calls = loss_fn, []

        def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:  # noqa: F811
            out = oom_loss(model, batch)
            if not autotune.is_planning():
                loss_calls.append(1)
                if len(loss_calls) == c["oom_call"]:
                    raise torch.OutOfMemoryError("injected: out of memory in the loss")
            return out
    elif c.get("oom_rank") == rank:
        where = model if c.get("oom_module") == "root" else getattr(model, c.get("oom_module", "mix"))
        inject_out_of_memory(where, c["oom_in"], c["oom_call"], planning=bool(c.get("oom_in_plan")), every=bool(c.get("oom_every")))
    plan = autotune.plan(model, loader, target_batch=c["target"], optimizer=opt, loss_fn=loss_fn,
                         memory_limit=c["limits"][rank], headroom=0, lr_rule="none", progress=False)
    limit = c.get("train_limits", c["limits"])[rank]
    ledger = TensorLedger("cpu")
    ledger.track(autotune.memory.ledger.held_tensors(model, opt))
    if c.get("preloaded"):
        ledger.ignore(t for batch in loader for t in batch)
    with ledger:
        result = autotune.fit(model, loader, plan=plan, optimizer=opt, loss_fn=loss_fn, count=count_tokens,
                              memory_limit=limit, lr_rule="none", progress=False, epochs=c.get("epochs", 1),
                              pad=autotune.pad_to_longest if c.get("pad") else None)
    return {
        "params": full_state(model),
        "plan": plan.to_dict(),
        "final_plan": result.plan.to_dict(),
        "history": [r.__dict__ for r in result.history],
        "ledger_peak": ledger.peak,
        "estimate": estimate,
        "indices": indices,
    }


def text_samples(n: int, *, lengths: tuple[int, int] = (5, 24), vocab: int = 500, seed: int = 11) -> list[torch.Tensor]:
    """Token sequences of random lengths (for a language model: the labels are the tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g)),), generator=g) for _ in range(n)]


def text_collate(batch: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Right padding to the batch's longest sequence: input ids, attention mask, labels (-100 on padding)."""
    longest = max(t.shape[0] for t in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros(len(batch), longest, dtype=torch.long)
    for i, t in enumerate(batch):
        ids[i, : t.shape[0]], mask[i, : t.shape[0]] = t, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, PAD)}


def count_shifted(batch: dict[str, torch.Tensor]) -> int:
    """A causal LM's loss items: the labels after the first position that are not padding."""
    return int((batch["labels"][:, 1:] != PAD).sum())


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy in the model's dtype (transformers' own loss computes in float32)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=PAD)


def train_fsdp_gpt2(rank: int, world: int, c: dict[str, Any]) -> dict[str, Any]:
    """GPT-2 from a small config, each transformer block sharded with fully_shard, then the model;
    attention masks and dynamic padding."""
    import hf_models
    from torch.distributed.fsdp import fully_shard

    samples = text_samples(c["n"])
    indices = rank_indices(len(samples), rank, world, "sampler")
    loader = DataLoader(Subset(Samples(samples), indices), batch_size=c.get("loader_batch", 4), collate_fn=text_collate)
    model = hf_models.gpt2()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    plan = autotune.plan(model, loader, target_batch=c["target"], optimizer=opt, loss_fn=lm_loss, memory_limit=c["limits"][rank],
                         headroom=0, lr_rule="none", progress=False)
    result = autotune.fit(model, loader, plan=plan, optimizer=opt, loss_fn=lm_loss, count=count_shifted, lr_rule="none", progress=False,
                          max_steps=c.get("steps"), pad=autotune.pad_to_longest if c.get("pad") else None)
    return {"params": full_state(model), "plan": plan.to_dict(), "history": [r.__dict__ for r in result.history]}


SCENARIOS = {"exchange": exchange, "tokens": train_tokens, "bn": train_bn, "epochs": train_epochs, "comm_hook": comm_hook, "fsdp": train_fsdp,
             "fsdp_gpt2": train_fsdp_gpt2}


if __name__ == "__main__":
    # Under torchrun: `torchrun --standalone --nproc_per_node=N ddp_worker.py SCENARIO OUTDIR CONFIG_JSON`.
    import json

    run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["MASTER_PORT"]), sys.argv[2], sys.argv[1],
        json.loads(sys.argv[3]))
