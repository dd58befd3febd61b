"""Lightning, planned: a callback that sets the batch size that fits and the accumulation that keeps
the effective batch.

Lightning's ``BatchSizeFinder`` (``Tuner.scale_batch_size``) searches the batch size with real steps
and leaves ``accumulate_grad_batches`` as it was, so the effective batch moves with it.
:class:`AutotuneCallback` plans once, when fitting starts, with your ``LightningModule``'s own
``training_step`` as the loss, its optimizer, its train dataloader and the trainer's precision, then
sets the batch size (the ``batch_size`` attribute Lightning's finder uses: the datamodule's, the
module's, or its ``hparams``) and ``trainer.accumulate_grad_batches`` so that
``batch size x accumulation x devices`` is the target, exactly::

    trainer = L.Trainer(callbacks=[autotune.integrations.lightning.AutotuneCallback(target_batch=256)])
    trainer.fit(module, datamodule=dm)

Everything it sets (the batch size on every holder, each to its own value, ``accumulate_grad_batches``,
and the learning rates when you ask for a rule) is put back when fitting ends for any reason: done,
an exception, Ctrl-C. ``callback.settings`` keeps what trained, in the launching process too (under
``ddp_spawn`` the first worker hands it back). While planning, ``training_step``'s ``self.log`` calls do
nothing, and ``self.trainer`` is the trainer.

Under several processes (``strategy="ddp"`` or ``"ddp_spawn"``) every rank plans on its own device, the
ranks share their largest micro-batches, and every rank sets the same equal split, derived from the
smallest: Lightning needs the same batch on every device, and ranks with different splits would wait
for each other for ever.

Refused before anything changes, with the fix: a second ``AutotuneCallback`` on one trainer, manual
optimization (Lightning ignores ``accumulate_grad_batches`` there), a loader passed to
``trainer.fit(train_dataloaders=...)`` (its batch size is fixed already); and, at the first batch, a
``train_dataloader()`` whose batches do not have the batch size it was given.

Exactness: Lightning divides each micro-batch's loss by ``accumulate_grad_batches``. With the equal
micro-batches set here that is exact for a loss that is the mean over the batch's samples; for a
token loss with padding each micro-batch weighs the same whatever its tokens, and an epoch's last step
of fewer batches is divided by the full accumulation too; the notes say by how much for your epoch.
Give ``count=`` (``count(batch) -> int``, the items your loss averages over, as for
:func:`autotune.fit`) and every step is the big batch's instead: each micro-batch's loss is weighted by
its items, and before the optimizer steps the gradients are divided by the step's items summed over
the devices (an epoch's short last step included)::

    AutotuneCallback(target_batch=256, count=lambda batch: int(batch["labels"].ne(-100).sum()))
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch

from autotune.batches import batch_size as size_of
from autotune.integrations.common import (
    TrainerSettings,
    equal_settings,
    missing,
    scale_gradients,
)
from autotune.planning.options import Probing, options
from autotune.planning.planner import plan_with
from autotune.step import normalize_precision

try:
    from lightning.pytorch import Callback
except ImportError:  # pragma: no cover - the extra; the class below then says how to install it
    Callback = object  # type: ignore[assignment,misc]

__all__ = ["AutotuneCallback"]

_PRECISIONS = {"32-true": "fp32", "32": "fp32", "64-true": "fp32", "64": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16",
               "bf16": "bf16", "16": "fp16"}


class AutotuneCallback(Callback):  # type: ignore[misc,valid-type]
    """Plan when fitting starts; set the batch size and ``accumulate_grad_batches``; put them back at the end.

    Args:
        target_batch: samples per optimizer step over all devices (default: what the trainer would
            train now: the batch size x ``accumulate_grad_batches`` x devices).
        memory_limit: as for :func:`autotune.plan` (default: what the device has).
        headroom: as for :func:`autotune.plan`.
        lr_rule: ``"none"`` (default: learning rates left as they are, and a note says so), or
            ``"auto"``, ``"sqrt"``, ``"linear"``: every param group's learning rate (and its
            schedulers' base rates) scaled to the target, put back at the end.
        base_batch: the effective batch the learning rate was tuned at (default: what the trainer
            would train now).
        batch_arg_name: the attribute that holds the batch size (Lightning's convention: on the
            datamodule, the module or its ``hparams``).
        count: ``count(batch) -> int``, the items ``training_step``'s loss is the mean over (tokens
            that are not padding); each step is then weighted by items, exactly the big batch's.
            Default: samples (exact for a mean over samples).

    Attributes:
        settings: what trained (:class:`autotune.integrations.common.TrainerSettings`), after
            fitting started.

    Raises:
        TypeError / ValueError: a bad ``target_batch``, ``base_batch``, ``memory_limit``, ``headroom`` or
            ``lr_rule``, refused when the callback is made, with the message ``autotune.plan`` gives.
    """

    def __init__(self, target_batch: int | None = None, *, memory_limit: int | str | None = None, headroom: float | None = None,
                 lr_rule: str = "none", base_batch: int | None = None, batch_arg_name: str = "batch_size",
                 count: Callable[[Any], int] | None = None) -> None:
        if Callback is object:
            raise missing("lightning", "lightning")
        self._options = options(target_batch=target_batch, memory_limit=memory_limit, headroom=headroom, lr_rule=lr_rule,
                                base_batch=base_batch, progress=False)  # refused here, before any trainer exists
        super().__init__()
        self.target_batch, self.memory_limit, self.headroom = target_batch, memory_limit, headroom
        self.lr_rule, self.base_batch, self.batch_arg_name = lr_rule, base_batch, batch_arg_name
        if count is not None and not callable(count):
            raise TypeError(f"Invalid count {count!r}: give a function count(batch) -> int, the items the loss averages over")
        self.count = count
        self._items = 0.0  # the step's items so far on this device (with count=)
        self._settings: TrainerSettings | None = None
        self._undo: list[Any] = []
        self._expect: int | None = None  # the first batch's size, checked once
        # Under ddp_spawn the workers get a copy of this callback: the first hands its settings back here.
        self._home, self._handoff = os.getpid(), os.path.join(tempfile.gettempdir(), f"autotune-settings-{uuid.uuid4().hex}.json")

    @property
    def settings(self) -> TrainerSettings | None:
        """What trained (None before fitting started)."""
        if self._settings is None and os.getpid() == self._home and os.path.exists(self._handoff):
            with open(self._handoff) as f:
                self._settings = TrainerSettings.from_dict(json.load(f))
            os.remove(self._handoff)
        return self._settings

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Plan, then set the batch size and the accumulation (before the train dataloader is made)."""
        source = self._refuse(trainer, pl_module)
        holders = _holders(pl_module, self.batch_arg_name)
        batch_size = int(cast(Any, _get(holders[-1], self.batch_arg_name)))  # the last holder is the one Lightning reads
        world = max(1, int(trainer.world_size))
        described = batch_size * int(trainer.accumulate_grad_batches) * world
        target = self.target_batch or described
        optimizer = trainer.optimizers[0]
        with _planning(pl_module, trainer):
            loader = source.train_dataloader()
            shared = dataclasses.replace(self._options, target_batch=target, base_batch=self.base_batch or described,
                                         precision=normalize_precision(_PRECISIONS.get(str(trainer.precision), "fp32")))
            plan = plan_with(pl_module, loader, shared, Probing(), optimizer=optimizer, loss_fn=_training_step, device=pl_module.device)
        if self.count is None:
            exactness = ("Lightning divides each micro-batch's loss by accumulate_grad_batches: exact for these equal micro-batches "
                         "of a loss that is the mean over samples, not for token losses with padding, nor for an epoch's shorter last "
                         "step; pass count= to weight each micro-batch by its items")
        else:
            exactness = ("exact for a loss that is the mean over the items count(batch) counts: each micro-batch's loss is weighted "
                         "by its items, and the gradients divided by the step's items summed over the devices before the optimizer "
                         "steps, for any split, an epoch's short last step included")
        settings = equal_settings(plan, lr_rule=self.lr_rule, learning_rate=optimizer.param_groups[0]["lr"], warmup=False,
                                  exactness=exactness)
        tail = _epoch_tail(loader, settings, trainer)
        if tail:
            settings = dataclasses.replace(settings, notes=(*settings.notes, tail))
        self._settings = settings
        accumulate = trainer.accumulate_grad_batches
        own = [(holder, _get(holder, self.batch_arg_name)) for holder in holders]
        for holder, _ in own:
            _set(holder, self.batch_arg_name, settings.micro_batch)
        trainer.accumulate_grad_batches = settings.accumulation_steps

        def undo() -> None:
            for holder, value in own:
                _set(holder, self.batch_arg_name, value)
            trainer.accumulate_grad_batches = accumulate

        self._undo = [undo]
        if self.count is not None:
            self._weigh_by_items(pl_module, settings.accumulation_steps)
        if settings.learning_rate is not None:
            self._scale_learning_rates(trainer, optimizer, plan.lr_scale)
        self._expect = settings.micro_batch
        if trainer.global_rank == 0 and os.getpid() != self._home:
            with open(self._handoff, "w") as f:
                json.dump(settings.to_dict(), f)

    def _refuse(self, trainer: Any, pl_module: Any) -> Any:
        """What cannot be planned, refused before anything changes; the object whose train_dataloader() trains."""
        mine = [c for c in trainer.callbacks if isinstance(c, AutotuneCallback)]
        if len(mine) > 1:
            raise ValueError(
                f"Invalid callbacks: {len(mine)} AutotuneCallbacks on one Trainer; each would plan over the batch size the other "
                "set, and put back the other's values; keep one"
            )
        if not pl_module.automatic_optimization:
            raise ValueError(
                f"Invalid {type(pl_module).__name__}: automatic_optimization is False, and Lightning ignores "
                "accumulate_grad_batches under manual optimization; plan with autotune.plan(...) and step every "
                "plan.accumulation_steps batches yourself, weighting each loss with autotune.accumulate, or drop AutotuneCallback"
            )
        data = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)
        if data is not None and data.instance is not None and not data.is_module():
            raise ValueError(
                f"Invalid train_dataloaders={type(data.instance).__name__}: a loader passed to trainer.fit() has its batch size "
                f"fixed already, so AutotuneCallback cannot set it; define train_dataloader() on your LightningModule or "
                f"DataModule, building the DataLoader with batch_size=self.{self.batch_arg_name}"
            )
        if not _holders(pl_module, self.batch_arg_name):
            raise ValueError(
                f"Invalid batch_arg_name {self.batch_arg_name!r}: neither the datamodule, the module nor its hparams has it; "
                "give your DataModule (or module) a batch_size attribute that its train_dataloader() uses"
            )
        source = trainer.datamodule if trainer.datamodule is not None else pl_module
        if not callable(getattr(source, "train_dataloader", None)):
            raise ValueError("Invalid fit: AutotuneCallback needs a train_dataloader() on the datamodule or the module, whose batch size it can set")
        return source

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """The first batch has the batch size set (else a loader that ignores it would train other steps)."""
        if self._expect is None:
            return
        expect, self._expect = self._expect, None
        got = size_of(batch)
        if got != expect:
            raise ValueError(
                f"Invalid train_dataloader(): its first batch has {got} samples, but AutotuneCallback set "
                f"{self.batch_arg_name}={expect} so that each step trains {self._settings.effective_batch if self._settings else '?'}; "
                f"build the DataLoader with batch_size=self.{self.batch_arg_name} (read when train_dataloader() is called), "
                "or drop AutotuneCallback"
            )

    def _weigh_by_items(self, pl_module: Any, accumulation: int) -> None:
        """``training_step``'s loss times its batch's items (times the accumulation Lightning divides by):
        the micro-batch's sum, which :meth:`on_before_optimizer_step` divides by the step's items."""
        count, own = cast(Callable[[Any], int], self.count), pl_module.__dict__.get("training_step")
        step = pl_module.training_step

        def training_step(batch: Any, *args: Any, **kwargs: Any) -> Any:
            out = step(batch, *args, **kwargs)
            items = int(count(batch))
            self._items += items
            weight = items * accumulation
            if isinstance(out, dict):
                return {**out, "loss": out["loss"] * weight}
            return out * weight

        pl_module.training_step = training_step
        self._items = 0.0

        def undo() -> None:
            if own is None:
                pl_module.__dict__.pop("training_step", None)
            else:
                pl_module.training_step = own

        self._undo.append(undo)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """With ``count=``: the accumulated sums divided by the step's items over all devices (times the
        devices, which DDP averaged over)."""
        if self.count is None or not self._undo:
            return
        items = torch.tensor(self._items, dtype=torch.float64, device=pl_module.device)
        world = max(1, int(trainer.world_size))
        if world > 1:
            items = trainer.strategy.reduce(items, reduce_op="sum")
        self._items = 0.0
        scale_gradients(optimizer, world / max(float(items), 1.0))

    def _scale_learning_rates(self, trainer: Any, optimizer: torch.optim.Optimizer, scale: float) -> None:
        groups = [(g, g["lr"], g.get("initial_lr")) for g in optimizer.param_groups]
        schedulers = [(c.scheduler, list(c.scheduler.base_lrs)) for c in trainer.lr_scheduler_configs if hasattr(c.scheduler, "base_lrs")]
        for g, lr, initial in groups:
            g["lr"] = lr * scale
            if initial is not None:
                g["initial_lr"] = initial * scale
        for scheduler, base in schedulers:
            scheduler.base_lrs = [b * scale for b in base]

        def undo() -> None:
            for g, lr, initial in groups:
                g["lr"] = lr
                if initial is not None:
                    g["initial_lr"] = initial
            for scheduler, base in schedulers:
                scheduler.base_lrs = base

        self._undo.append(undo)

    def _put_back(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        self._expect = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Put back what :meth:`on_fit_start` set when fitting stops on an error or Ctrl-C."""
        self._put_back()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Put back what :meth:`on_fit_start` set."""
        if stage == "fit":
            self._put_back()


def _holders(pl_module: Any, name: str) -> list[Any]:
    """The objects (or hparams dicts) that hold the batch size, in Lightning's order (the last is read)."""
    from lightning.pytorch.utilities.parsing import _lightning_get_all_attr_holders

    return list(_lightning_get_all_attr_holders(pl_module, name))


def _get(holder: Any, name: str) -> Any:
    return holder[name] if isinstance(holder, dict) else getattr(holder, name)


def _set(holder: Any, name: str, value: Any) -> None:
    if isinstance(holder, dict):
        holder[name] = value
    else:
        setattr(holder, name, value)


def _epoch_tail(loader: Any, settings: TrainerSettings, trainer: Any) -> str | None:
    """How Lightning weighs an epoch's last step, when it is not a full one, in numbers."""
    try:
        samples = len(loader.dataset)
    except (AttributeError, TypeError):
        return None
    world, m, k = settings.world_size, settings.micro_batch, settings.accumulation_steps
    per_rank = math.ceil(samples / world)  # Lightning's DistributedSampler pads the ranks to the same count
    batches = per_rank // m if getattr(loader, "drop_last", False) else math.ceil(per_rank / m)
    full_steps, left = divmod(batches, k)
    short = (per_rank % m) if not getattr(loader, "drop_last", False) else 0
    if left == 0 and not short:
        return None
    if left == 0:
        return (f"the epoch's last step has a short micro-batch of {short} samples per device that Lightning weighs as a full "
                f"one of {m} (1/{k} of the step): give the epoch a multiple of {m * k * world} samples, or drop_last=True")
    tail = (left - 1) * m + (short or m)
    # The loader's drop_last drops a short micro-batch, never a short step: it cannot help here.
    return (f"each epoch ends with a step of {tail * world} samples ({left} of {k} micro-batches per device) that Lightning still "
            f"divides by {k}: its gradient is {left}/{k} = {left / k:.3g} of their mean; give the epoch a multiple of "
            f"{m * k * world} samples")


def _training_step(model: Any, batch: Any) -> torch.Tensor:
    """The LightningModule's own training_step as the loss (its output, or the output's "loss")."""
    out = model.training_step(batch, 0)
    return out["loss"] if isinstance(out, dict) else out


class _Shared:
    """The trainer as ``self.trainer`` while planning: every attribute is the trainer's, and the plan's
    fake copy of the module shares it instead of copying it."""

    def __init__(self, trainer: Any) -> None:
        object.__setattr__(self, "_trainer", trainer)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_trainer"), name)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Shared:
        return self


@contextlib.contextmanager
def _planning(pl_module: Any, trainer: Any) -> Iterator[None]:
    """While planning: ``self.log`` and ``self.log_dict`` do nothing, and ``self.trainer`` is the
    trainer, shared by the plan's copies; all put back after."""
    saved = {name: pl_module.__dict__[name] for name in ("log", "log_dict") if name in pl_module.__dict__}
    own = pl_module.__dict__.get("_trainer")
    pl_module.log = lambda *args, **kwargs: None
    pl_module.log_dict = lambda *args, **kwargs: None
    pl_module.__dict__["_trainer"] = _Shared(trainer)
    try:
        yield
    finally:
        for name in ("log", "log_dict"):
            if name in saved:
                pl_module.__dict__[name] = saved[name]
            else:
                pl_module.__dict__.pop(name, None)
        pl_module.__dict__["_trainer"] = own
