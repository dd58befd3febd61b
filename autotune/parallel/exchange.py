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

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autotune.parallel.ranks import (
    collective_device,
    is_distributed,
    naming_lost_peers,
    world,
)

__all__ = [
    "Agreement",
    "BUCKET_BYTES",
    "FAILED",
    "FINE",
    "GradientSync",
    "OUT_OF_MEMORY",
    "bucket_bytes_needed",
    "synced_bytes",
]


# Gradients are summed in buckets of at most this many bytes (DDP's default bucket size).
BUCKET_BYTES = 25 * 2**20


FINE, OUT_OF_MEMORY, FAILED = 0, 1, 2


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
        vote: the ranks' mean of the ``vote`` they sent (a batch ramp raises its target only when
            every rank voted 1).
        proposal: the ranks' mean of the target they proposed with their vote.
    """

    status: int
    items: int
    samples: int
    loss: float
    ranks_with_data: int
    synced: bool
    pace: float = 1.0
    vote: float = 0.0
    proposal: float = 0.0


# Counts travel split in two, each exactly representable in a float32 sum up to 2**24 per part.
_SPLIT = 4096


_HEAD = 12  # fine, oom, failed, items (hi, lo), samples (hi, lo), loss sum, had data, pace, vote, proposal


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
        self.where = collective_device(device, group) if self.distributed else torch.device("cpu")
        self.world_size = world(group)[1]
        self.buckets = list(_buckets_of(self.params, bucket_bytes))
        self._buffers: dict[int, torch.Tensor] = {}
        self._views: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        # Buckets whose views were handed out as gradients, with each view's reference count then.
        self._lent: dict[int, list[int]] = {}
        self.collectives = 0  # made so far (for the benchmark and the tests)

    def exchange(self, *, status: int, items: int, samples: int, loss_sum: float, had_data: bool, pace: float = 1.0,
                 unit: float = 0.0, vote: float = 0.0, proposal: float = 0.0) -> Agreement:
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
            return Agreement(status, items, samples, loss_sum / items if items else float("nan"), int(had_data), fine, pace, vote,
                             proposal)
        fine_here = status == FINE
        head = [float(status == FINE), float(status == OUT_OF_MEMORY), float(status == FAILED),
                float(items // _SPLIT), float(items % _SPLIT), float(samples // _SPLIT), float(samples % _SPLIT),
                float(loss_sum), float(had_data and fine_here), float(pace), float(vote), float(proposal)]
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
        mean_pace, mean_vote, mean_proposal = (v / self.world_size for v in values[9:12])
        if code != FINE or with_data == 0 or total_items == 0:
            return Agreement(code, total_items, total_samples, loss, with_data, False, mean_pace, mean_vote, mean_proposal)
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
        return Agreement(code, total_items, total_samples, loss, with_data, True, mean_pace, mean_vote, mean_proposal)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum a small float64 tensor over ranks (BatchNorm statistics)."""
        if not self.distributed or values.numel() == 0:
            return values
        t = values.to(self.where, torch.float64)
        self._all_reduce(t)
        return t.cpu()

    def _all_reduce(self, t: torch.Tensor) -> None:
        with naming_lost_peers(self.group, what="in this step's exchange"):
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
    return max(_bucket_sizes(params, bucket_bytes), default=0)


def synced_bytes(params: Iterable[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> int:
    """The bytes :class:`GradientSync` sums over the ranks once a window for these parameters: every bucket's (the
    trainable gradients, each in its dtype promoted to at least fp32; the head's few values left out)."""
    return sum(_bucket_sizes(params, bucket_bytes))


def _bucket_sizes(params: Iterable[torch.Tensor], bucket_bytes: int) -> list[int]:
    trainable = [p for p in params if p.requires_grad]
    return [sum(trainable[i].numel() for i in idx) * dtype.itemsize for idx, dtype in _buckets_of(trainable, bucket_bytes)]
