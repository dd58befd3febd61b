"""FSDP2 (``fully_shard``) under autotune: trials and windows in lockstep.

Under FSDP2 each rank holds a shard of every parameter, gradient and optimizer state; every
forward all-gathers the parameters of each sharded block and every backward reduce-scatters its
gradients. Unlike DDP, whose windows autotune runs with no collective inside, the ranks here
cannot run on their own, so everything happens in lockstep:

- **Trials.** Every rank runs the same trial sizes. A trial is FSDP2's steady state: a micro-batch
  without gradient sync (the unsharded gradients accumulate: FSDP2 keeps them whole until the
  sync), one with it (the reduce-scatter), the optimizer step, the two again. Memory is counted,
  never enforced mid-trial; after each trial the ranks agree whether it fitted on all of them, so
  the search takes the same path everywhere. A trial in which a rank raised an out-of-memory error
  is abandoned by every rank at the same point and does not fit
  (:func:`autotune.parallel.lockstep.in_lockstep`).
- **Windows.** Before a window the ranks agree on their micro-batch counts and item counts; every
  rank runs as many micro-batches as the busiest one (a rank with fewer runs zero-weight
  micro-batches), with gradient sync on the last only, and weights ``n_i * W / N`` (``W`` ranks,
  ``N`` items over all of them: FSDP2 averages over ranks), so the gradient is the global big
  batch's. After the window the ranks agree again: if one rank's count went over its memory
  limit, every rank drops the window's gradients and redoes it, that rank with half its
  micro-batch.
- **Out-of-memory errors.** A window of shapes not yet run on some rank (where an out-of-memory
  error can happen) runs with the ranks agreeing before each of FSDP2's collectives
  (:func:`autotune.parallel.lockstep.in_lockstep`): an out-of-memory error raised on any rank, in a
  forward or a backward, makes every rank abandon that micro-batch at the same point, drop the
  window's gradients and BatchNorm updates, and redo the window, the rank that ran out with half its
  micro-batch. Windows of shapes already run skip the agreements (one flag more in the window's
  first gather).

The limit is counted, not enforced (the allocator is not capped): on the CPU by the tensor ledger,
on CUDA by the allocator's peak. Any other error raised inside one rank's forward or backward (its
own code, an out-of-memory error in a window of a shape already run, or one inside FSDP2's own
collective code) stops every rank within seconds: that rank writes its error to the process group's
store and aborts the group, so the others' pending collectives fail at once and they raise, naming
it (:func:`autotune.parallel.stops.stop_every_rank`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any

from autotune import batches as B
from autotune.errors import AutotuneError, AutotuneWarning, NothingFits
from autotune.memory.device import allocator_peak, release_cached, reset_peak
from autotune.memory.ledger import TensorLedger
from autotune.parallel.exchange import FINE, Agreement
from autotune.parallel.lockstep import Outcome, in_lockstep
from autotune.parallel.ranks import (
    check_distinct_samples,
    gather_numbers,
    set_gradient_sync,
)
from autotune.parallel.stops import failure_watch, stop_every_rank
from autotune.step import forward_backward
from autotune.train.retry import lower, retry_at_floor

__all__ = ["run_window"]


# --- training windows ----------------------------------------------------------------------------


def run_window(run: Any, windows: Iterator[Any], *, drop_last: bool = False) -> tuple[float, Any, Agreement] | None:
    """Run the next window of every rank in lockstep (see the module docstring).

    ``run`` is the training loop's state (``autotune.train.run.Run``). Returns ``(global mean
    loss, this rank's window, the agreement)``, or None when no rank has a window left.
    """
    failure: BaseException | None = None
    window: Any = None
    try:
        window = next(windows, None)
    except Exception as exc:  # the loader, the dataset or count failed on this rank
        failure = exc
    if window is not None and len(window):
        run.spare = B.slice_batch(window[0].batch, 0, min(run.plan.min_micro_batch, window[0].samples))
    bn_saved = run.window_start()
    device, group = run.device, run.par.group
    world_size = run.world_size
    while True:
        has = window is not None and failure is None
        rows = gather_numbers([
            float(failure is not None), float(len(window) if has else 0), float(window.items if has else 0),
            float(window.samples if has else 0), float(has), float(has or run.spare is not None),
            float(has and run.first_of_shape(window)),  # new shapes somewhere: the window runs guarded
        ], device, group)
        if any(r[0] for r in rows):
            run.raise_failure(failure)
        with_data = sum(int(r[4]) for r in rows)
        total_items, total_samples = sum(int(r[2]) for r in rows), sum(int(r[3]) for r in rows)
        if with_data == 0:
            return None
        if drop_last and total_samples < run.plan.effective_batch:
            return None  # nothing of the short last window has run
        if total_items == 0:  # no loss item anywhere: nothing to learn from, nothing runs
            return float("nan"), window, Agreement(FINE, 0, total_samples, float("nan"), with_data, False)
        lacking = [r for r, row in enumerate(rows) if not row[5]]
        if lacking:
            raise AutotuneError(
                f"rank {lacking[0]} has had no batch yet, so it cannot take part in a window under FSDP2 (every rank "
                "runs every forward); give every rank a shard of the data (a DistributedSampler)"
            )
        count = max(int(r[1]) for r in rows)
        scale = world_size * (window.items if has else 0) / total_items
        guarded = any(r[6] for r in rows)
        try:
            with failure_watch(group):
                peak, loss_sum, outcome = _run_micro_batches(run, window if has else None, count, scale, guarded=guarded)
        except Exception as exc:  # inside collective forwards: every rank stops within seconds, naming the cause
            stop_every_rank(exc, group, what="in this window")
        over = run.limit is not None and peak > run.limit
        if not outcome.anywhere:  # else some rank ran out of memory: every rank abandoned the window at the same point
            rows = gather_numbers([float(over), loss_sum, float(peak)], device, group)
            if not any(r[0] for r in rows):
                break
        # Some rank went over its limit or ran out of memory: every rank drops the window's gradients
        # and redoes it, that rank with a smaller micro-batch.
        run.optimizer.zero_grad(set_to_none=True)
        for p in run.outside:
            p.grad = None
        run.restore_bn(bn_saved)
        release_cached(device, collect=True)
        if over or outcome.own is not None:
            failure = _lowered(run, window, peak, outcome.own)
        _follow_lowered(run, failure)
        if failure is None and window is not None:
            window = window.with_micro_batch(run.plan.micro_batch)
    loss = sum(r[1] for r in rows) / total_items
    if run.lowered:
        run.measured = max(run.measured or 0, peak)
        run.plan = dataclasses.replace(run.plan, peak_memory=run.measured)
    if not run.checked_samples:
        run.checked_samples = True
        check_distinct_samples(window[0].batch if has and len(window) else None, device, group)
    run.finish_bn(has, with_data)
    agreed = Agreement(FINE, total_items, total_samples, loss, with_data, True)
    run.agreed = agreed
    return loss, window, agreed


def _lowered(run: Any, window: Any, peak: int, error: BaseException | None) -> BaseException | None:
    """Halve this rank's micro-batch after its window went over the limit or raised an out-of-memory
    ``error``; the error to raise when it cannot."""
    from autotune.units import format_bytes

    failed = max((m.samples for m in window), default=0) if window is not None else 0
    if failed == 0 and run.spare is not None:  # this rank had no samples left: only its zero-weight micro-batches ran
        failed = B.batch_size(run.spare)
    floor = run.plan.min_micro_batch
    what = (f"{type(error).__name__} raised on this rank" if error is not None
            else f"{format_bytes(peak)} counted on this rank, the limit is {format_bytes(run.limit)}")
    if failed <= floor and retry_at_floor(run, failed):
        return None
    if failed <= floor:
        return NothingFits(
            f"Out of memory while training at micro_batch={failed} under FSDP2 ({what}), twice (the window was retried "
            "once at that size): shard over more ranks, use precision='bf16', or raise memory_limit",
            needed=peak, budget=run.plan.budget, limit=run.plan.memory_limit, micro_batch=failed,
        )
    smaller = max(floor, failed // 2)
    warnings.warn(
        f"Out of memory at micro_batch={failed} ({what}); every rank redoes the window, this one with "
        f"micro_batch={smaller}",
        AutotuneWarning,
        stacklevel=5,  # here, the window, fit's loop, fit, the caller
    )
    lower(run, smaller)
    return None


def _follow_lowered(run: Any, failure: BaseException | None) -> None:
    """After a window to redo: every rank takes the smallest micro-batch of the ranks with its own limit
    (what ran out on one of them can on the others; in lockstep they run as many micro-batches anyway),
    and every rank's plan says every rank's micro-batch. Ranks with other limits keep theirs. One gather,
    on every rank, whatever it failed with (the failure itself is raised at the next agreement)."""
    limit = -1.0 if run.limit is None else float(run.limit)
    rows = gather_numbers([float(run.plan.micro_batch), limit], run.device, run.par.group)
    micro = [int(min(m for m, other in rows if other == own)) for _, own in rows]
    if failure is None and micro[run.rank] < run.plan.micro_batch:
        lowered_by = [r for r, (m, own) in enumerate(rows) if own == limit and m == micro[run.rank]]
        lower(run, micro[run.rank], why=f"as rank {lowered_by[0]}, whose limit is this rank's, after it ran out of memory")
    if run.plan.rank_micro_batches:
        run.plan = dataclasses.replace(run.plan, rank_micro_batches=tuple(micro))


def _run_micro_batches(run: Any, window: Any, count: int, scale: float, *, guarded: bool) -> tuple[int, float, Outcome]:
    """``count`` micro-batches on this rank, its own then zero-weight ones, sync on the last;
    ``guarded``: with the ranks agreeing before each collective (:func:`autotune.parallel.lockstep.in_lockstep`).

    Returns ``(peak bytes counted, sum of the loss over this rank's items, the lockstep outcome)``.
    """
    device, model, bnc = run.device, run.model, run.bnc
    own = list(window) if window is not None else []
    measure = run.limit is not None
    ledger: Any = contextlib.nullcontext()
    if measure and device.type != "cuda":
        ledger = TensorLedger(device.type)
        ledger.track(run.held())
    if measure and device.type == "cuda":
        reset_peak(device)
    total = 0.0
    if window is not None:
        bnc.start_window(window.samples)

    def micro_batches() -> None:
        nonlocal total
        for i in range(count):
            set_gradient_sync(model, i == count - 1)
            if i < len(own):
                micro = own[i]
                bnc.before_micro(micro.samples)
                loss = forward_backward(
                    model, run.loss_fn, B.to_device(micro.batch, device), weight=micro.weight * scale,
                    device_type=device.type, precision=run.precision, scaler=run.scaler,
                )
                total += float(loss) * micro.items
            else:
                _idle_micro(run)

    outcome = Outcome(None, False)
    try:
        with ledger:
            if guarded:
                outcome = in_lockstep(model, micro_batches, device=device, group=run.par.group)
            else:
                micro_batches()
    finally:
        set_gradient_sync(model, True)
    if not measure:
        return 0, total, outcome
    if device.type == "cuda":
        return allocator_peak(device)[0], total, outcome
    return ledger.peak, total, outcome


def _idle_micro(run: Any) -> None:
    """A zero-weight micro-batch: this rank takes part in the collectives and learns nothing from it
    (its BatchNorm statistics are put back)."""
    saved = run.save_bn()
    with run.bnc.paused():  # nothing pooled or recorded from it
        forward_backward(
            run.model, run.loss_fn, B.to_device(run.spare, run.device), weight=0.0, device_type=run.device.type,
            precision=run.precision, scaler=run.scaler,
        )
    run.restore_bn(saved)
