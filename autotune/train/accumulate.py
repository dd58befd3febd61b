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
``count=None`` items are what the loss the plan was made with averages over (``plan.items``: a
Transformers model's own loss, its label tokens; a loss of yours, samples); with ``count=fn`` they
are ``fn(batch)`` (e.g. non-padding tokens, :func:`autotune.shifted_label_tokens`), and the loss you
weight must then be the mean over exactly those items (e.g. ``F.cross_entropy(...,
ignore_index=-100)``), so that ``mean_i * n_i / N`` sums to the mean over all the window's items.
Micro-batches with no items are not yielded (their mean loss is undefined), and windows with no
items are skipped; an epoch in which ``count`` found no item at all is an error.

How a window is cut: consecutive loader batches whose per-sample shapes agree form a run (sequences
padded to different lengths are never joined, so no padding is invented); each run is cut into the
fewest micro-batches of at most ``micro_batch`` samples, as even as possible. Models with BatchNorm
(``plan.min_micro_batch == 2``) never get a micro-batch of one sample: a last window of one sample
joins the window before, and a sample that no micro-batch can take (a run of one, or an odd run at a
micro-batch of 2) is dropped with a warning that names it.

Several losses from one micro-batch (multi-task, or several models on the same inputs) are each
backpropagated on their own with the same weight, so only one graph is held at a time::

    for micro in window:
        for head in heads:
            (head_loss(head, micro.batch) * micro.weight).backward()
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from autotune import batches as B
from autotune.checks import (
    check_callable,
    check_count_values,
    check_flag,
    check_loader,
    check_positive_int,
)
from autotune.errors import AutotuneWarning
from autotune.items import count_for
from autotune.parallel.ranks import is_distributed, sum_over_ranks, world
from autotune.planning.plans import Plan, split_evenly

__all__ = ["Micro", "Window", "accumulate"]

Count = Callable[[Any], Any]
Pad = Callable[[list[Any]], Any]


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


def cut_sizes(n: int, cap: int, min_size: int = 1) -> tuple[tuple[int, ...], int]:
    """Sizes for ``n`` samples in the fewest micro-batches of ``min_size`` to ``cap`` samples.

    Returns:
        ``(sizes, dropped)``: sizes as even as possible, larger first, and how many samples at the
        end no micro-batch can take (0 unless ``min_size > 1``, e.g. one sample for BatchNorm).

    Example:
        >>> cut_sizes(7, 2, 2)
        ((2, 2, 2), 1)
    """
    for dropped in range(n + 1):
        m = n - dropped
        if m == 0:
            return (), n
        parts = math.ceil(m / cap)
        if parts * min_size <= m:
            return split_evenly(m, parts), dropped
    raise AssertionError("unreachable")  # pragma: no cover


class Window(Sequence[Micro]):
    """The samples of one optimizer step, cut into micro-batches with exact weights.

    Attributes:
        position: the window's position in the epoch (0-based).
        samples: samples in the window (on this rank).
        items: loss items in the window over all ranks (the ``N`` of the weights).
        total_samples: samples in the window over all ranks.
        micro_batch: the largest micro-batch size used to cut it.
        dropped: samples no micro-batch could take (BatchNorm with a lone sample); see the module
            docstring.

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
        min_micro_batch: int = 1,
        cap: Callable[[int], int] | None = None,
        pad: Pad | None = None,
    ) -> None:
        self._pieces = pieces
        self._count = count
        self._distributed = distributed
        self._sizes = sizes
        self._cap = cap if cap is not None else (lambda size: micro_batch)
        self._pad = pad
        self.position = position
        self.micro_batch = micro_batch
        self.min_micro_batch = min_micro_batch
        # Each piece's samples and per-sample shapes, walked once (this runs for every window).
        info = [B.size_and_shapes(p) for p in pieces]
        self.samples = sum(n for n, _ in info)
        batches, sizes_of, self.dropped = self._join(pieces, info) if pad is not None else self._cut(pieces, info, sizes)
        if batches:
            self.micro_batch = max(sizes_of)
        if self.dropped:
            self.samples -= self.dropped
            warnings.warn(
                f"Dropped {self.dropped} sample(s) at the end of window {position} of the epoch: the model has "
                f"BatchNorm, which cannot train on a micro-batch of one sample, and micro-batches of at most "
                f"{micro_batch} cannot take them with the others",
                AutotuneWarning,
                stacklevel=4,
            )
        counts = check_count_values([count(b) for b in batches]) if count is not None else list(sizes_of)
        self.items = int(sum(counts))
        self.total_samples = self.samples
        scale = 1.0
        if distributed:
            rank_count = world()[1]
            total_samples, total_items = sum_over_ranks([self.samples, self.items])
            self.total_samples, self.items = int(total_samples), int(total_items)
            scale = float(rank_count)
        kept = [(b, n, c) for b, n, c in zip(batches, sizes_of, counts) if c > 0]
        self._micros = tuple(
            Micro(batch=b, weight=c * scale / self.items, samples=n, items=c, last=i == len(kept) - 1)
            for i, (b, n, c) in enumerate(kept)
        )

    def _cut(self, pieces: list[Any], info: list[tuple[int, Any]], sizes: Sequence[int] | None) -> tuple[list[Any], list[int], int]:
        """Micro-batches of the pieces (``info``: each one's samples and per-sample shapes), and
        their sizes: each run of joinable pieces cut on its own, by the micro-batch its shape allows."""
        runs: list[tuple[list[Any], list[int], Any]] = []  # (pieces, their sizes, per-sample shapes)
        for piece, (n, shape) in zip(pieces, info):
            if runs and shape == runs[-1][2]:
                runs[-1][0].append(piece)
                runs[-1][1].append(n)
            else:
                runs.append(([piece], [n], shape))
        out: list[Any] = []
        out_sizes: list[int] = []
        dropped = 0
        for run, piece_sizes, shape in runs:
            n = sum(piece_sizes)
            cap = max(1, self._cap(_per_sample(shape)))
            if len(runs) == 1 and sizes is not None and sum(sizes) == n and max(sizes) <= cap and min(sizes) >= self.min_micro_batch:
                run_sizes: Sequence[int] = sizes  # the plan's layout
            else:
                run_sizes, lost = cut_sizes(n, cap, self.min_micro_batch)
                dropped += lost
            out.extend(_slices(run, piece_sizes, run_sizes))
            out_sizes.extend(run_sizes)
        return out, out_sizes, dropped

    def _join(self, pieces: list[Any], info: list[tuple[int, Any]]) -> tuple[list[Any], list[int], int]:
        """Micro-batches across pieces of different lengths, padded to the longest in each (``pad``):
        the window's pieces from the shortest to the longest, each micro-batch as large as its
        padded shape allows (``info``: each piece's samples and per-sample shapes)."""
        assert self._pad is not None
        micros: list[tuple[list[Any], int, int]] = []  # (parts, samples, per-sample size)
        parts: list[Any] = []
        held, size = 0, 0
        # Shortest first: pieces of similar lengths go together, so little padding is added. The
        # order of samples inside a window does not change its gradient.
        measured = [(piece, n, _per_sample(shape)) for piece, (n, shape) in zip(pieces, info)]
        for piece, n, piece_size in sorted(measured, key=lambda m: m[2]):
            start = 0
            while start < n:
                joined = max(size, piece_size)
                room = max(1, self._cap(joined)) - held
                if room <= 0:
                    micros.append((parts, held, size))
                    parts, held, size = [], 0, 0
                    continue
                take = min(room, n - start)
                parts.append(piece if (start == 0 and take == n) else B.slice_batch(piece, start, start + take))
                held, size, start = held + take, joined, start + take
        if parts:
            micros.append((parts, held, size))
        dropped = 0
        if len(micros) > 1 and micros[-1][1] < self.min_micro_batch:  # a lone sample: join the one before
            last, before = micros[-1], micros[-2]
            if before[1] + last[1] <= max(1, self._cap(max(before[2], last[2]))):
                micros[-2:] = [(before[0] + last[0], before[1] + last[1], max(before[2], last[2]))]
        if micros and micros[-1][1] < self.min_micro_batch:
            dropped = micros[-1][1]
            micros.pop()
        return [self._pad(parts) if len(parts) > 1 else parts[0] for parts, _, _ in micros], [n for _, n, _ in micros], dropped

    def with_micro_batch(self, micro_batch: int) -> Window:
        """The same samples cut into micro-batches of at most ``micro_batch`` (e.g. after an OOM)."""
        return self.with_cap(lambda size: min(micro_batch, self._cap(size)))

    def with_cap(self, cap: Callable[[int], int]) -> Window:
        """The same samples cut by another micro-batch for each per-sample size."""
        return Window(
            self._pieces, position=self.position, micro_batch=self.micro_batch, count=self._count,
            distributed=self._distributed, min_micro_batch=self.min_micro_batch, cap=cap, pad=self._pad,
        )

    def __getitem__(self, i: int) -> Micro:  # type: ignore[override]
        return self._micros[i]

    def __iter__(self) -> Iterator[Micro]:
        return iter(self._micros)

    def __len__(self) -> int:
        return len(self._micros)

    def __repr__(self) -> str:
        sizes = ", ".join(str(m.samples) for m in self._micros)
        return f"Window(position={self.position}, samples={self.samples}, items={self.items}, micro-batches=[{sizes}])"


def _per_sample(shapes: Any) -> int:
    """Elements per sample, from a batch's :func:`batches.sample_shapes` (its ``per_sample_numel``)."""
    return sum(math.prod(dims) for dims, _ in shapes)


def _slices(run: list[Any], piece_sizes: Sequence[int], sizes: Sequence[int]) -> list[Any]:
    """Consecutive micro-batches of ``sizes`` samples from a run of joinable pieces of
    ``piece_sizes`` samples (the rest is left)."""
    out: list[Any] = []
    queue = list(zip(run, piece_sizes))
    offset = 0  # samples of queue[0] already used
    for size in sizes:
        parts = []
        need = size
        while need:
            head, n = queue[0]
            take = min(need, n - offset)
            parts.append(head if (offset == 0 and take == n) else B.slice_batch(head, offset, offset + take))
            offset += take
            need -= take
            if offset == n:
                queue.pop(0)
                offset = 0
        out.append(B.concat(parts))
    return out


def accumulate(
    loader: Iterable[Any],
    plan: Plan | int,
    *,
    target_batch: int | None = None,
    count: Count | None = None,
    drop_last: bool = False,
    distributed: bool | None = None,
    min_micro_batch: int | None = None,
    skip_empty: bool = True,
    pad: Pad | None = None,
    cap: Callable[[int], int] | None = None,
    shares: Callable[[int], int] | None = None,
) -> Iterator[Window]:
    """Re-batch ``loader`` into optimizer-step windows of micro-batches with exact loss weights.

    The loader's own batch size does not matter: its batches are split or joined so that each
    window holds exactly the plan's samples per rank (``target_batch`` when single-process), except
    the last window of an epoch, which holds what is left and is weighted by its own item count.

    Args:
        loader: any iterable of batches (a tensor, a tuple/list or a dict of tensors, batch in
            dim 0; per-sample lists such as ids are cut with them). One pass over it is one epoch.
        plan: a :class:`Plan`, or the largest micro-batch as an int (then ``target_batch`` is
            required).
        target_batch: samples per window when ``plan`` is an int.
        count: ``count(batch) -> int``, the loss items in a batch; an int or a 0-d integer tensor.
            Default: what the loss the plan was made with averages over (``plan.items``: for a
            Transformers model's own loss its label tokens, shifted by one for a causal LM, see
            :mod:`autotune.items`; samples for a ``loss_fn`` of yours, or when ``plan`` is an int).
        drop_last: drop a last window shorter than the others.
        distributed: sum item counts over ranks and scale weights for DDP's averaging (default:
            whenever a process group with more than one rank is initialised). Every rank must then
            iterate its own shard in step with the others.
        min_micro_batch: never cut a micro-batch smaller than this (default: the plan's, 2 for
            models with BatchNorm; 1 when ``plan`` is an int).
        skip_empty: skip windows with no items (the default); False yields them too, with no
            micro-batches, so that ranks of a data-parallel run stay in step.
        pad: ``pad(batches) -> batch``, joins batches padded to different lengths into one (e.g.
            :func:`autotune.pad_to_longest`): micro-batches are then not held to the loader's
            batches, and pieces of different lengths are joined up to the micro-batch their padded
            shape allows. Without it, batches of different per-sample shapes are never joined.
        cap: ``cap(per_sample_size) -> int``, the micro-batch for each shape (default: the plan's
            :meth:`Plan.micro_batch_for`, which sizes each shape by its own memory when the plan
            has a shape model).
        shares: ``shares(i) -> int``, this rank's samples in window ``i`` of the epoch (default:
            the plan's, the same every window). ``fit`` passes :func:`autotune.planning.plans.rotated_share`
            under data parallelism, so that the ranks' shards run out together.

    Yields:
        :class:`Window` objects; iterate one to get its :class:`Micro` batches.

    Raises:
        ValueError: ``count`` returned 0 for every batch of the epoch, or an invalid count.

    Example:
        >>> for window in autotune.accumulate(loader, plan):  # doctest: +SKIP
        ...     for micro in window:
        ...         (loss_fn(model, micro.batch) * micro.weight).backward()
        ...     optimizer.step(); optimizer.zero_grad()
    """
    check_loader(loader)
    check_callable("count", count, "count(batch) -> the batch's loss items")
    check_callable("pad", pad, "pad(batches) -> batch, such as autotune.pad_to_longest")
    check_callable("cap", cap, "cap(per-sample size) -> the largest micro-batch of that size")
    check_callable("shares", shares, "shares(window) -> this rank's samples in that window")
    check_flag("drop_last", drop_last)
    check_flag("skip_empty", skip_empty)
    if distributed is not None:
        check_flag("distributed", distributed)
    check_positive_int("min_micro_batch", min_micro_batch, "the smallest micro-batch to cut", optional=True)
    if isinstance(plan, Plan):
        micro_batch = plan.micro_batch
        sizes: tuple[int, ...] | None = plan.micro_batches if plan.shape_model is None else None
        window_size = sum(plan.micro_batches)
        min_size = plan.min_micro_batch
        if cap is None and plan.shape_model is not None:
            cap = plan.micro_batch_for
        if count is None:  # the loss planned with: the model's own averages over its label tokens, say
            count = count_for(plan.items)
    elif not isinstance(plan, bool) and isinstance(plan, int) and plan >= 1:
        if isinstance(target_batch, bool) or not isinstance(target_batch, int) or target_batch < 1:
            raise ValueError(f"Invalid target_batch {target_batch!r}: with a micro-batch size as plan, give target_batch >= 1")
        micro_batch, sizes, window_size, min_size = plan, None, target_batch, 1
    elif isinstance(plan, dict):
        raise TypeError("Invalid plan of type dict: turn a saved plan back into one with autotune.Plan.from_dict(data)")
    else:
        raise ValueError(f"Invalid plan {plan!r}: pass a Plan, or a micro-batch size >= 1 with target_batch=")
    if min_micro_batch is not None:
        min_size = min_micro_batch
    micro_batch = max(micro_batch, min_size)
    if distributed is None:
        distributed = is_distributed()
    index = 0
    samples = items = 0
    for pieces, full in _windows(loader, shares or (lambda i: window_size), min_size):
        if not full and drop_last:
            break
        window = Window(
            pieces, position=index, micro_batch=micro_batch, sizes=sizes if full and shares is None else None, count=count,
            distributed=distributed, min_micro_batch=min_size, cap=cap, pad=pad,
        )
        index += 1
        samples += window.total_samples
        items += window.items
        if window.items == 0 and skip_empty:
            continue
        yield window
    if count is not None and samples > 0 and items == 0 and skip_empty:
        raise ValueError(
            f"Invalid count: it returned 0 items for every batch of the epoch ({samples} samples), so there is "
            "no loss to train on; check that it counts the loss's items (e.g. labels != -100) and that the "
            "labels are not all padding"
        )


def _windows(loader: Iterable[Any], size_of: Callable[[int], int], min_size: int = 1) -> Iterator[tuple[list[Any], bool]]:
    """Consecutive runs of exactly ``size_of(i)`` samples for run ``i`` (the last may be short):
    (pieces, full).

    A last run of fewer than ``min_size`` samples (one sample, for BatchNorm) joins the run before.
    """
    held: list[Any] | None = None  # the last full window, held back until the next one starts

    def runs() -> Iterator[tuple[list[Any], bool]]:
        pending: list[Any] = []
        have = 0
        index = 0
        window_size = size_of(index)
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
                    index += 1
                    window_size = size_of(index)
        if pending:
            yield pending, False

    if min_size <= 1:
        yield from runs()
        return
    for pieces, full in runs():
        if held is not None:
            if not full and sum(B.batch_size(p) for p in pieces) < min_size:
                yield held + pieces, True
                return
            yield held, True
            held = None
        if full:
            held = pieces
        else:
            yield pieces, False
    if held is not None:
        yield held, True
