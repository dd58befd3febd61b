"""Size, index, slice, join and move batches: a tensor, a tuple/list or a dict of them.

The batch dimension is dim 0 of every tensor in the batch. DataLoader's default collate turns
per-sample strings, ids and numbers into lists, so a list or tuple of such plain values whose length
is the batch size is a **per-sample list**: it is sliced, repeated and joined with the tensors, so
each micro-batch carries its own ids. Anything that cannot be split (a flag, a string, a list of
another length) is carried along unchanged to every part.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "batch_size",
    "concat",
    "map_tensors",
    "per_sample_numel",
    "repeat_lists",
    "repeat_to",
    "sample_shapes",
    "slice_batch",
    "tensors",
    "to_device",
]

Batch = Any


def map_tensors(batch: Batch, fn: Callable[[torch.Tensor], Any]) -> Batch:
    """Apply ``fn`` to every tensor in ``batch``, keeping the container types."""
    return _map(batch, fn, None)


def _rebuild(batch: Any, values: Any) -> Any:
    if isinstance(batch, Mapping):
        items = dict(values)
        try:
            return type(batch)(items)  # type: ignore[call-arg]
        except TypeError:  # a Mapping whose constructor takes something else
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*values)
    return type(batch)(values)


def _is_per_sample(value: Any, size: int | None) -> bool:
    """A list/tuple of plain values (no tensors, no containers) with one entry per sample."""
    return (
        size is not None
        and isinstance(value, (list, tuple))
        and not hasattr(value, "_fields")
        and len(value) == size
        and size > 0
        and all(not isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in value)
    )


def _map(
    batch: Batch,
    fn: Callable[[torch.Tensor], Any],
    per_sample: Callable[[Sequence[Any]], Any] | None,
    size: int | None = None,
) -> Batch:
    """``fn`` on tensors and, when ``per_sample`` is given, ``per_sample`` on per-sample lists."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if per_sample is not None and _is_per_sample(batch, size):
        return per_sample(batch)
    if isinstance(batch, Mapping):
        return _rebuild(batch, [(k, _map(v, fn, per_sample, size)) for k, v in batch.items()])
    if isinstance(batch, (list, tuple)):
        return _rebuild(batch, [_map(v, fn, per_sample, size) for v in batch])
    return batch


def tensors(batch: Batch) -> list[torch.Tensor]:
    """The tensors of ``batch``, in order."""
    found: list[torch.Tensor] = []
    map_tensors(batch, found.append)
    return found


def batch_size(batch: Batch) -> int:
    """Number of samples in ``batch`` (the common size of dim 0 of its tensors).

    Raises:
        TypeError: the batch holds no tensor.
        ValueError: a tensor has no batch dimension (0-d), or the tensors disagree on dim 0.
    """
    leaves = tensors(batch)
    if not leaves:
        raise TypeError(
            f"Invalid batch of type {type(batch).__name__}: it holds no tensor; a batch must be a "
            "tensor, a tuple/list or a dict of tensors with the batch in dim 0"
        )
    sizes = []
    for t in leaves:
        if t.dim() == 0:
            raise ValueError(
                "Invalid batch: it holds a 0-d tensor (a scalar), which has no batch dimension; "
                "give every tensor the batch in dim 0 (e.g. shape (batch,) instead of ())"
            )
        sizes.append(t.shape[0])
    if len(set(sizes)) > 1:
        raise ValueError(
            f"Invalid batch: its tensors disagree on the batch size (dim 0 sizes {sizes}); "
            "every tensor in a batch needs the same number of samples in dim 0"
        )
    return int(sizes[0])


def per_sample_numel(batch: Batch) -> int:
    """Elements per sample over all tensors of ``batch`` (what grows with sequence length)."""
    n = batch_size(batch)
    return sum(t.numel() // n for t in tensors(batch))


def sample_shapes(batch: Batch) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """Per-sample shape and dtype of each tensor: batches with equal ``sample_shapes`` can be joined."""
    return tuple((tuple(t.shape[1:]), t.dtype) for t in tensors(batch))


def repeat_to(batch: Batch, size: int) -> Batch:
    """A batch of ``size`` samples taken from ``batch`` cyclically (its samples repeat if needed)."""
    n = batch_size(batch)
    if size == n:
        return batch
    if size < n:
        return slice_batch(batch, 0, size)
    index = torch.arange(size) % n
    return _map(
        batch,
        lambda t: t.index_select(0, index.to(t.device)),
        lambda values: type(values)([values[i] for i in index.tolist()]),  # type: ignore[call-arg]
        n,
    )


def repeat_lists(batch: Batch, size: int, to: int) -> Batch:
    """``batch`` with its per-sample lists (of ``size`` entries) repeated cyclically to ``to``."""
    return _map(batch, lambda t: t, lambda values: type(values)([values[i % size] for i in range(to)]), size)  # type: ignore[call-arg]


def slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    """Samples ``start:stop`` of ``batch`` (tensor views, no copy; per-sample lists sliced too)."""
    return _map(batch, lambda t: t[start:stop], lambda values: values[start:stop], batch_size(batch))


def concat(batches: Sequence[Batch]) -> Batch:
    """Join batches of the same structure along dim 0 (per-sample lists are joined too).

    Raises:
        ValueError: the batches differ in structure or in per-sample shapes (e.g. sequences padded to
            different lengths).
    """
    first = batches[0]
    if len(batches) == 1:
        return first
    columns = [tensors(b) for b in batches]
    if len({len(c) for c in columns}) != 1:
        raise ValueError("Cannot join batches of different structures; every batch must hold the same tensors")
    joined = iter([torch.cat(list(parts), dim=0) for parts in zip(*columns)])
    lists = iter(_join_lists(batches))
    return _map(first, lambda _t: next(joined), lambda _values: next(lists), batch_size(first))


def _join_lists(batches: Sequence[Batch]) -> list[Any]:
    """Per-sample lists of each batch, in order, joined across the batches."""
    columns: list[list[Any]] = []
    for b in batches:
        found: list[Any] = []
        _map(b, lambda t: t, lambda values: found.append(values), batch_size(b))
        columns.append(found)
    joined = []
    for parts in zip(*columns):
        values = [v for part in parts for v in part]
        joined.append(type(parts[0])(values))
    return joined


def to_device(batch: Batch, device: torch.device | str) -> Batch:
    """``batch`` with every tensor moved to ``device``."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))
