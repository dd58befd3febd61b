"""The window of data-parallel ranks: each rank runs its own window alone (no collective inside), then
one all-reduce agrees on what happened everywhere and makes the gradients the global mean; a rank that
ran out of memory redoes its window smaller while the others wait."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from autotune.memory.ledger import is_out_of_memory
from autotune.parallel.exchange import FAILED, FINE, OUT_OF_MEMORY
from autotune.parallel.ranks import check_distinct_samples
from autotune.train.accumulate import Window
from autotune.train.attempt import attempt
from autotune.train.retry import retry_smaller

__all__ = ["run_window"]


def run_window(run: Any, windows: Iterator[Window], *, drop_last: bool = False) -> tuple[float, Window | None, Any] | None:
    """Data parallel ranks: run this rank's next window, then agree with the other ranks; redo it
    smaller after an OOM.

    Nothing inside the window talks to another rank. At its end one all-reduce tells every
    rank what happened everywhere and, when all went well, makes the gradients the global
    mean: if a rank ran out of memory, that rank (only) undoes its window and redoes it with a
    smaller micro-batch while the others wait with their gradients kept; if a rank failed,
    every rank raises, with that rank's message.
    """
    failure: BaseException | None = None
    window: Window | None = None
    try:
        window = next(windows, None)
    except Exception as exc:  # the loader, the dataset or count failed on this rank
        failure = exc
    bn_saved = run.window_start()
    done = False  # this rank's window has run (kept while another rank redoes its own)
    local_loss = 0.0
    while True:
        status = FINE
        if failure is None and window is not None and not done:
            try:
                local_loss = attempt(run, window)
                done = True
            except Exception as exc:
                failure = exc
        if failure is not None:
            status = OUT_OF_MEMORY if is_out_of_memory(failure) else FAILED
        items = window.items if (window is not None and done) else 0
        agreed = run.sync.exchange(
            status=status, items=items, samples=window.samples if (window is not None and done) else 0,
            loss_sum=local_loss * items, had_data=window is not None and status == FINE, pace=run.noise.every,
            unit=run.unit, vote=run.vote, proposal=run.proposal,
        )
        if agreed.status == FAILED:
            run.raise_failure(failure if status == FAILED else None)
        if agreed.status == OUT_OF_MEMORY:
            if status == OUT_OF_MEMORY:
                assert window is not None and failure is not None
                window = retry_smaller(run, window, failure, bn_saved)
                failure, done = None, False
            continue  # every rank agrees again once the ones that ran out of memory redid theirs
        break
    if not run.checked_samples:
        run.checked_samples = True
        check_distinct_samples(window[0].batch if (window is not None and len(window)) else None, run.device, run.par.group)
    if agreed.synced and run.synced:
        run.unit = float(agreed.items)  # the next window's weights expect this count
    if agreed.ranks_with_data == 0:
        return None
    if drop_last and agreed.samples < run.plan.effective_batch:
        # A short last window (over all ranks) is dropped: nothing of it may stay.
        run.optimizer.zero_grad(set_to_none=True)
        run.restore_bn(bn_saved)
        return None
    run.finish_bn(window is not None, agreed.ranks_with_data)
    run.agreed = agreed
    return agreed.loss, window, agreed
