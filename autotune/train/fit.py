"""``autotune.fit``: probe, plan, then train with exact gradient accumulation.

The loop, top to bottom (:func:`fit`)::

    for epoch in range(epochs):
        for window in accumulate(loader, plan):     # one window = one optimizer step
            loss = run.micro_batches(window)        # forward + weighted backward each; OOM: redo smaller
            run.step()                              # clip, optimizer step at the scaled LR, schedule, zero

Everything else (scaling the learning rate, BatchNorm momenta, the memory cap, the progress bar, and
putting them back) lives in :class:`_Run`, a context object, so that the loop stays readable.

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
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
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
    check_reiterable,
    check_scheduler,
    check_trainable,
    is_one_shot,
)
from autotune.errors import AutotuneError, AutotuneWarning, NothingFits
from autotune.memory.device import allocator_cap, cuda_memory_fraction, release_cached
from autotune.memory.ledger import TensorLedger, is_out_of_memory
from autotune.parallel.exchange import (
    FAILED,
    FINE,
    OUT_OF_MEMORY,
    Agreement,
    GradientSync,
)
from autotune.parallel.ranks import (
    Parallel,
    broadcast_model,
    bypass_nested,
    check_distinct_samples,
    gather,
    is_distributed,
    on_every_rank,
    parallel,
    sampler_epoch,
    set_epoch,
    world,
)
from autotune.planning.planner import plan as make_plan
from autotune.planning.planner import resolve_device
from autotune.planning.plans import Plan, peak_at, rotated_share, split_evenly
from autotune.planning.scaling import adjusted_bn_momentum
from autotune.probe.estimate import estimator_for
from autotune.probe.trial import Workload, check_step, held_tensors, min_micro_batch
from autotune.rng import RNGState
from autotune.step import (
    LossFn,
    Precision,
    autocast,
    batchnorms,
    default_loss,
    forward_backward,
    normalize_precision,
)
from autotune.train.accumulate import Count, Pad, Window, accumulate
from autotune.train.bn import BNController, FinishedRun, resolve_bn
from autotune.train.noise import NoiseMeter
from autotune.train.sharded import run_window as fsdp_window
from autotune.units import parse_bytes

__all__ = ["AutotuneWarning", "FitResult", "StepRecord", "fit"]


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step.

    Attributes:
        step: 1-based optimizer step over the whole run.
        epoch: 0-based epoch.
        samples: samples in the window.
        items: loss items in the window (samples, or what ``count`` returned).
        loss: the exact mean loss over the window's items.
        lr: the first param group's learning rate of this step (scaled; not applied when ``skipped``).
        micro_batch: the largest micro-batch used for this window.
        seconds: wall time of the step.
        micro_batches: the sizes of the micro-batches that ran (on this rank).
        noise_scale: the gradient noise scale measured so far (``B_simple`` in loss items; see
            :mod:`autotune.train.noise`), or None before it can be estimated.
        skipped: fp16 only: the GradScaler found non-finite gradients and skipped the optimizer
            step (the weights are those of the step before; the scale was lowered).
    """

    step: int
    epoch: int
    samples: int
    items: int
    loss: float
    lr: float
    micro_batch: int
    seconds: float
    micro_batches: tuple[int, ...] = ()
    noise_scale: float | None = None
    skipped: bool = False


@dataclass(frozen=True)
class FitResult:
    """What :func:`fit` did.

    Attributes:
        plan: the plan trained with; after an out-of-memory retry its micro-batch, accumulation
            steps, BatchNorm momentum and peak describe what training finally used.
        history: one :class:`StepRecord` per optimizer step.
        bn_tuning: the momentum study of ``bn=OptunaBN(...)`` (else None).
        noise_scale: the gradient noise scale over the run (:class:`autotune.train.noise.NoiseScale`:
            value, its range, windows averaged), None when it was not measured (``noise_note``
            says why).
        noise_note: why the noise scale is missing or only a lower bound, in words; None when it
            was measured with both ends of its range.
    """

    plan: Plan
    history: tuple[StepRecord, ...]
    bn_tuning: Any = None
    noise_scale: Any = None
    noise_note: str | None = None

    def advice(self) -> str | None:
        """Plain words when the target batch is far from the measured noise scale (else None).

        Both are in loss items: with ``count``, the target is the mean items per step.
        """
        if self.noise_scale is None:
            return None
        from autotune.train.noise import advice

        full = [r.items for r in self.history if r.samples == self.plan.effective_batch] or [r.items for r in self.history]
        items = round(sum(full) / len(full)) if full else self.plan.effective_batch
        return advice(self.noise_scale, items)

    @property
    def samples(self) -> int:
        """Samples trained on, over all steps."""
        return sum(r.samples for r in self.history)


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
    target_batch: int | None = None,
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
        target_batch: samples per optimizer step (required unless ``plan`` is given).
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
    _check_plan(plan, target_batch)
    check_reiterable(loader, epochs)
    check_grad_mode("fit")
    check_device_exists(device)
    par = parallel(model)  # under DDP: the inner module runs; autotune syncs once per window
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

    on_every_rank(look, device=None, group=par.group, what="looking at its first batches")

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
            model, loader, target_batch=target_batch, optimizer=optimizer, loss_fn=loss_fn,  # type: ignore[arg-type]
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
    if scaler is None and precision_name == "fp16":
        scaler = torch.amp.GradScaler(device.type)

    # --- the loop -------------------------------------------------------------------------------
    history: list[StepRecord] = []
    run = _Run(
        par, optimizer, scheduler, loss_fn, plan, device, precision_name, scaler, clip_grad_norm,
        limit, mode, bns, _total_steps(loader, plan, epochs, max_steps), progress,
        checkpointing=checkpointing or plan.checkpointing, noise_scale=noise_scale,
    )
    first_epoch = sampler_epoch(loader)  # continue where an earlier fit left the sampler
    # In a single process the short last window is dropped before it runs; with several ranks
    # only the agreement can tell that the global window is short.
    local_drop = drop_last and run.world_size == 1
    with run:
        for epoch in range(epochs):
            set_epoch(loader, first_epoch + epoch)
            windows = accumulate(
                run.meeting(loader), plan, count=count, drop_last=local_drop, min_micro_batch=min_micro,
                distributed=False, skip_empty=run.world_size == 1, pad=pad, cap=run.cap, shares=run.shares if run.world_size > 1 else None,
            )
            seen_samples = seen_items = 0
            while max_steps is None or len(history) < max_steps:
                start = time.perf_counter()
                done = run.window(windows, drop_last=drop_last)  # micro-batches, then one agreement
                if done is None:
                    break  # the epoch is over on every rank
                loss, window, agreed = done
                seen_samples, seen_items = seen_samples + agreed.samples, seen_items + agreed.items
                if agreed.items == 0:  # no loss item on any rank: nothing to learn from, no step
                    run.optimizer.zero_grad(set_to_none=True)
                    continue
                run.check_finite(loss, window, step=len(history) + 1, epoch=epoch)
                noise = run.measure_noise(agreed)  # the window's gradient, before clipping
                lr, skipped = run.step()  # clip, step at the scaled LR, schedule, zero
                record = StepRecord(
                    step=len(history) + 1, epoch=epoch, samples=int(agreed.samples), items=int(agreed.items),
                    loss=loss, lr=lr, micro_batch=max((m.samples for m in window), default=0) if window else 0,
                    seconds=time.perf_counter() - start, micro_batches=tuple(m.samples for m in window) if window else (),
                    noise_scale=noise, skipped=skipped,
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
            batches=lambda: (micro.batch for w in accumulate(loader, run.plan, min_micro_batch=min_micro, distributed=False, pad=pad, cap=run.cap) for micro in w),
            forward=lambda m, b: _forward(m, loss_fn, b, device, precision_name),  # type: ignore[arg-type]
            loss_fn=loss_fn,
            device=device,
            recording=run.bnc.recording,
        )
        tuning = mode.finish(inner, finished)
    measured = run.noise.estimate() if run.noise is not None else None
    return FitResult(plan=run.plan, history=tuple(history), bn_tuning=tuning,
                     noise_scale=measured, noise_note=_noise_note(measured, run, noise_scale))


def _noise_note(noise: Any, run: _Run, asked: bool | int) -> str | None:
    """Why ``FitResult.noise_scale`` is missing or open-ended (None when it is measured)."""
    if asked is False:
        return "not measured: noise_scale=False"
    if run.par.fsdp:
        return "not measured under FSDP2: its backward averages the gradients over the ranks, and the meter needs a rank's own"
    if noise is None:
        measured = run.noise.n if run.noise is not None else 0
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


class _Run:
    """Setup and restore around the loop, and the two things the loop does per window.

    On entry: BatchNorm mode applied, the CUDA allocator capped, a progress bar, train mode. On
    exit all of it is put back. :meth:`window` runs a window's micro-batches and the agreement with
    the other ranks; :meth:`step` syncs the gradients and steps the optimizer at the scaled LR.
    """

    def __init__(
        self,
        par: Parallel,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        loss_fn: LossFn,
        plan: Plan,
        device: torch.device,
        precision: Precision,
        scaler: torch.amp.GradScaler | None,
        clip_grad_norm: float | None,
        limit: int | None,
        mode: Any,
        bns: list[nn.modules.batchnorm._BatchNorm],
        total_steps: int | None,
        progress: bool,
        *,
        checkpointing: bool = False,
        noise_scale: bool | int = False,
    ) -> None:
        self.checkpointing = checkpointing
        self.noise = NoiseMeter() if noise_scale is not False else None
        self.noise_fixed = None if isinstance(noise_scale, bool) else max(1, int(noise_scale))
        self.small: tuple[torch.Tensor, float, int] | None = None  # first micro-batch: (|grad|^2, weight, items)
        # The meter measures every `noise_every`-th window, chosen so that it costs at most 1% of the
        # step time (for most models: every window).
        self.noise_every, self.noise_count, self.noise_seconds, self.first_norm_seconds = self.noise_fixed or 1, 0, 0.0, 0.0
        self.noise_due = noise_scale is not False
        self.par, self.model, self.optimizer, self.scheduler = par, par.inner, optimizer, scheduler
        self.loss_fn, self.plan, self.device, self.precision = loss_fn, plan, device, precision
        self.scaler, self.clip_grad_norm, self.limit = scaler, clip_grad_norm, limit
        self.bns = bns
        self.bnc = BNController(par.inner, mode.name if mode is not None else None, record=bool(mode is not None and mode.records))
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        in_optimizer = {id(p) for p in self.params}
        # Trainable parameters the optimizer does not step: their gradients are zeroed with the rest.
        self.outside = [p for p in par.inner.parameters() if p.requires_grad and id(p) not in in_optimizer]
        # The gradients the ranks sum: every trainable parameter but those DDP was told to ignore,
        # in the model's order (the same on every rank).
        self.synced = [p for name, p in par.inner.named_parameters() if p.requires_grad and name not in par.ignored]
        if par.fsdp:
            # FSDP2 reduce-scatters the gradients itself; the sync only sums BatchNorm statistics.
            self.synced = []
            self.noise = None
        self.sync = GradientSync(self.synced, device=device, group=par.group)
        # With several ranks the loss weights carry each rank's share of the global count ahead of
        # the exchange: n_i / unit instead of n_i / N_r, ``unit`` being the global count of the last
        # step (the same on every rank; 0 before the first, when the weights are the local ones).
        # The exchange then sends the gradients as they are and, when the count is again ``unit``,
        # writes them back as they are: two passes over the gradients fewer per step.
        self.unit = 0.0
        self.spare: Any = None  # under FSDP2: a small batch for zero-weight micro-batches
        self.rank, self.world_size = world(par.group)
        self.total_steps, self.progress = total_steps, progress
        self.stack = ExitStack()
        # After an OOM lowered the micro-batch: the peak counted since (CPU ledger), which then
        # replaces the estimated peak in the plan.
        self.measured: int | None = None
        self.lowered = False
        self.steps = 0  # optimizer steps taken in this run
        self.agreed: Any = None
        # Window shapes already run under the CPU ledger: later windows of the same shapes need no
        # counting (the count is the same), which keeps its dispatch overhead off the common path.
        self.counted: set[Any] = set()
        self.last_ledger: TensorLedger | None = None
        self.checked_samples = False
        # Out-of-memory corrections of the shape model: (per-sample size, micro-batch) pairs that
        # cap that size and longer ones; shorter shapes keep their own micro-batches.
        self.corrections: list[tuple[int, int]] = []
        # Micro-batches estimated for per-sample sizes longer than the plan measured (see meet).
        self.longer: dict[int, int] = {}

    def cap(self, size: int) -> int:
        """The micro-batch for samples of per-sample ``size``: the plan's (or one estimated when that
        size arrived, see :meth:`meet`), less what OOMs taught."""
        cap = self.longer.get(size) or self.plan.micro_batch_for(size)
        for at, limit in self.corrections:
            if size >= at:
                cap = min(cap, limit)
        return cap

    def shares(self, window: int) -> int:
        """This rank's samples in the epoch's window ``window``: the target shared among the ranks, the
        remainder taking turns (:func:`autotune.planning.plans.rotated_share`), so that equal shards run out
        together and only an epoch's last step is short."""
        return rotated_share(self.plan.effective_batch, self.world_size, self.rank, window)

    def meeting(self, loader: Iterable[Any]) -> Iterator[Any]:
        """``loader``'s batches, each :meth:`met <meet>` before it is cut into micro-batches."""
        for batch in loader:
            self.meet(batch)
            yield batch

    def meet(self, batch: Any) -> None:
        """A batch longer than anything the plan measured gets its micro-batch estimated now, before
        it runs, instead of running out of memory (a batch within 10% of a measured length takes
        that length's micro-batch, scaled down as if memory grew with the square of the length).

        Only with a plan sized by shape (``plan.by_shape``), not under FSDP2 (lockstep), and while
        the step can be estimated; otherwise the out-of-memory retry stays the safety net.
        """
        plan = self.plan
        if not (plan.by_shape and plan.probed_size) or self.par.fsdp or self.longer is _NO_ESTIMATES:
            return
        size = B.per_sample_numel(batch)
        known = {plan.probed_size: plan.micro_batch, **(dict(zip(plan.shape_model.sizes, plan.shape_model.micro_batches)) if plan.shape_model else {}),
                 **self.longer}
        if size <= max(known) or size in known:
            return
        below = max(k for k in known if k < size)
        if size <= 1.1 * below:
            self.longer[size] = max(plan.min_micro_batch, math.floor(known[below] * (below / size) ** 2))
            return
        work = Workload(model=self.model, optimizer=self.optimizer, loss_fn=self.loss_fn, batch=batch, device=self.device,
                        precision=self.precision, checkpointing=self.checkpointing)
        curve = plan.memory_curve
        scale = plan.peak_memory / max(curve(plan.micro_batch), 1) if curve is not None else (plan.shape_model.scale if plan.shape_model else 1.0)
        try:
            size_b, _ = estimator_for(work).largest(int(plan.budget / max(scale, 1.0)), sum(plan.micro_batches), confirm=True)
        except Exception:  # the step cannot be estimated: the plan's micro-batch, and the OOM retry
            self.longer = _NO_ESTIMATES
            return
        self.longer[size] = max(plan.min_micro_batch, size_b)

    def __enter__(self) -> _Run:
        from tqdm.auto import tqdm  # imported here: `import autotune` stays light

        stack = self.stack
        stack.enter_context(self.bnc)
        # Under FSDP2 the limit is counted, not enforced: an OOM inside a forward would strand the other ranks.
        cap = allocator_cap(self.limit, self.plan.set_aside) if (self.limit is not None and not self.par.fsdp) else None
        stack.enter_context(cuda_memory_fraction(self.device, cap))
        stack.enter_context(bypass_nested(self.par.nested))
        if self.checkpointing:
            from autotune.memory.checkpointing import activation_checkpointing

            stack.enter_context(activation_checkpointing(self.model))
        self.bar = tqdm(total=self.total_steps, unit="step", disable=not self.progress or self.rank != 0, delay=2.0, dynamic_ncols=True)
        stack.callback(self.bar.close)
        stack.callback(self.model.train, self.model.training)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stack.close()

    def held(self) -> Any:
        """Tensors held between steps: parameters, buffers, gradients, optimizer state."""
        return held_tensors(self.model, self.optimizer)

    def _ledger(self, window: Window) -> Any:
        """A tensor count for windows of new shapes on a CPU with a limit (else nothing)."""
        if self.limit is None or self.device.type == "cuda":
            return nullcontext()
        key = tuple(sorted({(m.samples, B.sample_shapes(m.batch)) for m in window}, key=repr))
        if key in self.counted:
            return nullcontext()
        self.counted.add(key)
        ledger = TensorLedger(self.device.type, limit=self.limit)
        ledger.track(held_tensors(self.model, self.optimizer))
        self.last_ledger = ledger
        return ledger

    def window(self, windows: Iterator[Window], *, drop_last: bool = False) -> tuple[float, Window | None, Any] | None:
        """Run the next window, in the way of this run's mode, and say what happened in it.

        Three modes, one method each: one process (:meth:`_single_window`: nothing to agree on), data
        parallel ranks (:meth:`_data_parallel_window`: each rank runs its window alone, then one
        all-reduce agrees on it and sums the gradients) and sharded ranks (FSDP2,
        :func:`autotune.train.sharded.run_window`: every micro-batch in lockstep).

        Returns ``(global mean loss, this rank's window, the agreement)``, or None when no rank
        has a window left (the epoch is over for all).
        """
        if self.par.fsdp:
            return fsdp_window(self, windows, drop_last=drop_last)
        if self.sync.distributed:
            return self._data_parallel_window(windows, drop_last=drop_last)
        return self._single_window(windows, drop_last=drop_last)

    def _attempt(self, window: Window) -> float:
        """This rank's micro-batches of ``window`` (no collective); its mean loss over its items.

        Windows of new shapes are counted under a CPU limit; after an OOM lowered the micro-batch,
        the count replaces the plan's estimated peak.
        """
        self.last_ledger = None
        with self._ledger(window):
            loss = _run_micro_batches(self, window)
        if self.lowered and self.last_ledger is not None:
            self.measured = max(self.measured or 0, self.last_ledger.peak)
            self.plan = dataclasses.replace(self.plan, peak_memory=self.measured)
        return loss

    def _single_window(self, windows: Iterator[Window], *, drop_last: bool = False) -> tuple[float, Window | None, Any] | None:
        """One process: run the next window; after an out-of-memory error undo it and redo it with a
        smaller micro-batch. The gradients are the window's mean as they stand."""
        window = next(windows, None)
        if window is None:
            return None
        bn_saved = self._save_bn()  # to undo a failed attempt; BN buffers are small
        while True:
            try:
                loss = self._attempt(window)
                break
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                window = self._retry_smaller(window, exc, bn_saved)
        if drop_last and window.samples < self.plan.effective_batch:
            self.optimizer.zero_grad(set_to_none=True)
            self._restore_bn(bn_saved)
            return None
        self.finish_bn(True, 1)
        loss = loss if window.items else float("nan")
        self.agreed = Agreement(FINE, window.items, window.samples, loss, 1, True, float(self.noise_every))
        return loss, window, self.agreed

    def _data_parallel_window(self, windows: Iterator[Window], *, drop_last: bool = False) -> tuple[float, Window | None, Any] | None:
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
        bn_saved = self._save_bn()
        done = False  # this rank's window has run (kept while another rank redoes its own)
        local_loss = 0.0
        while True:
            status = FINE
            if failure is None and window is not None and not done:
                try:
                    local_loss = self._attempt(window)
                    done = True
                except Exception as exc:
                    failure = exc
            if failure is not None:
                status = OUT_OF_MEMORY if is_out_of_memory(failure) else FAILED
            items = window.items if (window is not None and done) else 0
            agreed = self.sync.exchange(
                status=status, items=items, samples=window.samples if (window is not None and done) else 0,
                loss_sum=local_loss * items, had_data=window is not None and status == FINE, pace=self.noise_every,
                unit=self.unit,
            )
            if agreed.status == FAILED:
                self._raise_failure(failure if status == FAILED else None)
            if agreed.status == OUT_OF_MEMORY:
                if status == OUT_OF_MEMORY:
                    assert window is not None and failure is not None
                    window = self._retry_smaller(window, failure, bn_saved)
                    failure, done = None, False
                continue  # every rank agrees again once the ones that ran out of memory redid theirs
            break
        if not self.checked_samples:
            self.checked_samples = True
            check_distinct_samples(window[0].batch if (window is not None and len(window)) else None, self.device, self.par.group)
        if agreed.synced and self.synced:
            self.unit = float(agreed.items)  # the next window's weights expect this count
        if agreed.ranks_with_data == 0:
            return None
        if drop_last and agreed.samples < self.plan.effective_batch:
            # A short last window (over all ranks) is dropped: nothing of it may stay.
            self.optimizer.zero_grad(set_to_none=True)
            self._restore_bn(bn_saved)
            return None
        self.finish_bn(window is not None, agreed.ranks_with_data)
        self.agreed = agreed
        return agreed.loss, window, agreed

    def finish_bn(self, had_data: bool, ranks_with_data: int) -> None:
        """BatchNorm statistics at the window's end: pooled, or averaged over the ranks that had data
        (one more collective); nothing without BatchNorm."""
        if not self.bnc.modules:
            return
        payload = self.bnc.payload(had_data) if (self.world_size > 1 or self.bnc.mode == "pooled") else None
        summed = self.sync.sum(payload) if payload is not None else None
        self.bnc.finish_window(summed, ranks_with_data, distributed=self.world_size > 1)

    def _raise_failure(self, own: BaseException | None) -> None:
        """Every rank stops: the failing rank with its own error, the others naming it."""
        messages = gather(None if own is None else f"{type(own).__name__}: {own}", self.device, self.par.group)
        if own is not None:
            raise own
        rank, message = next((r, m) for r, m in enumerate(messages) if m is not None)
        raise AutotuneError(f"rank {rank} failed in this window, so every rank stops: {message}")

    def _save_bn(self) -> list[list[torch.Tensor]]:
        """A copy of the BatchNorm buffers, for :meth:`_restore_bn` when a window is undone."""
        return [[b.detach().clone() for b in m.buffers()] for m in self.bns]

    def _restore_bn(self, saved: list[list[torch.Tensor]]) -> None:
        with torch.no_grad():
            for m, values in zip(self.bns, saved):
                for b, value in zip(m.buffers(), values):
                    b.copy_(value)

    def _retry_smaller(self, window: Window, failure: BaseException, bn_saved: list[list[torch.Tensor]]) -> Window:
        """Undo this rank's attempt and cut its window smaller (half the micro-batch that failed).

        With a shape model only the failed shape and longer ones get the smaller micro-batch;
        shorter ones keep theirs. Without one (fixed shapes) the plan's micro-batch is lowered.
        """
        failed_size = getattr(failure, "autotune_micro_batch", window.micro_batch)
        failed_shape = getattr(failure, "autotune_micro_size", 0)
        failure.__traceback__ = None  # drop the frames that hold the attempt's tensors
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.outside:
            p.grad = None
        self._restore_bn(bn_saved)
        release_cached(self.device, collect=True)
        floor = self.plan.min_micro_batch
        if failed_size <= floor:
            raise NothingFits(
                f"Out of memory while training at micro_batch={failed_size}: a batch of the loader is larger "
                "than anything the memory allows; shorten the longest samples, use "
                "precision='bf16', or raise memory_limit",
                needed=0,
                budget=self.plan.budget,
                limit=self.plan.memory_limit,
                micro_batch=failed_size,
            )
        smaller = max(floor, failed_size // 2)
        warnings.warn(
            f"Out of memory at micro_batch={failed_size}; retrying the window with micro_batch={smaller}",
            AutotuneWarning,
            stacklevel=5,  # _retry_smaller, the mode's window, window, fit, the caller
        )
        if self.plan.shape_model is None:
            self._lower(smaller)
            return window.with_micro_batch(smaller)
        self.corrections.append((failed_shape, smaller))
        self.plan = dataclasses.replace(
            self.plan,
            notes=self.plan.notes + (
                f"out of memory while training at micro-batch {failed_size} of per-sample size {failed_shape}: "
                f"that size and longer ones capped at {smaller}",
            ),
        )
        return window.with_cap(self.cap)

    def _lower(self, micro_batch: int) -> None:
        """Lower the plan's micro-batch for the rest of the run; every field follows."""
        plan = self.plan
        share = sum(plan.micro_batches)
        sizes = split_evenly(share, math.ceil(share / micro_batch))
        base = next((m for m, _ in self.bnc._saved if m is not None), None)
        self.lowered = True
        self.measured = None
        ranks = list(plan.rank_micro_batches)
        if ranks:
            ranks[self.rank] = micro_batch
        self.plan = dataclasses.replace(
            plan,
            micro_batch=micro_batch,
            accumulation_steps=len(sizes),
            micro_batches=sizes,
            rank_micro_batches=tuple(ranks),
            bn_momentum=None if (plan.bn_momentum is None or base is None) else adjusted_bn_momentum(base, len(sizes)),
            peak_memory=peak_at(plan, micro_batch),
            notes=plan.notes + (f"out of memory while training: micro-batch lowered to {micro_batch}",),
        )

    def measure_noise(self, agreed: Any) -> float | None:
        """Feed the noise meter with this window: its first micro-batch against the whole window."""
        if self.noise is None:
            return None
        due, self.noise_due = self.noise_due, False
        small, self.small = self.small, None
        if due and small is not None:
            start = time.perf_counter()
            small_sq, weight, items = small
            grads = [p.grad for p in self.synced if p.grad is not None]
            if grads and weight > 0:
                big_sq = float(_squared_norm(grads))
                scale = float(self.scaler.get_scale()) ** 2 if self.scaler is not None else 1.0
                self.noise.add(float(small_sq) / (weight * weight) / scale, items, big_sq / scale, float(agreed.items))
            self.noise_seconds = time.perf_counter() - start + self.first_norm_seconds
        estimate = self.noise.estimate()
        return estimate.value if estimate is not None and math.isfinite(estimate.value) else None

    def pace_noise(self, step_seconds: float) -> None:
        """Measure the next window or not: at most 1% of the step time goes to the meter.

        Each rank proposes how often from its own timings (``noise_every``, sent with the next
        exchange); the windows measured follow the ranks' mean of the proposals, the same on every
        rank, so no rank waits for another's measurement.
        """
        if self.noise is None:
            return
        self.noise_count += 1
        if self.noise_fixed is not None:
            self.noise_every = self.noise_fixed
        elif self.noise_seconds and step_seconds > 0:
            self.noise_every = max(1, min(64, math.ceil(self.noise_seconds / (0.01 * step_seconds))))
        every = max(1, round(self.agreed.pace)) if self.agreed is not None else self.noise_every
        self.noise_due = self.noise_count % every == 0

    def check_finite(self, loss: float, window: Window | None, *, step: int, epoch: int) -> None:
        """Refuse to step on a non-finite loss: the weights would become NaN."""
        if math.isfinite(loss):
            return
        self.optimizer.zero_grad(set_to_none=True)
        where = f"window {window.position} of the epoch, {window.samples} samples here" if window is not None else "no window here"
        raise AutotuneError(
            f"Non-finite loss ({loss}) at step {step} (epoch {epoch}, {where}): the optimizer step was not taken, so "
            f"the weights are those after step {step - 1}; check the data of this window, lower the learning rate, "
            "or set clip_grad_norm"
        )

    def step(self) -> tuple[float, bool]:
        """Unscale, clip, step at ``lr_scale`` times the scheduled LR, schedule, zero the gradients
        (the exchange at the window's end already made them the global mean).

        Returns the first param group's learning rate of the step, and whether the GradScaler skipped it.
        """
        optimizer, scaler = self.optimizer, self.scaler
        step = self.steps + 1
        try:
            with self._ledger_for_step():
                if scaler is not None:
                    scaler.unscale_(optimizer)  # once per window, before clipping
                if self.clip_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(self.params, self.clip_grad_norm)
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
        settings = self.plan.optimizer_settings
        keys = ("lr", "betas", "eps", "weight_decay") if settings is not None else ("lr",)
        scheduled = [{k: g[k] for k in keys if k in g} for g in optimizer.param_groups]
        try:
            # Only the step sees the scaled LR (and, with follow_batch, the moved betas, eps and
            # weight decay): the scheduler and the param groups keep the unscaled values, whatever
            # the schedule does with them.
            for g in optimizer.param_groups:
                if settings is not None:
                    g.update(settings.apply(g))
                g["lr"] = g["lr"] * self.plan.lr_scale
            lr = float(optimizer.param_groups[0]["lr"])
            skipped = False
            if scaler is not None:
                before = float(scaler.get_scale())
                scaler.step(optimizer)
                scaler.update()
                skipped = float(scaler.get_scale()) < before  # it lowers the scale exactly when it skips
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
        self.steps = step
        if self.scheduler is not None:
            self.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        for p in self.outside:  # parameters outside the optimizer do not pile up gradients either
            p.grad = None
        return lr, skipped

    def _ledger_for_step(self) -> Any:
        """The first optimizer step creates the optimizer state: count it under a CPU limit."""
        if self.limit is None or self.device.type == "cuda" or self.par.fsdp or getattr(self, "_stepped", False):
            return nullcontext()
        self._stepped = True
        ledger = TensorLedger(self.device.type, limit=self.limit)
        ledger.track(held_tensors(self.model, self.optimizer))
        return ledger

    def show(self, record: StepRecord) -> None:
        """Advance the progress bar."""
        if self.bar.disable:
            return
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{record.loss:.4g}", samples_s=f"{record.samples / max(record.seconds, 1e-9):.0f}", refresh=False)


_NO_ESTIMATES: dict[int, int] = {}  # _Run.longer once the step could not be estimated


def _squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The squared norm of all gradients together, as a tensor (no sync)."""
    norms = torch._foreach_norm(grads)
    return torch.stack([n.to(norms[0].device) for n in norms]).double().square().sum()


def _forward(model: nn.Module, loss_fn: LossFn, batch: Any, device: torch.device, precision: Precision) -> Any:
    with autocast(device.type, precision):
        return loss_fn(model, B.to_device(batch, device))


def _run_micro_batches(run: _Run, window: Window) -> float:
    """Forward and weighted backward of every micro-batch of ``window`` on this rank; no collective.

    Returns the window's mean loss over this rank's items. An out-of-memory error carries the size
    of the micro-batch that failed (``autotune_micro_batch``), so the retry starts from it.
    """
    device, bnc = run.device, run.bnc
    losses: list[torch.Tensor] = []  # read once per window, not per micro-batch (no sync inside)
    bnc.start_window(window.samples)
    run.small = None
    # This rank's share of the global count, carried by the weights (see _Run.unit).
    share = window.items / run.unit if run.unit else 1.0
    for micro in window:
        bnc.before_micro(micro.samples)
        try:
            batch = B.to_device(micro.batch, device)
            loss = forward_backward(
                run.model, run.loss_fn, batch, weight=micro.weight * share, device_type=device.type,
                precision=run.precision, scaler=run.scaler,
            )
        except Exception as exc:
            if is_out_of_memory(exc):
                exc.autotune_micro_batch = micro.samples  # type: ignore[attr-defined]
                exc.autotune_micro_size = B.per_sample_numel(micro.batch)  # type: ignore[attr-defined]
            raise
        losses.append(loss)
        if run.noise_due and run.small is None:
            # After the first micro-batch the gradient is its own (weighted): |G_b|^2 for the noise scale.
            started = time.perf_counter()
            grads = [p.grad for p in run.synced if p.grad is not None]
            if grads:
                run.small = (_squared_norm(grads), micro.weight * share, micro.items)
            run.first_norm_seconds = time.perf_counter() - started
    return _weighted_sum(losses, [micro.weight for micro in window])


def _weighted_sum(losses: list[torch.Tensor], weights: list[float]) -> float:
    """``sum(w * loss)`` in float64, with one read from the device."""
    if len(losses) == 1:
        return float(losses[0]) * weights[0]
    if not losses:
        return 0.0
    stacked = torch.stack([loss.reshape(()) for loss in losses]).double()
    return float(stacked @ torch.tensor(weights, dtype=torch.float64, device=stacked.device))
