"""Ranks: who they are, what they gather, how a model is wrapped, and which rank went away.

Planning gathers each rank's figures (:func:`gather_numbers`, :func:`gather`), a model's wrappers
are read (:func:`parallel`: DDP, FSDP2), and a collective that fails because another rank's process
exited says which (:func:`lost_peer`, from what each rank announced in the store: :func:`announce`).
How one rank's failure stops them all is :mod:`autotune.parallel.stops`. Everything here is a no-op
in a single process.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autotune.memory.quantized import fsdp2_refused

__all__ = [
    "FAILED_KEY",
    "Parallel",
    "announce",
    "broadcast_model",
    "bypass_nested",
    "check_distinct_samples",
    "check_mesh",
    "collective_device",
    "gather",
    "gather_numbers",
    "exited_ranks",
    "group_broken",
    "is_distributed",
    "lost_peer",
    "naming_lost_peers",
    "forget_failure",
    "stopped_by_signal",
    "tell_failure",
    "told_causes",
    "parallel",
    "peers_here",
    "process_store",
    "sampler_epoch",
    "set_epoch",
    "set_gradient_sync",
    "sum_over_ranks",
    "unwrap",
    "world",
]


_AGREEING = "while the ranks agreed on what happened"


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
    with naming_lost_peers(group, what=_AGREEING):
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
    with naming_lost_peers(group, what=_AGREEING):
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
    with naming_lost_peers(group, what=_AGREEING):
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
        refused = fsdp2_refused(fsdp)
        if refused:
            raise ValueError(f"Invalid model: {refused}; plan and train the quantized model on one device, or shard it unquantized")
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


FAILED_KEY = "autotune/failed"  # the store key a failing rank writes its error under (and, below it, where each rank runs)


def process_store() -> Any:
    """The default process group's key-value store (None when there is none to reach)."""
    try:
        return torch.distributed.distributed_c10d._get_default_store()
    except Exception:
        return None


def group_broken(error: BaseException | None) -> bool:
    """Whether ``error`` came from :func:`autotune.parallel.stops.stop_every_rank`: the process group is aborted, and a
    collective would only replace the named cause with the transport's "connection closed"."""
    return bool(getattr(error, "autotune_group_broken", False))


# What gloo and NCCL say when a peer's process went away in the middle of a collective.
LOST_SECONDS = 1.0  # how long a rank whose peer's connection broke waits to see that peer's process gone
_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited", "ProcessGroupNCCL is aborted")


def lost_peer(error: BaseException, group: Any = None, *, what: str) -> BaseException | None:
    """When a collective failed because another rank's process went away (``error``: the transport's
    "connection closed by peer" and the like): an :class:`AutotuneError` that says which rank exited,
    when its process ran on this host and announced itself (:func:`announce`), else that a peer was
    lost. None for any other error (one of your own code that mentions a broken pipe included: only
    the transport's own errors count)."""
    text = str(error)
    from_transport = isinstance(error, getattr(torch.distributed, "DistError", ())) or "gloo" in text or "NCCL" in text
    if not from_transport or not any(m in text for m in _LOST):
        return None
    from autotune.errors import AutotuneError

    causes = told_causes(group)
    if causes:  # a rank that stopped on an error of its own said why before it left
        r, cause = next(iter(causes.items()))
        lost = AutotuneError(f"rank {r} stopped on an error of its own, so this rank stops too (it noticed {what}): {cause}")
        lost.autotune_elsewhere = True  # type: ignore[attr-defined]
        return lost
    gone = exited_soon(group)
    if gone:
        ranks = ", ".join(str(r) for r in gone)
        lost = AutotuneError(
            f"rank {ranks} exited {what} (its process is gone), so this rank stops too: the output of rank {ranks} says why"
        )
    else:
        first = (str(error).strip().splitlines() or [""])[0][:200]
        lost = AutotuneError(
            f"lost the connection to another rank {what} ({first}), so this rank stops: a rank exited or crashed; its output says why"
        )
    lost.autotune_elsewhere = True  # type: ignore[attr-defined]
    return lost


def exited_soon(group: Any = None) -> list[int]:
    """:func:`exited_ranks`, looked at again for up to :data:`LOST_SECONDS` while none has: a killed
    process closes its connections before it has exited (its files are closed first), so the reset a
    peer sees can arrive a moment before the process is gone."""
    gone = exited_ranks(group)
    deadline = time.monotonic() + LOST_SECONDS
    while not gone and peers_here(group) and time.monotonic() < deadline:
        time.sleep(0.02)
        gone = exited_ranks(group)
    return gone


def stopped_by_signal(group: Any = None) -> BaseException:
    """The error for a rank the launcher (or the system) stopped with SIGTERM: ``torchrun`` stops the
    other ranks as soon as one exits, often before they have noticed it themselves, so this says which
    rank exited (or stopped on an error it told), when it can."""
    from autotune.errors import AutotuneError

    causes = told_causes(group)
    gone = [] if causes else exited_soon(group)
    if causes:
        r, cause = next(iter(causes.items()))
        why = f"rank {r} stopped on an error of its own ({cause})"
    elif gone:
        ranks = ", ".join(str(r) for r in gone)
        why = f"rank {ranks} exited (its process is gone; the output of rank {ranks} says why)"
    else:
        why = "no other rank is known to have failed"
    stopped = AutotuneError(f"this rank was stopped with SIGTERM (by the launcher, or the system): {why}")
    stopped.autotune_elsewhere = True  # type: ignore[attr-defined]
    return stopped


_CAUSE = FAILED_KEY + "/cause/"  # below it, by rank: the error a rank stopped on, for the ranks it leaves waiting


def tell_failure(error: BaseException, group: Any = None) -> None:
    """Before this rank leaves on an error of its own (its optimizer step ran out of memory, its code
    raised): the error in the store, so that a rank whose collective then fails names it
    (:func:`lost_peer`) instead of "exited". Errors that name another rank's failure are not told again."""
    if not is_distributed() or getattr(error, "autotune_elsewhere", False) or getattr(error, "autotune_group_broken", False):
        return
    store = process_store()
    if store is None:
        return
    try:
        store.set(f"{_CAUSE}{world(group)[0]}", f"{type(error).__name__}: {error}"[:2000])
    except Exception:
        pass


def forget_failure(group: Any = None) -> None:
    """A new run on this rank: an error it told before (and recovered from) is no longer its cause."""
    store = process_store()
    if store is None or not is_distributed():
        return
    try:
        store.delete_key(f"{_CAUSE}{world(group)[0]}")
    except Exception:
        pass


def told_causes(group: Any = None) -> dict[int, str]:
    """``{rank: its error}`` for the other ranks that told one (:func:`tell_failure`)."""
    store = process_store()
    if store is None:
        return {}
    rank, size = world(group)
    causes = {}
    for r in range(size):
        key = f"{_CAUSE}{r}"
        if r == rank:
            continue
        try:
            if store.check([key]):
                causes[r] = store.get(key).decode()
        except Exception:
            continue
    return causes


def peers_here(group: Any = None) -> dict[int, int]:
    """``{rank: process id}`` of the other ranks that announced a process on this host (:func:`announce`);
    empty when the store cannot be read (it may have gone with a rank)."""
    import socket

    store = process_store()
    if store is None:
        return {}
    rank, size = world(group)
    host = socket.gethostname()
    peers = {}
    for r in range(size):
        if r == rank:
            continue
        key = f"{FAILED_KEY}/process/{r}"
        try:
            text = store.get(key).decode() if store.check([key]) else ""
        except Exception:
            continue
        name, _, pid = text.partition(" ")
        if name == host and pid.isdigit():
            peers[r] = int(pid)
    return peers


def exited_ranks(group: Any = None) -> list[int]:
    """The ranks whose process (announced in the store by :func:`announce`, on this host) has exited."""
    import psutil

    gone = []
    for r, pid in peers_here(group).items():
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                continue
        except psutil.NoSuchProcess:
            pass
        gone.append(r)
    return gone


class naming_lost_peers:
    """Around collectives: a failure because another rank's process went away is raised as
    :func:`lost_peer` says (which rank exited), instead of the transport's message."""

    def __init__(self, group: Any = None, *, what: str) -> None:
        self.group, self.what = group, what

    def __enter__(self) -> naming_lost_peers:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        if error is None or not isinstance(error, Exception) or group_broken(error):
            return
        lost = lost_peer(error, self.group, what=self.what)
        if lost is not None:
            raise lost from error


def announce(group: Any = None) -> None:
    """This rank's host and process id in the store: a failing peer can then close its connections to
    this process (see :func:`_abort`), and a peer can tell that this process exited (:func:`exited_ranks`)."""
    store = process_store()
    if store is None or not is_distributed():
        return
    import socket

    try:
        store.set(f"{FAILED_KEY}/process/{world(group)[0]}", f"{socket.gethostname()} {os.getpid()}")
    except Exception:
        pass


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
