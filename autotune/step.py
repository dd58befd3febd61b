"""The training step that probes measure and training runs: forward, loss, weighted backward; what a
step changes, copied and put back bitwise (:class:`Snapshot`); and the check, before training, that
your step runs at all (:func:`check_step`).

The default loss, used when ``loss_fn`` is None:

- a dict batch is passed as ``model(**batch)``; the loss is the output itself when it is a scalar
  tensor, else ``output["loss"]`` or ``output.loss``. A value that is not a tensor (the document ids or
  texts a collator left in the batch) is passed only where ``forward`` names it, as the Transformers
  Trainer drops the columns its model does not take (they would reach a ``**kwargs`` meant for the loss);
- an ``(inputs, targets)`` pair is passed as ``model(inputs)``; integer targets get cross-entropy
  (logits shaped ``targets.shape + (classes,)`` are flattened, as for sequence models; targets of
  -100 are ignored, as ``F.cross_entropy`` does), float targets get mean squared error;
- anything else raises ``TypeError`` asking for ``loss_fn``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from autotune import batches as B
from autotune.rng import RNGState

__all__ = [
    "EXACT_AT_ZERO_LR",
    "LossFn",
    "Precision",
    "Snapshot",
    "autocast",
    "batchnorms",
    "check_step",
    "default_loss",
    "forward_backward",
    "is_planning",
    "min_micro_batch",
    "normalize_precision",
    "planning",
]

LossFn = Callable[[nn.Module, Any], torch.Tensor]
Precision = Literal["fp32", "bf16", "fp16"]

_PRECISIONS = {
    None: "fp32",
    "fp32": "fp32",
    "32": "fp32",
    "float32": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "16": "fp16",
    "float16": "fp16",
}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def normalize_precision(precision: str | None) -> Precision:
    """``None``/``"fp32"``/``"bf16"``/``"fp16"`` (and common spellings) to a canonical name."""
    key = precision.lower() if isinstance(precision, str) else precision
    if key not in _PRECISIONS:
        raise ValueError(f"Invalid precision {precision!r}: use 'fp32', 'bf16' or 'fp16'")
    return _PRECISIONS[key]  # type: ignore[return-value]


def autocast(device_type: str, precision: Precision) -> contextlib.AbstractContextManager[Any]:
    """The autocast context for ``precision`` (nothing for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=_DTYPES[precision])


def _output_loss(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor) and output.numel() == 1:
        return output.reshape(())
    if isinstance(output, Mapping) and "loss" in output:
        return output["loss"]
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    raise TypeError(
        f"The model's output ({type(output).__name__}) holds no loss: return a scalar, a dict with "
        "'loss', or an object with a .loss attribute, or pass loss_fn=lambda model, batch: ..."
    )


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The mean loss of ``batch`` when no ``loss_fn`` is given (see the module docstring).

    Raises:
        TypeError: the batch is neither a dict nor an ``(inputs, targets)`` pair, or the model's
            output holds no loss.
    """
    if isinstance(batch, (tuple, list)) and len(batch) == 2:  # checked first: a cheaper test than Mapping's
        inputs, targets = batch
        if not isinstance(targets, torch.Tensor):
            raise TypeError(
                f"Invalid targets of type {type(targets).__name__} in an (inputs, targets) batch: "
                "targets must be a tensor, or pass loss_fn=lambda model, batch: ..."
            )
        output = model(inputs)
        if not isinstance(output, torch.Tensor):
            output = getattr(output, "logits", output)
        if not isinstance(output, torch.Tensor):
            kind = f"a dict with keys {sorted(map(str, output))}" if isinstance(output, dict) else f"a {type(output).__name__}"
            raise TypeError(
                f"Invalid model output for the default loss: the model returned {kind}, not a tensor of predictions "
                "(nor an object with .logits); pass loss_fn=lambda model, batch: ... that picks the predictions, e.g. "
                "loss_fn=lambda m, b: F.cross_entropy(m(b[0])[0], b[1])"
            )
        if targets.dtype in (torch.bool,) or targets.is_floating_point() or targets.is_complex():
            if output.shape != targets.shape:
                raise TypeError(
                    f"Float targets of shape {tuple(targets.shape)} do not match the model output "
                    f"{tuple(output.shape)} for the default MSE loss: pass loss_fn=..."
                )
            return F.mse_loss(output, targets.to(output.dtype))
        if output.dim() == targets.dim() + 1 and output.shape[:-1] == targets.shape:
            if targets.dim() == 1:
                return F.cross_entropy(output, targets)
            return F.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))
        raise TypeError(
            f"Integer targets of shape {tuple(targets.shape)} need logits of shape "
            f"targets.shape + (classes,) for the default cross-entropy; the model returned "
            f"{tuple(output.shape)}: pass loss_fn=lambda model, batch: ..."
        )
    if isinstance(batch, Mapping):
        return _output_loss(model(**_taken(model, batch)))
    raise TypeError(
        f"No default loss for a batch of type {type(batch).__name__}: autotune knows dict batches "
        "(model(**batch) returning a loss) and (inputs, targets) pairs; pass "
        "loss_fn=lambda model, batch: ... returning the batch's mean loss"
    )


def _taken(model: nn.Module, batch: Mapping[str, Any]) -> Mapping[str, Any]:
    """The keywords of a dict batch the model takes: every tensor, and a value of another kind only where the model's
    ``forward`` names it (see the module docstring)."""
    if all(isinstance(v, torch.Tensor) for v in batch.values()):
        return batch
    named = _named_inputs(type(model))
    if named is None:
        return batch
    return {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) or k in named}


@functools.lru_cache(maxsize=64)
def _named_inputs(cls: type) -> frozenset[str] | None:
    """The parameters a module class's ``forward`` names (not those it would take through ``**kwargs``); None where it
    has no signature to read (every value is passed, as before)."""
    try:
        parameters = inspect.signature(cls.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    return frozenset(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def forward_backward(
    model: nn.Module,
    loss_fn: LossFn,
    batch: Any,
    *,
    weight: float = 1.0,
    device_type: str = "cpu",
    precision: Precision = "fp32",
    scaler: torch.amp.GradScaler | None = None,
) -> torch.Tensor:
    """One micro-step: forward under autocast, loss, ``backward(loss * weight)``.

    Returns:
        The unweighted loss, detached.
    """
    with autocast(device_type, precision):
        loss = loss_fn(model, batch)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            f"loss_fn returned {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            + ": it must return the batch's mean loss as a scalar tensor"
        )
    if not loss.requires_grad:
        raise ValueError(
            "Invalid loss: it does not require grad, so backward() has nothing to differentiate. Either no "
            "parameter it depends on is trainable (a frozen model: requires_grad=False), or loss_fn detaches it "
            "(.detach(), .item(), torch.no_grad() inside it); return a loss computed from the model's output"
        )
    weighted = loss * weight if weight != 1.0 else loss
    if scaler is not None:
        weighted = scaler.scale(weighted)
    weighted.backward()
    return loss.detach()


def batchnorms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The model's BatchNorm modules that keep running statistics (updated by every training forward)."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


# --- a step undone, and a step checked ------------------------------------------------------------


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


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in host memory to put back later; a tensor on the meta device (a model without
    weights, estimated only) has no data to keep, and its copy stays there."""
    return t.detach().clone() if t.is_meta else t.detach().to("cpu", copy=True)


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
            self.values = None if self.zero_lr else [_host_copy(p) for p in self.params]
            self.grads = [
                None if p.grad is None else (p.grad, _host_copy(p.grad))
                for p in self.params
            ]
            self.buffers = [(b, _host_copy(b)) for b in _unique(model.buffers())]
            self.state = {
                p: {k: self._save(v) for k, v in s.items()} for p, s in optimizer.state.items()
            }
        self.groups = [
            {k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups
        ]
        self.opt_called = optimizer.__dict__.get("_opt_called", _MISSING)
        self.training = [(m, m.training) for m in model.modules()]
        self.rng = RNGState(loader)
        self.names = {n for n, _ in model.named_modules()} | {n for n, _ in model.named_parameters()}
        self.grown: list[str] = []  # modules and parameters a trial's forward created (removed again by restore)

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
            return _SavedTensor(value, _host_copy(value))
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
        self._remove_grown()

    def _remove_grown(self) -> None:
        """Modules and parameters the model's forward created during the trial: noted in ``grown`` and
        taken off the model again (see :meth:`refuse_grown`)."""
        new = [n for n, _ in [*self.model.named_modules(), *self.model.named_parameters()] if n not in self.names]
        for name in sorted(new, key=len):  # a parent first: its children go with it
            parent_name, _, attribute = name.rpartition(".")
            if parent_name in self.names or not parent_name:
                parent = self.model.get_submodule(parent_name) if parent_name else self.model
                if hasattr(parent, attribute):
                    delattr(parent, attribute)
        self.grown = sorted(set(self.grown) | set(new))

    def refuse_grown(self) -> None:
        """Raise when a trial's forward created modules or parameters (taken off again already)."""
        if self.grown:
            top = [n for n in self.grown if not any(n.startswith(other + ".") for other in self.grown)]
            raise ValueError(
                f"Invalid model {type(self.model).__name__}: its forward created {', '.join(top[:5])} while it ran; made "
                "after the optimizer, they would never be trained (and each step would make them anew); create every "
                "layer in __init__ (or use torch.nn.LazyLinear and run one forward before building the optimizer). "
                "They were taken off again: nothing has changed"
            )


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


def check_step(model: nn.Module, loss_fn: LossFn, loader: Any, *, device: torch.device, precision: Precision) -> None:
    """Refuse a loader or a loss that cannot train, before training changes anything.

    Looks at the loader's first batch (its generators put back) and runs one forward and backward of
    the loss on a sample of it, between a :class:`Snapshot` and its restore: a malformed batch, a
    loss that is not a scalar tensor with a gradient, or an error in your code is raised here, with
    the model, its gradients, the RNGs and the loader exactly as they were.
    """
    rng = RNGState(loader)
    try:
        batches = iter(loader)
        batch = next(batches, _NONE)
        for index, later in enumerate(itertools.islice(batches, 7), start=1):  # the first batches have its keys
            B.check_like_first(batch, later, index)
    finally:
        rng.restore()
    if batch is _NONE:
        raise ValueError(
            "Invalid loader: it yielded no batches; check the dataset is not empty and, with drop_last=True, that it "
            "holds at least one full batch"
        )
    size, _ = B.checked_batch(batch, 0)
    sample = B.to_device(B.slice_batch(batch, 0, min(size, min_micro_batch(model))), device)
    params = [p for p in model.parameters() if p.requires_grad]
    snapshot = Snapshot(model, torch.optim.SGD(params, lr=0.0), loader)
    try:
        with planning():
            model.train()
            forward_backward(model, loss_fn, sample, device_type=device.type, precision=precision)
    except Exception as exc:
        exc.add_note(
            f"autotune: raised by the model or the loss in the check before training (one forward and backward on "
            f"{B.batch_size(sample)} sample(s) of the loader's first batch, per-sample shapes "
            f"{[tuple(t.shape[1:]) for t in B.tensors(sample)]}); nothing has changed"
        )
        raise
    finally:
        snapshot.restore()
    snapshot.refuse_grown()


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
