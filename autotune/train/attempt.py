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

__all__ = ["attempt", "read_window", "run_micro_batches", "weighted_sum"]


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
        if measured:  # a measured window keeps its first micro-batch's gradient norm (a tensor: no read)
            run.noise.first(run.synced, micro.weight * share, micro.items)
    # In one process the gradients are the window's now: its norm for the meter joins the loss's read.
    big = run.noise.last(run.synced) if measured and run.world_size == 1 else None
    return read_window(run, weighted_sum(losses, [micro.weight for micro in window]), big)


def weighted_sum(losses: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """``sum(w * loss)`` in float64, on the losses' device (nothing read; the weights are not copied there)."""
    if not losses:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack([loss.reshape(()).double() * w for loss, w in zip(losses, weights)]).sum()


def read_window(run: Any, loss: torch.Tensor, big: torch.Tensor | None) -> float:
    """The window's one read from the device: its loss, with what the step needs to know on the host
    (the GradScaler's scale, for the meter and, with a fused optimizer, to tell a skipped step; the
    meter's squared norms).

    On a GPU every read waits for the device to finish what it was given: the plain loop reads its loss
    once per step, and so does the window, whatever its micro-batches. Returns the loss; the scale is
    kept in ``run.scale`` and the norms handed to the meter (:meth:`NoisePacer.read`).
    """
    values = [loss]
    # the scale as the tensor it is (GradScaler.get_scale() would read it on its own)
    scale = run.scaler._get_scale_async() if run.scaler is not None and run.scaler.is_enabled() else None
    if scale is not None:
        values.append(scale)
    if run.noise.small is not None:
        values.append(run.noise.small[0])
        if big is not None:
            values.append(big)
    read = torch.stack([v.reshape(()).to(loss.device, torch.float64) for v in values]).tolist() if len(values) > 1 else [float(loss)]
    run.scale = read[1] if scale is not None else None
    run.noise.read(read[1 + (scale is not None):])
    return read[0]
