"""Accelerate, planned: the micro-batch for your DataLoader and the accumulation for your Accelerator.

Accelerate's ``find_executable_batch_size`` retries a function with a smaller batch after each
out-of-memory error and knows nothing of accumulation. :func:`plan_accumulation` plans once, with
your model, optimizer, loss and a loader of your batches, and returns the per-device micro-batch and
``gradient_accumulation_steps`` that reach the target exactly; with ``apply=True`` (the default) it
also sets ``accelerator.gradient_accumulation_steps``. Your script then builds its DataLoader with
``settings.micro_batch`` and trains with ``accelerator.accumulate(model)``::

    settings = autotune.integrations.accelerate.plan_accumulation(
        accelerator, model, DataLoader(dataset, batch_size=32), target_batch=256, optimizer=optimizer,
    )
    loader = DataLoader(dataset, batch_size=settings.micro_batch, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model, batch))
            optimizer.step()
            optimizer.zero_grad()

Plan before ``accelerator.prepare``: the model then still holds its own parameters (not a DDP
wrapper's), on the device you move it to. Exactness: ``accelerator.backward`` divides each
micro-batch's loss by the accumulation steps, exact for these equal micro-batches of a loss that is
the mean over samples, not for token losses with padding, and at an epoch's end Accelerate steps on
what is left, still divided by the full accumulation. :class:`ItemWeights` makes every step the big
batch's for a loss that is the mean over items (tokens), the short last one included: one factor on
each micro-batch's loss, and the step's items summed over the processes before the optimizer steps::

    weigh = ItemWeights(accelerator, optimizer, count=lambda batch: int(batch["labels"].ne(-100).sum()))
    ...
            accelerator.backward(weigh(batch) * loss_fn(model, batch))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from autotune.checks import check_flag
from autotune.integrations.common import (
    TrainerSettings,
    equal_settings,
    missing,
    scale_gradients,
)
from autotune.planning.options import Probing, check_target, options
from autotune.planning.planner import plan_with
from autotune.step import LossFn, normalize_precision

__all__ = ["ItemWeights", "plan_accumulation"]


def plan_accumulation(
    accelerator: Any,
    model: torch.nn.Module,
    loader: Iterable[Any],
    *,
    target_batch: int,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: LossFn | None = None,
    memory_limit: int | str | None = None,
    headroom: float | None = None,
    lr_rule: str = "none",
    base_batch: int | None = None,
    apply: bool = True,
) -> TrainerSettings:
    """The micro-batch and the accumulation steps for an Accelerate script, planned on its device.

    Args:
        accelerator: the ``accelerate.Accelerator`` the script trains with (its device, mixed
            precision and number of processes are read).
        model: the model, not yet prepared, on the accelerator's device.
        loader: a re-iterable of batches of your data (any batch size: it is looked at, not trained on).
        target_batch: samples per optimizer step over all processes.
        optimizer: the optimizer (default: AdamW at 1e-3); its learning rate is read, never changed.
        loss_fn: ``loss_fn(model, batch) -> scalar`` (default: see :func:`autotune.step.default_loss`).
        memory_limit: as for :func:`autotune.plan` (default: what the device has).
        headroom: as for :func:`autotune.plan`.
        lr_rule: ``"none"`` (default), or a rule whose scaled learning rate ``settings.learning_rate``
            gives you (set it yourself: Accelerate has no learning rate of its own).
        base_batch: the batch the learning rate was tuned at (default: the loader's).
        apply: set ``accelerator.gradient_accumulation_steps`` to the plan's.

    Returns:
        :class:`autotune.integrations.common.TrainerSettings`.
    """
    shared = options(target_batch=check_target(target_batch), memory_limit=memory_limit, headroom=headroom, lr_rule=lr_rule,
                     base_batch=base_batch, progress=False)
    check_flag("apply", apply)
    try:
        from accelerate import Accelerator
    except ImportError:  # pragma: no cover - the extra
        raise missing("accelerate", "accelerate") from None
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"Invalid accelerator of type {type(accelerator).__name__}: pass the accelerate.Accelerator of the script")
    precision = {"bf16": "bf16", "fp16": "fp16"}.get(str(getattr(accelerator, "mixed_precision", "no")), "fp32")
    plan = plan_with(model, loader, dataclasses.replace(shared, precision=normalize_precision(precision)), Probing(),
                     optimizer=optimizer, loss_fn=loss_fn, device=accelerator.device)
    lr = (optimizer.param_groups[0]["lr"] if optimizer is not None else 1e-3)
    exactness = ("accelerator.backward divides each micro-batch's loss by the accumulation steps: exact for these equal "
                 "micro-batches of a loss that is the mean over samples, not for token losses with padding, nor for an epoch's "
                 "shorter last step; ItemWeights weights each micro-batch by its items")
    settings = equal_settings(plan, lr_rule=lr_rule, learning_rate=lr, warmup=False, exactness=exactness)
    if optimizer is None:  # its state is part of the memory planned, and its learning rate of any scaling
        settings = dataclasses.replace(settings, notes=(*settings.notes, (
            "no optimizer= given: planned with AdamW(lr=1e-3), its state and learning rate; pass the script's optimizer "
            "for its own")))
    if apply:
        accelerator.gradient_accumulation_steps = settings.accumulation_steps
    return settings


class ItemWeights:
    """Each micro-batch weighted by its items under Accelerate's accumulation: every optimizer step the
    big batch's for a loss that is the mean over items (tokens that are not padding), for any split and
    at an epoch's short last step, on any number of processes.

    ``weigh(batch)`` is the factor for that micro-batch's loss (its items times the accumulation steps
    ``accelerator.backward`` divides by), so the accumulated gradient is the sum over the step's items;
    just before the optimizer steps (a step pre-hook on it), the gradients are divided by the step's
    items summed over the processes (times the processes, which DDP averaged over)::

        weigh = ItemWeights(accelerator, optimizer, count=lambda batch: int(batch["labels"].ne(-100).sum()))
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(weigh(batch) * loss_fn(model, batch))
                optimizer.step()
                optimizer.zero_grad()

    Args:
        accelerator: the script's ``accelerate.Accelerator``.
        optimizer: the optimizer (before or after ``accelerator.prepare``).
        count: ``count(batch) -> int``, the items the loss is the mean over.

    Raises:
        TypeError: ``count`` is not callable.
    """

    def __init__(self, accelerator: Any, optimizer: torch.optim.Optimizer, count: Any) -> None:
        if not callable(count):
            raise TypeError(f"Invalid count {count!r}: give a function count(batch) -> int, the items the loss averages over")
        self.accelerator, self.count = accelerator, count
        self._items = 0
        inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper steps the optimizer it holds
        self._hook = inner.register_step_pre_hook(self._divide)

    def __call__(self, batch: Any) -> float:
        """The factor for this micro-batch's loss (and its items counted for the step)."""
        items = int(self.count(batch))
        self._items += items
        return float(items * self.accelerator.gradient_accumulation_steps)

    def _divide(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        items = torch.tensor(float(self._items), dtype=torch.float64, device=self.accelerator.device)
        processes = int(self.accelerator.num_processes)
        if processes > 1:
            items = self.accelerator.reduce(items, reduction="sum")
        self._items = 0
        scale_gradients(optimizer, processes / max(float(items), 1.0))

    def remove(self) -> None:
        """Take the step pre-hook off the optimizer."""
        self._hook.remove()
