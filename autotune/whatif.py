"""What would make the batch fit: the largest micro-batch under other settings, estimated.

When a model's weights and optimizer state fill most of the device, the question is not only "how
many samples fit" but "what should I change". The estimator answers it without a GPU and without
touching the model: for each combination of

- precision: fp32, or bf16 autocast (fp16 when that is what you train in),
- activation checkpointing: off, or on (the model's blocks; see :mod:`autotune.checkpointing`),
- optimizer: the one given, or one with smaller state (SGD with momentum: one buffer per parameter
  instead of Adam's two; SGD without momentum when the given one is SGD with momentum),

it estimates the largest micro-batch and the peak per sample. Every row is an estimate; the row of
your own settings is the plan's, verified by a real step.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .units import format_bytes

__all__ = ["WhatIf", "WhatIfRow", "estimate_rows", "what_if"]


@dataclass(frozen=True)
class WhatIfRow:
    """One combination of settings and what it allows.

    Attributes:
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        checkpointing: activation checkpointing on the model's blocks.
        optimizer: the optimizer, e.g. ``"AdamW (given)"`` or ``"SGD with momentum"``.
        micro_batch: the largest micro-batch that fits (0: not even the smallest).
        per_sample: bytes each sample adds to the peak (None when it could not be measured).
        fixed: bytes of the peak that do not grow with the samples (weights, gradients, state).
        changes: how many settings differ from yours (0: your own row).
        verified: whether ``micro_batch`` ran for real (your own row, when the plan verified it).
    """

    precision: str
    checkpointing: bool
    optimizer: str
    micro_batch: int
    per_sample: float | None
    fixed: float | None
    changes: int
    verified: bool = False

    def describe(self) -> str:
        """The row's settings in words, e.g. ``"bf16 autocast, activation checkpointing"``."""
        parts = [f"{self.precision} autocast" if self.precision != "fp32" else "fp32"]
        if self.checkpointing:
            parts.append("activation checkpointing")
        parts.append(self.optimizer)
        return ", ".join(parts)


@dataclass(frozen=True)
class WhatIf:
    """The what-if table (see the module docstring).

    Attributes:
        rows: one per combination, yours first.
        budget: bytes a step may use.
        lower: the smallest micro-batch the model can train on.
    """

    rows: tuple[WhatIfRow, ...]
    budget: int
    lower: int = 1

    def fitting(self) -> tuple[WhatIfRow, ...]:
        """The rows in which at least the smallest micro-batch fits."""
        return tuple(r for r in self.rows if r.micro_batch >= self.lower)

    def smallest_change(self) -> WhatIfRow | None:
        """The row with the fewest changed settings that fits (the largest micro-batch among them)."""
        fits = [r for r in self.fitting() if r.changes > 0]
        if not fits:
            return None
        return min(fits, key=lambda r: (r.changes, -r.micro_batch))

    def __str__(self) -> str:
        lines = [
            f"{'precision':<10} {'checkpointing':<14} {'optimizer':<26} {'micro-batch':>11} {'per sample':>12} {'fixed':>12}  ",
        ]
        for r in self.rows:
            per = "-" if r.per_sample is None else format_bytes(r.per_sample)
            fixed = "-" if r.fixed is None else format_bytes(r.fixed)
            tag = "verified" if r.verified else ("yours, estimate" if r.changes == 0 else "estimate")
            lines.append(f"{r.precision:<10} {'on' if r.checkpointing else 'off':<14} {r.optimizer:<26} {r.micro_batch:>11} {per:>12} {fixed:>12}  {tag}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The table as a JSON-ready dict."""
        return {"budget": self.budget, "lower": self.lower, "rows": [dataclasses.asdict(r) for r in self.rows]}


def _smaller_optimizer(optimizer: torch.optim.Optimizer) -> tuple[str, Callable[[list[dict[str, Any]]], torch.optim.Optimizer]] | None:
    """An optimizer with less state than ``optimizer`` (for the table), or None if there is none."""
    if isinstance(optimizer, torch.optim.SGD):
        if any(g.get("momentum", 0) for g in optimizer.param_groups):
            return "SGD without momentum", lambda groups: torch.optim.SGD(groups, lr=0.01)
        return None
    return "SGD with momentum", lambda groups: torch.optim.SGD(groups, lr=0.01, momentum=0.9)


def _line(points: dict[int, int], size: int) -> tuple[float | None, float | None]:
    """(per-sample bytes, fixed bytes) from estimates: the slope between the two largest sizes."""
    sizes = sorted(points)
    if len(sizes) < 2:
        return None, None
    top = [b for b in sizes if b <= max(size, sizes[1])][-2:] if size else sizes[-2:]
    if len(top) < 2:
        top = sizes[:2]
    (b1, b2) = top
    per = (points[b2] - points[b1]) / (b2 - b1)
    return per, points[b2] - per * b2


def estimate_rows(
    work: Any,
    step: Callable[..., None],
    *,
    budget: int,
    upper: int,
    lower: int,
    own_micro_batch: int | None = None,
    verified: bool = False,
) -> WhatIf:
    """The table for a workload: every combination estimated with ``estimated_max``."""
    from .estimate import Estimator
    from .search import estimated_max

    precisions = ["fp32", "fp16" if work.precision == "fp16" else "bf16"]
    if work.precision != "fp32":
        precisions.reverse()
    given = f"{type(work.optimizer).__name__} (given)"
    optimizers: list[tuple[str, Any]] = [(given, None)]
    smaller = _smaller_optimizer(work.optimizer)
    if smaller is not None:
        optimizers.append(smaller)
    checkpointings = [bool(work.checkpointing), not work.checkpointing]
    rows = []
    for precision, ckpt, (name, factory) in itertools.product(precisions, checkpointings, optimizers):
        changes = int(precision != work.precision) + int(ckpt != bool(work.checkpointing)) + int(factory is not None)
        try:
            estimator = Estimator(work, step, precision=precision, checkpointing=ckpt, optimizer=factory)
            size, points = estimated_max(estimator, budget, upper, lower=lower)
        except ValueError:  # no blocks to checkpoint
            continue
        per, fixed = _line(points, size)
        own = changes == 0 and own_micro_batch is not None
        rows.append(WhatIfRow(precision, ckpt, name, own_micro_batch if own else size, per, fixed, changes, verified and own))  # type: ignore[arg-type]
    rows.sort(key=lambda r: (r.changes, r.precision != work.precision, r.checkpointing != bool(work.checkpointing)))
    return WhatIf(tuple(rows), budget, lower)


def what_if(
    model: torch.nn.Module,
    loader: Iterable[Any],
    *,
    target_batch: int,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: Any = None,
    device: torch.device | str | None = None,
    memory_limit: int | str | None = None,
    headroom: float | None = None,
    precision: str | None = None,
    checkpointing: bool = False,
    verify: bool = True,
    progress: bool = True,
    plan: Any = None,
) -> WhatIf:
    """The largest micro-batch under other precisions, with activation checkpointing, and with an
    optimizer of smaller state: one table, estimated; your own settings' row verified by a real step.

    Takes the arguments of :func:`autotune.plan` (or ``plan=``, one made already with them, whose
    budget and verified micro-batch are used). The model, optimizer and RNG are left as they were.

    Returns:
        A :class:`WhatIf`; ``str()`` of it is the table.

    Example:
        >>> print(autotune.what_if(model, loader, target_batch=512, memory_limit="24GiB"))  # doctest: +SKIP
    """
    from .distributed import parallel
    from .errors import NothingFits
    from .planner import plan as make_plan

    if parallel(model).fsdp:
        raise ValueError(
            "Invalid model for what_if: it is sharded with FSDP2, and the table is estimated from a copy of the whole "
            "model; call what_if on the model before fully_shard, or autotune.shard_plan for the figures per rank"
        )
    from .probe import Workload, _trial_step, min_micro_batch, sample_batch
    from .rng import RNGState
    from .step import default_loss, normalize_precision

    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    own: int | None = None
    try:
        p = plan if plan is not None else make_plan(
            model, loader, target_batch=target_batch, optimizer=optimizer, loss_fn=loss_fn, device=device,
            memory_limit=memory_limit, headroom=headroom, precision=precision, verify=verify,
            progress=progress, by_shape=False, checkpointing=checkpointing,
        )
        budget, own, dev = p.budget, p.micro_batch, torch.device(p.device)
        upper = -(-target_batch // p.world_size)
        verify, precision, checkpointing = p.verified, p.precision, p.checkpointing
    except NothingFits as exc:
        if exc.what_if is not None:
            return exc.what_if  # type: ignore[no-any-return]
        raise
    rng = RNGState(loader)
    try:
        batch, _, _, _ = sample_batch(loader)
    finally:
        rng.restore()
    from .distributed import parallel

    inner = parallel(model).inner
    work = Workload(model=inner, optimizer=optimizer, loss_fn=loss_fn or default_loss, batch=batch, device=dev,
                    precision=normalize_precision(precision), checkpointing=checkpointing)
    return estimate_rows(work, _trial_step, budget=budget, upper=upper, lower=min_micro_batch(inner),
                         own_micro_batch=own, verified=verify)
