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
from collections.abc import Callable, Iterable
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import batches as B
from .accumulate import Count, Window, accumulate
from .bn import BNController, FinishedRun, batchnorms, resolve_bn
from .checks import (
    check_count_value,
    check_device_exists,
    check_grad_mode,
    check_optimizer,
    check_positive_number,
    check_reiterable,
    check_scheduler,
    check_trainable,
    is_one_shot,
)
from .distributed import all_reduce_gradients, check_distinct_samples, max_over_ranks, sum_over_ranks, unwrap, world
from .errors import AutotuneError, AutotuneWarning, NothingFits
from .memory import TensorLedger, cuda_memory_fraction, is_out_of_memory, release_cached
from .planner import _resolve_device, allocator_cap, plan as make_plan
from .plans import Plan, peak_at, split_evenly
from .probe import held_tensors, min_micro_batch
from .rng import RNGState
from .scaling import adjusted_bn_momentum
from .step import LossFn, Precision, autocast, default_loss, forward_backward, normalize_precision
from .units import parse_bytes

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
        lr: the first param group's learning rate applied in this step (scaled).
        micro_batch: the largest micro-batch used for this window.
        seconds: wall time of the step.
        micro_batches: the sizes of the micro-batches that ran (on this rank).
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


@dataclass(frozen=True)
class FitResult:
    """What :func:`fit` did.

    Attributes:
        plan: the plan trained with; after an out-of-memory retry its micro-batch, accumulation
            steps, BatchNorm momentum and peak describe what training finally used.
        history: one :class:`StepRecord` per optimizer step.
        bn_tuning: the momentum study of ``bn=OptunaBN(...)`` (else None).
    """

    plan: Plan
    history: tuple[StepRecord, ...]
    bn_tuning: Any = None

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


def _check_count(loader: Iterable[Any], count: Count | None, *, max_batches: int = 8) -> None:
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
    if seen and total == 0:
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
    drop_last: bool = False,
    scheduler: Any = None,
    scaler: torch.amp.GradScaler | None = None,
    bn: Any = "adjust",
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
        base_batch: as for :func:`autotune.plan`. When not given, ``fit`` warns before scaling the
            learning rate by a batch size it had to guess.
        count: ``count(batch) -> int``, loss items in a batch (e.g. non-padding tokens); default:
            samples.
        drop_last: drop each epoch's short last window.
        scheduler: any torch LR scheduler of ``optimizer`` except ``ReduceLROnPlateau`` (step that
            one yourself between calls); stepped once per optimizer step.
        scaler: a ``torch.amp.GradScaler`` for fp16 (default: a new one), e.g. to carry its scale
            from one ``fit`` call to the next.
        bn: how BatchNorm running statistics are kept (see :mod:`autotune.bn`): ``"adjust"``
            (default), ``"pooled"``, ``"precise"``, ``None`` (leave BatchNorm alone), or a mode
            with options: ``autotune.PreciseBN(samples=8192)``, ``autotune.OptunaBN(val_loader,
            n_trials=30, storage="sqlite:///bn.db")``.
        progress: show a tqdm bar (samples/s, loss) when training takes more than a moment.
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
    if plan is None and target_batch is None:
        raise TypeError("fit() needs target_batch= (samples per optimizer step), or plan=")
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
    inner, ddp = unwrap(model)  # under DDP: the wrapper trains, the inner module is probed and inspected
    check_trainable(inner)
    if optimizer is not None:
        check_optimizer(inner, optimizer)
    check_scheduler(scheduler, optimizer if optimizer is not None else object())  # type: ignore[arg-type]
    precision_name = normalize_precision(precision)
    limit = parse_bytes(memory_limit) if memory_limit is not None else None
    _check_count(loader, count)

    # --- setup ----------------------------------------------------------------------------------
    device = _fit_device(model, device)
    if ddp is None:
        model.to(device)
    _resolve_device(inner, device)  # the model has parameters, all on the device
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = loss_fn or default_loss
    if plan is None:
        plan = make_plan(
            model, loader, target_batch=target_batch, optimizer=optimizer, loss_fn=loss_fn,  # type: ignore[arg-type]
            device=device, memory_limit=limit, headroom=headroom, lr_rule=lr_rule,
            base_batch=base_batch, precision=precision_name, epochs=epochs,
        )
    if plan.lr_scale != 1.0 and plan.base_batch_source != "given":
        warnings.warn(
            f"Scaling the learning rate x{plan.lr_scale:.4g} ({plan.lr_rule} rule) from batch {plan.base_batch}, "
            f"{plan.base_batch_source}, to {plan.effective_batch}: if your learning rate was tuned at another "
            "batch size, pass base_batch= (or lr_rule='none' to keep it)",
            AutotuneWarning,
            stacklevel=2,
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
        model, ddp, optimizer, scheduler, loss_fn, plan, device, precision_name, scaler, clip_grad_norm,
        limit, mode, bns, _total_steps(loader, plan, epochs, max_steps), progress,
    )
    with run:
        for epoch in range(epochs):
            for window in accumulate(loader, plan, count=count, drop_last=drop_last, min_micro_batch=min_micro):
                if max_steps is not None and len(history) >= max_steps:
                    break
                start = time.perf_counter()
                loss, window = run.micro_batches(window)
                run.check_finite(loss, window, step=len(history) + 1, epoch=epoch)
                lr = run.step()
                record = StepRecord(
                    step=len(history) + 1, epoch=epoch, samples=window.total_samples, items=window.items,
                    loss=loss, lr=lr, micro_batch=max(m.samples for m in window), seconds=time.perf_counter() - start,
                    micro_batches=tuple(m.samples for m in window),
                )
                history.append(record)
                run.show(record)
                if callback is not None:
                    callback(record)
            if max_steps is not None and len(history) >= max_steps:
                break

    tuning = None
    if mode is not None and bns:
        finished = FinishedRun(
            batches=lambda: (micro.batch for w in accumulate(loader, run.plan, min_micro_batch=min_micro) for micro in w),
            forward=lambda m, b: _forward(m, loss_fn, b, device, precision_name),  # type: ignore[arg-type]
            loss_fn=loss_fn,
            device=device,
            recording=run.bnc.recording,
        )
        tuning = mode.finish(inner, finished)
    return FitResult(plan=run.plan, history=tuple(history), bn_tuning=tuning)


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
    exit all of it is put back. The learning rate is scaled only inside :meth:`step`.
    """

    def __init__(
        self,
        model: nn.Module,
        ddp: nn.Module | None,
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
    ) -> None:
        self.model, self.ddp, self.optimizer, self.scheduler = model, ddp, optimizer, scheduler
        self.loss_fn, self.plan, self.device, self.precision = loss_fn, plan, device, precision
        self.scaler, self.clip_grad_norm, self.limit = scaler, clip_grad_norm, limit
        self.bns = bns
        self.bnc = BNController(unwrap(model)[0], mode.name if mode is not None else None, record=bool(mode is not None and mode.records))
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.total_steps, self.progress = total_steps, progress
        self.stack = ExitStack()
        # After an OOM lowered the micro-batch: the peak counted since (CPU ledger), which then
        # replaces the estimated peak in the plan.
        self.measured: int | None = None
        self.lowered = False
        self.steps = 0  # optimizer steps taken in this run
        # Window shapes already run under the CPU ledger: later windows of the same shapes need no
        # counting (the count is the same), which keeps its dispatch overhead off the common path.
        self.counted: set[Any] = set()
        self.last_ledger: TensorLedger | None = None

    def __enter__(self) -> _Run:
        from tqdm.auto import tqdm  # imported here: `import autotune` stays light

        stack = self.stack
        stack.enter_context(self.bnc)
        cap = allocator_cap(self.limit, self.plan.set_aside) if self.limit is not None else None
        stack.enter_context(cuda_memory_fraction(self.device, cap))
        rank, _ = world()
        self.bar = tqdm(total=self.total_steps, unit="step", disable=not self.progress or rank != 0, delay=2.0, dynamic_ncols=True)
        stack.callback(self.bar.close)
        stack.callback(self.model.train, self.model.training)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stack.close()

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

    def micro_batches(self, window: Window) -> tuple[float, Window]:
        """Forward and weighted backward of every micro-batch; on OOM, undo and redo smaller.

        Returns the window's exact mean loss and the window as it finally ran.
        """
        ddp = self.ddp
        if ddp is not None and window.position == 0 and not getattr(self, "_checked_samples", False):
            self._checked_samples = True
            check_distinct_samples(window[0].batch)
        # BN buffers, to undo a failed attempt; they are small.
        bn_saved = [[b.detach().clone() for b in m.buffers()] for m in self.bns]
        while True:
            failed_size = window.micro_batch
            try:
                self.last_ledger = None
                with self._ledger(window):
                    total, failed_size = _run_window(self, window)
                if self.lowered and self.last_ledger is not None:
                    self.measured = max(self.measured or 0, self.last_ledger.peak)
                    self.plan = dataclasses.replace(self.plan, peak_memory=self.measured)
                return float(_global_loss(total, ddp, self.device)), window
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                failed_size = getattr(exc, "autotune_micro_batch", failed_size)
                exc.__traceback__ = None  # drop the frames that hold the attempt's tensors
            self.optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for m, saved in zip(self.bns, bn_saved):
                    for b, value in zip(m.buffers(), saved):
                        b.copy_(value)
            release_cached(self.device)
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
                stacklevel=3,
            )
            self._lower(smaller)
            window = window.with_micro_batch(smaller)

    def _lower(self, micro_batch: int) -> None:
        """Lower the plan's micro-batch for the rest of the run; every field follows."""
        plan = self.plan
        share = sum(plan.micro_batches)
        sizes = split_evenly(share, math.ceil(share / micro_batch))
        base = next((m for m, _ in self.bnc._saved if m is not None), None)
        self.lowered = True
        self.measured = None
        self.plan = dataclasses.replace(
            plan,
            micro_batch=micro_batch,
            accumulation_steps=len(sizes),
            micro_batches=sizes,
            bn_momentum=None if (plan.bn_momentum is None or base is None) else adjusted_bn_momentum(base, len(sizes)),
            peak_memory=peak_at(plan, micro_batch),
            notes=plan.notes + (f"out of memory while training: micro-batch lowered to {micro_batch}",),
        )

    def check_finite(self, loss: float, window: Window, *, step: int, epoch: int) -> None:
        """Refuse to step on a non-finite loss: the weights would become NaN."""
        if math.isfinite(loss):
            return
        self.optimizer.zero_grad(set_to_none=True)
        raise AutotuneError(
            f"Non-finite loss ({loss}) at step {step} (epoch {epoch}, window {window.position} of the epoch, "
            f"{window.total_samples} samples): the optimizer step was not taken, so the weights are those after "
            f"step {step - 1}; check the data of this window, lower the learning rate, or set clip_grad_norm"
        )

    def step(self) -> float:
        """Unscale, clip, step at ``lr_scale`` times the scheduled LR, schedule, zero the gradients.

        Returns the first param group's learning rate applied.
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
        scheduled = [g["lr"] for g in optimizer.param_groups]
        try:
            # Only the step sees the scaled LR: the scheduler and the param groups keep the
            # unscaled values, whatever the schedule does with them.
            for g in optimizer.param_groups:
                g["lr"] = g["lr"] * self.plan.lr_scale
            lr = float(optimizer.param_groups[0]["lr"])
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
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
            for g, value in zip(optimizer.param_groups, scheduled):
                g["lr"] = value
        self.steps = step
        if self.scheduler is not None:
            self.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)  # parameters outside the optimizer do not pile up
        return lr

    def _ledger_for_step(self) -> Any:
        """The first optimizer step creates the optimizer state: count it under a CPU limit."""
        if self.limit is None or self.device.type == "cuda" or getattr(self, "_stepped", False):
            return nullcontext()
        self._stepped = True
        ledger = TensorLedger(self.device.type, limit=self.limit)
        ledger.track(held_tensors(self.model, self.optimizer))
        return ledger

    def show(self, record: StepRecord) -> None:
        """Advance the progress bar."""
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{record.loss:.4g}", samples_s=f"{record.samples / max(record.seconds, 1e-9):.0f}", refresh=False)


def _forward(model: nn.Module, loss_fn: LossFn, batch: Any, device: torch.device, precision: Precision) -> Any:
    with autocast(device.type, precision):
        return loss_fn(model, B.to_device(batch, device))


def _status(failure: BaseException | None) -> int:
    if failure is None:
        return 0
    return 1 if is_out_of_memory(failure) else 2


def _global_loss(total: torch.Tensor, ddp: nn.Module | None, device: torch.device) -> float:
    """The window's mean loss over all ranks (weights carry the world size under DDP)."""
    if ddp is None:
        return float(total)
    _, world_size = world()
    return sum_over_ranks([float(total)], device)[0] / world_size


class _PeerOutOfMemory(torch.OutOfMemoryError):
    """Another rank ran out of memory in this window: every rank redoes it."""


def _run_window(run: _Run, window: Window) -> tuple[torch.Tensor, int]:
    """Forward and backward every micro-batch of ``window``; returns its weighted loss sum.

    An out-of-memory error carries the size of the micro-batch that failed
    (``autotune_micro_batch``), so the retry starts from it.

    Under DDP every micro-batch runs under ``no_sync()``, the ranks agree before each one that none
    has run out of memory or failed, and the accumulated gradients are all-reduced once, after the
    last one and a final agreement. A rank in trouble is therefore never waited for in a collective
    (not even in the buffer broadcast of DDP's forward): after an out-of-memory error all ranks redo
    the window together; after any other error every rank raises.
    """
    model, ddp, device, bnc = run.model, run.ddp, run.device, run.bnc
    total = torch.zeros((), device=device, dtype=torch.float64)
    bnc.start_window(window.samples)
    failure: BaseException | None = None
    status = 0  # under DDP, agreed before every micro-batch: 0 fine, 1 out of memory, 2 failed
    size = window.micro_batch
    for micro in window:
        if ddp is not None and (status := max_over_ranks(_status(failure), device)):
            break
        bnc.before_micro(micro.samples)
        size = micro.samples
        try:
            with ddp.no_sync() if ddp is not None else nullcontext():  # type: ignore[operator]
                batch = B.to_device(micro.batch, device)
                loss = forward_backward(
                    model, run.loss_fn, batch, weight=micro.weight, device_type=device.type,
                    precision=run.precision, scaler=run.scaler,
                )
                total += loss.to(torch.float64) * micro.weight  # no sync: read once per step
        except Exception as exc:
            if is_out_of_memory(exc):
                exc.autotune_micro_batch = micro.samples  # type: ignore[attr-defined]
            if ddp is None:
                raise
            failure = exc  # told to the other ranks at the next agreement, then raised
    if ddp is not None:
        status = max(status, max_over_ranks(_status(failure), device))
        if status == 2:
            if failure is not None and not is_out_of_memory(failure):
                raise failure
            raise AutotuneError("Another rank failed while training (see its error); every rank stops")
        if status == 1:
            raise failure or _PeerOutOfMemory("another rank ran out of memory in this window")
        all_reduce_gradients(ddp)
    bnc.end_window()
    return total, size
