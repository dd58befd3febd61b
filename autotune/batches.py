"""Size, index, slice, join and move batches: a tensor, a tuple/list or a dict of them.

The batch dimension is dim 0 of every tensor in the batch. Leaves that are not tensors (a flag, a
string) are carried along unchanged.
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
    "repeat_to",
    "slice_batch",
    "tensors",
    "to_device",
]

Batch = Any


def map_tensors(batch: Batch, fn: Callable[[torch.Tensor], Any]) -> Batch:
    """Apply ``fn`` to every tensor in ``batch``, keeping the container types."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        items = {k: map_tensors(v, fn) for k, v in batch.items()}
        try:
            return type(batch)(items)  # type: ignore[call-arg]
        except TypeError:  # a Mapping whose constructor takes something else
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
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


def repeat_to(batch: Batch, size: int) -> Batch:
    """A batch of ``size`` samples taken from ``batch`` cyclically (its samples repeat if needed)."""
    n = batch_size(batch)
    if size == n:
        return batch
    if size < n:
        return slice_batch(batch, 0, size)
    index = torch.arange(size) % n
    return map_tensors(batch, lambda t: t.index_select(0, index.to(t.device)))


def slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    """Samples ``start:stop`` of ``batch`` (views, no copy)."""
    return map_tensors(batch, lambda t: t[start:stop])


def concat(batches: Sequence[Batch]) -> Batch:
    """Join batches of the same structure along dim 0.

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
    return map_tensors(first, lambda _t: next(joined))


def to_device(batch: Batch, device: torch.device | str) -> Batch:
    """``batch`` with every tensor moved to ``device``."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))
