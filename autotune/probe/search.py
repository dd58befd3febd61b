"""Find the largest micro-batch whose training step fits a memory budget (pure).

Peak memory of a training step is close to a line in the batch size for fixed per-sample shapes:
``peak(b) = fixed + b * per_sample``. The search uses that in two phases:

1. **Estimates** (cheap, e.g. on fake tensors): two estimates give the line, the line gives a
   candidate, a few more estimates confirm the boundary (bisection where the line is off).
2. **Real steps** (costly): the candidate is run for real. The real peak rescales the estimated
   curve (``real(b) ~ ratio * estimate(b)``); with two real fits their own line is used. Each new
   candidate is the largest batch the current model predicts to fit, kept strictly between the
   largest real fit and the smallest real failure, so the bracket always shrinks. The search ends
   when the model predicts nothing larger, when the bracket closes, or after ``max_real`` steps.

Only a size that fitted in a real step is ever returned. Without estimates, the real phase starts
from one sample and a second, larger size to get a line.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from autotune.memory.curve import Curve

__all__ = ["Measurement", "SearchResult", "Trial", "estimated_max", "largest_fitting", "timed_at", "within_allocator"]


@dataclass(frozen=True)
class Measurement:
    """The outcome of running (or estimating) one step at one batch size.

    Attributes:
        fits: the step stayed within the budget.
        peak: peak bytes; for a step that did not fit, the bytes seen when it stopped (a lower bound).
    """

    fits: bool
    peak: int


@dataclass(frozen=True)
class Trial:
    """One measurement of a training step at one micro-batch size.

    Attributes:
        batch_size: samples in the micro-batch.
        peak_memory: peak bytes of the step (for a step that ran out of memory: the bytes in use when
            it stopped, a lower bound; for an estimate for CUDA: what the caching allocator reserves).
        fits: whether the step stayed within the budget.
        seconds: wall time of the measurement.
        estimate: True for an estimate (fake tensors, no data), False for a real step on the device.
        micro_step: seconds of the real step's steady micro-step, the optimizer state live (None: an estimate, or a
            step that stopped early); see :func:`autotune.probe.trial.phase_times`.
        optimizer_step: seconds of the real step's optimizer step (None as ``micro_step``).
        checkpointing: the activation checkpointing the step ran with: True on every block, a count on the first ones,
            False on none (``checkpointing="auto"`` tries several); None where not said (a plan saved before it was).
    """

    batch_size: int
    peak_memory: int
    fits: bool
    seconds: float
    estimate: bool
    micro_step: float | None = None
    optimizer_step: float | None = None
    checkpointing: bool | int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The trial as a JSON-ready dict."""
        return dataclasses.asdict(self)


def timed_at(trials: Iterable[Trial], micro_batch: int) -> tuple[float, float, int] | None:
    """What the real steps of ``micro_batch`` that fitted timed: the fastest micro-step, the fastest optimizer step
    and how many steps; None where none did."""
    timed = [t for t in trials if not t.estimate and t.fits and t.batch_size == micro_batch and t.micro_step is not None]
    if not timed:
        return None
    return min(t.micro_step for t in timed), min(t.optimizer_step or 0.0 for t in timed), len(timed)  # type: ignore[type-var]


@dataclass(frozen=True)
class SearchResult:
    """The answer of :func:`largest_fitting`.

    Attributes:
        batch_size: the largest size that fitted in a real step (0 when even 1 did not).
        peak: its real peak bytes (for 0: the bytes seen when one sample failed).
        smallest_failure: the smallest size seen to fail for real (None if none failed).
        estimated: the size the estimates pointed to (None without estimates).
    """

    batch_size: int
    peak: int
    smallest_failure: int | None
    estimated: int | None


def _largest_below(model: Callable[[int], float], budget: int, lo: int, hi: int) -> int:
    """Largest b in [lo, hi] with model(b) <= budget, assuming model grows with b (lo if none)."""
    if model(hi) <= budget:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if model(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def estimated_max(
    estimate: Callable[[int], int],
    budget: int,
    upper: int,
    *,
    lower: int = 1,
    start: int | None = None,
    max_estimates: int = 24,
) -> tuple[int, dict[int, int]]:
    """Largest ``b`` in ``[lower, upper]`` whose estimated peak is within ``budget``.

    Args:
        estimate: peak bytes of one step at batch ``b`` (assumed to grow with ``b``).
        budget: bytes available.
        upper: the largest size worth considering.
        lower: the smallest size that can train (2 for models whose BatchNorm needs two samples).
        start: the size to estimate first, when something already points at the answer (else
            ``lower``, then 16 for a line).
        max_estimates: a bound on calls to ``estimate``.

    Returns:
        ``(b, points)``: the size (0 if even ``lower`` is over budget) and every estimate made.
    """
    points: dict[int, int] = {}

    def est(b: int) -> int:
        if b not in points:
            points[b] = estimate(b)
        return points[b]

    lo, hi = lower - 1, upper + 1  # lo: the largest known fit (lower - 1: none); hi: the smallest known failure
    probe = lower if start is None else min(max(start, lower), upper)
    prev_width = None
    while len(points) < max_estimates:
        if est(probe) <= budget:
            lo = probe
        else:
            hi = probe
        width = hi - lo
        if width <= 1:
            break
        if lo < lower:  # nothing is known to fit: the smallest size next
            probe = lower
            continue
        if start is None and len(points) == 1:
            probe = min(upper, max(16, lower + 1))  # a second point for a line
            continue
        guess = _largest_below(Curve(points), budget, lo, hi - 1)
        if guess == lo:
            probe = lo + 1  # the line puts the boundary at lo: confirm with the neighbour
        elif prev_width is not None and width > prev_width // 2:
            probe = (lo + hi) // 2  # the line converges slowly here: bisect instead
        else:
            probe = guess
        prev_width = width
    return (lo if lo >= lower else 0), points


def largest_fitting(
    real: Callable[[int], Measurement],
    *,
    upper: int,
    budget: int,
    estimate: Callable[[int], int] | None = None,
    lower: int = 1,
    max_real: int = 8,
    tolerance: float = 0.03,
    start: int | None = None,
) -> SearchResult:
    """Largest batch size in ``[lower, upper]`` whose real step fits ``budget``.

    Args:
        real: runs the real step at a batch size and says whether it fitted.
        upper: never try more than this (e.g. the per-device target batch).
        budget: bytes the step may use.
        estimate: optional cheap peak estimate (bytes) for a batch size.
        lower: the smallest size that can train (1, or 2 for BatchNorm on 2-d inputs).
        max_real: a bound on real steps.
        tolerance: stop once the largest fit is within this fraction of the smallest failure.
        start: the first size to run, when the estimates already found it (``estimate`` is then
            only asked for the sizes around it).

    Returns:
        A :class:`SearchResult`; ``batch_size == 0`` means even ``lower`` samples did not fit.
    """
    if upper < 1:
        raise ValueError(f"Invalid upper {upper!r}: it must be at least 1")
    lower = min(max(1, lower), upper)
    estimated: int | None = None
    est_points: dict[int, int] = {}
    cached: Callable[[int], int] | None = None
    if estimate is not None:
        if start is None:
            estimated, est_points = estimated_max(estimate, budget, upper, lower=lower)
        else:
            estimated = start

        def cached(b: int) -> int:
            if b not in est_points:
                est_points[b] = estimate(b)
            return est_points[b]
    fits_at: dict[int, int] = {}  # real fits: batch -> peak
    failed_at: dict[int, int] = {}  # real failures: batch -> peak seen (a lower bound)
    lo, hi = lower - 1, upper + 1  # lo: largest real fit (lower - 1: none); hi: smallest failure
    candidate = max(estimated or lower, lower) if start is None else min(max(start, lower), upper)
    for used in range(1, max_real + 1):
        m = real(candidate)
        if m.fits:
            lo = candidate
            fits_at[candidate] = m.peak
        else:
            hi = candidate
            failed_at[candidate] = m.peak
        if hi - lo <= 1 or (fits_at and hi <= upper and hi - 1 - lo <= tolerance * lo):
            break
        if not fits_at:
            # Nothing fitted yet: the estimates were optimistic. Back off once by a margin like
            # allocator overhead; after a second failure, or with one real step left, try the
            # smallest size, so that "nothing fits" is only ever said after measuring it.
            if len(failed_at) == 1 and hi == estimated and used < max_real - 1:
                candidate = max(lower, math.floor(hi * 0.85))
            else:
                candidate = lower
            continue
        if not m.fits:
            # The model overshot; its line is not to be trusted between lo and hi: bisect.
            candidate = (lo + hi) // 2
            continue
        nxt = _predicted(fits_at, cached, budget, lo, hi, upper, failed_at)
        if nxt is None:
            break
        candidate = nxt
    return SearchResult(
        batch_size=lo if fits_at else 0,
        peak=fits_at.get(lo, failed_at.get(lower, max(failed_at.values(), default=0))),
        smallest_failure=hi if hi <= upper else None,
        estimated=estimated,
    )


def _predicted(
    fits_at: dict[int, int],
    estimate: Callable[[int], int] | None,
    budget: int,
    lo: int,
    hi: int,
    upper: int,
    failed_at: dict[int, int] | None = None,
) -> int | None:
    """The largest size the measurements predict to fit, strictly between lo and hi, or None.

    With estimates, the real peak is modelled as an affine function of the estimate through the two
    largest real fits (``real = a * estimate + c``: allocator overhead that grows with the batch
    and overhead that does not), or as a ratio with one real fit. Without estimates, the two
    largest real fits give a line in the batch size. A real failure's peak is a lower bound on its
    size's real peak: a model that predicts less there is wrong, and bisection is used instead.
    """
    sizes = sorted(fits_at)[-2:]
    model: Callable[[int], float]
    if estimate is not None:
        if len(sizes) == 2 and estimate(sizes[1]) > estimate(sizes[0]):
            (b1, b2), (e1, e2) = sizes, (estimate(sizes[0]), estimate(sizes[1]))
            a = (fits_at[b2] - fits_at[b1]) / (e2 - e1)
            c = fits_at[b2] - a * e2
            model = lambda b: a * estimate(b) + c  # noqa: E731
        else:
            b1 = sizes[-1]
            ratio = fits_at[b1] / max(estimate(b1), 1)
            model = lambda b: ratio * estimate(b)  # noqa: E731
    elif len(sizes) == 2:
        model = Curve({b: fits_at[b] for b in sizes})
    else:
        # One real point and no estimates: a second, larger point gives the line.
        return min(max(lo + 1, math.ceil(upper / 8), 2 * lo), hi - 1)
    if any(model(b) < peak for b, peak in (failed_at or {}).items()):
        return (lo + hi) // 2 if hi - lo > 1 else None
    if model(lo + 1) > budget:  # the usual answer, and often already estimated: stop here
        return None
    pred = _largest_below(model, budget, lo + 1, hi - 1)
    return pred if pred > lo else None


def within_allocator(allocator: Callable[[int, int | None], Any], size: int, budget: int, *, lower: int) -> tuple[int, Callable[[int], int]]:
    """For a CUDA target: the largest size up to ``size`` (found on the tensors' bytes) that the caching allocator
    serves under a cap of ``budget``, and the reserved bytes at any size (over the budget: at least ``budget + 1``).
    ``allocator(b, cap)`` is the allocator's replay at ``b`` samples (an ``AllocatorPeaks``)."""

    def fits(b: int) -> bool:
        return not allocator(b, budget).out_of_memory

    if size and not fits(size):  # the allocator's rounding and segments take more, a few percent: search just below
        size = _largest_below_failure(fits, size, lower=lower)

    def reserved(b: int) -> int:
        capped = allocator(b, budget)
        return capped.reserved if not capped.out_of_memory else max(budget + 1, allocator(b, None).reserved)

    return size, reserved


def _largest_below_failure(fits: Callable[[int], bool], failed: int, *, lower: int) -> int:
    """The largest size in ``[lower, failed)`` that ``fits`` (0: none), ``failed`` being known not to: down from it in
    steps that double until one fits, then bisected between that one and the last that did not."""
    hi, step = failed, 1
    while hi - step >= lower and not fits(hi - step):
        hi, step = hi - step, 2 * step
    lo = hi - step
    if lo < lower:
        if hi == lower or not fits(lower):
            return 0
        lo = lower
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
