"""What a trial runs, and putting back everything it changes.

A trial is the steady-state training step: micro-step, optimizer step, micro-step, without
``zero_grad`` in between, so the last micro-step runs while gradients and optimizer state are
live and a fresh gradient is being accumulated into them. Its peak is the peak of the whole
sequence; forward/backward alone under-counts. Estimates (:mod:`autotune.probe.estimate`) run the same
step on fake copies; real trials (:mod:`autotune.probe.largest`) run it on the device, between a
:class:`Snapshot` and its :meth:`Snapshot.restore`.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autotune import batches as B
from autotune.checks import is_one_shot
from autotune.memory.ledger import held_tensors
from autotune.parallel.ranks import set_gradient_sync
from autotune.probe.search import Trial
from autotune.rng import RNGState
from autotune.step import LossFn, Precision, forward_backward

__all__ = [
    "EXACT_AT_ZERO_LR",
    "Looked",
    "check_step",
    "checked_batch",
    "is_planning",
    "planning",
    "Snapshot",
    "Workload",
    "min_micro_batch",
    "sample_batch",
    "sharded_trial_step",
    "trial_step",
    "without_step_hooks",
    "zero_non_finite",
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


def min_micro_batch(model: nn.Module) -> int:
    """The smallest micro-batch that can train: 2 when the model has BatchNorm, else 1.

    BatchNorm in training mode cannot normalise a single value per channel (``BatchNorm1d`` on a
    ``(1, C)`` input raises ``ValueError``), so models with it start at two samples.
    """
    return 2 if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()) else 1


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
    for batch in loader:
        size, sample_shapes = checked_batch(batch, seen)
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


def checked_batch(batch: Any, index: int) -> tuple[int, Any]:
    """``(samples, per-sample shapes)`` of the loader's batch number ``index``; an error naming the
    loader and the batch when it is not a batch autotune can cut (no tensor, a scalar, tensors that
    disagree on the batch size, no sample)."""
    try:
        size, shapes = B.size_and_shapes(batch)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"Invalid loader: its batch {index} is not a batch ({exc})") from None
    if size == 0:
        raise ValueError(
            f"Invalid loader: its batch {index} holds no sample (dim 0 of size 0); drop empty batches from the "
            "loader (a sampler or collate_fn that yields them)"
        )
    return size, shapes


def check_step(model: nn.Module, loss_fn: LossFn, loader: Any, *, device: torch.device, precision: Precision) -> None:
    """Refuse a loader or a loss that cannot train, before training changes anything.

    Looks at the loader's first batch (its generators put back) and runs one forward and backward of
    the loss on a sample of it, between a :class:`Snapshot` and its restore: a malformed batch, a
    loss that is not a scalar tensor with a gradient, or an error in your code is raised here, with
    the model, its gradients, the RNGs and the loader exactly as they were.
    """
    rng = RNGState(loader)
    try:
        batch = next(iter(loader), _NONE)
    finally:
        rng.restore()
    if batch is _NONE:
        raise ValueError(
            "Invalid loader: it yielded no batches; check the dataset is not empty and, with drop_last=True, that it "
            "holds at least one full batch"
        )
    size, _ = checked_batch(batch, 0)
    sample = B.to_device(B.slice_batch(batch, 0, min(size, min_micro_batch(model))), device)
    params = [p for p in model.parameters() if p.requires_grad]
    snapshot = Snapshot(model, torch.optim.SGD(params, lr=0.0), loader)
    try:
        with planning():
            model.train()
            forward_backward(model, loss_fn, sample, device_type=device.type, precision=precision)
    finally:
        snapshot.restore()


_NONE = object()
_PLANNING = [0]  # how many trials or estimates are running (see planning)


def is_planning() -> bool:
    """Whether autotune is running a trial or an estimate of your step right now.

    Planning runs your model's forward and backward (and so its module hooks): once per trace on fake
    tensors (two or three per plan) and twice per real trial (usually one per plan), and never your
    optimizer's step hooks (a trial steps at a learning rate of 0; it is not a training step). A hook
    that counts what it sees or keeps tensors can skip those calls::

        def hook(module, inputs, output):
            if not autotune.is_planning():
                activations.append(output.detach())
    """
    return _PLANNING[0] > 0


@contextlib.contextmanager
def planning() -> Iterator[None]:
    """While it runs, :func:`is_planning` is True and the optimizers' step hooks (every optimizer's
    own and torch's global ones) are set aside, then put back."""
    from torch.optim import optimizer as opt_module

    saved = []
    for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"):
        hooks = getattr(opt_module, name, None)
        if hooks is not None:
            saved.append((hooks, dict(hooks)))
            hooks.clear()
    _PLANNING[0] += 1
    try:
        yield
    finally:
        _PLANNING[0] -= 1
        for hooks, values in saved:
            hooks.update(values)


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
    # Activation checkpointing on the model's blocks during trials (and on the estimate's copy).
    checkpointing: bool = False
    # Sharded with FSDP2: trials in lockstep with the other ranks (see autotune.train.sharded).
    fsdp: bool = False

    def record(self, trial: Trial) -> None:
        """Keep a trial and tell the ``on_trial`` callback, if any."""
        self.trials.append(trial)
        if self.on_trial is not None:
            self.on_trial(trial)

    def held_tensors(self) -> Iterator[torch.Tensor]:
        """Tensors the training holds between steps (see :func:`held_tensors`)."""
        return held_tensors(self.model, self.optimizer)


def trial_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    batch: Any,
    device_type: str,
    precision: Precision,
    finite: bool = False,
) -> None:
    """The steady-state step: micro-step, optimizer step, micro-step (see the module docstring).

    ``finite`` zeroes non-finite gradients before the step (trials stepped at a learning rate of 0).
    """
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


def sharded_trial_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    batch: Any,
    device_type: str,
    precision: Precision,
    finite: bool = False,
    *,
    accumulating: bool = True,
) -> None:
    """FSDP2's steady-state step: no-sync and sync micro-batches, the optimizer step, both again.

    The first pair and the step create the optimizer state; the second pair is a window of
    ``fit``: the state live, the gradients zeroed after the step, the unsharded gradients of the
    no-sync micro-batch held for the sync (the reduce-scatter), which makes the sharded ones.
    ``accumulating=False`` is a window of one micro-batch: sync-only micro-batches, whose
    backward reduce-scatters each block's gradients as it goes (none held unsharded).
    """
    syncs = (False, True) if accumulating else (True, True)
    model.train()
    try:
        for sync in syncs:
            set_gradient_sync(model, sync)
            forward_backward(model, loss_fn, batch, device_type=device_type, precision=precision)
        if finite:
            zero_non_finite(optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # as after every step of fit: a window starts without gradients
        for sync in syncs:
            set_gradient_sync(model, sync)
            forward_backward(model, loss_fn, batch, device_type=device_type, precision=precision)
    finally:
        set_gradient_sync(model, True)
