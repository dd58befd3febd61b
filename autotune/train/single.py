"""The window of one process: run it; after an out-of-memory error undo it and redo it with a smaller
micro-batch. Nothing to agree on: the gradients are the window's mean as they stand."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from autotune.memory.ledger import is_out_of_memory
from autotune.parallel.exchange import FINE, Agreement
from autotune.train.accumulate import Window
from autotune.train.attempt import attempt
from autotune.train.retry import retry_smaller

__all__ = ["run_window"]


def run_window(run: Any, windows: Iterator[Window], *, drop_last: bool = False) -> tuple[float, Window | None, Any] | None:
    """One process: run the next window; after an out-of-memory error undo it and redo it with a
    smaller micro-batch. The gradients are the window's mean as they stand."""
    window = next(windows, None)
    if window is None:
        return None
    bn_saved = run.window_start()  # to undo a failed attempt
    while True:
        try:
            loss = attempt(run, window)
            break
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            window = retry_smaller(run, window, exc, bn_saved)
    if drop_last and window.samples < run.plan.effective_batch:
        run.optimizer.zero_grad(set_to_none=True)
        run.restore_bn(bn_saved)
        return None
    run.finish_bn(True, 1)
    loss = loss if window.items else float("nan")
    run.agreed = Agreement(FINE, window.items, window.samples, loss, 1, True, float(run.noise.every), run.vote, run.proposal)
    return loss, window, run.agreed
