"""The plan: micro-batch, accumulation steps, learning rate and BatchNorm momentum (pure).

A window is the set of samples of one optimizer step. ``target_batch`` samples per window are first
shared among ranks (the first ``target_batch % world_size`` ranks take one more), then each rank's
share is cut into ``accumulation_steps`` micro-batches whose sizes differ by at most one, larger
first. For example 250 samples with at most 64 per micro-batch become 63, 63, 62, 62.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from .units import format_bytes

__all__ = ["Plan", "Trial", "split_evenly", "window_layout"]


@dataclass(frozen=True)
class Trial:
    """One measurement of a training step at one micro-batch size.

    Attributes:
        batch_size: samples in the micro-batch.
        peak_memory: peak bytes of the step (for a step that ran out of memory: the bytes in use when
            it stopped, a lower bound).
        fits: whether the step stayed within the budget.
        seconds: wall time of the measurement.
        estimate: True for an estimate on the meta device, False for a real step on the device.
    """

    batch_size: int
    peak_memory: int
    fits: bool
    seconds: float
    estimate: bool

    def to_dict(self) -> dict[str, Any]:
        """The trial as a JSON-ready dict."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Plan:
    """How to train ``effective_batch`` samples per optimizer step on this device.

    Attributes:
        micro_batch: the largest micro-batch verified to fit; no micro-batch of the plan is larger.
        accumulation_steps: micro-batches per optimizer step on each rank
            (``ceil(per-rank share / micro_batch)``).
        effective_batch: samples per optimizer step over all ranks; always equals the target batch.
        world_size: number of data-parallel ranks.
        micro_batches: the micro-batch sizes of one window on this rank, as even as possible,
            e.g. ``(63, 63, 62, 62)`` for 250 samples with ``micro_batch=64``.
        lr: the learning rate to train with (``base_lr * lr_scale``; first param group).
        base_lr: the optimizer's learning rate before scaling (first param group).
        lr_scale: the factor applied to every param group's learning rate.
        lr_rule: ``"linear"``, ``"sqrt"`` or ``"none"``.
        base_batch: the batch size the base learning rate was tuned at.
        warmup_steps: recommended linear warm-up in optimizer steps (None: none needed or unknown).
        bn_momentum: BatchNorm momentum for ``accumulation_steps`` forwards per step, or None when
            the model has no BatchNorm with a numeric momentum.
        limiting_rank: under DDP, the rank whose memory set the micro-batch (None in one process).
        bn_mode: how BatchNorm statistics are kept in training (``"adjust"``, ``"pooled"``,
            ``"precise"``, ``"optuna"``), None without BatchNorm or when left alone.
        memory_limit: the limit in bytes.
        headroom: the fraction of the limit kept free.
        peak_memory: peak bytes of a training step at ``micro_batch`` (a real measurement unless
            ``verified`` is False).
        device: the device probed, e.g. ``"cuda:0"``.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        verified: False only for an estimate-only plan (``verify=False``): no step ran on the device.
        optimizer: the optimizer's class name, e.g. ``"AdamW"``.
        trials: every measurement, in the order made.
        notes: what a user should know about how the plan was made.
    """

    micro_batch: int
    accumulation_steps: int
    effective_batch: int
    world_size: int
    micro_batches: tuple[int, ...]
    lr: float
    base_lr: float
    lr_scale: float
    lr_rule: str
    base_batch: int
    warmup_steps: int | None
    bn_momentum: float | None
    memory_limit: int
    headroom: float
    peak_memory: int
    device: str
    precision: str
    verified: bool = True
    optimizer: str = ""
    bn_mode: str | None = None
    limiting_rank: int | None = None
    trials: tuple[Trial, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def budget(self) -> int:
        """Bytes the training step may use: the limit less the headroom."""
        return int(self.memory_limit * (1.0 - self.headroom))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """The plan back from :meth:`to_dict`'s output (unknown keys are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        values["micro_batches"] = tuple(values["micro_batches"])
        values["trials"] = tuple(Trial(**t) for t in values.get("trials", ()))
        values["notes"] = tuple(values.get("notes", ()))
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The plan as a JSON-ready dict (trials as a list of dicts)."""
        data = dataclasses.asdict(self)
        data["micro_batches"] = list(self.micro_batches)
        data["trials"] = [t.to_dict() for t in self.trials]
        data["notes"] = list(self.notes)
        data["budget"] = self.budget
        return data

    def __str__(self) -> str:
        lines = [
            f"micro_batch={self.micro_batch} accumulation_steps={self.accumulation_steps} "
            f"effective_batch={self.effective_batch} world_size={self.world_size}",
            f"micro-batches per window: {', '.join(map(str, self.micro_batches))}",
            f"lr={self.lr:.6g} (base {self.base_lr:.6g} at batch {self.base_batch}, "
            f"rule {self.lr_rule}, x{self.lr_scale:.4g})"
            + (f", warm-up {self.warmup_steps} steps" if self.warmup_steps else ""),
            f"bn_momentum={self.bn_momentum if self.bn_momentum is None else f'{self.bn_momentum:.6g}'}"
            + (f" (bn={self.bn_mode})" if self.bn_mode else ""),
            f"memory: peak {format_bytes(self.peak_memory)} at micro-batch {self.micro_batch}, "
            f"limit {format_bytes(self.memory_limit)}, headroom {self.headroom:.0%} "
            f"on {self.device} ({self.precision})",
            f"trials: {sum(not t.estimate for t in self.trials)} real, "
            f"{sum(t.estimate for t in self.trials)} estimates",
        ]
        if not self.verified:
            lines.append("estimate, not verified on a device")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def split_evenly(total: int, parts: int) -> tuple[int, ...]:
    """Cut ``total`` into ``parts`` whole sizes that differ by at most one, larger first.

    Example:
        >>> split_evenly(250, 4)
        (63, 63, 62, 62)
    """
    if parts < 1:
        raise ValueError(f"Invalid parts {parts!r}: it must be at least 1")
    base, extra = divmod(total, parts)
    return tuple(base + 1 if i < extra else base for i in range(parts))


def window_layout(
    target_batch: int, max_micro_batch: int, world_size: int = 1
) -> tuple[tuple[int, ...], ...]:
    """Micro-batch sizes of one window, per rank: ``layout[rank][i]``.

    Every rank runs the same number of micro-batches (so collectives line up); the sizes over all
    ranks add up to ``target_batch`` exactly, and none exceeds ``max_micro_batch``.

    Raises:
        ValueError: ``target_batch < world_size`` (a rank would get no sample) or a size below 1.

    Example:
        >>> window_layout(250, 64)
        ((63, 63, 62, 62),)
    """
    if max_micro_batch < 1:
        raise ValueError(f"Invalid max_micro_batch {max_micro_batch!r}: it must be at least 1")
    if world_size < 1:
        raise ValueError(f"Invalid world_size {world_size!r}: it must be at least 1")
    if target_batch < world_size:
        raise ValueError(
            f"Invalid target_batch {target_batch!r} for {world_size} ranks: every rank needs at "
            f"least one sample per step; use target_batch >= {world_size}"
        )
    shares = split_evenly(target_batch, world_size)
    steps = math.ceil(shares[0] / max_micro_batch)
    return tuple(split_evenly(share, steps) for share in shares)
