"""What ``fit`` returns: one :class:`StepRecord` per optimizer step and the :class:`FitResult` of the run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.planning.plans import Plan

__all__ = ["FitResult", "StepRecord"]


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step.

    Attributes:
        step: 1-based optimizer step over the whole run.
        epoch: 0-based epoch.
        samples: samples in the window.
        items: loss items in the window (samples, or what ``count`` returned).
        loss: the exact mean loss over the window's items.
        lr: the first param group's learning rate of this step (scaled; not applied when ``skipped``).
        micro_batch: the largest micro-batch used for this window.
        seconds: wall time of the step.
        micro_batches: the sizes of the micro-batches that ran (on this rank).
        noise_scale: the gradient noise scale measured so far (``B_simple`` in loss items; see
            :mod:`autotune.train.noise`), or None before it can be estimated.
        skipped: fp16 only: the GradScaler found non-finite gradients and skipped the optimizer
            step (the weights are those of the step before; the scale was lowered).
        target: the target batch of this step (with a :class:`autotune.BatchRamp`, the stage's).
        target_change: with a ramp, the change of target decided after this step and why, in words
            (else None).
    """

    step: int
    epoch: int
    samples: int
    items: int
    loss: float
    lr: float
    micro_batch: int
    seconds: float
    micro_batches: tuple[int, ...] = ()
    noise_scale: float | None = None
    skipped: bool = False
    target: int = 0
    target_change: str | None = None


@dataclass(frozen=True)
class FitResult:
    """What :func:`fit` did.

    Attributes:
        plan: the plan trained with; after an out-of-memory retry its micro-batch, accumulation
            steps, BatchNorm momentum and peak describe what training finally used.
        history: one :class:`StepRecord` per optimizer step.
        bn_tuning: the momentum study of ``bn=OptunaBN(...)`` (else None).
        noise_scale: the gradient noise scale over the run (:class:`autotune.train.noise.NoiseScale`:
            value, its range, windows averaged), None when it was not measured (``noise_note``
            says why).
        noise_note: why the noise scale is missing or only a lower bound, in words; None when it
            was measured with both ends of its range.
        ramp: the :class:`autotune.BatchRamp` given as ``target_batch`` (its state after the run:
            pass it to a later ``fit`` to continue), else None.
        ramp_changes: the target changes in this run (:class:`autotune.train.ramp.RampChange`: when and why).
    """

    plan: Plan
    history: tuple[StepRecord, ...]
    bn_tuning: Any = None
    noise_scale: Any = None
    noise_note: str | None = None
    ramp: Any = None
    ramp_changes: tuple[Any, ...] = ()

    def advice(self) -> str | None:
        """Plain words when the target batch is far from the measured noise scale (else None).

        Both are in loss items: with ``count``, the target is the mean items per step.
        """
        if self.noise_scale is None:
            return None
        from autotune.train.noise import advice

        full = [r.items for r in self.history if r.samples == self.plan.effective_batch] or [r.items for r in self.history]
        items = round(sum(full) / len(full)) if full else self.plan.effective_batch
        return advice(self.noise_scale, items)

    @property
    def samples(self) -> int:
        """Samples trained on, over all steps."""
        return sum(r.samples for r in self.history)
