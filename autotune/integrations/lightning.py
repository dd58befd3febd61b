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

Everything it sets (the batch size, ``accumulate_grad_batches``, and the learning rates when you ask for a
rule) is put back when fitting ends, as the finder restores what it touched; ``callback.settings``
keeps what trained. While planning, ``training_step``'s ``self.log`` calls do nothing and the module is
detached from the trainer (put back after).

Exactness: Lightning divides each micro-batch's loss by ``accumulate_grad_batches``. With the equal
micro-batches set here that is exact for a loss that is the mean over the batch's samples; for a
token loss with padding each micro-batch weighs the same whatever its tokens, and an epoch's last step
of fewer batches is divided by the full accumulation too; a note says so: ``autotune.accumulate``
(your own loop) or ``autotune.fit`` weight each by its items.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import torch

from ..planner import plan as make_plan
from .common import TrainerSettings, equal_settings, missing

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

    Attributes:
        settings: what trained (:class:`autotune.integrations.common.TrainerSettings`), after
            fitting started.
    """

    def __init__(self, target_batch: int | None = None, *, memory_limit: int | str | None = None, headroom: float | None = None,
                 lr_rule: str = "none", base_batch: int | None = None, batch_arg_name: str = "batch_size") -> None:
        if Callback is object:
            raise missing("lightning", "lightning")
        super().__init__()
        self.target_batch, self.memory_limit, self.headroom = target_batch, memory_limit, headroom
        self.lr_rule, self.base_batch, self.batch_arg_name = lr_rule, base_batch, batch_arg_name
        self.settings: TrainerSettings | None = None
        self._undo: list[Any] = []

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Plan, then set the batch size and the accumulation (before the train dataloader is made)."""
        from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr

        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise ValueError(
                f"Invalid batch_arg_name {self.batch_arg_name!r}: neither the datamodule, the module nor its hparams has it; "
                "give your DataModule (or module) a batch_size attribute that its train_dataloader() uses"
            )
        source = trainer.datamodule if trainer.datamodule is not None else pl_module
        if not callable(getattr(source, "train_dataloader", None)):
            raise ValueError("Invalid fit: AutotuneCallback needs a train_dataloader() on the datamodule or the module, whose batch size it can set")
        batch_size = int(cast(Any, lightning_getattr(pl_module, self.batch_arg_name)))
        world = max(1, int(trainer.world_size))
        described = batch_size * int(trainer.accumulate_grad_batches) * world
        target = self.target_batch or described
        optimizer = trainer.optimizers[0]
        with _planning(pl_module):
            plan = make_plan(
                pl_module, source.train_dataloader(), target_batch=target, optimizer=optimizer, loss_fn=_training_step,
                device=pl_module.device, memory_limit=self.memory_limit, headroom=self.headroom, lr_rule=self.lr_rule,
                base_batch=self.base_batch or described, precision=_PRECISIONS.get(str(trainer.precision), "fp32"), progress=False,
            )
        exactness = ("Lightning divides each micro-batch's loss by accumulate_grad_batches: exact for these equal micro-batches of a "
                     "loss that is the mean over samples, not for token losses with padding, nor for an epoch's shorter last step; "
                     "autotune.accumulate or autotune.fit weight each micro-batch by its items")
        base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.settings = equal_settings(plan, lr_rule=self.lr_rule, learning_rate=base_lrs[0], warmup=False, exactness=exactness)
        accumulate = trainer.accumulate_grad_batches
        lightning_setattr(pl_module, self.batch_arg_name, self.settings.micro_batch)
        trainer.accumulate_grad_batches = self.settings.accumulation_steps
        self._undo = [lambda: lightning_setattr(pl_module, self.batch_arg_name, batch_size),
                      lambda: setattr(trainer, "accumulate_grad_batches", accumulate)]
        if self.settings.learning_rate is not None:
            self._scale_learning_rates(trainer, optimizer, plan.lr_scale)

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

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Put back what :meth:`on_fit_start` set."""
        if stage != "fit":
            return
        for undo in reversed(self._undo):
            undo()
        self._undo = []


def _training_step(model: Any, batch: Any) -> torch.Tensor:
    """The LightningModule's own training_step as the loss (its output, or the output's "loss")."""
    out = model.training_step(batch, 0)
    return out["loss"] if isinstance(out, dict) else out


@contextlib.contextmanager
def _planning(pl_module: Any) -> Iterator[None]:
    """While planning: ``self.log`` and ``self.log_dict`` do nothing, and the module is detached from
    its trainer (so that the plan's fake copy does not copy the trainer); both put back after."""
    saved = {name: pl_module.__dict__[name] for name in ("log", "log_dict") if name in pl_module.__dict__}
    trainer = pl_module.__dict__.get("_trainer")
    pl_module.log = lambda *args, **kwargs: None
    pl_module.log_dict = lambda *args, **kwargs: None
    pl_module.__dict__["_trainer"] = None
    try:
        yield
    finally:
        for name in ("log", "log_dict"):
            if name in saved:
                pl_module.__dict__[name] = saved[name]
            else:
                pl_module.__dict__.pop(name, None)
        pl_module.__dict__["_trainer"] = trainer
