"""Checks of what users pass in, made before anything changes.

Each check raises ``TypeError`` or ``ValueError`` naming the value and the fix, before the first
trial or optimizer step, so that a mistake never costs a model, an optimizer state or a sample of
the epoch.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "check_callable",
    "check_count_value",
    "check_count_values",
    "check_device_exists",
    "check_flag",
    "check_grad_mode",
    "check_loader",
    "check_model",
    "check_optimizer",
    "check_positive_int",
    "check_positive_number",
    "check_reiterable",
    "check_scheduler",
    "check_trainable",
    "is_one_shot",
    "resolve_device",
]


def check_device_exists(device: torch.device | str | None) -> None:
    """Refuse a device this machine lacks, or one autotune cannot measure (torch would fail deep inside)."""
    if device is None:
        return
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"Invalid device {device!r}: use 'cpu', 'cuda' or 'cuda:N'") from None
    if d.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ValueError(
                f"Invalid device {str(d)!r}: this machine has no Apple GPU (torch.backends.mps.is_available() is False); "
                "train on device='cpu' or 'cuda'"
            )
    elif d.type not in ("cpu", "cuda", "meta"):
        raise ValueError(
            f"Invalid device {str(d)!r}: autotune measures memory on 'cpu', 'cuda' (and 'mps' where there is one); "
            "train on one of those"
        )
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"Invalid device {str(d)!r}: this machine has no CUDA device (torch.cuda.is_available() is "
                "False); train on device='cpu', or plan for a GPU you do not have with "
                "autotune.plan(..., device='cuda', memory_limit='80GiB', verify=False)"
            )
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ValueError(
                f"Invalid device {str(d)!r}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}"
            )


def check_grad_mode(what: str) -> None:
    """Refuse to train under ``torch.no_grad()`` or ``torch.inference_mode()``."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"autotune.{what} was called under torch.inference_mode(): training needs gradients; "
            f"call autotune.{what} outside the inference_mode() block"
        )
    if not torch.is_grad_enabled():
        raise RuntimeError(
            f"autotune.{what} was called under torch.no_grad() (gradients are disabled): training needs "
            f"them; call autotune.{what} outside the no_grad() block, or torch.set_grad_enabled(True)"
        )


def check_trainable(model: nn.Module, *, estimate: bool = False) -> None:
    """The model is a module with parameters, initialised, with data, and at least one trainable.
    ``estimate``: for an estimate only, which needs shapes and dtypes, not data: parameters and buffers
    on the meta device are welcome."""
    check_model(model)
    params = list(model.parameters())
    lazy = [name for name, p in model.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise ValueError(
            f"Invalid model {type(model).__name__}: its parameters {', '.join(lazy[:3])}"
            f"{' ...' if len(lazy) > 3 else ''} are not initialised yet (a lazy module such as LazyLinear); "
            "run one forward pass on a batch first (model(x)), then create the optimizer and call autotune"
        )
    if not params:
        raise ValueError(
            f"Invalid model {type(model).__name__}: it has no parameters, so there is nothing to "
            "train; pass the module that owns the trainable weights"
        )
    if not any(p.requires_grad for p in params):
        raise ValueError(
            f"Invalid model {type(model).__name__}: all its {len(params)} parameters are frozen "
            "(requires_grad=False), so the loss has no gradient; unfreeze the ones to train "
            "(p.requires_grad_(True))"
        )
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta and not estimate:
        raise ValueError(
            f"Invalid model {type(model).__name__}: its parameters {', '.join(meta[:3])}{' ...' if len(meta) > 3 else ''} "
            "are on the meta device, without data: nothing can train them or measure their memory on a device; "
            "estimate without weights (autotune.plan(..., device='cuda', verify=False, memory_limit='80GiB'), "
            "autotune.what_if), or materialise the model first (model.to_empty(device='cpu') and initialise it, or "
            "load its weights)"
        )


def check_model(model: Any) -> None:
    """``model`` is a ``torch.nn.Module``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"Invalid model of type {type(model).__name__}: pass the torch.nn.Module to train")


def check_loader(loader: Any) -> None:
    """``loader`` is an iterable of batches (not None, and not a DataLoader that yields single samples)."""
    if loader is None or isinstance(loader, (str, bytes)) or not isinstance(loader, Iterable):
        raise TypeError(
            f"Invalid loader of type {type(loader).__name__}: pass an iterable of batches, such as a "
            "torch.utils.data.DataLoader or a list of (inputs, targets) pairs"
        )
    if getattr(loader, "batch_size", 0) is None and getattr(loader, "batch_sampler", None) is None and hasattr(loader, "dataset"):
        raise ValueError(
            "Invalid loader: DataLoader(batch_size=None) yields single samples, without a batch dimension; give it a "
            "batch_size (e.g. DataLoader(dataset, batch_size=32)): autotune re-batches them into micro-batches"
        )


def check_callable(name: str, value: Any, call: str) -> None:
    """``value`` is None or callable; ``call`` shows how it is called, for the message."""
    if value is not None and not callable(value):
        raise TypeError(f"Invalid {name} {value!r} ({type(value).__name__}): pass a function {call}, or None")


def check_flag(name: str, value: Any) -> None:
    """``value`` is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"Invalid {name} {value!r} ({type(value).__name__}): give True or False")


def check_progress(value: Any, *, seconds: bool = False) -> None:
    """``value`` is a bool; with ``seconds``, also a number of seconds >= 0 (after how long to show it)."""
    if isinstance(value, bool):
        return
    if seconds and isinstance(value, numbers.Real) and math.isfinite(value) and float(value) >= 0:
        return
    more = ", or after how many seconds to show it (a number >= 0)" if seconds else ""
    raise TypeError(f"Invalid progress {value!r} ({type(value).__name__}): give True or False{more}")


def check_optimizer(model: nn.Module, optimizer: Any) -> None:
    """The optimizer is a torch optimizer over (some of) the model's trainable parameters."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"Invalid optimizer of type {type(optimizer).__name__}: pass a torch.optim.Optimizer built on "
            "the model's parameters, e.g. torch.optim.AdamW(model.parameters(), lr=1e-3)"
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise TypeError(
            "Invalid optimizer LBFGS: its step needs a closure that re-evaluates the loss on the whole batch, several "
            "times a step, which accumulated micro-batches cannot give; use a first-order optimizer (SGD, AdamW), or "
            "train LBFGS on batches that fit without autotune"
        )
    own = {id(p) for p in model.parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    foreign = [p for p in params if id(p) not in own]
    if foreign:
        raise ValueError(
            f"Invalid optimizer {type(optimizer).__name__}: {len(foreign)} of its {len(params)} parameters "
            "are not the model's (an optimizer built for another model, or for a copy of this one); "
            "build it from this model: optimizer = type(optimizer)(model.parameters(), ...)"
        )
    if not any(p.requires_grad for p in params):
        raise ValueError(
            f"Invalid optimizer {type(optimizer).__name__}: none of its parameters is trainable "
            "(requires_grad=False), so its steps would change nothing; give it the trainable ones"
        )


def check_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """An LR scheduler of ``optimizer``, stepped once per optimizer step without arguments."""
    if scheduler is None:
        return
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    if isinstance(scheduler, ReduceLROnPlateau):
        raise TypeError(
            "Invalid scheduler ReduceLROnPlateau: it needs a metric at every step, which fit cannot know; "
            "step it yourself between calls, e.g. for each epoch: autotune.fit(..., epochs=1, plan=plan); "
            "scheduler.step(val_loss). autotune scales the LR it sets, exactly"
        )
    if not (isinstance(scheduler, LRScheduler) or (callable(getattr(scheduler, "step", None)) and hasattr(scheduler, "optimizer"))):
        raise TypeError(
            f"Invalid scheduler of type {type(scheduler).__name__}: pass a torch.optim.lr_scheduler "
            "scheduler (e.g. LambdaLR, OneCycleLR) built on the same optimizer, or None"
        )
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError(
            f"Invalid scheduler {type(scheduler).__name__}: it was built on another optimizer than the one "
            "fit steps, so it would never change the learning rate used; build it on this optimizer"
        )


def check_positive_int(name: str, value: Any, what: str, *, optional: bool = False) -> Any:
    """``value`` is a whole number >= 1 (not a bool), saying ``what`` it counts; with ``optional``, None
    (the default) passes too, and 0 does not stand for it."""
    if value is None and optional:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        tail = ", or leave it out for the default" if optional else ""
        raise ValueError(f"Invalid {name} {value!r}: give a positive int ({what}){tail}")
    return value


def check_positive_number(name: str, value: Any) -> None:
    """``value`` is None or a real number > 0 (not a bool, not a string)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"Invalid {name} {value!r} ({type(value).__name__}): give a positive number, e.g. {name}=1.0, or None")
    if not float(value) > 0:
        raise ValueError(f"Invalid {name} {value!r}: give a positive number, or None")


def is_one_shot(loader: Any) -> bool:
    """Whether ``loader`` is an iterator (a generator, ``iter(...)``): one pass and it is empty.

    Decided without calling ``iter(loader)``, which on a DataLoader would draw its shuffling seed. A
    DataLoader is re-iterable whatever else its class defines (Ray Train's prepared loader also has
    ``__next__``).
    """
    return isinstance(loader, Iterator) and not isinstance(loader, torch.utils.data.DataLoader)


def check_reiterable(loader: Iterable[Any], epochs: int) -> None:
    """A one-shot iterator can be trained on for one epoch only."""
    if epochs > 1 and is_one_shot(loader):
        raise TypeError(
            f"Invalid loader of type {type(loader).__name__} for epochs={epochs}: it is a one-shot "
            "iterator, so every epoch after the first would be empty; pass a re-iterable such as a "
            "DataLoader or a list of batches"
        )


def check_count_values(values: list[Any]) -> list[int]:
    """:func:`check_count_value` of each of a window's counts, the tensors among them read from their device at once
    (one stacked read a device: on a GPU each read waits for its queue, and one a micro-batch would stall it)."""
    tensors: dict[torch.device, list[int]] = {}
    for i, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            _check_count_tensor(value)
            tensors.setdefault(value.device, []).append(i)
    values = list(values)
    for at in tensors.values():
        for i, read in zip(at, torch.stack([values[i].reshape(()).to(torch.int64) for i in at]).tolist()):
            values[i] = read
    return [check_count_value(v) for v in values]


def _check_count_tensor(value: torch.Tensor) -> None:
    if value.numel() != 1 or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise ValueError(f"Invalid item count {value!r} ({type(value).__name__}) from count(batch): a tensor count must be "
                         "a single integer, e.g. int((labels != -100).sum())")


def check_count_value(value: Any) -> int:
    """An item count returned by ``count(batch)``: a whole number >= 0 (int or 0-d integer tensor)."""
    bad = f"Invalid item count {value!r} ({type(value).__name__}) from count(batch): "
    if isinstance(value, torch.Tensor):
        _check_count_tensor(value)
        value = int(value.item())
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(bad + "count must return a whole number >= 0, e.g. int((labels != -100).sum())")
    elif isinstance(value, numbers.Integral):
        value = operator.index(value)
    elif not math.isfinite(float(value)) or float(value) != math.floor(float(value)):
        raise ValueError(bad + "count must return a whole number of loss items")
    else:
        value = math.floor(float(value))
    if value < 0:
        raise ValueError(bad + "a count cannot be negative")
    return value


def resolve_device(model: nn.Module, device: torch.device | str | None, *, estimate: bool = False) -> torch.device:
    """The device to plan on: ``device``, or the model's; an error when the model is elsewhere.
    ``estimate``: nothing runs on the device (any model is welcome, on the meta device too), ``device`` given."""
    check_trainable(model, estimate=estimate)
    if estimate:
        return torch.device(device)  # type: ignore[arg-type]
    check_device_exists(device)
    model_device = _without_cpu_index(next(model.parameters()).device)
    if device is None:
        resolved = model_device
    else:
        # torchrun and the trainers name a rank's CPU 'cpu:0', 'cpu:1', ...: one memory, no index to match
        resolved = _without_cpu_index(torch.device(device))
        if resolved.type == "cuda" and resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
    if resolved.type == "cuda" and model_device.type == "cuda" and model_device.index is None:
        model_device = torch.device("cuda", torch.cuda.current_device())
    if model_device != resolved:
        raise ValueError(
            f"Invalid device {str(resolved)!r}: the model's parameters are on {str(model_device)!r}; "
            f"move the model first (model.to({str(resolved)!r})) or leave device=None"
        )
    return resolved


def _without_cpu_index(device: torch.device) -> torch.device:
    """'cpu:N' as 'cpu': CPU tensors carry no index, so a rank's 'cpu:1' is the model's 'cpu'."""
    return torch.device("cpu") if device.type == "cpu" else device
