"""``autotune.fit``: probe, plan, then train with exact gradient accumulation.

The loop, top to bottom (:func:`fit`)::

    with Run(...) as run:                               # setup; everything put back on the way out
        for epoch in range(epochs):
            windows = accumulate(loader, plan)          # one window = one optimizer step
            while (done := run_window(run, windows)):   # micro-batches, then (ranks) one agreement
                run.check_finite(loss, ...)             # no step on a non-finite loss
                optimizer_step(run)                     # clip, optimizer step at the scaled LR, schedule, zero

The window is one module per mode, chosen once (:mod:`autotune.train.single`,
:mod:`~autotune.train.data_parallel`, :mod:`~autotune.train.sharded`), each with the same shape; the
micro-batches of an attempt (:mod:`~autotune.train.attempt`), the out-of-memory retry
(:mod:`~autotune.train.retry`), the micro-batch per shape (:mod:`~autotune.train.caps`), the optimizer
step (:mod:`~autotune.train.stepping`) and the run's setup and restore (:class:`autotune.train.run.Run`)
each live in one place, and none of them calls back up into the loop.

The learning rate is scaled only around ``optimizer.step()``: the optimizer's param groups and the
scheduler always hold the unscaled values the user's schedule computes, and the step applies
``plan.lr_scale`` times them. That is exact for every scheduler (OneCycle, Cyclic, Sequential,
Chained, warm restarts, ``LambdaLR`` schedules such as transformers' ``get_scheduler``), and after
``fit`` returns the optimizer and scheduler are where the unscaled run would have left them, so
``fit(epochs=1)`` called N times trains like ``fit(epochs=N)``.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from autotune import batches as B
from autotune.checks import (
    check_callable,
    check_count_value,
    check_device_exists,
    check_flag,
    check_grad_mode,
    check_loader,
    check_model,
    check_optimizer,
    check_positive_number,
    check_progress,
    check_reiterable,
    check_scheduler,
    check_trainable,
    is_one_shot,
    resolve_device,
)
from autotune.errors import AutotuneWarning
from autotune.parallel.ranks import (
    broadcast_model,
    is_distributed,
    parallel,
    sampler_epoch,
    set_epoch,
    world,
)
from autotune.parallel.stops import on_every_rank
from autotune.planning.planner import plan as make_plan
from autotune.planning.plans import Plan
from autotune.planning.scaling import LR_RULES, auto_lr_rule
from autotune.rng import RNGState
from autotune.step import (
    LossFn,
    Precision,
    autocast,
    batchnorms,
    check_step,
    default_loss,
    min_micro_batch,
    normalize_precision,
)
from autotune.train import data_parallel, sharded, single
from autotune.train.accumulate import Count, Pad, accumulate
from autotune.train.bn import BN_MODES, FinishedRun, resolve_bn
from autotune.train.ramp import BatchRamp, RampChange, plan_for_target, ramp_micro_batch
from autotune.train.records import FitResult, StepRecord
from autotune.train.run import Run
from autotune.train.stepping import optimizer_step
from autotune.units import parse_bytes

__all__ = ["AutotuneWarning", "FitResult", "StepRecord", "fit"]


def _fit_device(model: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is not None:
        resolved = torch.device(device)
    else:
        first = next(model.parameters(), None)
        if first is not None and first.device.type != "cpu":
            resolved = first.device
        else:
            resolved = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def _check_plan(plan: Any, target_batch: int | None) -> None:
    if plan is None:
        return
    if not isinstance(plan, Plan):
        hint = " (a plan saved with to_dict() comes back with autotune.Plan.from_dict(data))" if isinstance(plan, (dict, str)) else ""
        raise TypeError(f"Invalid plan of type {type(plan).__name__}: pass an autotune.Plan{hint}")
    plan.check()
    _, world_size = world()
    if plan.world_size != world_size:
        raise ValueError(
            f"Invalid plan: it was made for {plan.world_size} rank(s) and this run has {world_size}; "
            "make a new plan in this run (autotune.plan on every rank)"
        )
    if target_batch is not None and target_batch != plan.effective_batch:
        raise ValueError(
            f"Invalid target_batch {target_batch!r}: the plan given trains {plan.effective_batch} "
            "samples per step; leave target_batch out or make a new plan"
        )


def _check_against_plan(plan: Plan | None, optimizer: Any, *, lr_rule: str, base_batch: int | None, headroom: float | None) -> None:
    """Arguments given beside ``plan=`` that the plan contradicts: refused (the plan's would win silently)."""
    if plan is None:
        return
    fix = "leave it out (the plan's holds), or make a new plan with it"
    if lr_rule != "auto" and lr_rule != plan.lr_rule:
        raise ValueError(f"Invalid lr_rule {lr_rule!r} with plan=: the plan scales the learning rate by its own rule {plan.lr_rule!r} "
                         f"(x{plan.lr_scale:.4g}); {fix}")
    if base_batch is not None and base_batch != plan.base_batch:
        raise ValueError(f"Invalid base_batch {base_batch!r} with plan=: the plan's learning rate is scaled from batch "
                         f"{plan.base_batch}; {fix}")
    if headroom is not None and headroom != plan.headroom:
        raise ValueError(f"Invalid headroom {headroom!r} with plan=: the plan was made with headroom {plan.headroom:g}; {fix}")
    if optimizer is not None and plan.lr_scale != 1.0 and plan.lr_rule in ("linear", "sqrt"):
        family = auto_lr_rule(c.__name__ for c in type(optimizer).__mro__)
        if family in ("linear", "sqrt") and family != plan.lr_rule:
            raise ValueError(
                f"Invalid optimizer {type(optimizer).__name__} for this plan: it was made for {plan.optimizer or 'an optimizer'} "
                f"and scales the learning rate by the {plan.lr_rule} rule (x{plan.lr_scale:.4g}), while "
                f"{type(optimizer).__name__} takes the {family} rule; make the plan with this optimizer "
                "(autotune.plan(..., optimizer=optimizer))"
            )


def _warn_if_larger_than_an_epoch(loader: Iterable[Any], target: int) -> None:
    """A target larger than an epoch's samples trains one short step per epoch at the target's learning rate."""
    try:
        samples = len(loader.dataset)  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        return
    if 0 < samples < target:
        warnings.warn(
            f"target_batch={target} is more than the {samples} samples of an epoch: every epoch trains one step of "
            f"{samples} samples, at the learning rate scaled for {target}; give a target of at most {samples}, or more "
            "data per epoch",
            AutotuneWarning,
            stacklevel=3,
        )


def _must_agree(model: nn.Module, target: int | None, precision: str, mode: Any, lr_rule: str) -> list[tuple[str, float, Any]]:
    """What every rank must share, as numbers for the start-up all-reduce: a difference would train
    another batch on each rank, or wait in a collective for ever."""
    precisions = ("fp32", "bf16", "fp16")
    shapes = ";".join(f"{name}:{tuple(p.shape)}" for name, p in model.named_parameters())
    return [
        ("target_batch", float(target or 0), lambda v: str(int(v))),
        ("precision", float(precisions.index(precision)), lambda v: repr(precisions[int(v)])),
        ("bn", float(BN_MODES.index(mode.name if mode is not None else None)), lambda v: repr(BN_MODES[int(v)])),
        ("lr_rule", float(LR_RULES.index(lr_rule)), lambda v: repr(LR_RULES[int(v)])),
        ("model (its parameters' names and shapes)", float(zlib.crc32(shapes.encode())), lambda v: f"checksum {int(v):08x}"),
    ]


def _check_count(loader: Iterable[Any], count: Count | None, group: Any = None, *, max_batches: int = 8) -> None:
    """Call ``count`` on the first batches (generators restored after), so a bad count fails now."""
    if count is None:
        return
    if not callable(count):
        raise TypeError(f"Invalid count {count!r}: pass a function count(batch) -> int, or None")
    if is_one_shot(loader):  # looking would consume it
        return
    rng = RNGState(loader)
    try:
        seen = total = 0
        for batch in loader:
            total += check_count_value(count(batch))
            seen += 1
            if seen >= max_batches:
                break
    finally:
        rng.restore()
    if seen and total == 0 and not is_distributed():  # one rank's shard may start with no items
        raise ValueError(
            f"Invalid count: it returned 0 items for each of the first {seen} batches, so there is no loss "
            "to train on; check that it counts the loss's items (e.g. int((labels != -100).sum()))"
        )


def fit(
    model: nn.Module,
    loader: Iterable[Any],
    target_batch: int | BatchRamp | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: LossFn | None = None,
    epochs: int = 1,
    max_steps: int | None = None,
    device: torch.device | str | None = None,
    memory_limit: int | str | None = None,
    headroom: float | None = None,
    precision: str | None = None,
    clip_grad_norm: float | None = None,
    lr_rule: str = "auto",
    base_batch: int | None = None,
    count: Count | None = None,
    pad: Pad | None = None,
    drop_last: bool = False,
    scheduler: Any = None,
    scaler: torch.amp.GradScaler | None = None,
    bn: Any = "adjust",
    checkpointing: bool = False,
    noise_scale: bool | int = True,
    progress: bool = True,
    plan: Plan | None = None,
    callback: Callable[[StepRecord], Any] | None = None,
) -> FitResult:
    """Probe the device, plan, and train ``target_batch`` samples per optimizer step, exactly.

    Each optimizer step sees exactly ``target_batch`` samples (the last window of an epoch: what is
    left, or nothing with ``drop_last=True``), cut into micro-batches that fit; micro-batch ``i``'s
    mean loss is weighted by ``n_i / N`` (items in it over items in the window), so the gradient is
    that of one big batch. Every step applies ``plan.lr_scale`` times the learning rate your
    optimizer and scheduler hold, which are never changed; BatchNorm momenta are set for the run
    and put back.

    Args:
        model: the module to train; it is moved to ``device``.
        loader: a re-iterable of batches (as for :func:`autotune.plan`); one pass is one epoch.
        target_batch: samples per optimizer step (required unless ``plan`` is given), or a
            :class:`autotune.BatchRamp`: a target that grows during the run, in fixed stages or
            following the measured noise scale (the plan is made for its largest target; pass the
            same ramp to a later ``fit`` to continue it).
        optimizer: default ``AdamW(lr=1e-3)`` over the model's parameters.
        loss_fn: ``loss_fn(model, batch) -> scalar``, the mean loss over the batch's items
            (default: see :func:`autotune.step.default_loss`). With ``count``, the mean over exactly
            the items ``count`` counts.
        epochs: passes over ``loader``.
        max_steps: stop after this many optimizer steps.
        device: default: the model's device if it is not the CPU, else CUDA when available.
        memory_limit: as for :func:`autotune.plan`; also enforced while training (CUDA: the
            allocator's cap; CPU: counting tensor bytes for each window of a new shape).
        headroom: as for :func:`autotune.plan`.
        precision: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"`` (autocast; fp16 adds a
            ``GradScaler``, unscaled once per window before clipping).
        clip_grad_norm: clip the accumulated gradient's norm to this, once per window.
        lr_rule: as for :func:`autotune.plan`.
        base_batch: as for :func:`autotune.plan`. When not given, the plan's notes say which batch
            size the learning rate was assumed to be tuned at (``result.plan.base_batch_source``).
        count: ``count(batch) -> int``, loss items in a batch (e.g. non-padding tokens); default:
            samples.
        pad: ``pad(batches) -> batch`` joining batches padded to different lengths (e.g.
            :func:`autotune.pad_to_longest`), so that micro-batches are not held to the loader's
            batches: pieces of different lengths are joined up to the micro-batch their padded
            shape allows. Without it, batches of different shapes are never joined.
        drop_last: drop each epoch's short last window.
        scheduler: any torch LR scheduler of ``optimizer`` except ``ReduceLROnPlateau`` (step that
            one yourself between calls); stepped once per optimizer step.
        scaler: a ``torch.amp.GradScaler`` for fp16 (default: a new one), e.g. to carry its scale
            from one ``fit`` call to the next.
        bn: how BatchNorm running statistics are kept (see :mod:`autotune.train.bn`): ``"adjust"``
            (default), ``"pooled"``, ``"precise"``, ``None`` (leave BatchNorm alone), or a mode
            with options: ``autotune.PreciseBN(samples=8192)``, ``autotune.OptunaBN(val_loader,
            n_trials=30, storage="sqlite:///bn.db")``.
        checkpointing: activation checkpointing on the model's blocks for the run (see
            :mod:`autotune.memory.checkpointing`), counted by the plan: fewer activations kept, about a
            third more compute; taken away when ``fit`` returns. A plan made with
            ``checkpointing=True`` trains that way too.
        noise_scale: measure the gradient noise scale while training, from the first micro-batch
            of a window against the whole window (two gradient norms; see :mod:`autotune.train.noise`):
            per step in the history and over the run in the result, whose ``advice()`` says when
            the target batch is far from it. True (the default) measures as many windows as keep
            its cost within 1% of the step time (every window for most models); an int ``n``
            measures every ``n``-th window; False never.
        progress: show what the probe is doing and a tqdm bar (samples/s, loss) when they take
            more than a moment.
        plan: use this plan instead of probing (e.g. one made by :func:`autotune.plan`).
        callback: called with each :class:`StepRecord`.

    Returns:
        A :class:`FitResult` with the plan (final micro-batch) and the per-step history.

    Raises:
        TypeError / ValueError: bad arguments, before anything changes (see ``docs/errors.md``).
        RuntimeError: called under ``torch.no_grad()`` or ``torch.inference_mode()``.
        AutotuneError: a non-finite loss (the step is not taken; the message names it).
        NothingFits: not even one sample fits (while probing, or while training after OOMs).

    Example:
        >>> result = autotune.fit(model, loader, target_batch=256)  # doctest: +SKIP
        >>> result.plan.accumulation_steps, result.history[-1].loss  # doctest: +SKIP
    """
    # --- checks: nothing has changed yet ------------------------------------------------------
    check_model(model)
    check_loader(loader)
    if plan is None and target_batch is None:
        raise TypeError("fit() needs target_batch= (samples per optimizer step), or plan=")
    check_callable("loss_fn", loss_fn, "loss_fn(model, batch) -> the batch's mean loss as a scalar tensor")
    check_callable("callback", callback, "callback(record) called after each optimizer step")
    check_callable("pad", pad, "pad(batches) -> batch, such as autotune.pad_to_longest")
    check_flag("drop_last", drop_last)
    check_flag("checkpointing", checkpointing)
    check_progress(progress)
    if scaler is not None and not all(callable(getattr(scaler, m, None)) for m in ("scale", "unscale_", "step", "update", "get_scale")):
        raise TypeError(f"Invalid scaler {scaler!r} ({type(scaler).__name__}): pass a torch.amp.GradScaler, or None (fp16 makes one)")
    if not (isinstance(noise_scale, bool) or (isinstance(noise_scale, int) and noise_scale >= 1)):
        raise ValueError(
            f"Invalid noise_scale {noise_scale!r}: give True (measure at most 1% of the step time), False, or every "
            "how many windows to measure (an int >= 1)"
        )
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"Invalid epochs {epochs!r}: give a whole number >= 1")
    if max_steps is not None and (not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1):
        raise ValueError(f"Invalid max_steps {max_steps!r}: give a whole number >= 1, or None")
    check_positive_number("clip_grad_norm", clip_grad_norm)
    mode = resolve_bn(bn)
    ramp = target_batch if isinstance(target_batch, BatchRamp) else None
    # a ramp's plan is made for its largest target
    target: int | None = ramp.maximum if ramp is not None else target_batch  # type: ignore[assignment]
    if ramp is not None:
        if ramp.adaptive_form and noise_scale is False:
            raise ValueError(f"Invalid noise_scale False with {ramp!r}: an adaptive ramp raises the batch from the measured "
                             "noise scale; leave noise_scale on, or use BatchRamp.fixed")
        if plan is not None and plan.effective_batch != ramp.maximum:
            raise ValueError(f"Invalid plan for {ramp!r}: it trains {plan.effective_batch} samples per step, and a ramp's plan is "
                             f"made for its largest target ({ramp.maximum}); make the plan with target_batch={ramp.maximum}")
    _check_plan(plan, target)
    _check_against_plan(plan, optimizer, lr_rule=lr_rule, base_batch=base_batch, headroom=headroom)
    check_reiterable(loader, epochs)
    check_grad_mode("fit")
    check_device_exists(device)
    par = parallel(model)  # under DDP: the inner module runs; autotune syncs once per window
    if ramp is not None and par.fsdp:
        raise ValueError(f"Invalid target_batch {ramp!r} for a model sharded with FSDP2: a changing target is not supported "
                         "under FSDP2 (its ranks run every micro-batch in lockstep); give a fixed target_batch")
    if mode is not None and mode.name in ("precise", "optuna") and par.fsdp:
        raise ValueError(
            f"Invalid bn {mode.name!r} for a model sharded with FSDP2: it recomputes BatchNorm statistics with extra "
            "forward passes that the ranks would not run in lockstep; use bn='adjust' or bn='pooled'"
        )
    inner = par.inner
    check_trainable(inner)
    if optimizer is not None:
        check_optimizer(inner, optimizer)
    check_scheduler(scheduler, optimizer if optimizer is not None else object())  # type: ignore[arg-type]
    precision_name = normalize_precision(precision if (precision is not None or plan is None) else plan.precision)
    if plan is not None and precision is not None and precision_name != plan.precision:
        raise ValueError(
            f"Invalid precision {precision!r}: the plan given was made for {plan.precision!r}, whose memory it measured; "
            "leave precision out, or make a new plan with this precision"
        )
    limit = parse_bytes(memory_limit) if memory_limit is not None else None
    # Every rank looks at its first batches: one whose dataset raises stops them all, together (one
    # small collective). Without a probe, nothing has run the loss on this loader's batches yet: one
    # forward and backward on a sample of the first, put back after, so a bad batch or loss is refused
    # now (on the model's device: moving it is the setup's). Under FSDP2 a forward is collective: the
    # first window checks it, every rank together.
    check_loss = plan is not None and not par.fsdp and not is_one_shot(loader)

    def look() -> None:
        _check_count(loader, count, par.group)
        if check_loss:
            check_step(inner, loss_fn or default_loss, loader, device=next(inner.parameters()).device, precision=precision_name)

    if lr_rule not in LR_RULES:
        raise ValueError(f"Invalid lr_rule {lr_rule!r}: use one of {', '.join(map(repr, LR_RULES))}")
    # Several ranks: what they must share travels in the same all-reduce (one process: nothing to compare).
    agree = _must_agree(inner, target if plan is None else plan.effective_batch, precision_name, mode, lr_rule) if is_distributed() else ()
    on_every_rank(look, device=None, group=par.group, what="looking at its first batches", agree=agree)

    # --- setup ----------------------------------------------------------------------------------
    device = _fit_device(model, device)
    if par.ddp is None and not par.fsdp:
        model.to(device)
    resolve_device(inner, device)  # the model has parameters, all on the device
    if par.ddp is None and not par.fsdp and is_distributed():
        broadcast_model(inner, par.group, device)  # the same start on every rank, as DDP makes it
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = loss_fn or default_loss
    if plan is None:
        plan = make_plan(
            model, loader, target_batch=target, optimizer=optimizer, loss_fn=loss_fn,  # type: ignore[arg-type]
            device=device, memory_limit=limit, headroom=headroom, lr_rule=lr_rule,
            base_batch=base_batch, precision=precision_name, epochs=epochs, progress=progress,
            checkpointing=checkpointing,
        )
    bns = batchnorms(inner)
    min_micro = max(plan.min_micro_batch, min_micro_batch(inner))
    plan = dataclasses.replace(plan, bn_mode=mode.name if (bns and mode is not None) else None, min_micro_batch=min_micro)
    if bns and mode is not None and min(plan.micro_batches) < 16 and plan.accumulation_steps > 1:
        warnings.warn(
            f"BatchNorm normalises over micro-batches of {min(plan.micro_batches)} samples (< 16), so its "
            "statistics are noisy; consider GroupNorm, or SyncBatchNorm across GPUs",
            AutotuneWarning,
            stacklevel=2,
        )
    _warn_if_larger_than_an_epoch(loader, plan.effective_batch)
    if scaler is None and precision_name == "fp16":
        scaler = torch.amp.GradScaler(device.type)

    # --- the loop -------------------------------------------------------------------------------
    history: list[StepRecord] = []
    changes: list[RampChange] = []
    rank = world(par.group)[0]
    if ramp is not None:  # the plan says what the ramp does with its micro-batch
        lines = ramp.describe(ramp_micro_batch(plan, ramp, min_micro), plan.world_size)
        plan = dataclasses.replace(plan, notes=plan.notes + (f"batch ramp {ramp!r}: " + "; ".join(lines),))
    run = Run(
        par, optimizer, scheduler, loss_fn,
        plan_for_target(plan, ramp.target, micro_batch=ramp_micro_batch(plan, ramp, min_micro), rank=rank) if ramp else plan,
        device, precision_name, scaler, clip_grad_norm, limit, mode, bns, _total_steps(loader, plan, epochs, max_steps), progress,
        checkpointing=checkpointing or plan.checkpointing, noise_scale=noise_scale,
    )
    if ramp is not None:
        run.ramp = ramp
        if ramp.adaptive_form:  # the meter travels with the ramp (a later fit continues it), every window measured
            ramp.meter = ramp.meter or run.noise.meter
            run.noise.meter = ramp.meter
            run.noise.fixed = run.noise.fixed or 1
            run.noise.every = run.noise.fixed
    # One window module per mode: one process, data-parallel ranks (one exchange per window), FSDP2 (lockstep).
    run_window = sharded.run_window if par.fsdp else data_parallel.run_window if run.sync is not None else single.run_window
    first_epoch = sampler_epoch(loader)  # continue where an earlier fit left the sampler
    # In a single process the short last window is dropped before it runs; with several ranks
    # only the agreement can tell that the global window is short.
    local_drop = drop_last and run.world_size == 1
    with run:
        for epoch in range(epochs):
            set_epoch(loader, first_epoch + epoch)
            if ramp is not None:
                ramp.begin_epoch()
            windows = accumulate(
                run.caps.meeting(loader), plan, count=count, drop_last=local_drop, min_micro_batch=min_micro, distributed=False,
                skip_empty=run.world_size == 1, pad=pad, cap=run.caps.cap, shares=run.shares if (run.world_size > 1 or ramp) else None,
            )
            seen_samples = seen_items = 0
            while max_steps is None or len(history) < max_steps:
                start = time.perf_counter()
                run.begin_window()  # a stop before this window's step puts the model back as it is now
                done = run_window(run, windows, drop_last=drop_last)  # micro-batches, then one agreement
                if done is None:
                    break  # the epoch is over on every rank
                loss, window, agreed = done
                seen_samples, seen_items = seen_samples + agreed.samples, seen_items + agreed.items
                if agreed.items == 0:  # no loss item on any rank: nothing to learn from, no step
                    run.optimizer.zero_grad(set_to_none=True)
                    if ramp is not None:
                        ramp.skipped(int(agreed.samples))
                    continue
                run.check_finite(loss, window, step=len(history) + 1, epoch=epoch)
                if ramp is not None:  # the learning rate follows the target of the window that ran
                    _follow(run, plan, ramp.trained_target())
                noise = run.measure_noise(agreed)  # the window's gradient, before clipping
                lr, skipped = optimizer_step(run, int(agreed.samples))  # clip, step at the scaled LR, schedule, zero
                run.end_window()
                change = None
                if ramp is not None:  # a stage reached, or every rank voted at this exchange: later windows grow
                    change = ramp.after_step(samples=int(agreed.samples), items=int(agreed.items), vote=agreed.vote)
                    ramp.pending_vote = ramp.vote(run.noise.meter.estimate() if run.noise.meter else None,
                                                  agreed.items / max(agreed.samples, 1))
                    changes += [change] if change else []
                record = StepRecord(
                    step=len(history) + 1, epoch=epoch, samples=int(agreed.samples), items=int(agreed.items),
                    loss=loss, lr=lr, micro_batch=max((m.samples for m in window), default=0) if window else 0,
                    seconds=time.perf_counter() - start, micro_batches=tuple(m.samples for m in window) if window else (),
                    noise_scale=noise, skipped=skipped, target=run.plan.effective_batch,
                    target_change=f"target {change.before} -> {change.target}: {change.reason}" if change else None,
                )
                run.pace_noise(record.seconds)
                history.append(record)
                run.show(record)
                if callback is not None:
                    callback(record)
            if count is not None and seen_samples > 0 and seen_items == 0:
                raise ValueError(
                    f"Invalid count: it returned 0 items for every batch of the epoch ({int(seen_samples)} samples on all "
                    "ranks), so there is no loss to train on; check that it counts the loss's items (e.g. labels != -100)"
                )
            if max_steps is not None and len(history) >= max_steps:
                break
        set_epoch(loader, first_epoch + epochs)  # the next fit starts on the next epoch

    tuning = None
    if mode is not None and bns:
        finished = FinishedRun(
            batches=lambda: (micro.batch for w in accumulate(loader, run.plan, min_micro_batch=min_micro, distributed=False, pad=pad, cap=run.caps.cap) for micro in w),
            forward=lambda m, b: _forward(m, loss_fn, b, device, precision_name),  # type: ignore[arg-type]
            loss_fn=loss_fn,
            device=device,
            recording=run.bnc.recording,
        )
        tuning = mode.finish(inner, finished)
    measured = run.noise.meter.estimate() if run.noise.meter is not None else None
    return FitResult(plan=run.plan, history=tuple(history), bn_tuning=tuning,
                     noise_scale=measured, noise_note=_noise_note(measured, run, noise_scale), ramp=ramp, ramp_changes=tuple(changes))


def _follow(run: Run, plan: Plan, target: int) -> None:
    """The run's plan for a ramp's ``target``: same micro-batch, its accumulation and learning rate."""
    if target != run.plan.effective_batch:  # the micro-batch stays the run's (or what an OOM lowered it to)
        run.plan = plan_for_target(plan, target, micro_batch=run.plan.micro_batch, rank=run.rank)


def _noise_note(noise: Any, run: Run, asked: bool | int) -> str | None:
    """Why ``FitResult.noise_scale`` is missing or open-ended (None when it is measured)."""
    if asked is False:
        return "not measured: noise_scale=False"
    if run.par.fsdp:
        return "not measured under FSDP2: its backward averages the gradients over the ranks, and the meter needs a rank's own"
    if noise is None:
        measured = run.noise.meter.n if run.noise.meter is not None else 0
        return (
            f"not measurable: {measured} window(s) of more than one micro-batch were measured and it takes two (a window "
            "of one micro-batch has no smaller gradient to compare with; a target that fits in one micro-batch has none)"
        )
    if math.isinf(noise.high):
        return (
            f"only a lower bound: the window's gradient was not told apart from its noise over {noise.steps:.0f} windows "
            "(the noise scale is far above the target, or the run is short); it is at least noise_scale.low"
        )
    return None


def _total_steps(loader: Iterable[Any], plan: Plan, epochs: int, max_steps: int | None) -> int | None:
    total = None
    try:
        total = epochs * math.ceil(len(loader.dataset) / plan.effective_batch)  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        pass
    if max_steps is not None:
        total = min(total or max_steps, max_steps)
    return total


def _forward(model: nn.Module, loss_fn: LossFn, batch: Any, device: torch.device, precision: Precision) -> Any:
    with autocast(device.type, precision):
        return loss_fn(model, B.to_device(batch, device))
