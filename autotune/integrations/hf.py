"""The Hugging Face ``Trainer``, planned: the per-device batch that fits and the accumulation that keeps
the effective batch.

The Trainer's ``auto_find_batch_size`` shrinks the per-device batch after an out-of-memory error and
keeps ``gradient_accumulation_steps``, so the effective batch silently shrinks too. :func:`prepare`
plans with the Trainer's own model, train dataset, data collator, loss (``trainer.compute_loss``),
optimizer class and precision, then gives the Trainer equal micro-batches that reach the target
exactly::

    trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=collator)
    prepared = autotune.integrations.hf.prepare(trainer, target_batch=256, memory_limit="24GiB")
    print(prepared)           # 16 per device x 16 accumulation steps x 1 device(s) = 256 ...
    trainer.train()

What it changes, and only that: ``trainer.args`` becomes a copy of your ``TrainingArguments`` with
``per_device_train_batch_size``, ``gradient_accumulation_steps`` and, when you ask for a learning-rate
rule, ``learning_rate`` (and ``warmup_steps`` when the learning rate grows and you set no warm-up)
replaced; your own ``TrainingArguments`` object is not touched. With ``auto_find_batch_size`` (or any
out-of-memory retry of the Trainer's), the retry's smaller per-device batch gets the accumulation that
keeps the target (the largest equal micro-batch within it). ``prepared.restore()`` puts the Trainer
back as it was.

Exactness: for models that accept the loss's keyword arguments (every ``transformers`` model with a
loss), the Trainer divides each micro-batch's summed loss by the items of the whole step
(``num_items_in_batch``), which is exact for token losses with padding; otherwise it divides each
micro-batch's mean by the number of micro-batches, exact for equal micro-batches of per-sample losses
only, and a note says so.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any, cast

import torch

from ..planner import plan as make_plan
from ..report import largest_divisor
from .common import TrainerSettings, equal_settings, missing

__all__ = ["Prepared", "prepare"]


@dataclasses.dataclass
class Prepared:
    """What :func:`prepare` did to a Trainer, and how to undo it.

    Attributes:
        settings: the micro-batch, accumulation steps, learning rate and notes
            (:class:`autotune.integrations.common.TrainerSettings`).
        retries: ``(per-device batch, accumulation steps)`` of each out-of-memory retry that kept the
            target.
    """

    settings: TrainerSettings
    retries: list[tuple[int, int]]
    _restore: Callable[[], None]

    def restore(self) -> None:
        """Put the Trainer back: its own ``TrainingArguments``, batch size and training loop."""
        self._restore()

    def __str__(self) -> str:
        return str(self.settings)


def _loader(trainer: Any, batch_size: int) -> torch.utils.data.DataLoader:
    """The train batches as the Trainer makes them: its dataset (unused columns removed, as it
    removes them) through its data collator, in order."""
    dataset = trainer.train_dataset
    if dataset is None:
        raise ValueError("Invalid trainer: it has no train_dataset to plan with; give Trainer(train_dataset=...)")
    remove = getattr(trainer, "_remove_unused_columns", None)
    try:
        import datasets

        if callable(remove) and isinstance(dataset, datasets.Dataset):
            dataset = remove(dataset, description="training")
    except ImportError:
        pass
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, collate_fn=trainer.data_collator, shuffle=False)


def _miscounts_shifted_labels(trainer: Any, model: Any) -> bool:
    """Whether the Trainer counts a step's items over unshifted labels for a causal LM loss that shifts
    them (a model whose ``loss_type`` is unset, e.g. ``GPT2LMHeadModel`` built from a config)."""
    if getattr(trainer, "_loss_shifts_labels", True) or not getattr(trainer, "model_accepts_loss_kwargs", False):
        return False
    if getattr(trainer, "compute_loss_func", None) is not None:  # your own loss: whether it shifts is yours to say
        return False
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # pragma: no cover - older transformers
        return False
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return getattr(model, "loss_function", None) is ForCausalLMLoss
        except Exception:
            return False


def _precision(args: Any) -> str:
    return "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"


def prepare(
    trainer: Any,
    *,
    target_batch: int | None = None,
    memory_limit: int | str | None = None,
    headroom: float | None = None,
    lr_rule: str = "none",
    base_batch: int | None = None,
    warmup: bool = True,
    keep_target: bool = True,
    progress: bool = True,
) -> Prepared:
    """Plan the Trainer's training and set its per-device batch and gradient accumulation.

    Args:
        trainer: a ``transformers.Trainer`` (before ``train()``).
        target_batch: samples per optimizer step over all devices (default: the effective batch its
            arguments describe, ``per_device_train_batch_size x gradient_accumulation_steps x
            world_size``, kept while the per-device batch changes).
        memory_limit: as for :func:`autotune.plan` (default: what the device has).
        headroom: as for :func:`autotune.plan`.
        lr_rule: ``"none"`` (default: the learning rate is left as it is, and a note says so),
            ``"auto"``, ``"sqrt"`` or ``"linear"``: scale ``learning_rate`` from ``base_batch``.
        base_batch: the effective batch the learning rate was tuned at (default: the one the
            Trainer's arguments describe).
        warmup: when the learning rate grows and the arguments set no warm-up, set the recommended
            ``warmup_steps``.
        keep_target: on an out-of-memory retry of the Trainer's (``auto_find_batch_size``), raise the
            accumulation so that the target is kept.
        progress: say what the probe does on stderr when it takes more than a second.

    Returns:
        A :class:`Prepared`; ``str()`` of it says what was set.

    Raises:
        ImportError: transformers is not installed.
        ValueError: no train dataset, or a target the devices cannot share equally.
    """
    try:
        from transformers import Trainer
    except ImportError:  # pragma: no cover - the extra
        raise missing("transformers", "hf") from None
    if not isinstance(trainer, Trainer):
        raise TypeError(f"Invalid trainer of type {type(trainer).__name__}: pass a transformers.Trainer")
    trainer = cast(Any, trainer)  # its private fields are read and set below, on purpose
    args = trainer.args
    world = max(1, int(getattr(args, "world_size", 1)))
    described = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
    target = described if target_batch is None else target_batch
    model = trainer.model
    if trainer.optimizer is not None:
        optimizer = trainer.optimizer
    else:  # the optimizer the Trainer will build (its class and settings), made here for the plan only
        cls, kwargs = trainer.get_optimizer_cls_and_kwargs(args, model)
        optimizer = cls([p for p in model.parameters() if p.requires_grad], **kwargs)

    def loss_fn(model: Any, batch: Any) -> torch.Tensor:
        # compute_loss pops "labels" from the batch it is given (with a loss function or label
        # smoothing): a copy, so the trial's second micro-step has them too
        return trainer.compute_loss(model, dict(batch))

    plan = make_plan(
        model, _loader(trainer, args.per_device_train_batch_size), target_batch=target, optimizer=optimizer, loss_fn=loss_fn,
        device=args.device, memory_limit=memory_limit, headroom=headroom, lr_rule=lr_rule,
        base_batch=base_batch or described, precision=_precision(args), progress=progress,
    )
    recount = _miscounts_shifted_labels(trainer, model)
    if getattr(trainer, "model_accepts_loss_kwargs", False):
        exactness = ("exact: the Trainer divides each micro-batch's summed loss by the items of the whole step "
                     "(num_items_in_batch), padding included")
        if recount:
            exactness += (
                f"; it counted them over unshifted labels (position 0 of every sequence included) while "
                f"{type(model).__name__}'s loss shifts them (its loss_type is unset), which scales each step by "
                "(tokens - sequences) / tokens: corrected for this Trainer (restore() puts it back); setting "
                "model.loss_type = 'ForCausalLM' before building a Trainer avoids it"
            )
    else:
        exactness = ("the Trainer divides each micro-batch's mean loss by the accumulation steps: exact for these equal "
                     "micro-batches of per-sample losses, not for token losses with padding (each micro-batch weighs the same "
                     "whatever its tokens); autotune.fit or autotune.accumulate weight each by its items")
    had_warmup = bool(getattr(args, "warmup_steps", 0)) or bool(getattr(args, "warmup_ratio", 0))
    settings = equal_settings(plan, lr_rule=lr_rule, learning_rate=args.learning_rate, warmup=warmup, exactness=exactness,
                              had_warmup=had_warmup)
    changes: dict[str, Any] = {
        "per_device_train_batch_size": settings.micro_batch,
        "gradient_accumulation_steps": settings.accumulation_steps,
    }
    if settings.learning_rate is not None:
        changes["learning_rate"] = settings.learning_rate
    if settings.warmup_steps is not None:
        changes["warmup_steps"] = settings.warmup_steps
    own_args, own_batch, own_shift = args, trainer._train_batch_size, getattr(trainer, "_loss_shifts_labels", None)
    if recount:
        trainer._loss_shifts_labels = True
    # A shallow copy with the fields set (dataclasses.replace would run __post_init__ again, which
    # resets the process's accelerator state the Trainer already holds).
    trainer.args = copy.copy(args)
    for name, value in changes.items():
        setattr(trainer.args, name, value)
    trainer._train_batch_size = trainer.args.train_batch_size
    retries: list[tuple[int, int]] = []
    inner = trainer.__dict__.get("_inner_training_loop")
    if keep_target:
        original = trainer._inner_training_loop
        share = target // world

        def loop(batch_size: int | None = None, args: Any = None, **kwargs: Any) -> Any:
            if batch_size is not None and batch_size != trainer.args.per_device_train_batch_size:
                # An out-of-memory retry with a smaller per-device batch: the largest equal micro-batch
                # within it that reaches the target, and the accumulation that makes up the rest.
                micro = largest_divisor(share, batch_size)
                trainer.args.per_device_train_batch_size = micro
                trainer.args.gradient_accumulation_steps = share // micro
                retries.append((micro, share // micro))
                batch_size = micro
            return original(batch_size=batch_size, args=trainer.args, **kwargs)

        trainer._inner_training_loop = loop

    def restore() -> None:
        trainer.args = own_args
        trainer._train_batch_size = own_batch
        if own_shift is not None:
            trainer._loss_shifts_labels = own_shift
        if inner is None:
            trainer.__dict__.pop("_inner_training_loop", None)
        else:
            trainer._inner_training_loop = inner

    return Prepared(settings, retries, restore)
