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

Why this is long: ``fit``'s many arguments are documented and refused in one place (``_Request.checked``), and the
loop, its setup and its finish are read top to bottom beside them.
"""

from __future__ import annotations

import dataclasses
import math
import os
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
    check_device_exists,
    check_flag,
    check_grad_mode,
    check_loader,
    check_model,
    check_optimizer,
    check_positive_number,
    check_reiterable,
    check_scheduler,
    check_trainable,
    is_one_shot,
    resolve_device,
)
from autotune.errors import AutotuneWarning
from autotune.items import count_for, first_batch, labelled, loss_items
from autotune.packed import packed_row, packing_problem
from autotune.parallel.ranks import (
    broadcast_model,
    is_distributed,
    parallel,
    sampler_epoch,
    set_epoch,
    world,
)
from autotune.parallel.stops import on_every_rank
from autotune.planning.options import Options, Probing, options
from autotune.planning.planner import plan_with
from autotune.planning.plans import Plan
from autotune.planning.scaling import LR_RULES
from autotune.step import (
    LossFn,
    Precision,
    autocast,
    batchnorms,
    check_step,
    default_loss,
    min_micro_batch,
)
from autotune.train import data_parallel, sharded, single
from autotune.train.accumulate import Count, Pad, accumulate
from autotune.train.arguments import (
    check_against_plan,
    check_count,
    check_plan,
    check_within_an_epoch,
)
from autotune.train.bn import BN_MODES, FinishedRun, resolve_bn
from autotune.train.experts import check_router_loss, router_loss_for
from autotune.train.ramp import BatchRamp, RampChange, plan_for_target
from autotune.train.records import FitResult, StepRecord
from autotune.train.resume import Tracker, tracker_for
from autotune.train.run import Run
from autotune.train.stepping import optimizer_step

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
    router_loss: str = "per_micro_batch",
    checkpointing: bool | int | str = False,
    noise_scale: bool | int = True,
    progress: bool = True,
    plan: Plan | None = None,
    callback: Callable[[StepRecord], Any] | None = None,
    checkpoint: str | os.PathLike[str] | None = None,
    save_every: int = 100,
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
        count: ``count(batch) -> int``, loss items in a batch (e.g. non-padding tokens, or
            :func:`autotune.shifted_label_tokens`). Default: for the model's own loss (no
            ``loss_fn``), what it averages over, measured on the first batches (a Transformers causal
            LM's label tokens shifted by one, a token classifier's labels, a sequence classifier's
            samples; see :mod:`autotune.items`), named in the plan's notes; for your ``loss_fn``,
            samples, with a note when the first batches show it is a mean over other items.
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
        router_loss: a mixture-of-experts model's load-balancing loss (a Transformers model whose config has
            ``output_router_logits``; see :mod:`autotune.train.experts`): ``"per_micro_batch"`` (default:
            each micro-batch's own, as trainers do; the plan's notes say how far it is from the window's on the
            first window) or ``"exact"``: the window's, from the fraction routed to each expert over the whole
            window, at one extra forward without gradients per window (the model's own loss, one process).
        checkpointing: activation checkpointing on the model's blocks for the run (see
            :mod:`autotune.memory.checkpointing`), counted by the plan: fewer activations kept, about a
            third more compute; taken away when ``fit`` returns. ``True`` for every block, a count for the
            first ones, or ``"auto"``: the fewest blocks with which the planned micro-batch fits. A plan
            made with checkpointing trains with the count it was made with.
        noise_scale: measure the gradient noise scale while training, from the first micro-batch
            of a window against the whole window (two gradient norms; see :mod:`autotune.train.noise`):
            per step in the history and over the run in the result, whose ``advice()`` says when
            the target batch is far from it. True (the default) measures as many windows as keep
            its cost within 1% of the step time (every window for most models); an int ``n``
            measures every ``n``-th window; False never.
        progress: show what the probe is doing and a tqdm bar (samples/s, loss) when they take
            more than a moment.
        plan: use this plan instead of probing (e.g. one made by :func:`autotune.plan`).
        callback: called with each :class:`StepRecord` (after the checkpoint of that step is written).
        checkpoint: a file to resume from and to save to (see :mod:`autotune.train.resume`): when it
            exists, the run continues where it was saved (its model, optimizer, scheduler and
            scaler states, the plan with what out-of-memory errors taught, the noise meter, the
            ramp, the samples trained in the epoch); every ``save_every`` optimizer steps and when
            ``fit`` returns it is written again. ``epochs`` and ``max_steps`` count the whole run.
        save_every: optimizer steps between two checkpoints.

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
    request = _Request.checked(  # every refusal is here, before anything changes
        model=model, loader=loader, target_batch=target_batch, optimizer=optimizer, loss_fn=loss_fn, epochs=epochs,
        max_steps=max_steps, device=device, memory_limit=memory_limit, headroom=headroom, precision=precision,
        clip_grad_norm=clip_grad_norm, lr_rule=lr_rule, base_batch=base_batch, count=count, pad=pad, drop_last=drop_last,
        scheduler=scheduler, scaler=scaler, bn=bn, router_loss=router_loss, checkpointing=checkpointing, noise_scale=noise_scale, progress=progress,
        plan=plan, callback=callback, checkpoint=checkpoint, save_every=save_every,
    )
    _look_and_agree(request)  # the first batches looked at, and what the ranks must share agreed, on every rank
    run = _set_up(request)  # the device, the optimizer, the plan unless given, the Run that puts everything back
    with run:
        history, changes = _epochs(run, request)
    return _finish(run, request, history, changes)


@dataclasses.dataclass
class _Request:
    """``fit``'s arguments, checked: the shared ones as :class:`autotune.planning.options.Options`."""

    model: nn.Module
    loader: Iterable[Any]
    par: Any
    shared: Options
    ramp: BatchRamp | None
    target: int | None
    mode: Any
    precision: Precision
    plan: Plan | None
    optimizer: Any
    loss_fn: Any
    device: Any
    scheduler: Any
    scaler: Any
    clip_grad_norm: float | None
    count: Count | None
    pad: Pad | None
    drop_last: bool
    epochs: int
    max_steps: int | None
    noise_scale: bool | int
    callback: Callable[[StepRecord], Any] | None
    tracker: Tracker | None
    router_loss: str = "per_micro_batch"

    @classmethod
    def checked(cls, *, model: Any, loader: Any, target_batch: Any, plan: Any, epochs: Any, max_steps: Any, precision: Any,
                memory_limit: Any, headroom: Any, lr_rule: Any, base_batch: Any, checkpointing: Any, progress: Any,
                **rest: Any) -> _Request:
        """Refuse every bad argument, naming it and the fix; nothing has changed yet."""
        check_model(model)
        check_loader(loader)
        if plan is None and target_batch is None:
            raise TypeError("fit() needs target_batch= (samples per optimizer step), or plan=")
        check_callable("loss_fn", rest["loss_fn"], "loss_fn(model, batch) -> the batch's mean loss as a scalar tensor")
        check_callable("callback", rest["callback"], "callback(record) called after each optimizer step")
        check_callable("pad", rest["pad"], "pad(batches) -> batch, such as autotune.pad_to_longest")
        check_flag("drop_last", rest["drop_last"])
        scaler, noise_scale = rest["scaler"], rest["noise_scale"]
        if scaler is not None and not all(callable(getattr(scaler, m, None)) for m in ("scale", "unscale_", "step", "update", "get_scale")):
            raise TypeError(f"Invalid scaler {scaler!r} ({type(scaler).__name__}): pass a torch.amp.GradScaler, or None (fp16 makes one)")
        if not (isinstance(noise_scale, bool) or (isinstance(noise_scale, int) and noise_scale >= 1)):
            raise ValueError(
                f"Invalid noise_scale {noise_scale!r}: give True (measure at most 1% of the step time), False, or every "
                "how many windows to measure (an int >= 1)"
            )
        if max_steps is not None and (not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1):
            raise ValueError(f"Invalid max_steps {max_steps!r}: give a whole number >= 1, or None")
        check_positive_number("clip_grad_norm", rest["clip_grad_norm"])
        mode = resolve_bn(rest.pop("bn"))
        if rest["router_loss"] != "per_micro_batch":  # the default asks nothing of the model
            check_router_loss(model, rest["router_loss"], loss_fn=rest["loss_fn"], distributed=is_distributed())
        ramp = target_batch if isinstance(target_batch, BatchRamp) else None
        target = ramp.maximum if ramp is not None else target_batch  # a ramp's plan is made for its largest target
        shared = options(target_batch=target, memory_limit=memory_limit, headroom=headroom, lr_rule=lr_rule, base_batch=base_batch,
                         precision=precision, epochs=epochs, checkpointing=checkpointing, progress=progress, progress_seconds=False,
                         epochs_optional=False)
        if ramp is not None:
            if ramp.adaptive_form and noise_scale is False:
                raise ValueError(f"Invalid noise_scale False with {ramp!r}: an adaptive ramp raises the batch from the measured "
                                 "noise scale; leave noise_scale on, or use BatchRamp.fixed")
            if plan is not None and plan.effective_batch != ramp.maximum:
                raise ValueError(f"Invalid plan for {ramp!r}: it trains {plan.effective_batch} samples per step, and a ramp's plan is "
                                 f"made for its largest target ({ramp.maximum}); make the plan with target_batch={ramp.maximum}")
        check_plan(plan, target)
        check_against_plan(plan, rest["optimizer"], lr_rule=lr_rule, base_batch=base_batch, headroom=headroom)
        check_reiterable(loader, epochs)
        check_grad_mode("fit")
        check_device_exists(rest["device"])
        par = parallel(model)  # under DDP: the inner module runs; autotune syncs once per window
        _check_with_ranks(par, ramp, mode)
        check_within_an_epoch(loader, None if ramp is not None else (plan.effective_batch if plan is not None else target),
                               world(par.group)[1])
        check_trainable(par.inner)
        if not isinstance(shared.checkpointing, bool):  # a count or "auto": checked against the model's blocks
            from autotune.memory.checkpointing import settled

            shared = dataclasses.replace(shared, checkpointing=settled(par.inner, shared.checkpointing))
        if rest["optimizer"] is not None:
            check_optimizer(par.inner, rest["optimizer"])
        check_scheduler(rest["scheduler"], rest["optimizer"] if rest["optimizer"] is not None else object())  # type: ignore[arg-type]
        tracker = tracker_for(rest.pop("checkpoint"), rest.pop("save_every"), par, loader, target, plan)
        name = shared.precision or (plan.precision if plan is not None else "fp32")
        if scaler is not None and name != "fp16":
            raise ValueError(
                f"Invalid scaler {type(scaler).__name__} for precision={name!r}: a GradScaler keeps fp16's small gradients "
                f"from underflowing; {name} has float32's range and needs none; drop scaler=, or train with precision='fp16'"
            )
        if plan is not None and shared.precision is not None and shared.precision != plan.precision:
            raise ValueError(
                f"Invalid precision {precision!r}: the plan given was made for {plan.precision!r}, whose memory it measured; "
                "leave precision out, or make a new plan with this precision"
            )
        return cls(model=model, loader=loader, par=par, shared=shared, ramp=ramp, target=target, mode=mode, precision=name,  # type: ignore[arg-type]
                   plan=plan, epochs=epochs, max_steps=max_steps, tracker=tracker, **rest)


def _check_with_ranks(par: Any, ramp: BatchRamp | None, mode: Any) -> None:
    """What FSDP2's lockstep cannot do: a changing target, BatchNorm modes with extra forwards."""
    if ramp is not None and par.fsdp:
        raise ValueError(f"Invalid target_batch {ramp!r} for a model sharded with FSDP2: a changing target is not supported "
                         "under FSDP2 (its ranks run every micro-batch in lockstep); give a fixed target_batch")
    if mode is not None and mode.name in ("precise", "optuna") and par.fsdp:
        raise ValueError(
            f"Invalid bn {mode.name!r} for a model sharded with FSDP2: it recomputes BatchNorm statistics with extra "
            "forward passes that the ranks would not run in lockstep; use bn='adjust' or bn='pooled'"
        )


def _look_and_agree(request: _Request) -> None:
    """Every rank looks at its first batches: one whose dataset raises stops them all, together (one
    small collective). Without a probe, nothing has run the loss on this loader's batches yet: one
    forward and backward on a sample of the first, put back after, so a bad batch or loss is refused
    now (on the model's device: moving it is the setup's). Under FSDP2 a forward is collective: the
    first window checks it, every rank together."""
    r, inner = request, request.par.inner
    check_loss = r.plan is not None and not r.par.fsdp and not is_one_shot(r.loader)

    def look() -> None:
        check_count(r.loader, r.count, r.par.group)
        row = packed_row(r.loader) if not r.par.fsdp else None  # packed rows the model would not keep apart: refused
        packing = packing_problem(inner, row, device=next(inner.parameters()).device, precision=r.precision) if row else None
        if packing:
            raise ValueError(f"Invalid loader: {packing}")
        if check_loss:
            check_step(inner, r.loss_fn or default_loss, r.loader, device=next(inner.parameters()).device, precision=r.precision)

    # Several ranks: what they must share travels in the same all-reduce (one process: nothing to compare).
    target = r.target if r.plan is None else r.plan.effective_batch
    agree = _must_agree(inner, target, r.precision, r.mode, r.shared.lr_rule) if is_distributed() else ()
    on_every_rank(look, device=None, group=r.par.group, what="looking at its first batches", agree=agree)


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


def _set_up(r: _Request) -> Run:
    """The device and the model on it, the optimizer, the plan unless given (with BatchNorm's settings
    and the ramp's note), the scaler for fp16: the :class:`Run` that trains and puts everything back."""
    par, inner = r.par, r.par.inner
    device = r.device = _fit_device(r.model, r.device)
    if par.ddp is None and not par.fsdp:
        r.model.to(device)
    resolve_device(inner, device)  # the model has parameters, all on the device
    if par.ddp is None and not par.fsdp and is_distributed():
        broadcast_model(inner, par.group, device)  # the same start on every rank, as DDP makes it
    if r.optimizer is None:
        r.optimizer = torch.optim.AdamW(r.model.parameters(), lr=1e-3)
    own_loss = r.loss_fn is None  # the model's own loss: weighted by what it averages over (autotune.items)
    r.loss_fn = r.loss_fn or default_loss
    tracker = r.tracker
    plan = r.plan
    if tracker is not None:
        tracker.restore(inner, r.optimizer, r.scheduler, None)
        plan = plan or tracker.plan(r.shared.memory_limit, world(par.group)[1])
        if r.ramp is not None and tracker.saved is not None and tracker.saved.ramp is not None:
            r.ramp.load_state_dict(tracker.saved.ramp)
    if plan is None:
        plan = plan_with(r.model, r.loader, dataclasses.replace(r.shared, precision=r.precision), Probing(items=True),
                         optimizer=r.optimizer, loss_fn=r.loss_fn, device=device)
    elif r.count is None and own_loss and (labelled(first_batch(r.loader)) or isinstance(getattr(inner, "loss_type", None), str)):
        # a plan made elsewhere: what the model's own loss averages over, told here
        items = loss_items(inner, None, r.loader, device=device, precision=r.precision,
                           measure=not par.fsdp and world(par.group)[1] == 1)
        plan = dataclasses.replace(plan, items=items.rule,
                                   notes=plan.notes + ((items.note,) if items.note and items.note not in plan.notes else ()))
    elif r.count is None:  # your loss_fn (or batches without labels), with a plan made elsewhere: by samples
        plan = dataclasses.replace(plan, items="samples")
    if r.count is None:
        r.count = count_for(plan.items)
    bns = batchnorms(inner)
    min_micro = max(plan.min_micro_batch, min_micro_batch(inner))
    plan = dataclasses.replace(plan, bn_mode=r.mode.name if (bns and r.mode is not None) else None, min_micro_batch=min_micro)
    if bns and r.mode is not None and min(plan.micro_batches) < 16 and plan.accumulation_steps > 1:
        warnings.warn(
            f"BatchNorm normalises over micro-batches of {min(plan.micro_batches)} samples (< 16), so its "
            "statistics are noisy; consider GroupNorm, or SyncBatchNorm across GPUs",
            AutotuneWarning,
            stacklevel=3,
        )
    if r.scaler is None and r.precision == "fp16":
        r.scaler = torch.amp.GradScaler(device.type)
        plan = dataclasses.replace(plan, notes=plan.notes + (
            "fp16: a GradScaler made for the run (scaler=None), its scale starting over; pass scaler= to carry it from one "
            "fit call to the next" + ("; on the CPU, bf16 has float32's range and needs none" if device.type == "cpu" else ""),))
    if tracker is not None:
        tracker.restore(None, None, None, r.scaler)
    ramp, rank = r.ramp, world(par.group)[0]
    if ramp is not None and not any(n.startswith("batch ramp") for n in plan.notes):  # the plan says what the ramp does
        lines = ramp.describe(plan.micro_batch, plan.world_size)
        plan = dataclasses.replace(plan, notes=plan.notes + (f"batch ramp {ramp!r}: " + "; ".join(lines),))
    r.plan = plan
    run = Run(
        par, r.optimizer, r.scheduler, r.loss_fn,
        plan_for_target(plan, ramp.target, micro_batch=plan.micro_batch, rank=rank, ramp=ramp) if ramp else plan,
        device, r.precision, r.scaler, r.clip_grad_norm, r.shared.memory_limit, r.mode, bns,
        _total_steps(r.loader, plan, r.epochs, r.max_steps), bool(r.shared.progress),
        checkpointing=plan.checkpointing if r.shared.checkpointing in (False, "auto") else r.shared.checkpointing,  # type: ignore[arg-type]
        noise_scale=r.noise_scale,
    )
    if ramp is not None:
        run.ramp = ramp
        if ramp.adaptive_form:  # the meter travels with the ramp (a later fit continues it), every window measured
            ramp.meter = ramp.meter or run.noise.meter
            run.noise.meter = ramp.meter
            run.noise.fixed = run.noise.fixed or 1
            run.noise.every = run.noise.fixed
    if tracker is not None:
        tracker.restore_run(run)
    if getattr(getattr(inner, "config", None), "output_router_logits", False):  # a mixture of experts' balancing loss
        run.router = router_loss_for(inner, r.router_loss)  # type: ignore[arg-type]
    return run


def _epochs(run: Run, r: _Request) -> tuple[list[StepRecord], list[RampChange]]:
    """The loop: each epoch cut into windows, each window one optimizer step (see the module docstring)."""
    plan, ramp, loader = r.plan, r.ramp, r.loader
    assert plan is not None
    history: list[StepRecord] = []
    changes: list[RampChange] = []
    min_micro = plan.min_micro_batch
    # One window module per mode: one process, data-parallel ranks (one exchange per window), FSDP2 (lockstep).
    run_window = sharded.run_window if r.par.fsdp else data_parallel.run_window if run.sync is not None else single.run_window
    tracker, done = r.tracker, r.tracker.steps if r.tracker is not None else 0  # a resumed run: the steps it took before
    first_epoch = tracker.saved.sampler_epoch - tracker.saved.epoch if tracker and tracker.saved else sampler_epoch(loader)
    # In a single process the short last window is dropped before it runs; with several ranks
    # only the agreement can tell that the global window is short.
    local_drop = r.drop_last and run.world_size == 1
    for epoch in range(tracker.epoch if tracker is not None else 0, r.epochs):
        set_epoch(loader, first_epoch + epoch)
        if ramp is not None:
            ramp.begin_epoch()
        # a resumed epoch: what is left of it, from the window it stopped at
        source, offset = tracker.begin_epoch(loader, epoch) if tracker is not None else (loader, 0)
        windows = accumulate(
            run.caps.meeting(source), plan, count=r.count, drop_last=local_drop, min_micro_batch=min_micro, distributed=False,
            skip_empty=run.world_size == 1, pad=r.pad, cap=run.caps.cap,
            shares=(lambda i: run.shares(i + offset)) if (run.world_size > 1 or ramp) else None,
        )
        seen_samples = seen_items = 0
        while r.max_steps is None or done + len(history) < r.max_steps:
            start = time.perf_counter()
            run.begin_window()  # a stop before this window's step puts the model back as it is now
            ran = run_window(run, windows, drop_last=r.drop_last)  # micro-batches, then one agreement
            if ran is None:
                if tracker is not None:
                    tracker.end_epoch()
                break  # the epoch is over on every rank
            loss, window, agreed = ran
            if tracker is not None:
                tracker.after_window(sum(m.samples for m in window) if window else 0)
            seen_samples, seen_items = seen_samples + agreed.samples, seen_items + agreed.items
            if agreed.items == 0:  # no loss item on any rank: nothing to learn from, no step
                run.optimizer.zero_grad(set_to_none=True)
                if ramp is not None:
                    ramp.skipped(int(agreed.samples))
                continue
            run.check_finite(loss, window, step=done + len(history) + 1, epoch=epoch)
            if ramp is not None:  # the learning rate follows the target of the window that ran
                _follow(run, plan, ramp, ramp.trained_target())
            noise = run.measure_noise(agreed)  # the window's gradient, before clipping
            lr, skipped = optimizer_step(run, int(agreed.samples))  # clip, step at the scaled LR, schedule, zero
            run.end_window()
            change = None
            if ramp is not None:  # a stage reached, or every rank voted at this exchange: later windows grow
                change = ramp.after_step(samples=int(agreed.samples), items=int(agreed.items), vote=agreed.vote,
                                         proposal=agreed.proposal)
                ramp.pending_vote, ramp.pending_proposal = ramp.vote(run.noise.meter.estimate() if run.noise.meter else None,
                                                                     agreed.items / max(agreed.samples, 1), fresh=run.noise.fresh)
                changes += [change] if change else []
            record = StepRecord(
                step=done + len(history) + 1, epoch=epoch, samples=int(agreed.samples), items=int(agreed.items),
                loss=loss, lr=lr, micro_batch=max((m.samples for m in window), default=0) if window else 0,
                seconds=time.perf_counter() - start, micro_batches=tuple(m.samples for m in window) if window else (),
                noise_scale=noise, skipped=skipped, target=run.plan.effective_batch,
                target_change=f"target {change.before} -> {change.target}: {change.reason}" if change else None,
            )
            run.pace_noise(record.seconds)
            history.append(record)
            if change is not None:  # the windows cut from here on take the new target's micro-batch
                _follow(run, plan, ramp, change.target)  # type: ignore[arg-type]
            run.show(record)
            if tracker is not None and tracker.due(record.step):
                _save(run, r, record.step, first_epoch)
            if r.callback is not None:
                r.callback(record)
        if r.count is not None and seen_samples > 0 and seen_items == 0:
            raise ValueError(
                f"Invalid count: it returned 0 items for every batch of the epoch ({int(seen_samples)} samples on all "
                "ranks), so there is no loss to train on; check that it counts the loss's items (e.g. labels != -100)"
            )
        if r.max_steps is not None and done + len(history) >= r.max_steps:
            break
    set_epoch(loader, first_epoch + r.epochs)  # the next fit starts on the next epoch
    if tracker is not None:
        _save(run, r, done + len(history), first_epoch)
    return history, changes


def _save(run: Run, r: _Request, step: int, first_epoch: int) -> None:
    """The checkpoint after optimizer step ``step`` of the run."""
    assert r.tracker is not None and r.plan is not None and r.target is not None
    r.tracker.write(run, base=r.plan, asked_limit=r.shared.memory_limit, target=r.plan.effective_batch, ramp=r.ramp,
                    scheduler=r.scheduler, scaler=r.scaler, step=step, sampler_epoch=first_epoch + r.tracker.epoch)


def _finish(run: Run, r: _Request, history: list[StepRecord], changes: list[RampChange]) -> FitResult:
    """BatchNorm's statistics finished as its mode says, and the result."""
    tuning = None
    inner, mode = r.par.inner, r.mode
    if mode is not None and run.bns:
        min_micro = run.plan.min_micro_batch
        finished = FinishedRun(
            batches=lambda: (micro.batch for w in accumulate(r.loader, run.plan, min_micro_batch=min_micro, distributed=False, pad=r.pad,
                                                             cap=run.caps.cap) for micro in w),
            forward=lambda m, b: _forward(m, r.loss_fn, b, r.device, r.precision),
            loss_fn=r.loss_fn,
            device=r.device,
            recording=run.bnc.recording,
        )
        tuning = mode.finish(inner, finished)
    measured = run.noise.meter.estimate() if run.noise.meter is not None else None
    return FitResult(plan=run.plan, history=tuple(history), bn_tuning=tuning, noise_scale=measured,
                     noise_note=_noise_note(measured, run, r.noise_scale), ramp=r.ramp, ramp_changes=tuple(changes))


def _follow(run: Run, plan: Plan, ramp: BatchRamp, target: int) -> None:
    """The run's plan for a ramp's ``target``: the plan's micro-batch (never above what an out-of-memory
    error lowered it to), the accumulation and learning rate of the target."""
    if target != run.plan.effective_batch:
        micro = run.plan.micro_batch if run.lowered else plan.micro_batch
        run.plan = plan_for_target(plan, target, micro_batch=micro, rank=run.rank, ramp=ramp)


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
    if noise.high <= 0:
        return str(noise)  # "not measured: ..." and why
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
