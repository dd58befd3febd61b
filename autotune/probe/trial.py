"""What a trial runs, and putting back everything it changes.

A trial is the steady-state training step: micro-step, optimizer step, micro-step, without
``zero_grad`` in between, so the last micro-step runs while gradients and optimizer state are
live and a fresh gradient is being accumulated into them. Its peak is the peak of the whole
sequence; forward/backward alone under-counts. Estimates (:mod:`autotune.probe.estimate`) run the same
step on fake copies; real trials (:mod:`autotune.probe.largest`) run it on the device, between a
:class:`autotune.step.Snapshot` and its restore.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from autotune import batches as B
from autotune.checks import is_one_shot
from autotune.memory.checkpointing import same_setting
from autotune.memory.ledger import held_tensors
from autotune.parallel.ranks import set_gradient_sync
from autotune.probe.search import Trial
from autotune.step import (
    LossFn,
    Precision,
    forward_backward,
)

__all__ = [
    "Clock",
    "Looked",
    "Workload",
    "sample_batch",
    "phase_times",
    "sharded_trial_step",
    "steady_times",
    "trial_step",
    "without_step_hooks",
    "zero_non_finite",
]


@dataclass(frozen=True)
class Looked:
    """What the first batches of a loader showed (:func:`sample_batch`).

    Attributes:
        batch: the batch with the most elements per sample (the longest sequences), probed.
        first_size: the first batch's size.
        seen: how many batches were looked at.
        shapes: one small batch (a sample) per distinct per-sample shape, in the order met; more
            than one when the lengths vary.
    """

    batch: Any
    first_size: int
    seen: int
    shapes: tuple[Any, ...]

    @property
    def varies(self) -> bool:
        """Whether the batches looked at differ in per-sample shape (sequences of varying length)."""
        return len(self.shapes) > 1


def sample_batch(loader: Iterable[Any], *, max_batches: int = 8) -> Looked:
    """Look at the first batches of ``loader``: the worst case, and the shapes that occur.

    Raises:
        TypeError: ``loader`` is a one-shot iterator (probing would consume its samples).
        ValueError: ``loader`` yields no batch, or a batch is malformed.
    """
    if is_one_shot(loader):
        raise TypeError(
            f"Invalid loader of type {type(loader).__name__}: it is a one-shot iterator, and probing "
            "would consume samples of your epoch; pass a re-iterable such as a list of batches or "
            "a torch.utils.data.DataLoader"
        )
    worst, worst_numel, first_size, seen = None, -1, 0, 0
    shapes: dict[Any, Any] = {}  # per-sample shapes -> one small template of them
    first: Any = None
    for batch in loader:
        size, sample_shapes = B.checked_batch(batch, seen)
        first = batch if seen == 0 else first
        B.check_like_first(first, batch, seen)
        numel = B.per_sample_numel(batch)
        if seen == 0:
            first_size = size
        if numel > worst_numel:
            worst, worst_numel = batch, numel
        if sample_shapes not in shapes:
            shapes[sample_shapes] = B.slice_batch(batch, 0, 1)
        seen += 1
        if seen >= max_batches:
            break
    if seen == 0:
        raise ValueError(
            "Invalid loader: it yielded no batches; check the dataset is not empty and, with "
            "drop_last=True, that it holds at least one full batch"
        )
    return Looked(worst, first_size, seen, tuple(shapes.values()))


@contextlib.contextmanager
def without_step_hooks(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """``optimizer``'s own step hooks set aside while a trial steps it (an EMA in a post-hook must not
    see a trial's step), then put back."""
    saved = []
    for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
        hooks = getattr(optimizer, name, None)
        if hooks is not None:
            saved.append((hooks, dict(hooks)))
            hooks.clear()
    try:
        yield
    finally:
        for hooks, values in saved:
            hooks.update(values)


@dataclass
class Workload:
    """What a trial runs: the model, its optimizer, the loss and one worst-case batch."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: LossFn
    batch: Any
    device: torch.device
    precision: Precision = "fp32"
    trials: list[Trial] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    on_trial: Callable[[Trial], Any] | None = None
    # Told before each real trial starts (a step of a big model can take a minute).
    on_start: Callable[[int], Any] | None = None
    # Budget the process's resident growth too, not only tensor bytes (the CPU's physical memory
    # as the limit: allocator overhead there is what the OOM killer sees).
    resident: bool = False
    # The estimator the probe used (None when the step could not be estimated), for the shape model.
    estimator: Any = None
    # The estimated memory curve the probe's answer came from (None: real trials or traces alone).
    curve: Any = None
    # Activation checkpointing on the model's blocks (True: all; a count: the first ones) during trials (and on the estimate's copy).
    checkpointing: bool | int = False
    # Sharded with FSDP2: trials in lockstep with the other ranks (see autotune.train.sharded).
    fsdp: bool = False
    # Under FSDP2: this rank's own out-of-memory error in the last trial (None: none, or another rank's),
    # and for each size whose trial ran out of memory somewhere, the ranks it ran out on and their errors.
    own_oom: BaseException | None = None
    oom_ranks: dict[int, str] = field(default_factory=dict)
    # Where in ``trials`` the trials of the plan's final setting start (checkpointing='auto' changes it after a search).
    settled: int = 0

    def record(self, trial: Trial) -> None:
        """Keep a trial (with the checkpointing it ran with, where it does not say its own: the workload's) and tell the
        ``on_trial`` callback, if any; not an estimate read again (made earlier: 0 s) that this workload kept already
        (``checkpointing="auto"`` confirms its count on the trace its search made)."""
        if trial.checkpointing is None:
            trial = replace(trial, checkpointing=self.checkpointing)
        if trial.estimate and trial.seconds == 0.0 and any(_alike(t, trial) for t in self.trials):
            return
        self.trials.append(trial)
        if self.on_trial is not None:
            self.on_trial(trial)

    def held_tensors(self) -> Iterator[torch.Tensor]:
        """Tensors the training holds between steps (see :func:`held_tensors`)."""
        return held_tensors(self.model, self.optimizer)


def _alike(kept: Trial, trial: Trial) -> bool:
    """Two estimates of one size, with the same bytes, verdict and checkpointing."""
    return (kept.estimate and same_setting(kept.checkpointing, trial.checkpointing)
            and (kept.batch_size, kept.peak_memory, kept.fits) == (trial.batch_size, trial.peak_memory, trial.fits))


def trial_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    batch: Any,
    device_type: str,
    precision: Precision,
    finite: bool = False,
    clock: Clock | None = None,
) -> None:
    """The steady-state step: micro-step, optimizer step, micro-step (see the module docstring).

    ``finite`` zeroes non-finite gradients before the step (trials stepped at a learning rate of 0). ``clock``, where
    given, notes the time at the start and at the end of each of the three (:func:`phase_times`).
    """
    model.train()
    _stamp(clock)
    forward_backward(model, loss_fn, batch, device_type=device_type, precision=precision)
    _stamp(clock)
    if finite:
        zero_non_finite(optimizer)
    optimizer.step()
    _stamp(clock)
    forward_backward(model, loss_fn, batch, device_type=device_type, precision=precision)
    _stamp(clock)


def steady_times(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn, batch: Any, device_type: str,
                 precision: Precision, sync: Callable[[], None], *, finite: bool = False) -> tuple[float, float]:
    """Seconds of one more micro-step of ``batch`` (forward and backward) and one more optimizer step, each timed on its
    own, ``sync`` waiting for the device's queued work (``finite`` as :func:`trial_step`'s, before the optimizer step's
    timing: training's step has nothing to zero). After a trial, its gradients and optimizer state live: steady ones."""
    clock = Clock(sync)
    clock.stamp()
    forward_backward(model, loss_fn, batch, device_type=device_type, precision=precision)
    clock.stamp()
    if finite:
        zero_non_finite(optimizer)
    clock.stamp()
    optimizer.step()
    clock.stamp()
    t = clock.times
    return t[1] - t[0], t[3] - t[2]


def _now() -> float:
    return time.perf_counter()


class Clock:
    """The times at which a timed trial's phases end (:func:`phase_times`), each read once ``sync`` has waited for the
    device's queued work."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.times: list[float] = []

    def stamp(self) -> None:
        """Note the time, the device's queued work done."""
        self.sync()
        self.times.append(_now())


def _stamp(clock: Clock | None) -> None:
    if clock is not None:
        clock.stamp()


def phase_times(clock: Clock, *, pairs: bool = False) -> tuple[float, float] | None:
    """A timed trial's steady micro-step and its optimizer step, in seconds, from its ``clock``; None where the trial
    stopped early.

    The trial's last micro-step is the steady one: the optimizer state exists and a gradient is accumulated into
    gradients held, as in every window of ``fit`` (its first micro-step may have paid for what a first step pays once:
    the allocator's fresh blocks, a kernel's tuning). The optimizer step is the trial's only one, which creates the
    state where none was kept: an upper bound of a later step's. With ``pairs`` (FSDP2's trial, whose phases are pairs
    of micro-steps, no-sync and sync) the micro-step is half the last pair.
    """
    t = clock.times
    if len(t) != 4:
        return None
    micro = (t[3] - t[2]) / (2 if pairs else 1)
    return micro, t[2] - t[1]


def zero_non_finite(optimizer: torch.optim.Optimizer) -> None:
    """Zero the non-finite values of the optimizer's gradients, in place.

    For trials stepped at a learning rate of 0: a non-finite gradient would still reach the weights
    (0 * inf is nan), and a trial's gradients are its own, only their memory matters.
    """
    for g in optimizer.param_groups:
        for p in g["params"]:
            if p.grad is not None:
                torch.nan_to_num_(p.grad, nan=0.0, posinf=0.0, neginf=0.0)


def sharded_trial_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    batch: Any,
    device_type: str,
    precision: Precision,
    finite: bool = False,
    clock: Clock | None = None,
    *,
    accumulating: bool = True,
) -> None:
    """FSDP2's steady-state step: no-sync and sync micro-batches, the optimizer step, both again.

    The first pair and the step create the optimizer state; the second pair is a window of
    ``fit``: the state live, the gradients zeroed after the step, the unsharded gradients of the
    no-sync micro-batch held for the sync (the reduce-scatter), which makes the sharded ones.
    ``accumulating=False`` is a window of one micro-batch: sync-only micro-batches, whose
    backward reduce-scatters each block's gradients as it goes (none held unsharded). ``clock`` as
    :func:`trial_step`'s, a pair of micro-steps for each micro-step.
    """
    syncs = (False, True) if accumulating else (True, True)
    model.train()
    try:
        _stamp(clock)
        for sync in syncs:
            set_gradient_sync(model, sync)
            forward_backward(model, loss_fn, batch, device_type=device_type, precision=precision)
        _stamp(clock)
        if finite:
            zero_non_finite(optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # as after every step of fit: a window starts without gradients
        _stamp(clock)
        for sync in syncs:
            set_gradient_sync(model, sync)
            forward_backward(model, loss_fn, batch, device_type=device_type, precision=precision)
        _stamp(clock)
    finally:
        set_gradient_sync(model, True)
