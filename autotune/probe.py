"""Run trial training steps safely and drive the search for the largest micro-batch.

A trial is the steady-state training step: micro-step, optimizer step, micro-step, without
``zero_grad`` in between, so the last micro-step runs while gradients and optimizer state are
live and a fresh gradient is being accumulated into them. Its peak is the peak of the whole
sequence. Forward/backward alone under-counts.

Estimates run the same step on fake copies of the model and optimizer (no data, no compute,
exact tensor bytes); real trials run it on the device under the memory budget. Every real trial
starts from, and every probe ends with, the model, optimizer and RNG states exactly as they were.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import batches as B
from .memory import (
    CUDA_BLOCK,
    ResidentPeak,
    TensorLedger,
    allocator_peak,
    is_out_of_memory,
    release_cached,
    reset_peak,
    synchronize,
)
from .plans import Trial
from .checks import is_one_shot
from .distributed import gather_numbers
from .errors import AutotuneError
from .estimate import Estimator, is_estimate_error
from .rng import RNGState
from .search import Measurement, SearchResult, estimated_max, largest_fitting
from .units import format_bytes
from .step import LossFn, Precision, forward_backward

__all__ = [
    "EXACT_AT_ZERO_LR",
    "Progress",
    "Snapshot",
    "Workload",
    "estimate_peak",
    "held_tensors",
    "min_micro_batch",
    "optimizer_state_bytes",
    "probe",
    "sample_batch",
]


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _exact_at_zero_lr() -> tuple[type, ...]:
    """``torch.optim`` optimizers whose step leaves every parameter bitwise unchanged at ``lr=0``.

    Each applies its update as ``p += -lr * ...`` and weight decay as ``p *= 1 - lr * wd`` or
    through the update, and ``tests/test_no_copy.py`` checks them bitwise (single tensor, foreach
    and fused). Not here: optimizers with LR-free updates (Rprop, LBFGS), ASGD (its ``eta`` state
    carries the learning rate of earlier steps), and any subclass, whose step may differ.
    """
    o = torch.optim
    names = ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta")
    return tuple(getattr(o, n) for n in names if hasattr(o, n))


EXACT_AT_ZERO_LR = _exact_at_zero_lr()


class Snapshot:
    """Exactly what a trial can change, copied to CPU, and put back bitwise by :meth:`restore`.

    Covers buffers, ``.grad`` that existed (None stays None; an existing gradient keeps its tensor
    object), the optimizer's existing per-parameter state (same tensor objects, values restored;
    entries the trial added are removed), its param-group settings, the modules' train/eval flags,
    and the random number generators (torch CPU and CUDA, Python, numpy, and the loader's own
    generators: see :class:`autotune.rng.RNGState`).

    Parameter values are copied only when the trial could change them: a trial of an optimizer in
    :data:`EXACT_AT_ZERO_LR` steps with a learning rate of exactly 0 (``zero_lr``), which leaves
    every parameter bitwise as it was, so a model whose weights fill the host memory is never
    copied there. Other optimizers (their own LR-free updates, schedule-free or D-Adaptation
    variants, subclasses) keep the full copy.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loader: Any = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.zero_lr = type(optimizer) in EXACT_AT_ZERO_LR
        self.params = _unique(
            [*model.parameters(), *(p for g in optimizer.param_groups for p in g["params"])]
        )
        with torch.no_grad():
            self.values = None if self.zero_lr else [p.detach().to("cpu", copy=True) for p in self.params]
            self.grads = [
                None if p.grad is None else (p.grad, p.grad.detach().to("cpu", copy=True))
                for p in self.params
            ]
            self.buffers = [(b, b.detach().to("cpu", copy=True)) for b in _unique(model.buffers())]
            self.state = {
                p: {k: self._save(v) for k, v in s.items()} for p, s in optimizer.state.items()
            }
        self.groups = [
            {k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups
        ]
        self.opt_called = optimizer.__dict__.get("_opt_called", _MISSING)
        self.training = [(m, m.training) for m in model.modules()]
        self.rng = RNGState(loader)

    def prepare_trial(self) -> None:
        """Before a real trial: every param group's learning rate to exactly 0 (zero_lr only)."""
        if not self.zero_lr:
            return
        for g in self.optimizer.param_groups:
            lr = g.get("lr")
            g["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0

    @staticmethod
    def _save(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return _SavedTensor(value, value.detach().to("cpu", copy=True))
        return copy.deepcopy(value)

    def restore(self) -> None:
        """Put everything back as it was when the snapshot was taken."""
        opt = self.optimizer
        with torch.no_grad():
            for p, v in zip(self.params, self.values or ()):
                p.copy_(v)
            for p, g in zip(self.params, self.grads):
                if g is None:
                    p.grad = None
                else:
                    original, value = g
                    original.copy_(value)
                    p.grad = original
            for b, v in self.buffers:
                b.copy_(v)
            for p in [p for p in opt.state if p not in self.state]:
                del opt.state[p]
            for p, saved in self.state.items():
                restored = {}
                for k, v in saved.items():
                    if isinstance(v, _SavedTensor):
                        restored[k] = v.original.copy_(v.value)
                    else:
                        restored[k] = copy.deepcopy(v)
                opt.state[p] = restored
        for group, saved_group in zip(opt.param_groups, self.groups):
            params = group["params"]
            group.clear()
            group.update(copy.deepcopy(saved_group))
            group["params"] = params
        # LR schedulers mark the optimizer when it steps; the trial's steps must not count.
        if self.opt_called is _MISSING:
            opt.__dict__.pop("_opt_called", None)
        else:
            opt.__dict__["_opt_called"] = self.opt_called
        for m, training in self.training:
            m.training = training
        self.rng.restore()


_MISSING = object()


@dataclass(frozen=True)
class _SavedTensor:
    """An optimizer state tensor and a CPU copy of its values (restored into the same object)."""

    original: torch.Tensor
    value: torch.Tensor


def held_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Tensors training holds between steps: parameters, buffers, gradients, optimizer state."""
    yield from model.parameters()
    yield from model.buffers()
    for p in model.parameters():
        if p.grad is not None:
            yield p.grad
    for s in optimizer.state.values():
        yield from (v for v in s.values() if isinstance(v, torch.Tensor))


def sample_batch(loader: Iterable[Any], *, max_batches: int = 8) -> tuple[Any, int, int, list[tuple[int, int]]]:
    """Look at the first batches of ``loader`` and keep the worst case.

    Returns:
        ``(batch, first_batch_size, batches_seen, length_dims)`` where ``batch`` is the batch with
        the most elements per sample (the longest sequences when lengths vary) and
        ``length_dims`` the ``(tensor, dim)`` pairs that hold a variable length (see
        :func:`autotune.batches.length_dims`; empty for fixed-shape data).

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
    shapes: list[Any] = []  # one small template per distinct per-sample shape
    for batch in loader:
        size = B.batch_size(batch)
        numel = B.per_sample_numel(batch)
        if seen == 0:
            first_size = size
        if numel > worst_numel:
            worst, worst_numel = batch, numel
        if all(B.sample_shapes(batch) != B.sample_shapes(s) for s in shapes):
            shapes.append(B.slice_batch(batch, 0, 1))
        seen += 1
        if seen >= max_batches:
            break
    if seen == 0:
        raise ValueError(
            "Invalid loader: it yielded no batches; check the dataset is not empty and, with "
            "drop_last=True, that it holds at least one full batch"
        )
    others = [s for s in shapes if B.sample_shapes(s) != B.sample_shapes(worst)]
    return worst, first_size, seen, B.length_dims([worst, *others])


class Progress:
    """One line per trial on stderr, once probing has taken more than ``delay`` seconds.

    A real trial is announced before it starts: for a big model one step can take a minute.
    """

    DELAY = 1.0  # seconds of probing before anything is shown

    def __init__(self, enabled: bool = True, *, delay: float | None = None, stream: Any = None) -> None:
        self.enabled = enabled
        self.delay = self.DELAY if delay is None else delay
        self.stream = stream
        self.start = time.perf_counter()

    def _show(self) -> bool:
        return self.enabled and time.perf_counter() - self.start > self.delay

    def _print(self, text: str) -> None:
        import sys

        print(f"autotune: {text}", file=self.stream or sys.stderr, flush=True)

    def starting(self, b: int) -> None:
        """A real trial of ``b`` samples starts."""
        if self._show():
            self._print(f"real step at micro-batch {b} ...")

    def done(self, trial: Trial) -> None:
        """A trial (estimate or real step) is done."""
        if self._show() or (self.enabled and not trial.estimate and trial.seconds > self.delay):
            kind = "estimate" if trial.estimate else "real step"
            verdict = "fits" if trial.fits else "does not fit"
            self._print(f"{kind} at micro-batch {trial.batch_size}: {verdict} ({format_bytes(trial.peak_memory)}, {trial.seconds:.2f} s)")


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
    # Activation checkpointing on the model's blocks during trials (and on the estimate's copy).
    checkpointing: bool = False
    # Sharded with FSDP2: trials in lockstep with the other ranks (see autotune.fsdp).
    fsdp: bool = False

    def record(self, trial: Trial) -> None:
        """Keep a trial and tell the ``on_trial`` callback, if any."""
        self.trials.append(trial)
        if self.on_trial is not None:
            self.on_trial(trial)

    def held_tensors(self) -> Iterator[torch.Tensor]:
        """Tensors the training holds between steps (see :func:`held_tensors`)."""
        return held_tensors(self.model, self.optimizer)


def _trial_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    batch: Any,
    device_type: str,
    precision: Precision,
    finite: bool = False,
) -> None:
    model.train()
    forward_backward(model, loss_fn, batch, device_type=device_type, precision=precision)
    if finite:
        zero_non_finite(optimizer)
    optimizer.step()
    forward_backward(model, loss_fn, batch, device_type=device_type, precision=precision)


def zero_non_finite(optimizer: torch.optim.Optimizer) -> None:
    """Zero the non-finite values of the optimizer's gradients, in place.

    For trials stepped at a learning rate of 0: a non-finite gradient would still reach the weights
    (0 * inf is nan), and a trial's gradients are its own, only their memory matters.
    """
    for g in optimizer.param_groups:
        for p in g["params"]:
            if p.grad is not None:
                torch.nan_to_num_(p.grad, nan=0.0, posinf=0.0, neginf=0.0)


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if it owns its storage exactly, else a contiguous copy."""
    if t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.is_contiguous():
        return t
    return t.contiguous().clone()


def min_micro_batch(model: nn.Module) -> int:
    """The smallest micro-batch that can train: 2 when the model has BatchNorm, else 1.

    BatchNorm in training mode cannot normalise a single value per channel (``BatchNorm1d`` on a
    ``(1, C)`` input raises ``ValueError``), so models with it start at two samples.
    """
    return 2 if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()) else 1


def optimizer_state_bytes(work: Workload) -> int | None:
    """Bytes of optimizer state after one step (estimated); None if the step cannot be estimated."""
    try:
        estimator = Estimator(work, _trial_step)
        estimator(min_micro_batch(work.model))
    except Exception:
        return None
    return estimator.optimizer_state_bytes()


def estimate_peak(work: Workload, batch_size: int) -> int:
    """Peak bytes of one steady-state training step at ``batch_size``, estimated on fake tensors
    (see :mod:`autotune.estimate`).

    Raises whatever the model raises without data (data-dependent shapes, ``.item()``).
    """
    return Estimator(work, _trial_step)(batch_size)


def probe(
    work: Workload,
    *,
    upper: int,
    budget: int,
    snapshot: Snapshot,
    verify: bool = True,
    estimate: bool = True,
    max_real: int = 8,
) -> SearchResult:
    """Find the largest micro-batch whose trial step fits ``budget`` bytes.

    Args:
        work: the workload; its ``trials`` and ``notes`` lists receive what happens.
        upper: the largest size to try (the per-device target batch).
        budget: bytes the step may use (the limit less the headroom).
        snapshot: restores the workload's state after every real trial.
        verify: run real trials (False: an estimate-only answer).
        estimate: use estimates (False: real trials only).
        max_real: a bound on real trials.

    Returns:
        The search result; ``batch_size == 0`` when one sample does not fit.
    """
    estimator: Callable[[int], int] | None = None
    lower = min(min_micro_batch(work.model), upper)
    reason = "estimate=False"
    if estimate:
        try:
            estimator_ = Estimator(work, _trial_step)
            start = time.perf_counter()
            first = estimator_(lower)  # fail here, not inside the search, if the step cannot be estimated
            seconds = time.perf_counter() - start
            work.estimator = estimator_
        except Exception as exc:
            if not is_estimate_error(exc):
                raise  # the user's code failed for its own reasons: say so now, not after real trials
            reason = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
            work.notes.append(f"estimate unavailable ({reason}); real trials only")
        else:
            cache = {lower: first}
            work.record(Trial(lower, first, first <= budget, seconds, estimate=True))

            def estimator(b: int) -> int:
                if b not in cache:
                    start = time.perf_counter()
                    cache[b] = estimator_(b)
                    work.record(Trial(b, cache[b], cache[b] <= budget, time.perf_counter() - start, estimate=True))
                return cache[b]

    if not verify:
        if estimator is None:
            raise AutotuneError(
                f"Cannot estimate this model without running it ({reason}): plan on the device itself "
                "(autotune.plan with verify=True, or autotune report on a machine that has the device)"
            )
        size, points = estimated_max(estimator, budget, upper, lower=lower)
        return SearchResult(size, points.get(size, points[lower]), None, size)

    def measure(b: int) -> Measurement:
        # Under FSDP2 a micro-batch of the whole share is a window of one: no unsharded gradients held.
        whole = work.fsdp and b >= upper
        if not work.checkpointing:
            return _real_trial(work, b, budget, snapshot, whole=whole)
        from .checkpointing import activation_checkpointing

        with activation_checkpointing(work.model):
            return _real_trial(work, b, budget, snapshot, whole=whole)

    real: Callable[[int], Measurement] = measure
    search_budget = budget
    if work.fsdp:
        real, search_budget = _in_lockstep(work, measure, budget)
        # The whole share in one micro-batch holds no unsharded gradients, so it may fit where
        # smaller, accumulating ones do not: tried first, then the search below it.
        whole = real(upper)
        if whole.fits:
            return SearchResult(upper, whole.peak, None, None)
        if upper == lower:
            return SearchResult(0, whole.peak, upper, None)
        return largest_fitting(real, upper=upper - 1, budget=search_budget, lower=lower, max_real=max_real)
    return largest_fitting(real, upper=upper, budget=search_budget, estimate=estimator, lower=lower, max_real=max_real)


def _in_lockstep(work: Workload, measure: Callable[[int], Measurement], budget: int) -> tuple[Callable[[int], Measurement], int]:
    """Under FSDP2: trials every rank runs together, whose outcome every rank agrees on.

    The ranks' budgets may differ (per-rank limits), so the search runs against the smallest and
    each trial reports the tightest rank's peak shifted onto it: ``max_r(peak_r - budget_r) +
    min_r(budget_r)``. A size then fits when it fits on every rank, and every rank's search takes
    the same path (a different path would pair different collectives). A trial that fails on one
    rank for another reason than memory stops every rank.
    """
    common = int(min(r[0] for r in gather_numbers([float(budget)], work.device)))

    def real(b: int) -> Measurement:
        failure: BaseException | None = None
        try:
            measured = measure(b)
        except Exception as exc:
            failure, measured = exc, Measurement(False, 0)
        rows = gather_numbers([float(failure is not None), float(measured.fits), float(measured.peak - budget)], work.device)
        failed = [r for r, row in enumerate(rows) if row[0]]
        if failure is not None:
            raise failure
        if failed:
            raise AutotuneError(
                f"rank {failed[0]} failed in its trial at micro-batch {b} (its own error says why); every rank stops"
            )
        return Measurement(all(r[1] for r in rows), int(max(r[2] for r in rows)) + common)

    return real, common


def _real_trial(work: Workload, b: int, budget: int, snapshot: Snapshot, *, whole: bool = False) -> Measurement:
    device = work.device
    if work.on_start is not None:
        work.on_start(b)
    release_cached(device)
    # A compact copy: a slice of a larger tensor would count the whole of its storage.
    batch = B.map_tensors(B.to_device(B.repeat_to(work.batch, b), device), _compact)
    # Under FSDP2 the budget is checked after the trial: raising inside one rank's forward would
    # leave the others waiting in a collective.
    ledger = TensorLedger(device.type, limit=None if work.fsdp else budget, block=CUDA_BLOCK if device.type == "cuda" else 1)
    ledger.track(work.held_tensors())
    ledger.track(B.tensors(batch))
    held = ledger.live
    retries = reset_peak(device)
    # Against physical memory, the process also grows by what the tensor count cannot see (the
    # allocator's fragmentation, library scratch memory): its resident size is sampled.
    resident = ResidentPeak() if (device.type == "cpu" and work.resident) else None
    start = time.perf_counter()
    fits = True
    snapshot.prepare_trial()
    step: Callable[..., None] = _trial_step
    if work.fsdp:
        import functools

        from .fsdp import trial_step

        step = functools.partial(trial_step, accumulating=not whole)
    try:
        with ledger, (resident if resident is not None else contextlib.nullcontext()):
            step(work.model, work.optimizer, work.loss_fn, batch, device.type, work.precision, finite=snapshot.zero_lr)
        synchronize(device)  # the step's time includes the device's queued work
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        fits = False
        exc.__traceback__ = None  # drop the frames that hold the step's tensors
    finally:
        seconds = time.perf_counter() - start
        del batch
        snapshot.restore()
        release_cached(device)
    peak = ledger.peak
    if resident is not None and resident.growth is not None:
        peak = max(peak, held + resident.growth)
    reserved, retries_after = allocator_peak(device)
    peak = max(peak, reserved)
    fits = fits and peak <= budget
    if device.type == "cuda" and retries_after > retries:
        # Not a failure: cuDNN sizes its workspaces from the device's free memory, not the cap, and
        # the allocator freeing its cache to serve one is how it recovers. The headroom covers it.
        work.notes.append(
            f"the CUDA allocator freed its cache and retried {retries_after - retries} time(s) at micro-batch {b} "
            f"(fragmentation, or a library workspace sized from free memory); the step {'fitted' if fits else 'did not fit'}"
        )
    work.record(Trial(b, peak, fits, seconds, estimate=False))
    return Measurement(fits, peak)
