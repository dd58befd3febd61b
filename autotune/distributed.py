"""Data-parallel training without collectives inside a window: one agreement, one gradient sync.

Inside a window every rank runs its own micro-batches forward and backward on the inner module (no
DDP forward, no buffer broadcast, no agreement per micro-batch), with its own micro-batch size and
its own number of micro-batches, weighting each micro-batch by its share of the rank's items. At the
window's end:

1. **One agreement** (:func:`agree`): a single small all-reduce carries everything the ranks must
   agree on: each rank's status (fine, out of memory, failed), items, samples, loss, whether it had
   data, which parameters have a gradient, and its BatchNorm statistics.
2. **One gradient sync** (:func:`sync_gradients`): each rank scales its local mean gradient by its
   share of the global items, ``N_r / N``, and the gradients are summed in place, bucket by bucket
   (the extra memory is one bucket), which gives exactly the global mean.

Two collectives per optimizer step (one per bucket of ``BUCKET_BYTES`` for the gradients), whatever
the number of micro-batches and ranks; nothing inside a window depends on another rank, so ranks
cannot disagree on counts: uneven shards, dynamic padding, per-rank micro-batches and out-of-memory
retries on one rank are all exact. A rank out of data takes part with nothing; an error on one rank
reaches every rank at the next agreement. Everything here is a no-op in a single process.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "BUCKET_BYTES",
    "Agreement",
    "agree",
    "broadcast_model",
    "check_distinct_samples",
    "gather",
    "is_distributed",
    "on_every_rank",
    "set_epoch",
    "sum_over_ranks",
    "sync_gradients",
    "unwrap",
    "world",
]

# Gradients are summed in buckets of at most this many bytes (DDP's default bucket size).
BUCKET_BYTES = 25 * 2**20

FINE, OUT_OF_MEMORY, FAILED = 0, 1, 2


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


def _where(device: torch.device | None, group: Any = None) -> torch.device:
    """Where a collective's tensors live: the rank's GPU with NCCL, else the CPU."""
    if torch.distributed.get_backend(group) == "nccl":
        return device if device is not None and device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sum_over_ranks(values: list[float], device: torch.device | None = None, group: Any = None) -> list[float]:
    """Element-wise sum of ``values`` over all ranks (float64)."""
    if not is_distributed():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_where(device, group))
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


# --- recognising the model -------------------------------------------------------------------


@dataclass(frozen=True)
class Parallel:
    """How a model is wrapped for data parallelism.

    Attributes:
        inner: the module to run forward and backward on (no DDP forward).
        ddp: the DistributedDataParallel wrapper, if any (top level, compiled, or nested).
        group: the process group the ranks agree in (DDP's, else the default group).
        ignored: names of parameters DDP was told not to synchronise.
        nested: DDP modules inside ``inner`` whose forward must be bypassed while training.
    """

    inner: nn.Module
    ddp: nn.Module | None
    group: Any
    ignored: frozenset[str]
    nested: tuple[nn.Module, ...] = ()


def unwrap(model: nn.Module) -> tuple[nn.Module, nn.Module | None]:
    """``(module to run, DDP wrapper or None)``; see :func:`parallel` for the details."""
    p = parallel(model)
    return p.inner, p.ddp


def parallel(model: nn.Module) -> Parallel:
    """Recognise DDP, ``torch.compile(DDP(m))``, DDP nested in a module, or a plain model.

    Raises:
        TypeError: ``nn.DataParallel`` (single-process, one replica per GPU), which autotune does
            not drive.
        NotImplementedError: a model sharded with FSDP.
        ValueError: a DDP model with a communication hook, which autotune's own gradient sync
            would bypass.
    """
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(model, DataParallel) or any(isinstance(m, DataParallel) for m in model.modules()):
        raise TypeError(
            "Invalid model: nn.DataParallel is not supported (one process driving several GPUs); use "
            "DistributedDataParallel with one process per GPU (torchrun), or pass the plain module"
        )
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        fsdp: tuple[type, ...] = (FSDPModule, FullyShardedDataParallel)
    except ImportError:  # pragma: no cover - older torch
        fsdp = ()
    if fsdp and any(isinstance(m, fsdp) for m in model.modules()):
        raise NotImplementedError(
            "FSDP-sharded models are not supported yet: autotune's probe and accumulation assume every "
            "rank holds the whole model (DDP). Plan with the unsharded model on one GPU, or use DDP"
        )
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


def _ignored(ddp: nn.Module) -> frozenset[str]:
    names = getattr(ddp, "parameters_to_ignore", None) or getattr(ddp.module, "_ddp_params_and_buffers_to_ignore", ())
    return frozenset(names)


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
            m.forward = m.module.forward  # type: ignore[method-assign]

    def __exit__(self, *exc: Any) -> None:
        for m in self.nested:
            del m.forward


def broadcast_model(model: nn.Module, group: Any = None, device: torch.device | None = None) -> None:
    """Make every rank's parameters and buffers rank 0's, as DDP does when it wraps a model."""
    if not is_distributed():
        return
    src = torch.distributed.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if _where(device, group).type == t.device.type:
                torch.distributed.broadcast(t.data, src=src, group=group)
            else:
                moved = t.detach().to(_where(device, group))
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


# --- the agreement at the end of a window ----------------------------------------------------


@dataclass(frozen=True)
class Agreement:
    """What all ranks agreed at the end of a window.

    Attributes:
        status: FINE (0), OUT_OF_MEMORY (1: some rank must redo its window) or FAILED (2).
        items: loss items over all ranks (the ``N`` of the global mean).
        samples: samples over all ranks.
        loss: the global mean loss (items-weighted).
        ranks_with_data: how many ranks had a window.
        has_grad: per parameter, whether any rank has a gradient for it.
        extra: the summed extra payload (BatchNorm statistics).
    """

    status: int
    items: float
    samples: float
    loss: float
    ranks_with_data: int
    has_grad: list[bool]
    extra: torch.Tensor


def agree(
    *,
    status: int,
    items: int,
    samples: int,
    loss_sum: float,
    had_data: bool,
    params: Sequence[torch.Tensor],
    extra: torch.Tensor | None = None,
    device: torch.device | None = None,
    group: Any = None,
) -> Agreement:
    """One all-reduce of everything the ranks must agree on after a window (see the module doc)."""
    extra = torch.zeros(0, dtype=torch.float64) if extra is None else extra.detach().to(torch.float64).flatten().cpu()
    head = [float(status == FINE), float(status == OUT_OF_MEMORY), float(status == FAILED), float(items), float(samples), float(loss_sum), float(had_data)]
    grads = [float(p.grad is not None) for p in params]
    t = torch.tensor(head + grads, dtype=torch.float64)
    t = torch.cat([t, extra])
    if is_distributed():
        t = t.to(_where(device, group))
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM, group=group)
        t = t.cpu()
    fine, oom, failed, total_items, total_samples, total_loss, with_data = t[:7].tolist()
    code = FAILED if failed else (OUT_OF_MEMORY if oom else FINE)
    n = len(params)
    return Agreement(
        status=code,
        items=total_items,
        samples=total_samples,
        loss=total_loss / total_items if total_items else float("nan"),
        ranks_with_data=int(round(with_data)),
        has_grad=[v > 0 for v in t[7 : 7 + n].tolist()],
        extra=t[7 + n :],
    )


def sync_gradients(
    params: Sequence[torch.Tensor],
    has_grad: Sequence[bool],
    scale: float,
    *,
    device: torch.device | None = None,
    group: Any = None,
    bucket_bytes: int = BUCKET_BYTES,
) -> int:
    """Scale the local gradients by ``scale`` and sum them over ranks, in place, bucket by bucket.

    A parameter no rank has a gradient for keeps ``grad=None`` (so weight decay leaves it alone, as
    without autotune); one that only other ranks have takes part with zeros. The extra memory is one
    bucket (a flat copy of at most ``bucket_bytes``; none for a bucket of a single tensor).

    Returns:
        The number of all-reduce calls made (one per bucket).
    """
    if not is_distributed():
        for p in params:
            if p.grad is not None and scale != 1.0:
                p.grad.mul_(scale)
        return 0
    where = _where(device, group)
    live = []
    for p, any_grad in zip(params, has_grad):
        if not any_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif scale != 1.0:
            p.grad.mul_(scale)
        live.append(p.grad)
    calls = 0
    for bucket in _buckets(live, bucket_bytes):
        if len(bucket) == 1 and bucket[0].is_contiguous() and bucket[0].device == where:
            torch.distributed.all_reduce(bucket[0], group=group)
        else:
            flat = torch._utils._flatten_dense_tensors([g.to(where) for g in bucket]) if bucket[0].device != where else torch._utils._flatten_dense_tensors(bucket)
            torch.distributed.all_reduce(flat, group=group)
            for g, synced in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
                g.copy_(synced)
            del flat
        calls += 1
    return calls


def _buckets(grads: Iterable[torch.Tensor], bucket_bytes: int) -> Iterable[list[torch.Tensor]]:
    """Consecutive gradients of one dtype and device, at most ``bucket_bytes`` per bucket."""
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if bucket and (size + nbytes > bucket_bytes or g.dtype != bucket[0].dtype or g.device != bucket[0].device):
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += nbytes
    if bucket:
        yield bucket


def bucket_bytes_needed(params: Iterable[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> int:
    """The largest flat copy :func:`sync_gradients` makes for these parameters (what the probe sets aside)."""
    grads = [p for p in params if p.requires_grad]
    return max((sum(g.numel() * g.element_size() for g in b) for b in _buckets(grads, bucket_bytes) if len(b) > 1), default=0)


def on_every_rank(fn: Any, *args: Any, device: torch.device | None = None, group: Any = None, what: str = "") -> Any:
    """Run ``fn(*args)`` on every rank; if it raised on any rank, raise on every rank.

    The rank that failed raises its own error; the others an AutotuneError naming it. For steps that
    touch the data before training (a dataset that raises on one rank must not leave the others
    waiting in the next collective).
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
    messages = gather(None if error is None else f"{type(error).__name__}: {error}", device, group)
    if error is not None:
        raise error
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if failed:
        from .errors import AutotuneError

        rank, message = failed[0]
        raise AutotuneError(f"rank {rank} failed {what}, so every rank stops: {message}")
    return result


def check_distinct_samples(batch: Any, device: torch.device | None = None, group: Any = None) -> None:
    """Warn when every rank got the same first batch (a loader without a DistributedSampler)."""
    if not is_distributed():
        return
    from . import batches as B
    from .errors import AutotuneWarning

    fingerprint = None if batch is None else tuple((tuple(t.shape), float(t.detach().double().sum().item())) for t in B.tensors(batch)[:4])
    prints = gather(fingerprint, device, group)
    if prints[0] is not None and all(p == prints[0] for p in prints):
        warnings.warn(
            "Every rank got the same first batch: each rank should see its own shard of the data; use "
            "torch.utils.data.DistributedSampler (DataLoader(dataset, sampler=DistributedSampler(dataset)))",
            AutotuneWarning,
            stacklevel=3,
        )

