"""Ranks: who they are, what they gather and agree on, and how one rank's failure stops them all.

Planning gathers each rank's figures (:func:`gather_numbers`, :func:`gather`, :func:`on_every_rank`),
a model's wrappers are read (:func:`parallel`: DDP, FSDP2), and a rank that fails writes its error to
the store and breaks its communication so that every other rank raises naming it within seconds
(:func:`stop_every_rank`, :class:`failure_watch`). Everything here is a no-op in a single process.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import nn

__all__ = [
    "ACK_SECONDS",
    "Parallel",
    "announce",
    "broadcast_model",
    "bypass_nested",
    "check_distinct_samples",
    "check_mesh",
    "collective_device",
    "failure_watch",
    "gather",
    "gather_numbers",
    "is_distributed",
    "on_every_rank",
    "parallel",
    "sampler_epoch",
    "set_epoch",
    "set_gradient_sync",
    "stop_every_rank",
    "sum_over_ranks",
    "unwrap",
    "world",
]


def is_distributed() -> bool:
    """Whether a process group with more than one rank is initialised."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world(group: Any = None) -> tuple[int, int]:
    """(rank, world_size) of an initialised process group, else (0, 1)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def collective_device(device: torch.device | None, group: Any = None) -> torch.device:
    """Where a collective's tensors live: the rank's GPU with NCCL, else the CPU."""
    if torch.distributed.get_backend(group) == "nccl":
        return device if device is not None and device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sum_over_ranks(values: list[float], device: torch.device | None = None, group: Any = None) -> list[float]:
    """Element-wise sum of ``values`` over all ranks (float64)."""
    if not is_distributed():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=collective_device(device, group))
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM, group=group)
    return t.tolist()


def gather_numbers(values: Sequence[float], device: torch.device | None = None, group: Any = None) -> list[list[float]]:
    """Every rank's ``values`` (as many on each rank), in rank order, through one float64 all-reduce.

    Cheaper than :func:`gather` for a few numbers: one collective, nothing pickled.
    """
    rank, size = world(group)
    if size == 1:
        return [list(values)]
    t = torch.zeros(size, len(values), dtype=torch.float64)
    t[rank] = torch.tensor([float(v) for v in values], dtype=torch.float64)
    t = t.to(collective_device(device, group))
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM, group=group)
    return t.tolist()


def gather(obj: Any, device: torch.device | None = None, group: Any = None) -> list[Any]:
    """``obj`` from every rank, in rank order (``[obj]`` in a single process).

    With NCCL the objects travel through ``device`` (the rank's training device): without it,
    ``all_gather_object`` uses the current CUDA device, which is GPU 0 on every rank that never
    called ``torch.cuda.set_device``.
    """
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size(group)
    if torch.distributed.get_backend(group) == "nccl" and device is not None and device.type == "cuda":
        with torch.cuda.device(device):
            torch.distributed.all_gather_object(out, obj, group=group)
    else:
        torch.distributed.all_gather_object(out, obj, group=group)
    return out


@dataclass(frozen=True)
class Parallel:
    """How a model is wrapped for data parallelism.

    Attributes:
        inner: the module to run forward and backward on (no DDP forward).
        ddp: the DistributedDataParallel wrapper, if any (top level, compiled, or nested).
        group: the process group the ranks agree in (DDP's, else the default group).
        ignored: names of parameters DDP was told not to synchronise.
        nested: DDP modules inside ``inner`` whose forward must be bypassed while training.
        fsdp: ``inner`` is sharded with FSDP2 (``fully_shard``): every forward and backward issues
            collectives, so the ranks run in lockstep (see :mod:`autotune.train.sharded`).
    """

    inner: nn.Module
    ddp: nn.Module | None
    group: Any
    ignored: frozenset[str]
    nested: tuple[nn.Module, ...] = ()
    fsdp: bool = False


def unwrap(model: nn.Module) -> tuple[nn.Module, nn.Module | None]:
    """``(module to run, DDP wrapper or None)``; see :func:`parallel` for the details."""
    p = parallel(model)
    return p.inner, p.ddp


def parallel(model: nn.Module) -> Parallel:
    """Recognise DDP, ``torch.compile(DDP(m))``, DDP nested in a module, FSDP2 (``fully_shard``),
    or a plain model.

    Raises:
        TypeError: ``nn.DataParallel`` (single-process, one replica per GPU), which autotune does
            not drive.
        TypeError: a model wrapped in FSDP1 (``FullyShardedDataParallel``), or sharded with
            ``fully_shard`` in parts but not at the root.
        ValueError: a DDP model with a communication hook, which autotune's own gradient sync
            would bypass.
    """
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(model, DataParallel) or any(isinstance(m, DataParallel) for m in model.modules()):
        raise TypeError(
            "Invalid model: nn.DataParallel is not supported (one process driving several GPUs); use "
            "DistributedDataParallel with one process per GPU (torchrun), or pass the plain module"
        )
    fsdp = _fsdp_root(model)
    if fsdp is not None:
        return Parallel(fsdp, None, None, frozenset(), fsdp=True)
    top = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    if isinstance(top, DistributedDataParallel):
        if top is not model:
            warnings.warn(
                "torch.compile(DDP(model)): autotune runs the inner module uncompiled (it syncs gradients "
                "itself, once per window); compile the inner module instead, DDP(torch.compile(model)), "
                "to keep the compiled speed",
                stacklevel=3,
            )
        _refuse_comm_hooks(top)
        return Parallel(top.module, top, getattr(top, "process_group", None), _ignored(top))
    nested = tuple(m for m in model.modules() if isinstance(m, DistributedDataParallel))
    for m in nested:
        _refuse_comm_hooks(m)
    group = getattr(nested[0], "process_group", None) if nested else None
    ignored = frozenset().union(*(_ignored(m) for m in nested)) if nested else frozenset()
    return Parallel(model, nested[0] if nested else None, group, ignored, nested)


def _fsdp_root(model: nn.Module) -> nn.Module | None:
    """The model if it is sharded with FSDP2 at its root; errors for FSDP1 and partial sharding."""
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # pragma: no cover - older torch
        return None
    top = getattr(model, "_orig_mod", model)
    if any(isinstance(m, FullyShardedDataParallel) for m in top.modules()):
        raise TypeError(
            "Invalid model: FullyShardedDataParallel (FSDP1) is not supported; shard it with FSDP2 instead: "
            "torch.distributed.fsdp.fully_shard on each block, then on the model itself"
        )
    if isinstance(top, FSDPModule):
        if top is not model:
            raise TypeError(
                "Invalid model: torch.compile(fully_shard(model)) is not supported; compile the blocks before "
                "sharding them (fully_shard(torch.compile(block))), or pass the uncompiled model"
            )
        check_mesh(model)
        return model
    if any(isinstance(m, FSDPModule) for m in top.modules()):
        raise TypeError(
            "Invalid model: some of its blocks are sharded with fully_shard but the model itself is not; "
            "call fully_shard(model) on the root too, after its blocks (FSDP2's root groups what is left)"
        )
    return None


def check_mesh(model: nn.Module) -> None:
    """Refuse a sharding autotune does not drive: a mesh other than all ranks in one dimension."""
    state = getattr(model, "_get_fsdp_state", None)
    group = getattr(getattr(state(), "_fsdp_param_group", None), "mesh_info", None) if state else None
    mesh = getattr(group, "mesh", None)
    if mesh is None:
        return
    _, world_size = world()
    if mesh.ndim != 1 or mesh.size() != world_size:
        raise ValueError(
            f"Invalid model: it is sharded over a device mesh of shape {tuple(mesh.shape)}, but autotune drives FSDP2 "
            f"sharded over all {world_size} ranks in one dimension; shard with fully_shard(module) on the default "
            "mesh (HSDP and tensor-parallel meshes are not supported)"
        )


def _ignored(ddp: nn.Module) -> frozenset[str]:
    names = getattr(ddp, "parameters_to_ignore", None) or getattr(ddp.module, "_ddp_params_and_buffers_to_ignore", ())
    return frozenset(names or ())


def _refuse_comm_hooks(ddp: nn.Module) -> None:
    if getattr(ddp, "_comm_hooks", None):
        raise ValueError(
            "Invalid model: its DDP wrapper has a communication hook (register_comm_hook: compression, "
            "PowerSGD, ...), which autotune would bypass: it all-reduces the gradients itself, once per "
            "window. Remove the hook, or train with your own loop and autotune.accumulate"
        )


class bypass_nested:
    """Run nested DDP modules' inner forward (no buffer broadcast, no reducer) while active."""

    def __init__(self, nested: Sequence[nn.Module]) -> None:
        self.nested = nested

    def __enter__(self) -> None:
        for m in self.nested:
            m.forward = m.module.forward  # type: ignore[method-assign, union-attr]

    def __exit__(self, *exc: Any) -> None:
        for m in self.nested:
            del m.forward


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """FSDP2: whether the next backward reduce-scatters the gradients (False: they stay unsharded)."""
    model.set_requires_gradient_sync(sync)  # type: ignore[operator]


def broadcast_model(model: nn.Module, group: Any = None, device: torch.device | None = None) -> None:
    """Make every rank's parameters and buffers rank 0's, as DDP does when it wraps a model."""
    if not is_distributed():
        return
    src = torch.distributed.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if collective_device(device, group).type == t.device.type:
                torch.distributed.broadcast(t.data, src=src, group=group)
            else:
                moved = t.detach().to(collective_device(device, group))
                torch.distributed.broadcast(moved, src=src, group=group)
                t.data.copy_(moved)


def set_epoch(loader: Any, epoch: int) -> None:
    """``set_epoch(epoch)`` on the loader's sampler (a DistributedSampler reshuffles by it)."""
    for obj in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if obj is not None and callable(getattr(obj, "set_epoch", None)):
            obj.set_epoch(epoch)
            return


def sampler_epoch(loader: Any) -> int:
    """The epoch the loader's sampler is at (0 when it has none)."""
    for obj in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if obj is not None and callable(getattr(obj, "set_epoch", None)):
            return int(getattr(obj, "epoch", 0))
    return 0


def on_every_rank(fn: Any, *args: Any, device: torch.device | None = None, group: Any = None, what: str = "",
                  agree: Sequence[tuple[str, float, Any]] = ()) -> Any:
    """Run ``fn(*args)`` on every rank; if it raised on any rank, raise on every rank.

    The rank that failed raises its own error; the others an AutotuneError naming it. For steps that
    touch the data before training (a dataset that raises on one rank must not leave the others
    waiting in the next collective). ``agree``: ``(name, number, shown)`` settings every rank must
    share, carried in the same all-reduce; a difference raises ValueError on every rank, naming the
    ranks and their values (``shown(number)``).
    """
    error: BaseException | None = None
    result = None
    try:
        result = fn(*args)
    except Exception as exc:
        error = exc
    if not is_distributed():
        if error is not None:
            raise error
        return result
    # One small all-reduce says whether any rank failed (and carries what must agree); only then do the
    # messages travel.
    rows = gather_numbers([error is not None, *(number for _, number, _ in agree)], device, group)
    if not any(row[0] for row in rows):
        for i, (name, _, shown) in enumerate(agree, start=1):
            values = [row[i] for row in rows]
            if len(set(values)) > 1:
                ranks = ", ".join(f"rank {r}: {shown(v)}" for r, v in enumerate(values))
                raise ValueError(f"Invalid {name}: the ranks disagree ({ranks}); every rank must train with the same {name}")
        return result
    messages = gather(None if error is None else f"{type(error).__name__}: {error}", device, group)
    if error is not None:
        raise error
    from autotune.errors import AutotuneError

    rank, message = next((r, m) for r, m in enumerate(messages) if m is not None)
    raise AutotuneError(f"rank {rank} failed {what}, so every rank stops: {message}")


_FAILED = "autotune/failed"  # the store key the failing rank writes its error under


def _store() -> Any:
    """The default process group's key-value store (None when there is none to reach)."""
    try:
        return torch.distributed.distributed_c10d._get_default_store()
    except Exception:
        return None


def group_broken(error: BaseException | None) -> bool:
    """Whether ``error`` came from :func:`stop_every_rank`: the process group is aborted, and a
    collective would only replace the named cause with the transport's "connection closed"."""
    return bool(getattr(error, "autotune_group_broken", False))


def stop_every_rank(own: BaseException, group: Any = None, *, what: str) -> NoReturn:
    """A rank's step raised inside a lockstep step (FSDP2: every forward and backward is collective):
    make every rank stop within seconds, each naming the cause, instead of leaving the others waiting
    in a collective until the process group's timeout.

    On the rank whose own code failed: its error is written to the process group's store, the
    process group is aborted (its peers' pending collectives then fail at once), and it raises its own
    error after the others have read it (at most ``ACK_SECONDS``). On a rank whose collective failed
    because a peer aborted: an :class:`AutotuneError` naming that rank and its error. The process
    group cannot be used afterwards: the run is over.
    """
    from autotune.errors import AutotuneError

    store = _store()
    rank, size = world(group)
    told = _read_failure(store)
    if told is not None and told[0] != rank:
        _ack(store, rank)
        stopped = AutotuneError(f"rank {told[0]} failed {what}, so every rank stops: {told[1]}")
        stopped.autotune_group_broken = True  # type: ignore[attr-defined]
        raise stopped from own
    if store is not None:
        try:
            store.set(_FAILED, f"{rank}\n{type(own).__name__}: {own}")
        except Exception:
            store = None
    _abort(group)
    if store is not None:
        _wait_for_acks(store, [r for r in range(size) if r != rank])
    own.autotune_group_broken = True  # type: ignore[attr-defined]  # no collective may follow: the group is aborted
    raise own


ACK_SECONDS = 10.0  # how long a failing rank waits for the others to read its error


def _read_failure(store: Any) -> tuple[int, str] | None:
    if store is None:
        return None
    try:
        if not store.check([_FAILED]):
            return None
        text = store.get(_FAILED).decode()
    except Exception:
        return None
    rank, _, message = text.partition("\n")
    return int(rank), message


def _ack(store: Any, rank: int) -> None:
    try:
        store.set(f"{_FAILED}/read/{rank}", "1")
    except Exception:
        pass


def _wait_for_acks(store: Any, ranks: Sequence[int]) -> None:
    import datetime

    try:
        store.wait([f"{_FAILED}/read/{r}" for r in ranks], datetime.timedelta(seconds=ACK_SECONDS))
    except Exception:  # a peer that never reads it: its own collective has failed anyway
        pass


def announce(group: Any = None) -> None:
    """Before a lockstep step: this rank's host and process id in the store, so that a failing peer
    can close its connections to this process (see :func:`_abort`)."""
    store = _store()
    if store is None or not is_distributed():
        return
    import socket

    try:
        store.set(f"{_FAILED}/process/{world(group)[0]}", f"{socket.gethostname()} {os.getpid()}")
    except Exception:
        pass


def _abort(group: Any) -> None:
    """Make the peers' pending collectives fail now.

    NCCL: the communicator is aborted (and the peers' :class:`failure_watch` aborts theirs). gloo
    has no abort that reaches a peer waiting in a receive: its connections close only when the
    process group is freed, which FSDP2's own references prevent. So this rank's TCP connections to
    its peers' processes (announced in the store; never the store's own) are shut down: each peer's
    pending receive fails at once with "connection closed by peer".
    """
    dist = torch.distributed
    try:
        backend = dist.get_backend(group)
    except Exception:
        backend = None
    if backend == "nccl":
        try:
            dist.distributed_c10d._abort_process_group(group)
        except Exception:
            pass
        return
    _close_peer_connections(group)


def _close_peer_connections(group: Any) -> None:
    import socket

    store = _store()
    if store is None:
        return
    try:
        import psutil
    except ImportError:  # pragma: no cover - a dependency
        return
    rank, size = world(group)
    host = socket.gethostname()
    peers: set[int] = set()
    for r in range(size):
        if r == rank:
            continue
        try:
            text = store.get(f"{_FAILED}/process/{r}").decode() if store.check([f"{_FAILED}/process/{r}"]) else ""
        except Exception:
            continue
        name, _, pid = text.partition(" ")
        if name == host and pid.isdigit():
            peers.add(int(pid))
    store_port = getattr(store, "port", None) or int(os.environ.get("MASTER_PORT", "0") or 0)
    try:
        everyone = psutil.net_connections(kind="tcp")
        mine = psutil.Process().net_connections(kind="tcp")
    except Exception:
        return
    owner = {(c.laddr.ip, c.laddr.port): c.pid for c in everyone if c.laddr}
    for c in mine:
        if not c.raddr or c.fd is None or c.fd < 0 or store_port in (c.laddr.port, c.raddr.port):
            continue
        if owner.get((c.raddr.ip, c.raddr.port)) in peers:
            try:
                with socket.socket(fileno=os.dup(c.fd)) as s:
                    s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class failure_watch:
    """While a lockstep step runs with NCCL, a thread watches the store for another rank's failure and
    aborts this rank's process group, so that a collective this rank is blocked in fails at once
    (gloo's blocked collectives fail by themselves when the failing rank destroys its group)."""

    def __init__(self, group: Any = None, *, interval: float = 0.2) -> None:
        self.group, self.interval = group, interval
        self._stop: Any = None

    def __enter__(self) -> failure_watch:
        import threading

        dist = torch.distributed
        store = _store()
        if store is None or not is_distributed() or dist.get_backend(self.group) != "nccl":
            return self
        rank = world(self.group)[0]
        self._stop = threading.Event()

        def watch() -> None:
            while not self._stop.wait(self.interval):
                told = _read_failure(store)
                if told is not None and told[0] != rank:
                    _abort(self.group)
                    return

        threading.Thread(target=watch, name="autotune-failure-watch", daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._stop is not None:
            self._stop.set()


def check_distinct_samples(batch: Any, device: torch.device | None = None, group: Any = None) -> None:
    """Warn when every rank got the same first batch (a loader without a DistributedSampler)."""
    if not is_distributed():
        return
    from autotune import batches as B
    from autotune.errors import AutotuneWarning

    # Up to 4 tensors of the batch, each as (1, its size, its sum); zeros where there is none.
    fingerprint = [0.0] * 12
    for i, t in enumerate(B.tensors(batch)[:4] if batch is not None else []):
        fingerprint[3 * i : 3 * i + 3] = [1.0, float(t.numel()), float(t.detach().double().sum())]
    prints = gather_numbers(fingerprint, device, group)
    if prints[0][0] and all(p == prints[0] for p in prints):
        warnings.warn(
            "Every rank got the same first batch: each rank should see its own shard of the data; use "
            "torch.utils.data.DistributedSampler (DataLoader(dataset, sampler=DistributedSampler(dataset)))",
            AutotuneWarning,
            stacklevel=3,
        )
