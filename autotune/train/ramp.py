"""A target batch that grows during a run: fixed stages, or following the measured noise scale.

The batch worth training with is not constant: the critical batch (McCandlish et al. 2018) is small at
initialisation and grows as the loss falls (Merrill et al. 2025, "Critical Batch Size Revisited"),
which is why large runs ramp their batch (GPT-3, DeepSeek-V3). :class:`BatchRamp` gives ``fit`` such a
target, in one of two forms:

- :meth:`BatchRamp.fixed`: stages in samples (or loss items) seen, e.g. 256 until 2M samples, then 512;
- :meth:`BatchRamp.adaptive`: start at a batch and raise it to the largest of ``start x factor^k`` at
  or below both the measured noise scale over ``margin`` and the lower end of its range, once
  ``windows`` measured windows in a row asked for more than the current batch; never lowering it and
  never beyond ``maximum``. The meter forgets at each raise (the noise scale it follows has moved). It
  compares a window's first micro-batch with the whole window: see :data:`SPLIT_EVERY` for the windows
  it cuts in halves for that.

Every optimizer step stays exact for its own target (the same ``n_i / N`` weights); the micro-batch
does not change (it is planned for the largest target), the accumulation steps follow the target. The
learning rate at a raise (``lr``): by default (``"peak"``) the plan's rule while the schedule holds its
peak (a constant rate, a warmup, a stable phase) and, once the schedule decays, in proportion to the
target above the last target trained at the peak; or the rule at every target (``"follow"``), the first
target's all run (``"hold"``, as in Smith et al. 2018), in proportion to the target from the first
target's (``"linear"``), or the rule plus what a decaying schedule has taken, up to the linear coupling
(``"restore"``). The scheduler steps once per ``start`` samples seen, so a schedule made for the run's
samples ends where the run ends. Under data parallelism the ranks agree on each change in the exchange
they already make. The ramp keeps its state: pass the same object to a later ``fit`` and it continues
where it stopped.

Why this is long: :class:`BatchRamp` is one class of about 300 lines: both forms are one object that
``fit``, its checkpoint and the ranks' exchange read alike (the target of each window cut, the samples
seen, the vote), and the adaptive rule (``grid``, ``proposed``, ``vote``) sits beside the state it reads.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from autotune.checks import check_positive_int
from autotune.planning.plans import (
    Plan,
    even_micro_batches,
    largest_share,
    rotated_share,
)
from autotune.planning.scaling import LRRule, adjusted_bn_momentum, lr_scale
from autotune.train.noise import NoiseMeter

__all__ = ["PEAK_TOLERANCE", "SPLIT_EVERY", "BatchRamp", "RampChange", "plan_for_target"]

Unit = Literal["samples", "items"]
# An adaptive ramp's meter compares a window's first micro-batch with the whole window. In one process, a
# window that fits in one micro-batch is cut in two halves for it once every SPLIT_EVERY windows (the
# others run whole, as a fixed target's would); a window of several micro-batches is measured as it is,
# and so is every window with several ranks (a rank's own gradient against the global one).
SPLIT_EVERY = 8
Coupling = Literal["follow", "hold", "linear", "restore", "peak"]
# lr="peak": the schedule holds its peak while its rate is within this fraction of the highest it has held
PEAK_TOLERANCE = 0.01


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
                 factor: int = 2, margin: float = 3.0, windows: int = 10, unit: Unit = "samples", lr: Coupling = "peak") -> None:
        if unit not in ("samples", "items"):
            raise ValueError(f"Invalid unit {unit!r}: use 'samples' or 'items' (what fit's count counts)")
        if lr not in get_args(Coupling):
            raise ValueError(f"Invalid lr {lr!r}: use 'follow' (the plan's rule at each target), 'hold' (the first target's "
                             "learning rate all run), 'linear' (the first target's, times target / start), 'restore' "
                             "(linear while the schedule has decayed, up to the rule's at the schedule's first rate) or 'peak' "
                             "(the rule while the schedule holds its peak, linear above the last target trained there once it decays)")
        self.lr: Coupling = lr
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
                raise ValueError(f"Invalid margin {margin!r}: give a number >= 1 (the batch is kept at or below the measured "
                                 "noise scale over margin)")
            windows = check_positive_int("windows", windows, "measured windows in a row that must agree before a raise")
        assert start is not None and maximum is not None
        self.start, self.maximum, self.factor, self.margin, self.windows = start, maximum, factor, float(margin), windows
        self.measured = 0  # measured windows in a row that asked for more than the current target
        self.target = start
        self.seen = 0
        self.steps = 0
        self.changes: list[RampChange] = []
        self.scheduler_due = 0.0  # scheduler steps owed (one per `start` samples), carried between steps
        self.meter: Any = None  # adaptive: the noise meter, kept across fit calls (see fit)
        self._pending: deque[int] = deque()  # targets of windows cut and not yet trained
        self.pending_vote = 0.0  # the vote cast after the last step, for the next exchange (kept across fit calls)
        self.pending_proposal = 0.0  # the target proposed with it
        self.streak_low = 0  # the smallest target proposed in the current run of windows asking for a raise
        self.split = False  # whether the window cut last is cut in two halves for the meter (see SPLIT_EVERY)
        self.schedule_peak = 0.0  # lr="peak": the highest rate the schedule has held (first param group)
        self.pivot = start  # lr="peak": the target of the last step taken while the schedule held its peak

    @classmethod
    def fixed(cls, stages: Sequence[tuple[int, int]], *, unit: Unit = "samples", lr: Coupling = "peak") -> BatchRamp:
        """Stages ``[(from_seen, target), ...]``: the windows that start once at least ``from_seen``
        samples (or items) have been trained have the target ``target`` (windows count whole: a stage
        begins with the first window that starts at or after its count). The first stage starts at 0;
        the targets never shrink. ``lr``: the learning rate at a raise, as in :meth:`adaptive`.

        Example:
            >>> ramp = BatchRamp.fixed([(0, 256), (2_000_000, 512), (4_000_000, 1024)])
            >>> ramp.target, ramp.maximum
            (256, 1024)
        """
        return cls(stages=stages, unit=unit, lr=lr)

    @classmethod
    def adaptive(cls, start: int, maximum: int, *, factor: int = 2, margin: float = 3.0, windows: int = 10,
                 unit: Unit = "samples", lr: Coupling = "peak") -> BatchRamp:
        """Start at ``start``; raise the batch to follow the measured noise scale ``B``: to the largest of
        ``start x factor^k`` (and ``maximum``) at or below both ``B / margin`` and the lower end of
        ``B``'s range (two standard errors down), once ``windows`` measured windows in a row asked for
        more than the current batch (to the smallest they asked for). So ``margin`` keeps the batch
        between ``B / (margin x factor)`` and ``B / margin``: 3 (the default) holds it at most at a
        third of the measured noise scale, which overstates the batch worth taking when the curvature
        is uneven. The default was chosen on ``benchmarks/batch_ramp.py`` over six seeds and both ways the
        meter measures (one window in eight, every window): margin 2 lost loss where every window is
        measured, margin 4 saved the fewest steps where one in eight is (see ``docs/ramp.md``); a larger
        margin trades steps for loss. Never lowered. A first raise can skip several batches (a start from a
        measurement); the meter forgets what it measured at the old batch at each raise. ``lr``: how the
        learning rate couples to the batch, see :meth:`lr_factor` and :meth:`step_factors`: ``"peak"``
        (the default: the plan's rule while the schedule holds its peak, in proportion to the batch above
        the last target trained there once it decays), ``"follow"`` (the rule at every target),
        ``"hold"`` (the first target's learning rate all run), ``"linear"`` (the first target's times
        ``target / start``) or ``"restore"`` (the rule, lifted toward ``"linear"`` as the schedule
        decays). On the benchmark ``"peak"`` kept what ``"follow"`` saved with a constant learning rate
        (the two are one there) and what ``"linear"`` saved with a cosine schedule, where the rule at
        every raise anneals twice.

        Example:
            >>> BatchRamp.adaptive(64, 1024).target
            64
        """
        return cls(start=start, maximum=maximum, factor=factor, margin=margin, windows=windows, unit=unit, lr=lr)

    def lr_factor(self, target: int, base_batch: int, rule: LRRule) -> float:
        """What a step at ``target`` multiplies the scheduled learning rate by: the plan's rule at
        ``target`` (``lr="follow"``), at the first target all run (``"hold"``), or at the first target times
        ``target / start`` (``"linear"``: in proportion to the batch from the first target on, whatever
        the rule). ``"restore"`` and ``"peak"`` are ``"follow"`` here; :meth:`step_factors` moves them step
        by step, as they read the schedule."""
        if self.lr in ("follow", "restore", "peak"):
            return lr_scale(target / base_batch, rule)
        return lr_scale(self.start / base_batch, rule) if self.lr == "hold" else self._linear(target, base_batch, rule)

    def _linear(self, target: int, base_batch: int, rule: LRRule, origin: int | None = None) -> float:
        """The linear coupling's factor at ``target``: the rule's at ``origin`` (the first target unless
        given), times ``target / origin``."""
        origin = self.start if origin is None else origin
        return lr_scale(origin / base_batch, rule) * target / origin

    def step_factors(self, plan: Plan, groups: Sequence[dict[str, Any]]) -> list[float]:
        """What this step multiplies each param group's scheduled learning rate by (call it once per step):
        ``plan.lr_scale``, except with the two couplings that read the schedule.

        - ``lr="restore"``: a target above the first takes back, up to the linear coupling, what the
          schedule has decayed, never beyond the rule's scale at the schedule's first rate
          (``group["initial_lr"]``, which torch's schedulers set): ``max(rule, min(linear, rule x first /
          scheduled))``. Without a schedule, or while it holds its first rate, that is the rule.
        - ``lr="peak"``: the rule while the schedule holds its peak (the first param group's rate within
          :data:`PEAK_TOLERANCE` of the highest it has held: a constant rate, a warmup, the stable phase of
          warmup-stable-decay); once it has decayed, the rule's scale at the last target trained at the peak
          (the pivot) times ``target / pivot``: a raise then keeps the learning rate per sample, as
          ``"linear"`` does, where the schedule anneals already. Without a schedule that is the rule.
        """
        rule, known = plan.lr_scale, _known_rule(plan)
        if known is None or self.lr not in ("restore", "peak"):
            return [rule] * len(groups)
        target = plan.effective_batch
        if self.lr == "peak":
            scheduled = float(groups[0]["lr"])
            self.schedule_peak = max(self.schedule_peak, scheduled)
            if scheduled >= self.schedule_peak * (1 - PEAK_TOLERANCE):
                self.pivot = target
            return [self._linear(target, plan.base_batch, known, origin=self.pivot)] * len(groups)
        linear = self._linear(target, plan.base_batch, known)
        factors = []
        for group in groups:
            scheduled, first = group["lr"], group.get("initial_lr", group["lr"])
            factors.append(max(rule, min(linear, rule * first / scheduled)) if scheduled > 0 else rule)
        return factors

    @property
    def adaptive_form(self) -> bool:
        """Whether the ramp follows the noise scale (else fixed stages)."""
        return self.stages is None

    def __repr__(self) -> str:
        lr = f", lr={self.lr!r}" if self.lr != "peak" else ""
        if self.stages is not None:
            return f"BatchRamp.fixed({list(self.stages)!r}, unit={self.unit!r}{lr})"
        return (f"BatchRamp.adaptive({self.start}, {self.maximum}, factor={self.factor}, margin={self.margin:g}, windows={self.windows}, "
                f"unit={self.unit!r}{lr})")

    # --- a checkpoint ----------------------------------------------------------------------------

    _SETTINGS = ("stages", "start", "maximum", "factor", "margin", "windows", "unit", "lr")

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
        saved = {"lr": "follow", **state}  # a state saved before the lr setting existed followed the rule
        differ = [f"{k}={saved.get(k)!r} (this ramp: {getattr(self, k)!r})" for k in self._SETTINGS if saved.get(k) != getattr(self, k)]
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
        # counted from the steps taken, so that a resumed run splits the same windows
        self.split = self.stages is None and (self.steps + len(self._pending)) % SPLIT_EVERY == 0
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

    def grid(self) -> list[int]:
        """The targets an adaptive ramp can take: ``start`` times powers of ``factor``, and ``maximum``."""
        out = [self.start]
        while out[-1] < self.maximum:
            out.append(min(self.maximum, out[-1] * self.factor))
        return out

    def proposed(self, noise: Any, items_per_sample: float) -> int:
        """The target one measurement asks for: the largest of :meth:`grid` whose batch (in the noise
        scale's unit) is at most both the noise scale over ``margin`` and the lower end of its range, and
        never below the current target.

        Example:
            >>> from autotune.train.noise import NoiseScale
            >>> ramp = BatchRamp.adaptive(16, 1024, margin=2)  # the batches 16, 32, ..., 1024
            >>> ramp.proposed(NoiseScale(300.0, 40.0, 10.0, 1.0, 300.0, low=200.0, high=420.0), 1.0)
            128
        """
        per_sample = items_per_sample if self.unit == "items" else 1.0
        return self._grid_at_most(min(noise.value / self.margin, noise.low) / per_sample)

    def _grid_at_most(self, bound: float) -> int:
        """The largest of :meth:`grid` at or below ``bound``, never below the current target."""
        return max([self.target] + [t for t in self.grid() if t <= bound])

    def vote(self, noise: Any, items_per_sample: float, fresh: bool = True) -> tuple[float, float]:
        """This rank's vote after a step (1.0: raise) and the target it proposes, sent in the next
        exchange. It votes to raise once :meth:`proposed` has been above the current target for
        ``windows`` measured windows in a row (``fresh``: this step's window was measured); it proposes
        the smallest target those windows asked for."""
        if self.stages is not None or noise is None or self.target >= self.maximum:
            return 0.0, 0.0
        # Held for `windows` measured windows in a row: a vote at every step is a test at every step, and
        # one range out of many would miss the truth by chance.
        if fresh:
            wanted = self.proposed(noise, items_per_sample)
            if wanted > self.target:
                self.measured += 1
                self.streak_low = min(self.streak_low or wanted, wanted)
            else:
                self.measured, self.streak_low = 0, 0
        if self.measured >= self.windows and noise.steps >= self.windows:
            return 1.0, float(self.streak_low)
        return 0.0, 0.0

    def after_step(self, *, samples: int, items: int, vote: float, proposal: float = 0.0) -> RampChange | None:
        """A step of ``samples`` (``items``) trained, and the ranks' mean ``vote`` and ``proposal`` from
        the exchange: count it and change the target when a stage is reached, or when every rank voted to
        raise (to the largest of :meth:`grid` at or below the ranks' mean proposal)."""
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
            now = self._grid_at_most(proposal + 1e-6)
            if now == before:
                return None
            reason = (f"the noise scale over {self.margin:g}, and its range's lower end, lay at or above {now} ({self.unit}) "
                      f"for {self.windows} measured windows in a row, on every rank")
            if self.meter is not None:
                self.meter.forget()  # what it measured at the old batch: the noise scale has moved since
        self.target = now
        self.measured, self.streak_low = 0, 0
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
        """What the ramp would do with micro-batches of at most ``micro_batch`` per rank: per stage, the
        micro-batches per step and (with ``total`` samples) the optimizer steps. An adaptive ramp in one
        process cuts one window in :data:`SPLIT_EVERY` that fits in one micro-batch in two halves, for its
        meter."""
        def split(target: int) -> str:
            share = largest_share(target, world_size)
            sizes = even_micro_batches(share, micro_batch)
            size = f"{sizes[0]}" if min(sizes) == max(sizes) else f"{min(sizes)}-{max(sizes)}"
            one = self.adaptive_form and len(sizes) == 1 and world_size == 1
            halves = f" (one step in {SPLIT_EVERY}: 2 of {math.ceil(share / 2)})" if one else ""
            return (f"{len(sizes)} micro-batch{'es' if len(sizes) > 1 else ''} of {size} per step" + (" per rank" if world_size > 1 else "")
                    + halves)

        if self.stages is None:
            return [f"{t} per step: {split(t)}" for t in self.grid()] + [
                f"raised to the largest at or below the noise scale / {self.margin:g} and its range's lower end, after "
                f"{self.windows} measured windows in a row"]
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


def _known_rule(plan: Plan) -> LRRule | None:
    """The plan's learning-rate rule where it is one the ramp can apply at another target (None: the plan
    keeps its own scale at every target)."""
    return plan.lr_rule if plan.lr_rule in get_args(LRRule) else None  # type: ignore[return-value]


def plan_for_target(plan: Plan, target: int, *, micro_batch: int, rank: int = 0, ramp: BatchRamp | None = None) -> Plan:
    """``plan`` (made for the ramp's largest target) at another ``target``: micro-batches of at most
    ``micro_batch`` (the same at every stage), the accumulation steps of this rank's share, the learning
    rate by the plan's rule for this target (as ``ramp`` couples it, see :meth:`BatchRamp.lr_factor`),
    the BatchNorm momentum per micro-batch for these steps."""
    share = rotated_share(target, plan.world_size, rank, 0)
    micro_batch = max(1, min(micro_batch, share))  # a target below the plan's micro-batch: one micro-batch of it
    sizes = even_micro_batches(share, micro_batch)
    scale, rule = plan.lr_scale, _known_rule(plan)
    if rule is not None:
        scale = ramp.lr_factor(target, plan.base_batch, rule) if ramp is not None else lr_scale(target / plan.base_batch, rule)
    momentum = None
    if plan.bn_momentum is not None:
        base = 1 - (1 - plan.bn_momentum) ** plan.accumulation_steps
        momentum = adjusted_bn_momentum(base, len(sizes))
    return dataclasses.replace(plan, effective_batch=target, micro_batches=sizes, accumulation_steps=len(sizes),
                               micro_batch=micro_batch, lr_scale=scale, lr=plan.base_lr * scale, bn_momentum=momentum)
