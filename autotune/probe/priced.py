"""On a GPU, a plan paid in device steps: the estimate, or short real steps, whichever costs less there.

An estimate costs CPU time (traces on fake tensors, about the same on any device), a real step costs
device time: on a fast GPU a step of a few samples takes milliseconds, where three traces of a large
model take seconds. So with ``verify=True`` on CUDA the probe first runs the real step at the smallest
micro-batch (the search would run it anyway), counting the operations it dispatches, and then prices
both ways on to the answer:

- **the estimate**: three traces (two sizes and a confirmation) of that many operations, at
  :data:`FAKE_SECONDS_PER_OP` each;
- **real steps**: one more step, at one sample more (the measured step's time, in proportion to its
  size); the two measured peaks (the allocator's own ``max_memory_reserved``) give a line, its
  largest size within the budget is the candidate.

Both end in the same verifying step at the size found, so only the rest is compared. The cheaper way
runs, and a note says which ran and what it cost, in steps at the size found. A first step that does
not fit leaves the choice to the estimate (which says what would fit instead).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from autotune.memory.curve import MemoryCurve
from autotune.probe.search import Measurement, SearchResult, Trial, largest_fitting
from autotune.probe.trial import Workload

__all__ = ["FAKE_SECONDS_PER_OP", "OperationCount", "Priced", "applies", "by_real_steps", "note", "price", "step_seconds"]

# A trace's cost per dispatched operation on fake tensors (measured on 2 cores: a Llama-3-8B layer at 4096
# tokens, 1016 operations in 0.27-0.36 s). A constant: a faster host traces for less than it says.
FAKE_SECONDS_PER_OP = 3e-4
TRACES = 3  # two sizes and the confirming one


class OperationCount(TorchDispatchMode):
    """Counts the operations dispatched while it is active (the real step at the smallest size)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def applies(work: Workload) -> bool:
    """Whether the plan of ``work`` chooses between the estimate and real steps: CUDA, one process's
    own trials (FSDP2's run in lockstep and keep their own order)."""
    return work.device.type == "cuda" and not work.fsdp


def step_seconds(trial: Trial) -> float:
    """The device time of a real trial (its wall time: the step synchronises before it is read)."""
    return trial.seconds


@dataclass(frozen=True)
class Priced:
    """The two ways on from the first real step, priced in seconds.

    Attributes:
        first: the first real trial (the smallest size).
        operations: the operations its step dispatched (two micro-steps and the optimizer step).
        estimate: the traces' predicted seconds.
        steps: the one more real step's predicted seconds.
    """

    first: Trial
    operations: int
    estimate: float
    steps: float

    @property
    def real_steps(self) -> bool:
        """Whether real steps cost less."""
        return self.steps < self.estimate


def price(first: Trial, operations: int) -> Priced:
    """Both ways priced from the first real step and the operations it dispatched."""
    seconds = step_seconds(first)
    per_trace = operations / 2  # a trace is one micro-step (the optimizer step once, small beside it)
    return Priced(first, operations, TRACES * per_trace * FAKE_SECONDS_PER_OP, seconds * (first.batch_size + 1) / first.batch_size)


def by_real_steps(measure: Callable[[int], Measurement], first: Measurement, lower: int, *, upper: int, budget: int,
                  max_real: int) -> SearchResult:
    """The search on from real steps at ``lower`` (``first``) and ``lower + 1``: the line through their
    peaks gives the candidate, which a real step verifies (the search goes on from there if it does not fit)."""
    second = measure(lower + 1)
    known = {lower: first, lower + 1: second}
    line = MemoryCurve.through(lower, first.peak, lower + 1, second.peak)
    size = line.largest(budget, lower, upper) if second.fits else lower

    def real(b: int) -> Measurement:
        return known.pop(b) if b in known else measure(b)

    return largest_fitting(real, upper=upper, budget=budget, estimate=line, lower=lower, max_real=max_real, start=max(size, lower))


def note(priced: Priced, trials: list[Trial], size: int) -> str:
    """What the plan ran, and what it and the other way cost, in steps at the size found."""
    real = [t for t in trials if not t.estimate]
    at = next((t for t in reversed(real) if t.batch_size == size), None)
    unit = step_seconds(at) if at is not None else step_seconds(priced.first) * max(size, 1) / priced.first.batch_size
    spent = sum(step_seconds(t) for t in real) + sum(t.seconds for t in trials if t.estimate)
    unit = max(unit, 1e-9)
    other = (f"the estimate would have cost about {priced.estimate:.2f} s ({TRACES} traces of about {priced.operations // 2} "
             f"operations), {priced.estimate / unit:.1f} steps" if priced.real_steps else
             f"real steps would have cost about {priced.steps:.2f} s more, {priced.steps / unit:.1f} steps")
    ran = (f"real steps at {', '.join(str(t.batch_size) for t in real)} samples" if priced.real_steps else
           f"the estimate (after the real step at {priced.first.batch_size})")
    return (f"on this device the plan ran {ran}: {spent:.2f} s, {spent / unit:.1f} steps at micro-batch {size} "
            f"({unit:.3f} s a step); {other}")
