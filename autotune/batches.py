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
    "checked_batch",
    "check_like_first",
    "concat",
    "length_dims",
    "longest_length",
    "pad_to_longest",
    "map_tensors",
    "per_sample_numel",
    "repeat_lists",
    "repeat_to",
    "resize_length",
    "sample_shapes",
    "size_and_shapes",
    "slice_batch",
    "tensors",
    "to_device",
    "tokens_per_sample",
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
    """The tensors of ``batch``, in order (the order :func:`map_tensors` visits them)."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    found: list[torch.Tensor] = []
    _collect(batch, found)
    return found


def _collect(batch: Any, found: list[torch.Tensor]) -> None:
    """The walk of :func:`_map` without building anything: called once per micro-batch and more."""
    if isinstance(batch, torch.Tensor):
        found.append(batch)
    elif isinstance(batch, Mapping):
        for value in batch.values():
            _collect(value, found)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            _collect(value, found)


def batch_size(batch: Batch) -> int:
    """Number of samples in ``batch`` (the common size of dim 0 of its tensors).

    Raises:
        TypeError: the batch holds no tensor.
        ValueError: a tensor has no batch dimension (0-d), or the tensors disagree on dim 0.
    """
    return _size_of(tensors(batch), batch)


def _size_of(leaves: list[torch.Tensor], batch: Batch) -> int:
    """The batch size of ``batch``, given its tensors."""
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
        named = f": {', '.join(f'{k} {n}' for k, n in _named_sizes(batch))}" if isinstance(batch, Mapping) else ""
        patches = ("; a vision-language batch of every image's patches in one tensor (pixel_values beside image_grid_thw, as "
                   "Qwen2-VL's processor makes it) has a row a patch, not a sample, and cannot be cut into micro-batches"
                   if isinstance(batch, Mapping) and "image_grid_thw" in batch else "")
        raise ValueError(
            f"Invalid batch: its tensors disagree on the batch size (dim 0 sizes {sizes}{named}); "
            f"every tensor in a batch needs the same number of samples in dim 0{patches}"
        )
    return int(sizes[0])


def _named_sizes(batch: Any, prefix: str = "") -> list[tuple[str, int]]:
    """Each tensor of a dict batch by its key (``outer.inner`` where nested) and the size of its dim 0."""
    out: list[tuple[str, int]] = []
    items = batch.items() if isinstance(batch, Mapping) else enumerate(batch) if isinstance(batch, (list, tuple)) else ()
    for key, value in items:
        name = f"{prefix}{key}" if isinstance(batch, Mapping) else f"{prefix.rstrip('.')}[{key}]"
        if isinstance(value, torch.Tensor):
            out.append((name, int(value.shape[0]) if value.dim() else 0))
        else:
            out.extend(_named_sizes(value, name + "."))
    return out


def per_sample_numel(batch: Batch) -> int:
    """Elements per sample over all tensors of ``batch`` (what grows with sequence length)."""
    leaves = tensors(batch)
    n = _size_of(leaves, batch)
    return sum(t.numel() // n for t in leaves)


def sample_shapes(batch: Batch) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """Per-sample shape and dtype of each tensor: batches with equal ``sample_shapes`` can be joined."""
    return tuple((tuple(t.shape[1:]), t.dtype) for t in tensors(batch))


def size_and_shapes(batch: Batch) -> tuple[int, tuple[tuple[tuple[int, ...], torch.dtype], ...]]:
    """``(batch_size(batch), sample_shapes(batch))`` in one walk of the batch."""
    leaves = tensors(batch)
    return _size_of(leaves, batch), tuple((tuple(t.shape[1:]), t.dtype) for t in leaves)


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


def check_like_first(first: Any, batch: Any, index: int) -> None:
    """Batch ``index`` of a loader has the dict keys and the dtypes of its first batch (batches that
    differ cannot be joined into micro-batches, nor trained by one loss and model).

    Raises:
        ValueError: naming both sets of keys, or of dtypes.
    """
    if isinstance(first, Mapping) and isinstance(batch, Mapping) and set(first) != set(batch):
        missing, extra = sorted(map(str, set(first) - set(batch))), sorted(map(str, set(batch) - set(first)))
        raise ValueError(
            f"Invalid loader: its batch {index} has the keys {sorted(map(str, batch))}, its first batch {sorted(map(str, first))} "
            f"(missing {missing or 'none'}, extra {extra or 'none'}); every batch of the loader needs the same keys"
        )
    dtypes, first_dtypes = [str(t.dtype) for t in tensors(batch)], [str(t.dtype) for t in tensors(first)]
    if dtypes != first_dtypes and len(dtypes) == len(first_dtypes):
        raise ValueError(
            f"Invalid loader: its batch {index} holds tensors of dtypes {dtypes}, its first batch {first_dtypes}; make "
            "every batch the same (e.g. .float() in your dataset or collate_fn)"
        )


def _aligned(first: Any, other: Any, where: str = "") -> Any:
    """``other`` with its dicts' keys in ``first``'s order, so that batches join by key, not by
    position; an error naming the keys when they differ."""
    if isinstance(first, Mapping):
        if not isinstance(other, Mapping):
            raise ValueError(f"Cannot join batches{where}: one is a dict with keys {sorted(map(str, first))}, another a "
                             f"{type(other).__name__}; every batch must have the same structure")
        if set(first) != set(other):
            missing, extra = sorted(map(str, set(first) - set(other))), sorted(map(str, set(other) - set(first)))
            raise ValueError(
                f"Cannot join batches{where} with different keys: {sorted(map(str, first))} and {sorted(map(str, other))} "
                f"(missing {missing or 'none'}, extra {extra or 'none'}); every batch of the loader needs the same keys"
            )
        return {k: _aligned(first[k], other[k], f"{where}[{k!r}]") for k in first}
    if isinstance(first, (list, tuple)) and isinstance(other, (list, tuple)) and len(first) == len(other) and not isinstance(first, str):
        if any(isinstance(v, (Mapping, list, tuple)) for v in first):
            return type(other)(_aligned(a, b, f"{where}[{i}]") for i, (a, b) in enumerate(zip(first, other)))
    return other


def _columns(batches: Sequence[Batch]) -> list[list[torch.Tensor]]:
    """Each batch's tensors, in order; an error when the batches do not hold the same tensors."""
    columns = [tensors(b) for b in batches]
    if len({len(c) for c in columns}) != 1:
        raise ValueError("Cannot join batches of different structures; every batch must hold the same tensors")
    return columns


def concat(batches: Sequence[Batch]) -> Batch:
    """Join batches of the same structure along dim 0 (per-sample lists are joined too).

    Raises:
        ValueError: the batches differ in structure or in per-sample shapes (e.g. sequences padded to
            different lengths).
    """
    if not batches:
        raise ValueError("Invalid batches []: give at least one batch to join")
    first = batches[0]
    if len(batches) == 1:
        return first
    batches = [first, *(_aligned(first, b) for b in batches[1:])]  # dicts join by key, whatever their order
    columns = _columns(batches)
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


def length_dims(batches: Sequence[Batch]) -> list[tuple[int, int]]:
    """The ``(tensor index, dim)`` pairs that hold a variable length, from a few batches.

    A dim (past the batch dim) whose size differs between the batches varies; when none does,
    integer tensors of two or more dims are taken as token sequences, their dim 1 the length.
    Every dim of the first batch whose size equals a varying dim's size in it goes with it (ids,
    attention mask and labels grow together). Empty for fixed-shape data (images).
    """
    columns = [tensors(b) for b in batches]
    first = columns[0]
    varying: set[tuple[int, int]] = set()
    for i, t in enumerate(first):
        for d in range(1, t.dim()):
            if any(len(c) > i and c[i].dim() == t.dim() and c[i].shape[d] != t.shape[d] for c in columns[1:]):
                varying.add((i, d))
    if not varying:
        varying = {(i, 1) for i, t in enumerate(first) if t.dim() >= 2 and not (t.is_floating_point() or t.is_complex())}
    sizes = {first[i].shape[d] for i, d in varying}
    # dim 1 of any tensor of the same length goes with them (ids, attention mask, labels, embeddings)
    family = {(i, 1) for i, t in enumerate(first) if t.dim() >= 2 and t.shape[1] in sizes}
    return sorted(varying | family)


def longest_length(batch: Batch, dims: Sequence[tuple[int, int]]) -> int:
    """The longest of the length ``dims`` (see :func:`length_dims`) in ``batch``."""
    leaves = tensors(batch)
    return max(leaves[i].shape[d] for i, d in dims)


def resize_length(batch: Batch, dims: Sequence[tuple[int, int]], length: int, *, longest: int | None = None) -> Batch:
    """``batch`` with the length ``dims`` cut or tiled to ``length`` (a template for estimates:
    the values are the batch's own, repeated).

    With ``longest`` (the batch's longest length dim), every length dim is scaled by
    ``length / longest`` instead, so that an encoder-decoder batch keeps the ratio of its input and
    label lengths.
    """
    wanted: dict[int, list[int]] = {}
    for i, d in dims:
        wanted.setdefault(i, []).append(d)
    counter = iter(range(10**9))

    def resize(t: torch.Tensor) -> torch.Tensor:
        i = next(counter)
        for d in wanted.get(i, ()):
            n = t.shape[d]
            new = length if longest is None else max(1, round(n * length / longest))
            if new <= n:
                t = t.narrow(d, 0, new)
            else:
                index = torch.arange(new, device=t.device) % n
                t = t.index_select(d, index)
        return t

    return map_tensors(batch, resize)


def pad_to_longest(batches: Sequence[Batch], *, values: Mapping[Any, float] | Sequence[float] | None = None, default: float = 0) -> Batch:
    """Join batches padded to different lengths into one, padding each to the longest first.

    Every dim past the batch dim whose size differs between the batches is padded on the right.
    The padding value of each tensor comes from ``values`` (by key for dict batches, by position
    for tuples and lists); else it is ``-100`` (the ignore index of ``cross_entropy``) for
    ``labels`` and for an integer tensor the collate already padded with -100, and ``default`` (0)
    for everything else, ``input_ids`` and ``attention_mask`` included.

    Example:
        >>> a = {"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.ones(2, 3, dtype=torch.long)}
        >>> b = {"input_ids": torch.ones(1, 5, dtype=torch.long), "labels": torch.ones(1, 5, dtype=torch.long)}
        >>> joined = pad_to_longest([a, b])
        >>> joined["labels"].tolist()[0] == [1, 1, 1, -100, -100]
        True
    """
    if not batches:
        raise ValueError("Invalid batches []: give at least one batch to join")
    first = batches[0]
    if len(batches) == 1:
        return first
    batches = [first, *(_aligned(first, b) for b in batches[1:])]  # dicts join by key, whatever their order
    columns = _columns(batches)
    keys = _tensor_keys(first)
    fills = []
    for position, key in enumerate(keys):
        if isinstance(values, Mapping) and key in values:
            fills.append(values[key])
        elif isinstance(values, Sequence) and not isinstance(values, str) and position < len(values):
            fills.append(values[position])
        elif key == "labels" or any(_holds(c[position], -100) for c in columns):
            fills.append(-100)  # labels, or a tensor the collate already padded with the ignore index
        else:
            fills.append(default)
    joined = []
    for parts, fill in zip(zip(*columns), fills):
        shape = [max(p.shape[d] for p in parts) for d in range(parts[0].dim())]
        padded = []
        for p in parts:
            pad: list[int] = []
            for d in range(p.dim() - 1, 0, -1):  # F.pad wants the last dim first
                pad += [0, shape[d] - p.shape[d]]
            padded.append(torch.nn.functional.pad(p, pad, value=fill) if any(pad) else p)
        joined.append(torch.cat(padded, dim=0))
    it = iter(joined)
    lists = iter(_join_lists(batches))
    return _map(first, lambda _t: next(it), lambda _values: next(lists), batch_size(first))


def _holds(t: torch.Tensor, value: int) -> bool:
    return not (t.is_floating_point() or t.is_complex()) and t.dtype != torch.bool and bool((t == value).any())


def _tensor_keys(batch: Batch) -> list[Any]:
    """The dict key (or None) of each tensor of ``batch``, in order."""
    keys: list[Any] = []
    if isinstance(batch, Mapping):
        for k, v in batch.items():
            if isinstance(v, torch.Tensor):
                keys.append(k)
            else:
                keys.extend(_tensor_keys(v))
        return keys
    if isinstance(batch, (list, tuple)):
        for v in batch:
            keys.extend([None] if isinstance(v, torch.Tensor) else _tensor_keys(v))
        return keys
    return [None] if isinstance(batch, torch.Tensor) else []


def to_device(batch: Batch, device: torch.device | str) -> Batch:
    """``batch`` with every tensor moved to ``device``."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


def checked_batch(batch: Any, index: int) -> tuple[int, Any]:
    """``(samples, per-sample shapes)`` of the loader's batch number ``index``; an error naming the
    loader and the batch when it is not a batch autotune can cut (no tensor, a scalar, tensors that
    disagree on the batch size, no sample)."""
    try:
        size, shapes = size_and_shapes(batch)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"Invalid loader: its batch {index} is not a batch ({exc})") from None
    if size == 0:
        raise ValueError(
            f"Invalid loader: its batch {index} holds no sample (dim 0 of size 0); drop empty batches from the "
            "loader (a sampler or collate_fn that yields them)"
        )
    return size, shapes


def tokens_per_sample(batch: Any) -> int | None:
    """Tokens in one sample of ``batch``: its ``input_ids``' length (a dict or an object holding them), or a 2-D
    integer tensor's; None where the batch has no tokens."""
    ids = batch.get("input_ids") if isinstance(batch, dict) else getattr(batch, "input_ids", None)
    if ids is None:
        leaves = tensors(batch)
        ids = next((t for t in leaves if t.dim() == 2 and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool), None)
    if ids is None or ids.dim() < 2:
        return None
    return int(ids[0].numel())
