"""A target batch that grows during a run: fixed stages, or following the measured noise scale.

The batch worth training with is not constant: the critical batch (McCandlish et al. 2018) is small at
initialisation and grows as the loss falls (Merrill et al. 2025, "Critical Batch Size Revisited"),
which is why large runs ramp their batch (GPT-3, DeepSeek-V3). :class:`BatchRamp` gives ``fit`` such a
target, in one of two forms:

- :meth:`BatchRamp.fixed`: stages in samples (or loss items) seen, e.g. 256 until 2M samples, then 512;
- :meth:`BatchRamp.adaptive`: start at a batch and multiply it (by 2) when the measured noise scale's
  whole range lies well above the current batch (its lower end at least ``margin`` times it), never
  lowering it and never beyond ``maximum``. The meter compares a window's first micro-batch with the
  whole window, so an adaptive ramp trains micro-batches of at most half its first target (every window
  then holds two micro-batches at least), the same size all run.

Every optimizer step stays exact for its own target (the same ``n_i / N`` weights); the micro-batch
does not change (it is planned for the largest target), the accumulation steps follow the target; the
learning rate follows the plan's rule for each target; the scheduler steps once per ``start`` samples
seen, so a schedule made for the run's samples ends where the run ends. Under data parallelism the
ranks agree on each change in the exchange they already make. The ramp keeps its state: pass the same
object to a later ``fit`` and it continues where it stopped.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from autotune.checks import check_positive_int
from autotune.planning.plans import (
    Plan,
    even_micro_batches,
    largest_share,
    rotated_share,
)
from autotune.planning.scaling import adjusted_bn_momentum, lr_scale
from autotune.train.noise import NoiseMeter

__all__ = ["BatchRamp", "RampChange", "plan_for_target", "ramp_micro_batch"]

Unit = Literal["samples", "items"]


@dataclass(frozen=True)
class RampChange:
    """One change of the target batch.

    Attributes:
        step: the optimizer step (over the ramp's whole life) after which the new target applies.
        seen: samples (or items, see ``BatchRamp.unit``) trained when the new target began.
        before: the target until then.
        target: the new target.
        reason: why, in words (the stage reached, or the noise scale's range against the batch).
    """

    step: int
    seen: int
    before: int
    target: int
    reason: str


class BatchRamp:
    """The target batch of a run that grows as it trains; make one with :meth:`fixed` or :meth:`adaptive`.

    Attributes:
        target: the target batch now (samples per optimizer step over all ranks).
        maximum: the largest target it can reach (what the plan is made for).
        start: the first target (the scheduler steps once per ``start`` samples).
        unit: what the stages and the noise scale count: ``"samples"`` or ``"items"`` (``fit``'s ``count``).
        seen: samples (or items) trained so far under this ramp.
        steps: optimizer steps taken under this ramp.
        changes: every :class:`RampChange`, in order.
    """

    def __init__(self, *, stages: Sequence[tuple[int, int]] | None = None, start: int | None = None, maximum: int | None = None,
                 factor: int = 2, margin: float = 2.0, windows: int = 10, unit: Unit = "samples") -> None:
        if unit not in ("samples", "items"):
            raise ValueError(f"Invalid unit {unit!r}: use 'samples' or 'items' (what fit's count counts)")
        self.unit: Unit = unit
        self.stages: tuple[tuple[int, int], ...] | None = None
        if stages is not None:
            self.stages = _checked_stages(stages)
            start, maximum = self.stages[0][1], self.stages[-1][1]
        else:
            start = check_positive_int("start", start, "the target batch the ramp begins with")
            maximum = check_positive_int("maximum", maximum, "the largest target batch it may reach")
            if maximum < start:
                raise ValueError(f"Invalid maximum {maximum}: it is below start={start}; the ramp never lowers the batch; "
                                 f"give maximum >= {start}")
            factor = check_positive_int("factor", factor, "what the batch is multiplied by at a raise")
            if factor < 2:
                raise ValueError(f"Invalid factor {factor}: a raise must grow the batch; give factor >= 2")
            if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 1:
                raise ValueError(f"Invalid margin {margin!r}: give a number >= 1 (raise when the noise scale's lower end "
                                 "is at least margin times the batch)")
            windows = check_positive_int("windows", windows, "measured windows in a row that must agree before a raise")
        assert start is not None and maximum is not None
        self.start, self.maximum, self.factor, self.margin, self.windows = start, maximum, factor, float(margin), windows
        self.measured = 0  # measured windows in a row whose range lay at or above margin x the batch
        self.target = start
        self.seen = 0
        self.steps = 0
        self.changes: list[RampChange] = []
        self.scheduler_due = 0.0  # scheduler steps owed (one per `start` samples), carried between steps
        self.meter: Any = None  # adaptive: the noise meter, kept across fit calls (see fit)
        self._pending: deque[int] = deque()  # targets of windows cut and not yet trained
        self.pending_vote = 0.0  # the vote cast after the last step, for the next exchange (kept across fit calls)

    @classmethod
    def fixed(cls, stages: Sequence[tuple[int, int]], *, unit: Unit = "samples") -> BatchRamp:
        """Stages ``[(from_seen, target), ...]``: the windows that start once at least ``from_seen``
        samples (or items) have been trained have the target ``target`` (windows count whole: a stage
        begins with the first window that starts at or after its count). The first stage starts at 0;
        the targets never shrink.

        Example:
            >>> ramp = BatchRamp.fixed([(0, 256), (2_000_000, 512), (4_000_000, 1024)])
            >>> ramp.target, ramp.maximum
            (256, 1024)
        """
        return cls(stages=stages, unit=unit)

    @classmethod
    def adaptive(cls, start: int, maximum: int, *, factor: int = 2, margin: float = 2.0, windows: int = 10,
                 unit: Unit = "samples") -> BatchRamp:
        """Start at ``start``; after a step whose measured noise scale's range lies at or above
        ``margin`` times the batch (its lower end, two standard errors down), multiply the batch by
        ``factor``, up to ``maximum``. Decided from the range, not the point estimate, and only when it
        held for ``windows`` measured windows in a row (a range from two or three windows says little,
        and one range out of many misses by chance), so that noise in the meter cannot raise the
        batch; never lowered.

        Example:
            >>> BatchRamp.adaptive(64, 1024).target
            64
        """
        return cls(start=start, maximum=maximum, factor=factor, margin=margin, windows=windows, unit=unit)

    @property
    def adaptive_form(self) -> bool:
        """Whether the ramp follows the noise scale (else fixed stages)."""
        return self.stages is None

    def __repr__(self) -> str:
        if self.stages is not None:
            return f"BatchRamp.fixed({list(self.stages)!r}, unit={self.unit!r})"
        return (f"BatchRamp.adaptive({self.start}, {self.maximum}, factor={self.factor}, margin={self.margin:g}, windows={self.windows}, "
                f"unit={self.unit!r})")

    # --- a checkpoint ----------------------------------------------------------------------------

    _SETTINGS = ("stages", "start", "maximum", "factor", "margin", "windows", "unit")

    def state_dict(self) -> dict[str, Any]:
        """Where the ramp stands: its settings, target, what it has trained, its changes and an
        adaptive ramp's noise meter, as plain values to save with a checkpoint (``fit(checkpoint=...)``
        saves it for you); :meth:`load_state_dict` takes it back."""
        state = {k: copy.deepcopy(v) for k, v in vars(self).items() if k not in ("meter", "_pending")}
        state["changes"] = [dataclasses.asdict(c) for c in self.changes]
        state["meter"] = self.meter.state_dict() if self.meter is not None else None
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from what :meth:`state_dict` gave, on a ramp made with the same settings.

        Raises:
            ValueError: the settings differ (naming them), before anything changes.
        """
        differ = [f"{k}={state.get(k)!r} (this ramp: {getattr(self, k)!r})" for k in self._SETTINGS if state.get(k) != getattr(self, k)]
        if differ:
            raise ValueError(f"Invalid ramp state: it was saved by a ramp with other settings: {', '.join(differ)}; make the ramp "
                             "as the saved run made it")
        for k, v in state.items():
            if k not in ("meter", "changes"):
                setattr(self, k, copy.deepcopy(v))
        self.changes = [RampChange(**c) for c in state["changes"]]
        if state["meter"] is not None:
            self.meter = NoiseMeter()
            self.meter.load_state_dict(state["meter"])
        self._pending.clear()

    # --- inside fit ------------------------------------------------------------------------------

    def begin_epoch(self) -> None:
        """A new pass over the loader: no window of it is cut yet."""
        self._pending.clear()

    def window_target(self) -> int:
        """The target of the next window cut. Fixed stages in samples are read at the samples seen
        when that window starts (the windows cut ahead of training counted as full)."""
        target = self.target
        if self.stages is not None and self.unit == "samples":
            ahead = self.seen + sum(self._pending)
            target = max(t for at, t in self.stages if at <= ahead)
        self._pending.append(target)
        return target

    def skipped(self, samples: int) -> None:
        """A window with no loss item ran and took no step: its samples count as seen."""
        if self._pending:
            self._pending.popleft()
        self.seen += 0 if self.unit == "items" else samples

    def trained_target(self) -> int:
        """The target of the window that just ran (the oldest window cut and not yet counted)."""
        return self._pending[0] if self._pending else self.target

    def vote(self, noise: Any, items_per_sample: float) -> float:
        """This rank's vote after a measured step (1.0: raise), sent in the next exchange."""
        if self.stages is not None or noise is None or self.target >= self.maximum:
            return 0.0
        batch = self.target * (items_per_sample if self.unit == "items" else 1.0)
        # Held for `windows` measured windows in a row: a vote at every step is a test at every step, and
        # one range out of many would miss the truth by chance.
        self.measured = self.measured + 1 if noise.low >= self.margin * batch else 0
        return 1.0 if self.measured >= self.windows and noise.steps >= self.windows else 0.0

    def after_step(self, *, samples: int, items: int, vote: float) -> RampChange | None:
        """A step of ``samples`` (``items``) trained, and the ranks' mean ``vote`` from the exchange:
        count it and change the target when a stage is reached or every rank voted to raise."""
        if self._pending:
            self._pending.popleft()
        self.steps += 1
        self.seen += items if self.unit == "items" else samples
        before = self.target
        if self.stages is not None:
            if self.unit == "samples":
                now = self._pending[0] if self._pending else max(t for at, t in self.stages if at <= self.seen)
            else:
                now = max(t for at, t in self.stages if at <= self.seen)
            if now == before:
                return None
            at = max(at for at, t in self.stages if t == now)
            reason = f"stage from {at:,} {self.unit} reached ({self.seen:,} trained)"
        else:
            if vote < 1.0 - 1e-9 or before >= self.maximum:
                return None
            now = min(self.maximum, before * self.factor)
            reason = (f"the noise scale's range lies at or above {self.margin:g} x the batch of {before} "
                      f"({self.unit}), on every rank")
        self.target = now
        self.measured = 0
        change = RampChange(self.steps, self.seen, before, now, reason)
        self.changes.append(change)
        return change

    def scheduler_steps(self, samples: int) -> int:
        """How many times to step the scheduler after a step of ``samples``: one per ``start`` samples."""
        self.scheduler_due += samples / self.start
        n = math.floor(self.scheduler_due + 1e-9)
        self.scheduler_due -= n
        return n

    def describe(self, micro_batch: int, world_size: int = 1, total: int | None = None) -> list[str]:
        """What the ramp would do with micro-batches of at most ``micro_batch`` per rank (an adaptive
        ramp: at most half each target's share, for its meter): per stage, the micro-batches per step
        and (with ``total`` samples) the optimizer steps."""
        def split(target: int) -> str:
            share = largest_share(target, world_size)
            micro = min(micro_batch, max(1, math.ceil(share / 2))) if self.adaptive_form else micro_batch
            sizes = even_micro_batches(share, micro)
            size = f"{sizes[0]}" if min(sizes) == max(sizes) else f"{min(sizes)}-{max(sizes)}"
            return f"{len(sizes)} micro-batch{'es' if len(sizes) > 1 else ''} of {size} per step" + (" per rank" if world_size > 1 else "")

        if self.stages is None:
            targets, t = [self.start], self.start
            while t < self.maximum:
                t = min(self.maximum, t * self.factor)
                targets.append(t)
            return [f"{t} per step: {split(t)}" for t in targets] + [
                f"raised x{self.factor} when the noise scale's lower end is >= {self.margin:g} x the batch"]
        lines = []
        for i, (at, target) in enumerate(self.stages):
            end = self.stages[i + 1][0] if i + 1 < len(self.stages) else total
            span = f"from {at:,} to {end:,} {self.unit}" if end is not None else f"from {at:,} {self.unit} on"
            steps = f", {math.ceil((end - at) / target):,} steps" if end is not None and self.unit == "samples" else ""
            lines.append(f"{target} per step {span}: {split(target)}{steps}")
        return lines


def _checked_stages(stages: Any) -> tuple[tuple[int, int], ...]:
    try:
        pairs = [tuple(s) for s in stages]
    except TypeError:
        raise ValueError(f"Invalid stages {stages!r}: give a list of (from_seen, target) pairs, e.g. [(0, 256), (2_000_000, 512)]") from None
    if not pairs:
        raise ValueError("Invalid stages []: give at least one (from_seen, target) pair, the first from 0")
    out = []
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"Invalid stage {pair!r}: give (from_seen, target), e.g. (2_000_000, 512)")
        at, target = pair
        if isinstance(at, bool) or not isinstance(at, int) or at < 0:
            raise ValueError(f"Invalid stage start {at!r}: give a whole number of samples (or items) >= 0")
        check_positive_int("stage target", target, "samples per optimizer step")
        out.append((at, target))
    if out[0][0] != 0:
        raise ValueError(f"Invalid stages: the first starts at {out[0][0]}, not 0; add a first stage (0, target)")
    for (a0, t0), (a1, t1) in zip(out, out[1:]):
        if a1 <= a0:
            raise ValueError(f"Invalid stages: {a1} does not come after {a0}; give the stages in increasing order of from_seen")
        if t1 < t0:
            raise ValueError(f"Invalid stages: the target shrinks from {t0} to {t1} at {a1:,}; a ramp never lowers the batch "
                             "(give non-decreasing targets)")
    return tuple(out)


def ramp_micro_batch(plan: Plan, ramp: BatchRamp, min_micro_batch: int = 1, target: int | None = None) -> int:
    """The micro-batch at a ramp's ``target`` (default: its first): the plan's (made for the largest
    target); for an adaptive ramp at most half the target's share per rank, so that every window holds
    two micro-batches for the noise meter to compare. It grows with the target: a raised target trains
    larger micro-batches, not the first target's halves for the whole run."""
    if not ramp.adaptive_form:
        return plan.micro_batch
    share = rotated_share(target or ramp.start, plan.world_size, 0, 0)
    return max(1, min(plan.micro_batch, max(min_micro_batch, math.ceil(share / 2))))


def plan_for_target(plan: Plan, target: int, *, micro_batch: int, rank: int = 0) -> Plan:
    """``plan`` (made for the ramp's largest target) at another ``target``: micro-batches of at most
    ``micro_batch`` (the same at every stage), the accumulation steps of this rank's share, the learning
    rate by the plan's rule for this target, the BatchNorm momentum per micro-batch for these steps."""
    share = rotated_share(target, plan.world_size, rank, 0)
    sizes = even_micro_batches(share, micro_batch)
    rule = plan.lr_rule
    scale = lr_scale(target / plan.base_batch, rule) if rule in ("linear", "sqrt", "none") else plan.lr_scale  # type: ignore[arg-type]
    momentum = None
    if plan.bn_momentum is not None:
        base = 1 - (1 - plan.bn_momentum) ** plan.accumulation_steps
        momentum = adjusted_bn_momentum(base, len(sizes))
    return dataclasses.replace(plan, effective_batch=target, micro_batches=sizes, accumulation_steps=len(sizes),
                               micro_batch=micro_batch, lr_scale=scale, lr=plan.base_lr * scale, bn_momentum=momentum)
