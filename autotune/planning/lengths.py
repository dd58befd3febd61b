"""The memory model in length: from the shapes a loader has (and the lengths asked for), the curve of
each, fitted into one :class:`autotune.memory.shapes.ShapeModel` that sizes every batch by its shape."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from autotune import batches as B
from autotune.memory.shapes import fit_shape_model
from autotune.probe.trial import Looked, Workload
from autotune.step import min_micro_batch

__all__ = ["max_length", "shape_model_for"]


def shape_model_for(work: Workload, looked: Looked, found: Any, budget: int, upper: int, lengths: Sequence[int] | None) -> Any:
    """The shape model from the shapes the loader has (the shortest, one between and the probed,
    longest one) and the lengths asked for; None when the step cannot be estimated.

    A shape that cannot be estimated (an asked length longer than the model takes) is left out with
    a note; nothing longer than the longest batch seen is estimated unless asked.
    """
    estimator = work.estimator
    if estimator is None:
        work.notes.append("no model of memory against length: the step could not be estimated; every shape uses micro_batch")
        return None
    probed = B.per_sample_numel(work.batch)
    seen = sorted({B.per_sample_numel(t): t for t in looked.shapes}.items())
    templates = {probed: work.batch}
    if len(seen) > 1:
        for size, template in (seen[0], seen[len(seen) // 2]):
            templates.setdefault(size, template)
    if lengths:
        dims = B.length_dims([work.batch, *looked.shapes])
        longest = B.longest_length(work.batch, dims)
        accepted = max_length(work.model)
        for length in sorted(set(lengths)):
            if accepted is not None and length > accepted:
                work.notes.append(f"length {length} left out of the shape model: the model takes at most {accepted}")
                continue
            template = B.resize_length(work.batch, dims, length, longest=longest) if dims else None
            if template is not None:
                templates.setdefault(B.per_sample_numel(template), template)
    curves = {}
    for size, template in sorted(templates.items()):
        try:
            curves[size] = estimator.curve(None if size == probed else template)
        except Exception as exc:  # a shape the model cannot take: it will not be trained at either
            work.notes.append(f"per-sample size {size} left out of the shape model ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]})")
    return fit_shape_model(
        curves,
        probed_size=probed,
        probed_micro_batch=found.batch_size,
        probed_real_peak=found.peak,
        budget=budget,
        lower=min_micro_batch(work.model),
        upper=upper,
    )


def max_length(model: nn.Module) -> int | None:
    """The longest sequence a Hugging Face model takes (its position embeddings), when it says."""
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
