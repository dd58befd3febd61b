"""Find the largest micro-batch that fits: estimates first, then real trials on the device.

The estimates (:mod:`autotune.probe.estimate`) give memory against the micro-batch from two traces on fake
tensors; its largest size within the budget is the candidate, which a real trial (:mod:`autotune.probe.trial`'s
step, under the memory budget) verifies. On the CPU the estimate is the real peak to the byte, so one
real trial is the whole search; on a GPU the allocator's overhead recalibrates the estimate and a few
more real trials may follow (:func:`autotune.probe.search.largest_fitting`). An estimate that cannot run is
not an error: the search uses real trials only and a note says why. Every real trial starts from,
and every probe ends with, the model, optimizer and RNG states exactly as they were.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from autotune import batches as B
from autotune.errors import AutotuneError
from autotune.memory.curve import MemoryCurve
from autotune.memory.device import (
    CUDA_BLOCK,
    allocator_peak,
    release_cached,
    reset_peak,
    synchronize,
)
from autotune.memory.ledger import ResidentPeak, TensorLedger, is_out_of_memory
from autotune.parallel.lockstep import in_lockstep
from autotune.parallel.ranks import (
    announce,
    gather,
    gather_numbers,
)
from autotune.parallel.stops import failure_watch, stop_every_rank
from autotune.probe.compiled import backend_of, compiled_parts, measured
from autotune.probe.compiled import note as compiled_note
from autotune.probe.estimate import estimator_for
from autotune.probe.priced import OperationCount, applies, by_real_steps, note, price
from autotune.probe.search import Measurement, SearchResult, Trial, largest_fitting
from autotune.probe.trial import (
    Clock,
    Workload,
    phase_times,
    sharded_trial_step,
    steady_times,
    trial_step,
    without_step_hooks,
)
from autotune.step import Snapshot, min_micro_batch, planning
from autotune.units import format_bytes

__all__ = ["Progress", "probe"]


class Progress:
    """One line per trial on stderr, once probing has taken more than ``delay`` seconds.

    A real trial is announced before it starts: for a big model one step can take a minute.
    """

    DELAY = 1.0  # seconds of probing before anything is shown

    def __init__(self, enabled: bool = True, *, delay: float | None = None, stream: Any = None) -> None:
        self.enabled = enabled
        self.delay = self.DELAY if delay is None else delay
        self.stream = stream
        self.start = time.perf_counter()

    def _show(self) -> bool:
        return self.enabled and time.perf_counter() - self.start > self.delay

    def _print(self, text: str) -> None:
        import sys

        print(f"autotune: {text}", file=self.stream or sys.stderr, flush=True)

    def starting(self, b: int) -> None:
        """A real trial of ``b`` samples starts."""
        if self._show():
            self._print(f"real step at micro-batch {b} ...")

    def done(self, trial: Trial) -> None:
        """A trial (estimate or real step) is done."""
        if self._show() or (self.enabled and not trial.estimate and trial.seconds > self.delay):
            kind = "estimate" if trial.estimate else "real step"
            verdict = "fits" if trial.fits else "does not fit"
            count = trial.checkpointing
            blocks = f" with the first {count} blocks checkpointed" if isinstance(count, int) and not isinstance(count, bool) else ""
            self._print(f"{kind} at micro-batch {trial.batch_size}{blocks}: {verdict} ({format_bytes(trial.peak_memory)}, {trial.seconds:.2f} s)")


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if it owns its storage exactly, else a contiguous copy."""
    if t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.is_contiguous():
        return t
    return t.contiguous().clone()


def probe(
    work: Workload,
    *,
    upper: int,
    budget: int,
    snapshot: Snapshot,
    verify: bool = True,
    estimate: bool = True,
    max_real: int = 8,
) -> SearchResult:
    """Find the largest micro-batch whose trial step fits ``budget`` bytes.

    Args:
        work: the workload; its ``trials`` and ``notes`` lists receive what happens, and
            ``work.estimator`` the estimator used (None when the step could not be estimated).
        upper: the largest size to try (the per-device target batch).
        budget: bytes the step may use (the limit less the headroom).
        snapshot: restores the workload's state after every real trial.
        verify: run real trials (False: an estimate-only answer).
        estimate: use estimates (False: real trials only).
        max_real: a bound on real trials.

    Returns:
        The search result; ``batch_size == 0`` when one sample does not fit.
    """
    lower = min(min_micro_batch(work.model), upper)

    def measure(b: int) -> Measurement:
        # Under FSDP2 a micro-batch of the whole share is a window of one: no unsharded gradients held.
        whole = work.fsdp and b >= upper
        if not work.checkpointing:
            return _real_trial(work, b, budget, snapshot, whole=whole)
        from autotune.memory.checkpointing import activation_checkpointing

        with activation_checkpointing(work.model, work.checkpointing):
            return _real_trial(work, b, budget, snapshot, whole=whole)

    found: tuple[int, Callable[[int], int]] | None = None
    reason = "estimate=False"
    priced = None
    # the estimate or real steps: whichever costs less here (a compiled model never runs under the counting mode)
    if estimate and verify and applies(work) and upper > lower and not _compiled(work):
        counter = OperationCount()
        with counter:
            first = measure(lower)
        if first.fits:
            priced = price(work.trials[-1], counter.count)
            if priced.real_steps:
                result = by_real_steps(measure, first, lower, upper=upper, budget=budget, max_real=max_real)
                work.notes.append(note(priced, work.trials, result.batch_size))
                return result
    if estimate:
        # A real step confirms the estimate to the byte on the CPU; elsewhere (allocator overhead, or
        # no device at all) one more estimate at the candidate confirms the line it came from.
        confirm = not (verify and work.device.type == "cpu")
        try:
            found = _estimated(work, upper=upper, budget=budget, confirm=confirm)
        except Exception as exc:  # any estimate that cannot run: real trials find the answer
            work.estimator = None
            reason = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:160]}"
            work.notes.append(f"estimate unavailable ({reason}); real trials only")

    if not verify:
        if found is None:
            raise AutotuneError(
                f"Cannot estimate this model without running it ({reason}): plan on the device itself "
                "(autotune.plan with verify=True, or autotune report on a machine that has the device)"
            )
        size, peak = found
        _note_compiled(work, verified=False)
        return SearchResult(size, peak(size or lower), None, size)

    real: Callable[[int], Measurement] = measure
    search_budget = budget
    if work.fsdp:
        real, search_budget = _in_lockstep(work, measure, budget)
        # The whole share in one micro-batch holds no unsharded gradients, so it may fit where
        # smaller, accumulating ones do not: tried first, then the search below it.
        whole = real(upper)
        if whole.fits:
            return SearchResult(upper, whole.peak, None, None)
        if upper == lower:
            return SearchResult(0, whole.peak, upper, None)
        return largest_fitting(real, upper=upper - 1, budget=search_budget, lower=lower, max_real=max_real)
    if found is None:
        return largest_fitting(real, upper=upper, budget=search_budget, lower=lower, max_real=max_real)
    size, peak = found
    result = largest_fitting(real, upper=upper, budget=search_budget, estimate=peak, lower=lower, max_real=max_real, start=size)
    if priced is not None:
        work.notes.append(note(priced, work.trials, result.batch_size))
    _note_compiled(work, verified=True, at=result.batch_size, measured=result.peak, estimated=peak)
    return result


def _compiled(work: Workload) -> tuple[str, ...]:
    """The compiled parts of the workload's model (:func:`autotune.probe.compiled.compiled_parts`); an eager model,
    told apart here, is not passed on."""
    if not any(type(m).__name__ == "OptimizedModule" or m.__dict__.get("_compiled_call_impl") is not None for m in work.model.modules()):
        return ()
    return compiled_parts(work.model)


def _note_compiled(work: Workload, *, verified: bool, at: int = 0, measured: int = 0, estimated: Callable[[int], int] | None = None) -> None:
    """A compiled model's plan says what was planned (:func:`autotune.probe.compiled.note`), with the compiled
    step measured and the eager estimate at the micro-batch found."""
    parts = _compiled(work)
    if parts:
        work.notes.append(compiled_note(parts, backend=backend_of(work.model), size=at or None, measured=measured or None,
                                        estimated=estimated(at) if verified and estimated is not None and at else None))


def _estimated(work: Workload, *, upper: int, budget: int, confirm: bool) -> tuple[int, Callable[[int], int]]:
    """The largest micro-batch the estimates allow and the estimated peak at any size
    (:meth:`autotune.probe.estimate.Estimator.largest`); every trace used is recorded as a trial, for a CUDA target with
    the caching allocator's reserved bytes at its size and whether its replay fits the budget (what the search decides
    on; the tensors' peak alone can fit where the allocator's segments do not)."""
    estimator = estimator_for(work)
    work.estimator = estimator
    cuda = work.device.type == "cuda"
    told: list[tuple[Any, bool]] = []  # for a CUDA target, each trace told once the allocator's replay has decided
    estimator.on_trace = (lambda trace, reused: told.append((trace, reused))) if cuda else _recorder(work, budget)
    try:
        size, peak = estimator.largest(budget, upper, confirm=confirm)
    finally:
        estimator.on_trace = None
    for trace, reused in told:  # what decided, as the plan's peak: the bytes the allocator reserves, served under the budget
        reserved = peak(trace.size)
        work.record(Trial(trace.size, reserved, reserved <= budget, 0.0 if reused else trace.seconds, estimate=True))
    work.curve = peak if isinstance(peak, MemoryCurve) else (estimator.curve() if cuda else None)
    if cuda:
        work.notes.append(_allocator_note(estimator, size or min(estimator.lower, upper), budget))
    for said in (estimator.note, *estimator.assumed):
        if said and said not in work.notes:
            work.notes.append(said)
    if estimator.unlearned:
        work.notes.append(
            "CUDA's autocast decision could not be learned for " + ", ".join(sorted(estimator.unlearned))
            + " (estimated as the CPU runs them)"
        )
    return size, peak


def _allocator_note(estimator: Any, size: int, budget: int) -> str:
    """What the CUDA estimate budgets: the caching allocator's reserved bytes, beside the allocated ones."""
    from autotune.memory.allocator import cublas_workspace, expandable_segments

    capped = estimator.allocator(size, cap=budget)
    ws = cublas_workspace()
    return (
        f"the CUDA estimate budgets what the caching allocator reserves: {format_bytes(capped.reserved)} reserved at "
        f"micro-batch {size}, {format_bytes(capped.allocated)} allocated (cuBLAS's workspace of {format_bytes(ws)} "
        f"included; {'expandable segments' if expandable_segments() else 'fixed segments'})"
        + (f"; the allocator releases its cached segments {capped.retries} time(s) a window at this size" if capped.retries else "")
    )


def _recorder(work: Workload, budget: int) -> Callable[[Any, bool], None]:
    """Record each trace an estimate uses as a trial (one made earlier, and kept, cost nothing now; read again, it is
    kept once: :meth:`~autotune.probe.trial.Workload.record`)."""

    def record(trace: Any, reused: bool) -> None:
        work.record(Trial(trace.size, trace.peak, trace.peak <= budget, 0.0 if reused else trace.seconds, estimate=True))

    return record


def _in_lockstep(work: Workload, measure: Callable[[int], Measurement], budget: int) -> tuple[Callable[[int], Measurement], int]:
    """Under FSDP2: trials every rank runs together, whose outcome every rank agrees on.

    The ranks' budgets may differ (per-rank limits), so the search runs against the smallest and
    each trial reports the tightest rank's peak shifted onto it: ``max_r(peak_r - budget_r) +
    min_r(budget_r)``. A size then fits when it fits on every rank, and every rank's search takes
    the same path (a different path would pair different collectives). A trial in which a rank runs
    out of memory is abandoned by every rank at the same point and does not fit anywhere
    (:func:`autotune.parallel.lockstep.in_lockstep`, in :func:`_attempt`); any other error raised on
    one rank stops every rank within seconds (:func:`autotune.parallel.stops.stop_every_rank`).
    """
    announce()  # where a failing peer finds this process
    common = int(min(r[0] for r in gather_numbers([float(budget)], work.device)))

    def real(b: int) -> Measurement:
        try:
            with failure_watch():
                measured = measure(b)
        except Exception as exc:  # inside collective forwards: every rank stops within seconds, naming the cause
            stop_every_rank(exc, what=f"in its trial at micro-batch {b}")
        rows = gather_numbers([float(measured.fits), float(measured.peak - budget), float(work.own_oom is not None)], work.device)
        if any(r[2] for r in rows):  # some rank ran out of memory: every rank learns which, and why
            own = work.own_oom
            messages = gather(None if own is None else f"{type(own).__name__}: {own}"[:300], work.device)
            work.oom_ranks[b] = "; ".join(f"rank {r} ({m})" for r, m in enumerate(messages) if m is not None)
            work.notes = [n.replace(f"at micro-batch {b} on some rank", f"at micro-batch {b} on {work.oom_ranks[b]}") for n in work.notes]
        return Measurement(all(r[0] for r in rows), int(max(r[1] for r in rows)) + common)

    return real, common


def _real_trial(work: Workload, b: int, budget: int, snapshot: Snapshot, *, whole: bool = False) -> Measurement:
    """One real trial of ``b`` samples under ``budget``, recorded.

    An out-of-memory error in a step that stayed within its budget came from outside what the step
    counts (another process, a transient spike of the device's own memory): the trial runs once more,
    after freeing what can be freed, and its second outcome counts; a note says so.
    """
    device = work.device
    if work.on_start is not None:
        work.on_start(b)
    fits, peak, seconds, oom, timed = _attempt(work, b, budget, snapshot, whole=whole)
    if oom and work.fsdp:
        work.notes.append(
            f"an out-of-memory error at micro-batch {b} on some rank: every rank abandoned that trial at the same point, "
            "and the size does not fit"
        )
    elif oom and peak <= budget:
        release_cached(device, collect=True)
        first = peak
        fits, peak, more, oom, timed = _attempt(work, b, budget, snapshot, whole=whole)
        seconds += more
        work.notes.append(
            f"an out-of-memory error at micro-batch {b} with {format_bytes(first)} counted, within the budget of "
            f"{format_bytes(budget)} (memory taken outside the step), was tried once more: "
            + ("it fitted" if fits else "it failed again" if oom else "it did not fit")
        )
    micro, optimizer = timed if timed is not None and fits else (None, None)
    work.record(Trial(b, peak, fits, seconds, estimate=False, micro_step=micro, optimizer_step=optimizer))
    return Measurement(fits, peak)


# Where the device runs kernels queued by the host, the tensor ledger's host cost (about 8 us an operation on a 2-core
# host) can outlast the device's own work on a step of small kernels, and the trial's optimizer step allocates its
# state from an emptied cache: a steady micro-step and optimizer step are timed once more outside the ledger, as they
# run in training. On the CPU that gains 3-4% for one more micro-step a trial (benchmarks/measured_step.py).
RETIMED = ("cuda",)


def _attempt(work: Workload, b: int, budget: int, snapshot: Snapshot, *,
             whole: bool) -> tuple[bool, int, float, bool, tuple[float, float] | None]:
    """Run the trial step once: ``(fits, peak bytes, seconds, whether it raised out of memory, the steady micro-step's
    and the optimizer step's seconds)``."""
    device = work.device
    release_cached(device)
    # A compact copy: a slice of a larger tensor would count the whole of its storage.
    batch = B.map_tensors(B.to_device(B.repeat_to(work.batch, b), device), _compact)
    # Under FSDP2 the budget is checked after the trial (raising inside one rank's forward would
    # leave the others waiting in a collective); an out-of-memory error is shared by every rank.
    ledger = TensorLedger(device.type, limit=None if work.fsdp else budget, block=CUDA_BLOCK if device.type == "cuda" else 1)
    ledger.track(work.held_tensors())
    ledger.track(B.tensors(batch))
    held = ledger.live
    retries = reset_peak(device)
    # Against physical memory, the process also grows by what the tensor count cannot see (the
    # allocator's fragmentation, library scratch memory): its resident size is sampled.
    resident = ResidentPeak() if (device.type == "cpu" and work.resident) else None
    start = time.perf_counter()
    oom = False
    work.own_oom = None
    snapshot.prepare_trial()
    clock = Clock(functools.partial(synchronize, device))  # the trial's phases (autotune.probe.trial.phase_times)
    step: Callable[[], None] = functools.partial(
        sharded_trial_step if work.fsdp else trial_step, work.model, work.optimizer, work.loss_fn, batch, device.type,
        work.precision, finite=snapshot.zero_lr, clock=clock, **({"accumulating": not whole} if work.fsdp else {}),
    )
    compiled, count, timed = bool(_compiled(work)), None, None
    try:
        if compiled:  # its first step at a size compiles it: run, put back, then measured (see autotune.probe.compiled)
            with planning(), without_step_hooks(work.optimizer):
                step()
            clock.times.clear()
            snapshot.restore()
            snapshot.prepare_trial()
            release_cached(device)
            retries = reset_peak(device)  # on CUDA the measured step's peak, not the compiling one's
            start = time.perf_counter()
        # Your optimizer's step hooks never see a trial's step (at learning rate 0, not a training step). A compiled
        # step is counted by the device's allocator: under the ledger it would run eager (autotune.probe.compiled).
        meter = measured(device) if compiled else ledger
        with planning(), without_step_hooks(work.optimizer):
            with meter as count, (resident if resident is not None else contextlib.nullcontext()):
                if work.fsdp:
                    outcome = in_lockstep(work.model, step, device=device)
                    oom, work.own_oom = outcome.anywhere, outcome.own
                else:
                    step()
            timed = phase_times(clock, pairs=work.fsdp)
            if timed is not None and device.type in RETIMED and not (compiled or work.fsdp):
                # one more steady micro-step and optimizer step: they hold what the trial's last micro-step and its step held
                timed = steady_times(work.model, work.optimizer, work.loss_fn, batch, device.type, work.precision, clock.sync,
                                     finite=snapshot.zero_lr)
        synchronize(device)  # the step's time includes the device's queued work
    except Exception as exc:
        if not is_out_of_memory(exc) or work.fsdp:  # under FSDP2 the others wait in a collective: see _in_lockstep
            if not is_out_of_memory(exc):
                exc.add_note(
                    f"autotune: raised by the model or the loss in a planning trial at micro-batch {b}; the model, the "
                    "optimizer and the RNGs are as they were"
                )
            raise
        oom = True
        exc.__traceback__ = None  # drop the frames that hold the step's tensors
    finally:
        seconds = time.perf_counter() - start
        del batch, step
        snapshot.restore()
        release_cached(device, collect=device.type == "cuda" or oom)
    peak = held + getattr(count, "growth", 0) if compiled else ledger.peak
    if resident is not None and resident.growth is not None:
        peak = max(peak, held + resident.growth)
    reserved, retries_after = allocator_peak(device)
    peak = max(peak, reserved)
    fits = not oom and peak <= budget
    if device.type == "cuda" and retries_after > retries:
        # Not a failure: cuDNN sizes its workspaces from the device's free memory, not the cap, and
        # the allocator freeing its cache to serve one is how it recovers. The headroom covers it.
        work.notes.append(
            f"the CUDA allocator freed its cache and retried {retries_after - retries} time(s) at micro-batch {b} "
            f"(fragmentation, or a library workspace sized from free memory); the step {'fitted' if fits else 'did not fit'}"
        )
    return fits, peak, seconds, oom, timed
