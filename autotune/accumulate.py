"""Windows of micro-batches with exact loss weights, for your own training loop.

The classic loop divides each micro-batch's mean loss by ``accumulation_steps``::

    for i, (x, y) in enumerate(loader):
        loss = criterion(model(x), y) / accumulation_steps   # exact only for equal micro-batches
        loss.backward()
        if (i + 1) % accumulation_steps == 0:
            optimizer.step(); optimizer.zero_grad()

That is the big-batch gradient only when every micro-batch holds the same number of loss items: it
over-weights the short last batch of an epoch, and for token losses with padding it weights a
micro-batch of 10 real tokens like one of 1000. :func:`accumulate` replaces it::

    for window in autotune.accumulate(loader, plan):          # one window = one optimizer step
        for micro in window:
            loss = criterion(model(micro.batch[0]), micro.batch[1]) * micro.weight
            loss.backward()
        optimizer.step(); optimizer.zero_grad()

``micro.weight`` is ``n_i / N``: the micro-batch's items over the window's items. With
``count=None`` items are samples; with ``count=fn`` they are ``fn(batch)`` (e.g. non-padding
tokens), and the loss you weight must then be the mean over exactly those items (e.g.
``F.cross_entropy(..., ignore_index=-100)``), so that ``mean_i * n_i / N`` sums to the mean over all
the window's items. Micro-batches with no items are not yielded (their mean loss is undefined), and
windows with no items are skipped.

Several losses from one micro-batch (multi-task, or several models on the same inputs) are each
backpropagated on their own with the same weight, so only one graph is held at a time::

    for micro in window:
        for head in heads:
            (head_loss(head, micro.batch) * micro.weight).backward()
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from . import batches as B
from .distributed import is_distributed, sum_over_ranks, world
from .plans import Plan, split_evenly

__all__ = ["Micro", "Window", "accumulate"]

Count = Callable[[Any], int]


@dataclass(frozen=True)
class Micro:
    """One micro-batch of a window.

    Attributes:
        batch: the samples, in the loader's batch structure.
        weight: ``items / window.items``: multiply the micro-batch's mean loss by it.
        samples: samples in the micro-batch.
        items: loss items in it (samples, or ``count(batch)``).
        last: whether it is the window's last micro-batch (e.g. to sync gradients only then).
    """

    batch: Any
    weight: float
    samples: int
    items: int
    last: bool


class Window(Sequence[Micro]):
    """The samples of one optimizer step, cut into micro-batches with exact weights.

    Attributes:
        position: the window's position in the epoch (0-based).
        samples: samples in the window (on this rank).
        items: loss items in the window over all ranks (the ``N`` of the weights).
        total_samples: samples in the window over all ranks.
        micro_batch: the largest micro-batch size used to cut it.

    Under ``torch.distributed`` (``distributed=True``) the item count is summed over all ranks and
    each weight is multiplied by the world size, because DDP averages gradients over ranks: the
    synchronised gradient is then exactly the global mean.
    """

    def __init__(
        self,
        pieces: list[Any],
        *,
        position: int,
        micro_batch: int,
        sizes: Sequence[int] | None = None,
        count: Count | None = None,
        distributed: bool = False,
    ) -> None:
        self._pieces = pieces
        self._count = count
        self._distributed = distributed
        self.position = position
        self.micro_batch = micro_batch
        self.samples = sum(B.batch_size(p) for p in pieces)
        if sizes is None or sum(sizes) != self.samples or max(sizes) > micro_batch:
            sizes = split_evenly(self.samples, math.ceil(self.samples / micro_batch))
        batches = _cut(pieces, sizes)
        counts = [count(b) if count is not None else B.batch_size(b) for b in batches]
        for c in counts:
            if c < 0 or int(c) != c:
                raise ValueError(f"Invalid item count {c!r} from count(): it must be a whole number >= 0")
        self.items = int(sum(counts))
        self.total_samples = self.samples
        scale = 1.0
        if distributed:
            rank_count = world()[1]
            total_samples, total_items = sum_over_ranks([self.samples, self.items])
            self.total_samples, self.items = int(total_samples), int(total_items)
            scale = float(rank_count)
        kept = [(b, int(c)) for b, c in zip(batches, counts) if c > 0]
        self._micros = tuple(
            Micro(batch=b, weight=c * scale / self.items, samples=B.batch_size(b), items=c, last=i == len(kept) - 1)
            for i, (b, c) in enumerate(kept)
        )

    def with_micro_batch(self, micro_batch: int) -> Window:
        """The same samples cut into micro-batches of at most ``micro_batch`` (e.g. after an OOM)."""
        return Window(self._pieces, position=self.position, micro_batch=micro_batch, count=self._count, distributed=self._distributed)

    def __getitem__(self, i: int) -> Micro:  # type: ignore[override]
        return self._micros[i]

    def __len__(self) -> int:
        return len(self._micros)

    def __repr__(self) -> str:
        sizes = ", ".join(str(m.samples) for m in self._micros)
        return f"Window(position={self.position}, samples={self.samples}, items={self.items}, micro-batches=[{sizes}])"


def _cut(pieces: list[Any], sizes: Sequence[int]) -> list[Any]:
    """Cut consecutive pieces into micro-batches of ``sizes`` samples.

    Pieces from different loader batches are joined when their per-sample shapes agree; when they
    do not (sequences padded to different lengths), the micro-batch is split at the boundary
    instead, so no padding is invented. Weights stay exact either way.
    """
    out: list[Any] = []
    queue = list(pieces)
    offset = 0  # samples of queue[0] already used
    for size in sizes:
        parts = []
        need = size
        while need:
            head = queue[0]
            n = B.batch_size(head)
            take = min(need, n - offset)
            parts.append(head if (offset == 0 and take == n) else B.slice_batch(head, offset, offset + take))
            offset += take
            need -= take
            if offset == n:
                queue.pop(0)
                offset = 0
        out.extend(_join(parts))
    return out


def _join(parts: list[Any]) -> list[Any]:
    """Join consecutive parts whose per-sample shapes agree; keep runs of other shapes apart."""
    runs: list[list[Any]] = []
    last_shape: Any = None
    for part in parts:
        shape = _sample_shapes(part)
        if runs and shape == last_shape:
            runs[-1].append(part)
        else:
            runs.append([part])
            last_shape = shape
    return [run[0] if len(run) == 1 else B.concat(run) for run in runs]


def _sample_shapes(batch: Any) -> tuple[Any, ...]:
    return tuple((tuple(t.shape[1:]), t.dtype) for t in B.tensors(batch))


def accumulate(
    loader: Iterable[Any],
    plan: Plan | int,
    *,
    target_batch: int | None = None,
    count: Count | None = None,
    drop_last: bool = False,
    distributed: bool | None = None,
) -> Iterator[Window]:
    """Re-batch ``loader`` into optimizer-step windows of micro-batches with exact loss weights.

    The loader's own batch size does not matter: its batches are split or joined so that each
    window holds exactly the plan's samples per rank (``target_batch`` when single-process), except
    the last window of an epoch, which holds what is left and is weighted by its own item count.

    Args:
        loader: any iterable of batches (a tensor, a tuple/list or a dict of tensors, batch in
            dim 0). One pass over it is one epoch.
        plan: a :class:`Plan`, or the largest micro-batch as an int (then ``target_batch`` is
            required).
        target_batch: samples per window when ``plan`` is an int.
        count: ``count(batch) -> int``, the loss items in a batch (default: its samples).
        drop_last: drop a last window shorter than the others.
        distributed: sum item counts over ranks and scale weights for DDP's averaging (default:
            whenever a process group with more than one rank is initialised). Every rank must then
            iterate its own shard in step with the others.

    Yields:
        :class:`Window` objects; iterate one to get its :class:`Micro` batches.

    Example:
        >>> for window in autotune.accumulate(loader, plan):  # doctest: +SKIP
        ...     for micro in window:
        ...         (loss_fn(model, micro.batch) * micro.weight).backward()
        ...     optimizer.step(); optimizer.zero_grad()
    """
    if isinstance(plan, Plan):
        micro_batch = plan.micro_batch
        sizes: tuple[int, ...] | None = plan.micro_batches
        window_size = sum(plan.micro_batches)
    else:
        if isinstance(plan, bool) or not isinstance(plan, int) or plan < 1:
            raise ValueError(f"Invalid plan {plan!r}: pass a Plan, or a micro-batch size >= 1 with target_batch=")
        if isinstance(target_batch, bool) or not isinstance(target_batch, int) or target_batch < 1:
            raise ValueError(f"Invalid target_batch {target_batch!r}: with a micro-batch size as plan, give target_batch >= 1")
        micro_batch, sizes, window_size = plan, None, target_batch
    if distributed is None:
        distributed = is_distributed()
    index = 0
    for pieces, full in _windows(loader, window_size):
        if not full and drop_last:
            return
        window = Window(pieces, position=index, micro_batch=micro_batch, sizes=sizes if full else None, count=count, distributed=distributed)
        index += 1
        if window.items == 0:
            continue
        yield window


def _windows(loader: Iterable[Any], window_size: int) -> Iterator[tuple[list[Any], bool]]:
    """Consecutive runs of exactly ``window_size`` samples (the last may be short): (pieces, full)."""
    pending: list[Any] = []
    have = 0
    for batch in loader:
        n = B.batch_size(batch)
        start = 0
        while start < n:
            take = min(window_size - have, n - start)
            pending.append(batch if (start == 0 and take == n) else B.slice_batch(batch, start, start + take))
            have += take
            start += take
            if have == window_size:
                yield pending, True
                pending, have = [], 0
    if pending:
        yield pending, False
