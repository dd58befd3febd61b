"""Packed rows: several sequences in one row, told apart by ``position_ids`` that restart inside it.

Packing trains as separate sequences only where the model reads those restarts as boundaries. Some do
not: Transformers 5 ignores a packed row's ``position_ids`` while ``config.use_cache`` is on, and every
token then attends to the sequences before it in the row (90% off the separate sequences' loss,
measured on a small Llama). :func:`packing_problem` measures it on the first packed row of the loader:
the logits of the row's second sequence, in the row and alone; where they differ, ``fit`` refuses the
loader before training and ``plan`` says so in its notes. Nothing changes: no gradient, the modules'
modes and the RNGs put back.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from autotune.checks import is_one_shot
from autotune.rng import RNGState
from autotune.step import Precision, autocast, planning

__all__ = ["packing_problem"]

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


def packing_problem(model: nn.Module, loader: Iterable[Any], *, device: torch.device, precision: Precision = "fp32",
                    max_batches: int = 4) -> str | None:
    """What is wrong with the loader's packed rows on this model, in words (None: nothing found).

    Looks at the first ``max_batches`` dict batches for ``position_ids`` that restart inside a row; on
    the first such row, runs the model (no gradient, eval mode) on the row up to the end of its second
    sequence and on that sequence alone, and compares the second sequence's logits. A model whose
    forward does not take ``input_ids`` and ``position_ids``, or returns no logits, is not judged.
    """
    if is_one_shot(loader):
        return None
    rng = RNGState(loader)
    modes = [(m, m.training) for m in model.modules()]
    try:
        found = None
        for index, batch in enumerate(itertools.islice(loader, max_batches)):
            where = _restart(batch)
            if where is not None:
                found = (index, batch, where)
                break
        if found is None:
            return None
        index, batch, (row, start, end) = found
        ids = batch["input_ids"][row: row + 1].to(device)
        positions = batch["position_ids"][row: row + 1].to(device)
        model.eval()
        with torch.no_grad(), planning(), autocast(device.type, precision):
            try:
                packed = _logits(model(input_ids=ids[:, :end], position_ids=positions[:, :end]))
                alone = _logits(model(input_ids=ids[:, start:end], position_ids=positions[:, start:end]))
            except Exception:  # a forward that takes other arguments: not ours to judge
                return None
        if packed is None or alone is None or packed[:, start:end].shape != alone.shape:
            return None
        difference = float((packed[:, start:end].double() - alone.double()).abs().max())
        scale = float(alone.double().abs().max()) or 1.0
        if difference <= _TOLERANCE.get(alone.dtype, 2e-2) * scale:
            return None
    finally:
        for m, training in modes:
            m.training = training
        rng.restore()
    fix = ("set model.config.use_cache = False (Transformers then reads a packed row's position_ids as boundaries), "
           if getattr(getattr(model, "config", None), "use_cache", False) else "")
    return (f"batch {index} packs several sequences in a row (its position_ids restart inside row {row}, at position {start}), "
            f"and {type(model).__name__} attends across them: measured, the second sequence's logits in the row differ from "
            f"the same sequence alone by {difference:.3g} (at most {scale:.3g}), so packed sequences would train on each other; "
            f"{fix}or give one sequence per row (padding, with an attention_mask)")
