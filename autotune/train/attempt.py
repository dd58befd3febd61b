"""One attempt at a window on this rank: every micro-batch forward and weighted backward, no
collective. Shared by the one-process and data-parallel windows (the sharded window runs its
micro-batches in lockstep, :mod:`autotune.train.sharded`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from autotune import batches as B
from autotune.memory.ledger import is_out_of_memory
from autotune.step import forward_backward
from autotune.train.accumulate import Window

__all__ = ["attempt", "run_micro_batches", "weighted_sum"]


def attempt(run: Any, window: Window) -> float:
    """This rank's micro-batches of ``window`` (no collective); its mean loss over its items.

    Windows of new shapes are counted under a CPU limit; after an OOM lowered the micro-batch,
    the count replaces the plan's estimated peak. ``run`` is the :class:`autotune.train.run.Run`.
    """
    run.last_ledger = None
    with run.window_ledger(window):
        loss = run_micro_batches(run, window)
    if run.lowered and run.last_ledger is not None:
        run.measured = max(run.measured or 0, run.last_ledger.peak)
        run.plan = dataclasses.replace(run.plan, peak_memory=run.measured)
    return loss


def run_micro_batches(run: Any, window: Window) -> float:
    """Forward and weighted backward of every micro-batch of ``window`` on this rank; no collective.

    Returns the window's mean loss over this rank's items. An out-of-memory error carries the size
    of the micro-batch that failed (``autotune_micro_batch``), so the retry starts from it.
    """
    device, bnc = run.device, run.bnc
    losses: list[torch.Tensor] = []  # read once per window, not per micro-batch (no sync inside)
    bnc.start_window(window.samples)
    run.noise.small = None
    # This rank's share of the global count, carried by the weights (see Run.unit).
    share = window.items / run.unit if run.unit else 1.0
    # A window of one micro-batch in one process has no smaller gradient to compare with; with several
    # ranks, a rank's own gradient is one (against the global window's).
    measured = run.noise.due and (len(window) > 1 or run.world_size > 1)
    # A mixture-of-experts load-balancing loss: the window's routing, from a forward without gradients
    # (exact mode; and the first window, to say how far the per-micro-batch convention is), else None.
    routed = run.router.before_window(run, window) if run.router is not None else None
    for micro in window:
        bnc.before_micro(micro.samples)
        try:
            batch = B.to_device(micro.batch, device)
            loss_fn = run.loss_fn if routed is None else run.router.loss_fn(routed, micro.weight * share)
            loss = forward_backward(
                run.model, loss_fn, batch, weight=micro.weight * share, device_type=device.type,
                precision=run.precision, scaler=run.scaler,
            )
        except Exception as exc:
            if is_out_of_memory(exc):
                exc.autotune_micro_batch = micro.samples  # type: ignore[attr-defined]
                exc.autotune_micro_size = B.per_sample_numel(micro.batch)  # type: ignore[attr-defined]
            raise
        losses.append(loss)
        if measured:  # a measured window keeps its first micro-batch's gradient norm
            run.noise.first(run.synced, micro.weight * share, micro.items)
    return weighted_sum(losses, [micro.weight for micro in window])


def weighted_sum(losses: list[torch.Tensor], weights: list[float]) -> float:
    """``sum(w * loss)`` in float64, with one read from the device."""
    if len(losses) == 1:
        return float(losses[0]) * weights[0]
    if not losses:
        return 0.0
    stacked = torch.stack([loss.reshape(()) for loss in losses]).double()
    return float(stacked @ torch.tensor(weights, dtype=torch.float64, device=stacked.device))
