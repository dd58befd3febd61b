"""Data-parallel training without collectives inside a window: one exchange at its end.

Inside a window every rank runs its own micro-batches forward and backward on the inner module (no
DDP forward, no buffer broadcast, no agreement per micro-batch), with its own micro-batch size and
its own number of micro-batches, weighting each micro-batch by its share of the rank's items. At the
window's end, **one exchange** (:class:`GradientSync`): each rank's gradients, multiplied by its item count, go
into flat buckets, the first one headed by everything the ranks must agree on (each rank's status:
fine, out of memory or failed; its items, samples and loss; whether it had data; which parameters
have a gradient). The buckets are summed and divided by the global item count, which gives exactly
the global mean; if a rank is not fine, nothing is written back and every rank keeps its own
gradients. One collective per optimizer step for a model whose gradients fit one bucket of
``BUCKET_BYTES`` (one per bucket otherwise), plus one for BatchNorm statistics, whatever the number
of micro-batches and ranks. Nothing inside a window depends on another rank, so ranks cannot
disagree on counts: uneven shards, dynamic padding, per-rank micro-batches and out-of-memory retries
on one rank are all exact. A rank out of data takes part with nothing; an error on one rank reaches
every rank at the next exchange. Everything here is a no-op in a single process.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import nn

__all__ = [
    "Agreement",
    "BUCKET_BYTES",
    "GradientSync",
    "announce",
    "broadcast_model",
    "check_distinct_samples",
    "check_mesh",
    "failure_watch",
    "gather",
    "gather_numbers",
    "is_distributed",
    "on_every_rank",
    "set_epoch",
    "set_gradient_sync",
    "stop_every_rank",
    "sum_over_ranks",
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


def gather_numbers(values: Sequence[float], device: torch.device | None = None, group: Any = None) -> list[list[float]]:
    """Every rank's ``values`` (as many on each rank), in rank order, through one float64 all-reduce.

    Cheaper than :func:`gather` for a few numbers: one collective, nothing pickled.
    """
    rank, size = world(group)
    if size == 1:
        return [list(values)]
    t = torch.zeros(size, len(values), dtype=torch.float64)
    t[rank] = torch.tensor([float(v) for v in values], dtype=torch.float64)
    t = t.to(_where(device, group))
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
        fsdp: ``inner`` is sharded with FSDP2 (``fully_shard``): every forward and backward issues
            collectives, so the ranks run in lockstep (see :mod:`autotune.fsdp`).
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


# --- the exchange at the end of a window -------------------------------------------------------


@dataclass(frozen=True)
class Agreement:
    """What all ranks agreed at the end of a window.

    Attributes:
        status: FINE (0), OUT_OF_MEMORY (1: some rank must redo its window) or FAILED (2).
        items: loss items over all ranks (the ``N`` of the global mean).
        samples: samples over all ranks.
        loss: the global mean loss (items-weighted).
        ranks_with_data: how many ranks had a window.
        synced: whether the gradients are now the global mean on every rank.
        pace: the ranks' mean of the ``pace`` they proposed (the same on every rank), so that
            every rank measures the noise scale in the same windows.
    """

    status: int
    items: int
    samples: int
    loss: float
    ranks_with_data: int
    synced: bool
    pace: float = 1.0


# Counts travel split in two, each exactly representable in a float32 sum up to 2**24 per part.
_SPLIT = 4096
_HEAD = 10  # fine, oom, failed, items (hi, lo), samples (hi, lo), loss sum, had data, pace


class GradientSync:
    """The end-of-window exchange: the ranks' status and their gradients, in the same buckets.

    Each rank copies its gradients, multiplied by its item count ``N_r`` (or as they are, when its
    loss weights already carried ``N_r / unit``: see :meth:`exchange`), into flat buckets of at
    most ``bucket_bytes`` (in float32 at least, so that low-precision gradients cannot overflow),
    the first bucket headed by what the ranks must agree on: status, items, samples, loss, whether
    it had data, and which parameters have a gradient. The first bucket is summed; if every rank is
    fine the gradients become the global mean (divided by ``N``) and the other buckets follow; if
    not, nothing is written back, so each rank keeps its own gradients (a rank that ran out of
    memory redoes its window; the others wait with theirs). One collective per bucket, whatever
    the number of micro-batches and ranks: for most models one per optimizer step. With one
    bucket its buffer is kept between steps and the summed gradients are handed out as views of
    it, which the optimizer's ``zero_grad(set_to_none=True)`` lets go (a view still held at the next
    exchange makes it write into a new buffer); with several, each is copied back and no buffer
    is kept.

    In a single process it makes no collective and changes nothing.
    """

    def __init__(self, params: Sequence[torch.Tensor], *, device: torch.device | None = None, group: Any = None,
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        self.params = list(params)
        self.group = group
        self.distributed = is_distributed()
        self.where = _where(device, group) if self.distributed else torch.device("cpu")
        self.world_size = world(group)[1]
        self.buckets = list(_buckets_of(self.params, bucket_bytes))
        self._buffers: dict[int, torch.Tensor] = {}
        self._views: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        # Buckets whose views were handed out as gradients, with each view's reference count then.
        self._lent: dict[int, list[int]] = {}
        self.collectives = 0  # made so far (for the benchmark and the tests)

    def exchange(self, *, status: int, items: int, samples: int, loss_sum: float, had_data: bool, pace: float = 1.0,
                 unit: float = 0.0) -> Agreement:
        """Agree on the window and, if every rank is fine, make the gradients the global mean.

        ``pace`` is a small number each rank proposes (how often to measure the noise scale); the
        agreement carries the ranks' mean of it.

        ``unit`` says what the gradients hold. 0: this rank's mean over its ``items``, so they are
        multiplied by ``items`` on the way out and the sum divided by the global count. Otherwise a
        number the same on every rank, and the gradients are already the sum over this rank's items
        divided by it (the loss weights carried the factor): they go out as they are, and the sum is
        multiplied by ``unit / N``, no pass at all when the count is what ``unit`` expected. Two
        passes over the gradients fewer per step than the first way.
        """
        if not self.distributed:
            fine = status == FINE
            return Agreement(status, items, samples, loss_sum / items if items else float("nan"), int(had_data), fine, pace)
        fine_here = status == FINE
        head = [float(status == FINE), float(status == OUT_OF_MEMORY), float(status == FAILED),
                float(items // _SPLIT), float(items % _SPLIT), float(samples // _SPLIT), float(samples % _SPLIT),
                float(loss_sum), float(had_data and fine_here), float(pace)]
        flags = [float(fine_here and p.grad is not None) for p in self.params]
        out = (1.0 if unit else float(items)) if fine_here else 0.0
        flat = self._flat(0, head + flags, out)
        self._all_reduce(flat)
        values = flat[: _HEAD + len(self.params)].tolist()
        fine, oom, failed = values[0], values[1], values[2]
        total_items = int(round(values[3])) * _SPLIT + int(round(values[4]))
        total_samples = int(round(values[5])) * _SPLIT + int(round(values[6]))
        with_data = int(round(values[8]))
        code = FAILED if failed else (OUT_OF_MEMORY if oom else FINE)
        loss = values[7] / total_items if total_items else float("nan")
        mean_pace = values[9] / self.world_size
        if code != FINE or with_data == 0 or total_items == 0:
            return Agreement(code, total_items, total_samples, loss, with_data, False, mean_pace)
        has_grad = [v > 0 for v in values[_HEAD:]]
        back = unit / total_items if unit else 1.0 / total_items
        self._write_back(0, flat, back, has_grad)
        for b in range(1, len(self.buckets)):
            flat = self._flat(b, [], out)
            self._all_reduce(flat)
            self._write_back(b, flat, back, has_grad)
        if len(self.buckets) > 1:
            self._buffers.clear()  # several buckets: keep none between steps (at most one at a time)
            self._views.clear()
            self._lent.clear()
        return Agreement(code, total_items, total_samples, loss, with_data, True, mean_pace)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum a small float64 tensor over ranks (BatchNorm statistics)."""
        if not self.distributed or values.numel() == 0:
            return values
        t = values.to(self.where, torch.float64)
        self._all_reduce(t)
        return t.cpu()

    def _all_reduce(self, t: torch.Tensor) -> None:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM, group=self.group)
        self.collectives += 1

    def _flat(self, b: int, head: list[float], scale: float) -> torch.Tensor:
        """Bucket ``b``: ``head``, then each gradient times ``scale`` (zeros where there is none)."""
        indices, dtype = self.buckets[b]
        grads = [self.params[i].grad for i in indices]
        sizes = [self.params[i].numel() for i in indices]
        # One buffer per bucket, kept: allocating (and first touching) a fresh one every step costs
        # page faults a hand-written DDP loop, with its persistent buckets, does not pay.
        flat = self._buffers.get(b)
        if flat is not None and b in self._lent and self._held_elsewhere(b, grads):
            # A view handed out last step is still held: write into a new buffer, the old one stays
            # with the views.
            flat = None
            del self._views[b]
            del self._lent[b]
        if flat is None or flat.numel() != len(head) + sum(sizes):
            flat = self._buffers[b] = torch.empty(len(head) + sum(sizes), dtype=dtype, device=self.where)
        if scale != 0.0 and all(g is not None and g.dtype == dtype and g.device == self.where for g in grads):
            # The common case in two C++ calls: concatenate into the buffer, then scale.
            parts = [torch.tensor(head, dtype=dtype, device=self.where)] if head else []
            torch.cat(parts + [g.reshape(-1) for g in grads], out=flat)  # type: ignore[union-attr]
            if scale != 1.0:
                flat[len(head):].mul_(scale)
            return flat
        if head:
            flat[: len(head)] = torch.tensor(head, dtype=dtype)
        offset = len(head)
        for g, n in zip(grads, sizes):
            part = flat[offset : offset + n]
            if g is None or scale == 0.0:
                part.zero_()
            else:
                part.copy_(g.reshape(-1))
                if scale != 1.0:
                    part.mul_(scale)
            offset += n
        return flat

    def _held_elsewhere(self, b: int, grads: Sequence[torch.Tensor | None]) -> bool:
        """Whether a view of bucket ``b`` handed out last step is held by anything but this exchange:
        still its parameter's gradient (an optimizer that zeroes in place instead of setting None),
        or kept elsewhere (an optimizer that stores the last gradients). When handed out, each
        view's count included its parameter's reference, which ``zero_grad`` has dropped since."""
        views = self._views[b][1]
        return any(g is v or now >= then for g, v, now, then in zip(grads, views, _references(views), self._lent[b]))

    def _write_back(self, b: int, flat: torch.Tensor, scale: float, has_grad: Sequence[bool]) -> None:
        """The summed gradients of bucket ``b``, times ``scale``, into ``.grad`` (None stays None
        where no rank has a gradient)."""
        indices, _ = self.buckets[b]
        offset = _HEAD + len(self.params) if b == 0 else 0
        body = flat[offset:]
        if scale != 1.0:
            body.mul_(scale)
        params = [self.params[i] for i in indices]
        if all(has_grad[i] for i in indices) and all(p.grad is not None and p.grad.dtype == body.dtype and p.grad.device == body.device for p in params):
            views = self._views.get(b)
            if views is None or views[0] is not flat:
                views = self._views[b] = (flat, torch._utils._unflatten_dense_tensors(body, [p.grad for p in params]))
            if len(self.buckets) == 1:
                # The buffer is kept between steps, so the gradients can simply become its views
                # until the optimizer sets them to None: no copy back.
                _hand_out(params, views[1])
                self._lent[b] = _references(views[1])
            else:
                torch._foreach_copy_([p.grad for p in params], views[1])  # type: ignore[misc]
            return
        offset = 0
        for i, p in zip(indices, params):
            n = p.numel()
            if has_grad[i]:
                summed = body[offset : offset + n].view(p.shape)
                if p.grad is None:
                    p.grad = summed.to(p.dtype).to(p.device).clone()
                else:
                    p.grad.copy_(summed)
            offset += n


def _hand_out(params: Sequence[torch.Tensor], views: Sequence[torch.Tensor]) -> None:
    """Each view becomes its parameter's gradient (no reference left behind here)."""
    for p, v in zip(params, views):
        p.grad = v


def _references(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The reference count of each tensor, as seen from here (compared only with another call)."""
    return [sys.getrefcount(t) for t in tensors]


def _buckets_of(params: Sequence[torch.Tensor], bucket_bytes: int) -> Iterable[tuple[list[int], torch.dtype]]:
    """Consecutive parameters of one gradient dtype, at most ``bucket_bytes`` per bucket (the first
    always exists, for the head, even when it holds no parameter)."""
    bucket: list[int] = []
    dtype: torch.dtype | None = None
    size = 0
    emitted = False
    for i, p in enumerate(params):
        wide = torch.promote_types(p.dtype, torch.float32)
        nbytes = p.numel() * wide.itemsize
        if bucket and (size + nbytes > bucket_bytes or wide != dtype):
            yield bucket, dtype  # type: ignore[misc]
            emitted = True
            bucket, size = [], 0
        bucket.append(i)
        dtype = wide
        size += nbytes
    if bucket or not emitted:
        yield bucket, dtype or torch.float32


def bucket_bytes_needed(params: Iterable[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> int:
    """The largest flat bucket :class:`GradientSync` makes for these parameters (what the probe
    sets aside for the sync)."""
    trainable = [p for p in params if p.requires_grad]
    return max((sum(trainable[i].numel() for i in idx) * dtype.itemsize for idx, dtype in _buckets_of(trainable, bucket_bytes)), default=0)


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
    # One small all-reduce says whether any rank failed; only then do the messages travel.
    if not any(v for (v,) in gather_numbers([error is not None], device, group)):
        return result
    messages = gather(None if error is None else f"{type(error).__name__}: {error}", device, group)
    if error is not None:
        raise error
    from .errors import AutotuneError

    rank, message = next((r, m) for r, m in enumerate(messages) if m is not None)
    raise AutotuneError(f"rank {rank} failed {what}, so every rank stops: {message}")


# --- stopping every rank when one fails inside a collective step (FSDP2) ----------------------------

_FAILED = "autotune/failed"  # the store key the failing rank writes its error under


def _store() -> Any:
    """The default process group's key-value store (None when there is none to reach)."""
    try:
        return torch.distributed.distributed_c10d._get_default_store()
    except Exception:
        return None


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
    from .errors import AutotuneError

    store = _store()
    rank, size = world(group)
    told = _read_failure(store)
    if told is not None and told[0] != rank:
        _ack(store, rank)
        raise AutotuneError(f"rank {told[0]} failed {what}, so every rank stops: {told[1]}") from own
    if store is not None:
        try:
            store.set(_FAILED, f"{rank}\n{type(own).__name__}: {own}")
        except Exception:
            store = None
    _abort(group)
    if store is not None:
        _wait_for_acks(store, [r for r in range(size) if r != rank])
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
    from . import batches as B
    from .errors import AutotuneWarning

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

