"""``autotune.fit``: probe, plan, then train with exact gradient accumulation.

The loop, top to bottom: for each window of ``target_batch`` samples, run its micro-batches
(forward, weighted backward), then clip, step the optimizer (and the scheduler) once, and zero the
gradients. Everything else here is setting up the plan and putting things back afterwards.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import batches as B
from .accumulate import Count, Window, accumulate
from .errors import AutotuneError, AutotuneWarning, NothingFits
from .memory import TensorLedger, cuda_memory_fraction, is_out_of_memory, release_cached
from .planner import _resolve_device, plan as make_plan
from .probe import held_tensors, min_micro_batch
from .plans import Plan, split_evenly
from .bn import BN_MODES, BNController, batchnorms, precise_bn
from .distributed import all_reduce_gradients, check_distinct_samples, max_over_ranks, sum_over_ranks, unwrap, world
from .step import LossFn, Precision, autocast, default_loss, forward_backward, normalize_precision
from .units import parse_bytes

if TYPE_CHECKING:
    from .tune import BNTuning

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
        lr: the first param group's learning rate used for this step.
        micro_batch: the largest micro-batch used for this window.
        seconds: wall time of the step.
    """

    step: int
    epoch: int
    samples: int
    items: int
    loss: float
    lr: float
    micro_batch: int
    seconds: float


@dataclass(frozen=True)
class FitResult:
    """What :func:`fit` did.

    Attributes:
        plan: the plan trained with (its micro-batch is the final one, after any OOM retry).
        history: one :class:`StepRecord` per optimizer step.
        bn_tuning: the momentum study of ``bn="optuna"`` (else None).
    """

    plan: Plan
    history: tuple[StepRecord, ...]
    bn_tuning: BNTuning | None = None

    @property
    def samples(self) -> int:
        """Samples trained on, over all steps."""
        return sum(r.samples for r in self.history)


@contextmanager
def _scaled_lr(optimizer: torch.optim.Optimizer, scheduler: Any, scale: float) -> Iterator[None]:
    """Multiply every param group's LR (and a scheduler's base LRs) by ``scale``; put them back."""
    keys = ("lr", "initial_lr")
    saved = [{k: g[k] for k in keys if k in g} for g in optimizer.param_groups]
    base_lrs = list(getattr(scheduler, "base_lrs", []) or [])
    for group in optimizer.param_groups:
        for k in keys:
            if k in group:
                group[k] = group[k] * scale
    if base_lrs:
        scheduler.base_lrs = [lr * scale for lr in base_lrs]
    try:
        yield
    finally:
        for group, values in zip(optimizer.param_groups, saved):
            group.update(values)
        if base_lrs:
            scheduler.base_lrs = base_lrs


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


def _replan(plan: Plan, micro_batch: int) -> Plan:
    share = sum(plan.micro_batches)
    sizes = split_evenly(share, math.ceil(share / micro_batch))
    return dataclasses.replace(
        plan,
        micro_batch=micro_batch,
        accumulation_steps=len(sizes),
        micro_batches=sizes,
        notes=plan.notes + (f"out of memory while training: micro-batch lowered to {micro_batch}",),
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
    bn: str | None = "adjust",
    bn_samples: int = 4096,
    val_loader: Iterable[Any] | None = None,
    n_trials: int = 20,
    storage: str | None = None,
    study_name: str | None = None,
    seed: int | None = None,
    progress: bool = True,
    plan: Plan | None = None,
    callback: Callable[[StepRecord], Any] | None = None,
) -> FitResult:
    """Probe the device, plan, and train ``target_batch`` samples per optimizer step, exactly.

    Each optimizer step sees exactly ``target_batch`` samples (the last window of an epoch: what is
    left, or nothing with ``drop_last=True``), cut into micro-batches that fit; micro-batch ``i``'s
    mean loss is weighted by ``n_i / N`` (items in it over items in the window), so the gradient is
    that of one big batch. The optimizer's learning rates are scaled by the plan for the run and put
    back afterwards, and so are the BatchNorm momenta.

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
            allocator's cap; CPU: counting tensor bytes, which costs some speed).
        headroom: as for :func:`autotune.plan`.
        precision: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"`` (autocast; fp16 adds a
            ``GradScaler``, unscaled once per window before clipping).
        clip_grad_norm: clip the accumulated gradient's norm to this, once per window.
        lr_rule: as for :func:`autotune.plan`.
        base_batch: as for :func:`autotune.plan`.
        count: ``count(batch) -> int``, loss items in a batch (e.g. non-padding tokens); default:
            samples.
        drop_last: drop each epoch's short last window.
        scheduler: any torch LR scheduler; stepped once per optimizer step. Its base LRs are
            scaled with the optimizer's for the run.
        bn: how BatchNorm running statistics are kept (see :mod:`autotune.bn`): ``"adjust"``
            (default): momentum ``1 - (1 - m) ** (n_i / N)`` per micro-batch, so they decay per
            step as with one big batch; ``"pooled"``: one update per step from statistics pooled
            over the window, exactly as one big-batch forward; ``"precise"``: recomputed after
            training over ``bn_samples`` samples with the weights frozen; ``"optuna"``: momentum
            tuned on ``val_loader`` by replaying recorded statistics (``n_trials``, ``storage``,
            ``study_name``, ``seed``); ``None``: leave BatchNorm alone. The modules' ``momentum``
            attributes are put back when ``fit`` returns.
        bn_samples: samples for ``bn="precise"``.
        val_loader: validation batches, needed by ``bn="optuna"``.
        n_trials: Optuna trials of ``bn="optuna"`` (each a replay and a validation pass).
        storage: Optuna storage URL for ``bn="optuna"``, e.g. ``"sqlite:///bn.db"``, so a study can
            be resumed or shared.
        study_name: the study's name in ``storage``.
        seed: seed of the study's sampler.
        progress: show a tqdm bar (samples/s, loss) when training takes more than a moment.
        plan: use this plan instead of probing.
        callback: called with each :class:`StepRecord`.

    Returns:
        A :class:`FitResult` with the plan (final micro-batch) and the per-step history.

    Raises:
        TypeError / ValueError: bad arguments.
        NothingFits: not even one sample fits (while probing, or while training after OOMs).

    Example:
        >>> result = autotune.fit(model, loader, target_batch=256)  # doctest: +SKIP
        >>> result.plan.accumulation_steps, result.history[-1].loss  # doctest: +SKIP
    """
    if plan is None and target_batch is None:
        raise TypeError("fit() needs target_batch= (samples per optimizer step), or plan=")
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
        raise ValueError(f"Invalid epochs {epochs!r}: give a whole number >= 1")
    if max_steps is not None and (not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1):
        raise ValueError(f"Invalid max_steps {max_steps!r}: give a whole number >= 1, or None")
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise ValueError(f"Invalid clip_grad_norm {clip_grad_norm!r}: give a positive norm, or None")
    if bn not in BN_MODES:
        raise ValueError(f"Invalid bn {bn!r}: use 'adjust', 'pooled', 'precise', 'optuna' or None")
    if bn == "optuna" and val_loader is None:
        raise ValueError("bn='optuna' tunes BatchNorm momentum on validation data: pass val_loader=")
    inner, ddp = unwrap(model)  # under DDP: the wrapper trains, the inner module is probed and inspected
    rank, _ = world()
    device = _fit_device(model, device)
    precision_name = normalize_precision(precision)
    limit = parse_bytes(memory_limit) if memory_limit is not None else None
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
            base_batch=base_batch, precision=precision_name,
        )
    elif target_batch is not None and target_batch != plan.effective_batch:
        raise ValueError(
            f"Invalid target_batch {target_batch!r}: the plan given trains {plan.effective_batch} "
            "samples per step; leave target_batch out or make a new plan"
        )

    bns = batchnorms(inner)
    plan = dataclasses.replace(plan, bn_mode=bn if bns else None)
    if bns and bn is not None and min(plan.micro_batches) < 16 and plan.accumulation_steps > 1:
        warnings.warn(
            f"BatchNorm normalises over micro-batches of {min(plan.micro_batches)} samples (< 16), so its "
            "statistics are noisy; consider GroupNorm, or SyncBatchNorm across GPUs",
            AutotuneWarning,
            stacklevel=2,
        )
    scaler = torch.amp.GradScaler(device.type) if precision_name == "fp16" else None
    params = [p for g in optimizer.param_groups for p in g["params"]]
    bnc = BNController(inner, bn, record=bn == "optuna")
    history: list[StepRecord] = []
    ledger = TensorLedger(device.type, limit=limit) if (limit is not None and device.type != "cuda") else None

    from tqdm.auto import tqdm  # imported here: `import autotune` stays light

    total_windows = None
    try:
        total_windows = epochs * math.ceil(len(loader.dataset) / plan.effective_batch)  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        pass
    if max_steps is not None:
        total_windows = min(total_windows or max_steps, max_steps)
    bar = tqdm(total=total_windows, unit="step", disable=not progress or rank != 0, delay=2.0, dynamic_ncols=True)

    with ExitStack() as stack:
        stack.enter_context(_scaled_lr(optimizer, scheduler, plan.lr_scale))
        stack.enter_context(bnc)
        stack.enter_context(cuda_memory_fraction(device, limit))
        stack.callback(bar.close)
        was_training = model.training
        stack.callback(model.train, was_training)
        if ledger is not None:
            ledger.track(held_tensors(model, optimizer))
        model.train()
        optimizer.zero_grad(set_to_none=True)
        step = 0
        for epoch in range(epochs):
            if max_steps is not None and step >= max_steps:
                break
            for window in accumulate(loader, plan, count=count, drop_last=drop_last):
                if max_steps is not None and step >= max_steps:
                    break
                if window.micro_batch > plan.micro_batch:  # lowered after an OOM earlier on
                    window = window.with_micro_batch(plan.micro_batch)
                start = time.perf_counter()
                # The ledger (CPU with a limit) counts the window's tensors and the optimizer step.
                with ledger if ledger is not None else nullcontext():
                    if step == 0 and ddp is not None:
                        check_distinct_samples(window[0].batch)
                    loss, window, plan = _run_window_with_retry(
                        model, ddp, loss_fn, window, device, precision_name, scaler, optimizer, bns, bnc, plan
                    )
                    if scaler is not None:
                        scaler.unscale_(optimizer)  # once per window, before clipping
                    if clip_grad_norm is not None:
                        torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
                    lr = float(optimizer.param_groups[0]["lr"])
                    if scaler is not None:
                        scaler.step(optimizer)
                        scaler.update()
                    else:
                        optimizer.step()
                    if scheduler is not None:
                        scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                step += 1
                record = StepRecord(
                    step=step, epoch=epoch, samples=window.total_samples, items=window.items,
                    loss=_global_loss(loss, ddp, device), lr=lr, micro_batch=window.micro_batch,
                    seconds=time.perf_counter() - start,
                )
                history.append(record)
                bar.update(1)
                bar.set_postfix(loss=f"{record.loss:.4g}", samples_s=f"{record.samples / max(record.seconds, 1e-9):.0f}", refresh=False)
                if callback is not None:
                    callback(record)
    tuning = None
    if bn == "precise":
        batches = (micro.batch for w in accumulate(loader, plan) for micro in w)
        precise_bn(inner, batches, lambda m, b: _forward(m, loss_fn, b, device, precision_name), samples=bn_samples)
    elif bn == "optuna" and bnc.recording is not None:
        from .tune import run_study

        tuning = run_study(
            inner, bnc.recording, val_loader, loss_fn, device,  # type: ignore[arg-type]
            n_trials=n_trials, storage=storage, study_name=study_name, seed=seed,
        )
    return FitResult(plan=plan, history=tuple(history), bn_tuning=tuning)


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


def _run_window_with_retry(
    model: nn.Module,
    ddp: nn.Module | None,
    loss_fn: LossFn,
    window: Window,
    device: torch.device,
    precision: Precision,
    scaler: torch.amp.GradScaler | None,
    optimizer: torch.optim.Optimizer,
    bns: list[nn.modules.batchnorm._BatchNorm],
    bnc: BNController,
    plan: Plan,
) -> tuple[torch.Tensor, Window, Plan]:
    """Run a window; on out-of-memory, undo the attempt, halve the micro-batch and redo it.

    Returns the window's mean loss, the window as finally cut, and the plan (updated if the
    micro-batch was lowered). The GradScaler needs no undo: its scale only changes in ``update()``,
    once per window, after this returns.
    """
    # BN buffers, to undo a failed attempt; they are small.
    bn_saved = [[b.detach().clone() for b in m.buffers()] for m in bns]
    while True:
        try:
            return _run_window(model, ddp, loss_fn, window, device, precision, scaler, bnc), window, plan
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            exc.__traceback__ = None  # drop the frames that hold the attempt's tensors
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, saved in zip(bns, bn_saved):
                for b, value in zip(m.buffers(), saved):
                    b.copy_(value)
        release_cached(device)
        floor = min_micro_batch(unwrap(model)[0])
        if window.micro_batch <= floor:
            raise NothingFits(
                f"Out of memory while training at micro_batch={window.micro_batch}: a batch of the loader is larger "
                "than anything the memory allows; shorten the longest samples, use "
                "precision='bf16', or raise memory_limit",
                needed=0,
                budget=plan.budget,
                limit=plan.memory_limit,
            )
        smaller = max(floor, window.micro_batch // 2)
        warnings.warn(
            f"Out of memory at micro_batch={window.micro_batch}; retrying the window with "
            f"micro_batch={smaller}",
            AutotuneWarning,
            stacklevel=3,
        )
        plan = _replan(plan, smaller)
        window = window.with_micro_batch(smaller)


def _run_window(
    model: nn.Module,
    ddp: nn.Module | None,
    loss_fn: LossFn,
    window: Window,
    device: torch.device,
    precision: Precision,
    scaler: torch.amp.GradScaler | None,
    bnc: BNController,
) -> torch.Tensor:
    """Forward and backward every micro-batch of ``window``; returns its weighted loss sum.

    Under DDP every micro-batch runs under ``no_sync()``, the ranks agree before each one that none
    has run out of memory or failed, and the accumulated gradients are all-reduced once, after the
    last one and a final agreement. A rank in trouble is therefore never waited for in a collective
    (not even in the buffer broadcast of DDP's forward): after an out-of-memory error all ranks redo
    the window together; after any other error every rank raises.
    """
    total = torch.zeros((), device=device, dtype=torch.float64)
    bnc.start_window(window.samples)
    failure: BaseException | None = None
    status = 0  # under DDP, agreed before every micro-batch: 0 fine, 1 out of memory, 2 failed
    for micro in window:
        if ddp is not None and (status := max_over_ranks(_status(failure), device)):
            break
        bnc.before_micro(micro.samples)
        try:
            with ddp.no_sync() if ddp is not None else nullcontext():  # type: ignore[operator]
                batch = B.to_device(micro.batch, device)
                loss = forward_backward(
                    model, loss_fn, batch, weight=micro.weight, device_type=device.type, precision=precision, scaler=scaler
                )
                total += loss.to(torch.float64) * micro.weight  # no sync: read once per step
        except Exception as exc:
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
    return total
