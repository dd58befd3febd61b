"""The optimizer step at the planned batch: unscale (fp16), clip, step at ``plan.lr_scale`` times the
learning rate the schedule holds (or a ramp's ``step_factors``, the same unless its coupling reads the
schedule), schedule, zero the gradients. Only the step sees the scaled rate: the optimizer's param groups
and the scheduler keep the unscaled values, whatever the schedule does."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from autotune.errors import AutotuneError
from autotune.memory.ledger import TensorLedger, held_tensors, is_out_of_memory

__all__ = ["optimizer_step"]


def optimizer_step(run: Any, samples: int = 0) -> tuple[float, bool]:
    """Unscale, clip, step at ``lr_scale`` times the scheduled LR, schedule, zero the gradients
    (the exchange at the window's end already made them the global mean). ``run`` is the
    :class:`autotune.train.run.Run`.

    Returns the first param group's learning rate of the step, and whether the GradScaler skipped it.
    """
    optimizer, scaler = run.optimizer, run.scaler
    step = run.steps + 1
    try:
        with _ledger_for_step(run):
            if scaler is not None:
                scaler.unscale_(optimizer)  # once per window, before clipping
            if run.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(run.params, run.clip_grad_norm)
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        optimizer.zero_grad(set_to_none=True)
        raise AutotuneError(
            f"Out of memory while {'unscaling and ' if scaler is not None else ''}clipping the gradients at step {step}: "
            f"the optimizer step was not taken, so the weights are those after step {step - 1}. Clipping needs "
            "memory for the gradient norms the probe does not run; give it room with a larger headroom= "
            "(or a lower memory_limit for the plan), or clip with foreach=False"
        ) from exc
    settings = run.plan.optimizer_settings
    keys = ("lr", "betas", "eps", "weight_decay") if settings is not None else ("lr",)
    scheduled = [{k: g[k] for k in keys if k in g} for g in optimizer.param_groups]
    try:
        # Only the step sees the scaled LR (and, with follow_batch, the moved betas, eps and
        # weight decay): the scheduler and the param groups keep the unscaled values, whatever
        # the schedule does with them.
        groups = optimizer.param_groups
        factors = run.ramp.step_factors(run.plan, groups) if run.ramp is not None else [run.plan.lr_scale] * len(groups)
        for g, factor in zip(groups, factors):
            if settings is not None:
                g.update(settings.apply(g))
            g["lr"] = g["lr"] * factor
        lr = float(optimizer.param_groups[0]["lr"])
        skipped = False
        if scaler is not None:
            skipped = _scaler_step(scaler, optimizer, run.scale)
        else:
            optimizer.step()
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        raise AutotuneError(
            f"Out of memory inside optimizer.step() at step {step}: the step may be partly applied (some "
            "parameters updated, others not), so training cannot go on exactly from here. Restart from your "
            "last checkpoint with more room for the step: a larger headroom= (the probe measures one step, but "
            "fragmentation can grow), or an optimizer with foreach=False, whose step allocates less"
        ) from exc
    finally:
        for g, values in zip(optimizer.param_groups, scheduled):
            g.update(values)
    run.steps = step
    if run.scheduler is not None:
        # With a growing target the schedule advances by samples seen: once per the ramp's first target.
        for _ in range(run.ramp.scheduler_steps(samples) if run.ramp is not None else 1):
            run.scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    for p in run.outside:  # parameters outside the optimizer do not pile up gradients either
        p.grad = None
    return lr, skipped

def _scaler_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, scale: float | None) -> bool:
    """``scaler.step`` and ``scaler.update``; whether the scaler skipped the step (non-finite gradients).

    Told by the optimizer's own step hook, which runs only when the step does: nothing read from the
    device beyond the scaler's own check. An optimizer without hooks, or one whose step is handed the
    scaler's verdict and skips inside (fused ones), is told by the scale, which the update lowers exactly
    when the step was skipped: one read (``scale``: the scale the window ran at, read with its loss).
    """
    hook = getattr(optimizer, "register_step_post_hook", None)
    if hook is None or getattr(optimizer, "_step_supports_amp_scaling", False):
        before = scale if scale is not None else float(scaler.get_scale())
        scaler.step(optimizer)
        scaler.update()
        return float(scaler.get_scale()) < before
    stepped: list[bool] = []
    handle = hook(lambda *_: stepped.append(True))
    try:
        scaler.step(optimizer)
    finally:
        handle.remove()
    scaler.update()
    return not stepped


def _ledger_for_step(run: Any) -> Any:
    """The first optimizer step creates the optimizer state: count it under a CPU limit."""
    if run.limit is None or run.device.type == "cuda" or run.par.fsdp or run.stepped:
        return nullcontext()
    run.stepped = True
    ledger = TensorLedger(run.device.type, limit=run.limit)
    ledger.track(held_tensors(run.model, run.optimizer))
    return ledger
