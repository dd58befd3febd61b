"""Packed rows: several sequences in one row, told apart by ``position_ids`` that restart inside it.

Packing trains as separate sequences only where the model reads those restarts as boundaries. Some do
not: Transformers 5 ignores a packed row's ``position_ids`` while ``config.use_cache`` is on, and every
token then attends to the sequences before it in the row (90% off the separate sequences' loss,
measured on a small Llama). :func:`packing_problem` measures it on the first packed row of the loader:
the logits of the row's second sequence, in the row and alone (:func:`packed_row` finds the row without
the model, so a loader without packed rows costs no forward); where they differ, ``fit`` refuses the
loader before training and ``plan`` says so in its notes. Nothing changes: no gradient, the modules'
modes and the RNGs put back.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from autotune.checks import is_one_shot
from autotune.rng import RNGState
from autotune.step import Precision, autocast, planning

__all__ = ["PackedRow", "packed_row", "packing_problem"]

_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}  # relative to the logits' size; half precision: 2e-2


def _restart(batch: Any) -> tuple[int, int, int] | None:
    """The first row whose ``position_ids`` restart inside it: (row, start, end) of its second sequence."""
    if not isinstance(batch, Mapping):
        return None
    positions, ids = batch.get("position_ids"), batch.get("input_ids")
    if not isinstance(positions, torch.Tensor) or not isinstance(ids, torch.Tensor) or positions.dim() != 2:
        return None
    drops = positions[:, 1:] <= positions[:, :-1]
    rows = drops.any(1).nonzero()
    if not len(rows):
        return None
    row = int(rows[0])
    starts = (drops[row].nonzero().flatten() + 1).tolist()
    end = starts[1] if len(starts) > 1 else positions.shape[1]
    return row, starts[0], end


def _logits(output: Any) -> torch.Tensor | None:
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else None


@dataclasses.dataclass(frozen=True)
class PackedRow:
    """The first row of the loader whose ``position_ids`` restart inside it."""

    batch_index: int
    row: int  # its row in that batch
    ids: torch.Tensor  # (1, length): the row
    positions: torch.Tensor  # (1, length)
    start: int  # where its second sequence starts
    end: int  # and ends


def packed_row(loader: Iterable[Any], *, max_batches: int = 4) -> PackedRow | None:
    """The first packed row among the first ``max_batches`` dict batches (its generators put back), or None."""
    if is_one_shot(loader):
        return None
    rng = RNGState(loader)
    try:
        for index, batch in enumerate(itertools.islice(loader, max_batches)):
            where = _restart(batch)
            if where is not None:
                row, start, end = where
                return PackedRow(index, row, batch["input_ids"][row: row + 1], batch["position_ids"][row: row + 1], start, end)
    finally:
        rng.restore()
    return None


def packing_problem(model: nn.Module, row: PackedRow, *, device: torch.device, precision: Precision = "fp32") -> str | None:
    """What is wrong with training ``row`` (:func:`packed_row`) on this model, in words (None: nothing found).

    Runs the model (no gradient, eval mode) on the row up to the end of its second sequence and on that
    sequence alone, and compares the second sequence's logits. A model whose forward does not take
    ``input_ids`` and ``position_ids``, or returns no logits, is not judged.
    """
    start, end = row.start, row.end
    ids, positions = row.ids.to(device), row.positions.to(device)
    modes = [(m, m.training) for m in model.modules()]
    rng = RNGState()
    try:
        model.eval()
        with torch.no_grad(), planning(), autocast(device.type, precision):
            try:
                packed = _logits(model(input_ids=ids[:, :end], position_ids=positions[:, :end]))
                alone = _logits(model(input_ids=ids[:, start:end], position_ids=positions[:, start:end]))
            except Exception:  # a forward that takes other arguments: not ours to judge
                return None
    finally:
        for m, training in modes:
            m.training = training
        rng.restore()
    if packed is None or alone is None or packed[:, start:end].shape != alone.shape:
        return None
    difference = float((packed[:, start:end].double() - alone.double()).abs().max())
    scale = float(alone.double().abs().max()) or 1.0
    if difference <= _TOLERANCE.get(alone.dtype, 2e-2) * scale:
        return None
    fix = ("set model.config.use_cache = False (Transformers then reads a packed row's position_ids as boundaries), "
           if getattr(getattr(model, "config", None), "use_cache", False) else "")
    return (f"batch {row.batch_index} packs several sequences in a row (its position_ids restart inside row "
            f"{row.row}, at position {start}), and {type(model).__name__} attends across them: measured, the second sequence's logits in the row "
            f"differ from the same sequence alone by {difference:.3g} (at most {scale:.3g}), so packed sequences would train "
            f"on each other; {fix}or give one sequence per row (padding, with an attention_mask)")
