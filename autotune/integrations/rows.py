"""Batches whose rows are not samples: what a trainer's collator makes of one sample, found out.

TRL's preference collators (``DPOTrainer``, ``RewardTrainer``) stack each pair's chosen and rejected
sequences as two rows of one tensor: the chosen rows of the whole batch first, then the rejected
ones. Cut anywhere but at the collator's own sizes, such a batch loses its pairs (one row is a
chosen sequence without its rejected one). :func:`rows_of` asks the collator itself: it collates one
sample and two, and learns how many rows a sample becomes in each tensor and in which order. A
:class:`Rows` then turns a collated batch into one with a sample per row (``to_samples``: each
multi-row tensor gets a dimension for a sample's rows), which planning and the loss check can cut
and repeat as any batch, and back into the collator's own layout (``to_rows``) before the loss sees it.
The tensors are the same; only their view changes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from autotune.batches import batch_size

__all__ = ["ONE_ROW", "Rows", "rows_of"]


@dataclass(frozen=True)
class Rows:
    """How many rows a collator makes of one sample, and where it puts them.

    Attributes:
        per_sample: rows per sample in the multi-row tensors (1: every row is a sample).
        grouped: the rows come grouped by their place in a sample (all first rows, then all second
            rows: TRL's layout) rather than sample by sample.
        keys: the tensors with ``per_sample`` rows per sample (the others have one).
    """

    per_sample: int = 1
    grouped: bool = True
    keys: frozenset[str] = field(default_factory=frozenset)

    def to_samples(self, batch: Any) -> Any:
        """``batch`` with one sample per row: each multi-row tensor ``(per_sample x n, ...)`` as
        ``(n, per_sample, ...)``."""
        if self.per_sample == 1:
            return batch
        out = dict(batch)
        for key in self.keys:
            t = batch[key]
            n = t.shape[0] // self.per_sample
            out[key] = t.view(self.per_sample, n, *t.shape[1:]).transpose(0, 1) if self.grouped else t.view(n, self.per_sample, *t.shape[1:])
        return out

    def to_rows(self, batch: Any) -> Any:
        """The collator's own layout of a batch :meth:`to_samples` made (cut or repeated since)."""
        if self.per_sample == 1:
            return batch
        out = dict(batch)
        for key in self.keys:
            t = batch[key]
            rows = t.transpose(0, 1) if self.grouped else t
            out[key] = rows.reshape(t.shape[0] * self.per_sample, *t.shape[2:])
        return out

    def samples_in(self, batch: Any) -> int:
        """The samples in a batch in the collator's layout."""
        if self.per_sample == 1:
            return batch_size(batch)
        return int(batch[next(iter(self.keys))].shape[0]) // self.per_sample


ONE_ROW = Rows()


def _tensor_rows(batch: Any) -> dict[str, int] | None:
    if not isinstance(batch, Mapping):
        return None
    return {k: int(v.shape[0]) for k, v in batch.items() if torch.is_tensor(v) and v.dim() > 0}


def _agrees(got: torch.Tensor, want: torch.Tensor) -> bool:
    """The rows agree where both have values (a batch pads its rows to its longest)."""
    common = tuple(slice(0, min(a, b)) for a, b in zip(got.shape, want.shape))
    return got.dim() == want.dim() and bool(torch.equal(got[common], want[common]))


def rows_of(collate: Callable[[list[Any]], Any], samples: Sequence[Any]) -> Rows:
    """What ``collate`` makes of a sample, from two of ``samples``: :data:`ONE_ROW` when every row is
    a sample (or the batches are not dicts of tensors).

    Raises:
        ValueError: the collator makes several rows of a sample in an order that is neither grouped
            nor sample by sample, or in different numbers per tensor.
    """
    if len(samples) < 2:
        return ONE_ROW
    one, two = collate([samples[0]]), collate([samples[0], samples[1]])
    rows_one, rows_two = _tensor_rows(one), _tensor_rows(two)
    if not rows_one or not rows_two or rows_one.keys() != rows_two.keys():
        return ONE_ROW
    keys = {k for k, r in rows_one.items() if r > 1 and rows_two[k] == 2 * r}
    per = {rows_one[k] for k in keys}
    if not keys:
        return ONE_ROW
    if len(per) > 1 or any(rows_two[k] != 2 * r for k, r in rows_one.items()):
        raise ValueError(
            f"Invalid data collator {type(collate).__name__}: it makes {sorted(per)} rows of one sample in different tensors "
            f"({rows_one}); autotune plans in samples and cannot tell which rows belong together")
    (u,) = per
    for grouped in (True, False):
        places = [j * 2 for j in range(u)] if grouped else list(range(u))
        if all(_agrees(two[k][places], one[k]) for k in keys):
            return Rows(u, grouped, frozenset(keys))
    raise ValueError(
        f"Invalid data collator {type(collate).__name__}: it makes {u} rows of one sample, in an order that is neither "
        "grouped (all first rows, then all second rows) nor sample by sample; autotune plans in samples and cannot tell "
        "which rows belong together")
