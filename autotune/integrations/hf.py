"""The Hugging Face ``Trainer``, planned: the per-device batch that fits and the accumulation that keeps
the effective batch, with every accumulated step the big batch's.

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
out-of-memory retry of the Trainer's), each retry trains the largest equal micro-batch strictly below
the one that failed, with the accumulation that keeps the target. Where the Trainer's loss rule would
be wrong for your model (below), the Trainer's loss is corrected. ``prepared.restore()`` puts the
Trainer back as it was.

Exactness, found out per model, not assumed (:mod:`autotune.integrations.loss_rules`): :func:`prepare`
evaluates the Trainer's own loss on one batch (no gradient, dropout off) with two different
``num_items_in_batch`` and on two halves collated as micro-batches are, and so learns whether the
loss divides by the count the Trainer passes, and whether it is a mean over the labelled items
(shifted or not), over samples, a sum, or none of these. In transformers 5.x the Trainer stops
dividing by the accumulation steps whenever the model's ``forward`` takes ``**kwargs`` and trusts the
model to divide by ``num_items_in_batch``; most heads (sequence and token classification, masked LM,
T5, Whisper) ignore it and return their micro-batch mean, so every step would be k times the true
gradient. For those, the Trainer's ``compute_loss`` is wrapped to weight each micro-batch by its share
of the step (its items or samples over the step's, summed over the devices, from the Trainer's own
``get_batch_samples``), which is the big batch's loss for any split, an epoch's short last step
included; a causal LM whose loss shifts the labels while the Trainer counts them unshifted gets the
Trainer's count corrected. Collators whose rows are not samples (TRL's preference pairs) are planned
in samples (:mod:`autotune.integrations.rows`); a padding-free collator's flattened row is compared
with its samples one per row, which a model that lets packed sequences see each other fails. The
notes say which rule holds; where none can be made exact they say how far from exact (a measured
factor), never "exact"; under the Trainer's bf16 or fp16 autocast, "exact up to" its rounding (a
micro-batch's products round otherwise than the big batch's).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any, cast

import torch

from autotune.batches import tensors
from autotune.errors import AutotuneError
from autotune.integrations.common import (
    TrainerSettings,
    equal_settings,
    missing,
)
from autotune.integrations.loss_rules import (
    Correction,
    LossCheck,
    check_loss,
    check_packed,
    correction,
    counting,
    metrics_kept,
    packed,
    trainer_count,
    weighted,
)
from autotune.integrations.router_loss import balanced, coefficient_off, routed_step, said
from autotune.integrations.rows import ONE_ROW, Rows, rows_of
from autotune.planning.options import Probing, options
from autotune.planning.planner import plan_with
from autotune.planning.report import largest_divisor
from autotune.step import normalize_precision
from autotune.train.experts import check_router_loss, router_of

__all__ = ["LossCheck", "Prepared", "check_loss", "prepare"]

_ACTIVE = "_autotune_prepared"  # the Trainer's attribute that marks a preparation in force


@dataclasses.dataclass
class Prepared:
    """What :func:`prepare` did to a Trainer, and how to undo it.

    Attributes:
        settings: the micro-batch, accumulation steps, learning rate and notes the plan gave
            (:class:`autotune.integrations.common.TrainerSettings`).
        retries: ``(per-device batch, accumulation steps)`` of each out-of-memory retry that kept the
            target, in order; the last one is what trains.
        loss_check: what the Trainer's loss does with the item count (None: the batches carry no
            labels).
    """

    settings: TrainerSettings
    retries: list[tuple[int, int]]
    loss_check: LossCheck | None
    _restore: Callable[[], None]

    @property
    def micro_batch(self) -> int:
        """The per-device batch that trains now (the plan's, or the last out-of-memory retry's)."""
        return self.retries[-1][0] if self.retries else self.settings.micro_batch

    @property
    def accumulation_steps(self) -> int:
        """The accumulation steps that train now."""
        return self.retries[-1][1] if self.retries else self.settings.accumulation_steps

    def restore(self) -> None:
        """Put the Trainer back: its own ``TrainingArguments``, batch size, loss rule and training
        loop. A second call does nothing."""
        self._restore()

    def __str__(self) -> str:
        text = str(self.settings)
        if self.retries:
            failed = ", ".join(map(str, [self.settings.micro_batch, *(m for m, _ in self.retries[:-1])]))
            text += (
                f"\nafter out-of-memory errors at {failed} per device: trains {self.micro_batch} per device x "
                f"{self.accumulation_steps} accumulation steps x "
                f"{self.settings.world_size} device(s) = {self.micro_batch * self.accumulation_steps * self.settings.world_size}"
            )
        return text


def _dataset(trainer: Any) -> Any:
    """The train dataset as the Trainer reads it (unused columns removed, as it removes them)."""
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
    return dataset


def _loader(dataset: Any, collator: Any, rows: Rows, batch_size: int) -> torch.utils.data.DataLoader:
    """The train batches as the Trainer's collator makes them, in order, one sample per row (:class:`Rows`)."""
    collate = _per_sample(collator)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, collate_fn=lambda s: rows.to_samples(collate(s)), shuffle=False)


def _per_sample(collator: Any) -> Any:
    """The collator, giving one row per sample: a padding-free collator (TRL's, with packing) flattens a
    batch into one row, which has no samples to split into micro-batches, so planning sees the same
    sequences padded instead (the same tokens plus padding: memory counted from above)."""
    if getattr(collator, "padding_free", False) is True:
        collator = copy.copy(collator)
        collator.padding_free = False
    return collator


def _precision(args: Any) -> str:
    return "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"


def _rounded(fix: Correction, args: Any) -> Correction:
    """An exact rule, said exact up to the rounding of the Trainer's autocast (bf16 or fp16): a
    micro-batch's products round otherwise than the big batch's, which no loss rule undoes."""
    precision = _precision(args)
    if precision == "fp32" or not fix.exactness.startswith("exact"):
        return fix
    return dataclasses.replace(fix, exactness=(
        f"exact up to {precision} rounding{fix.exactness[len('exact'):]}; the Trainer autocasts to {precision} ({precision}=True "
        f"in its arguments; TRL's SFTConfig sets bf16=True by default), so a micro-batch's products round otherwise than the "
        f"big batch's: a step's gradient and the big batch's differ by {precision} rounding (of order 1e-2 relative, as "
        f"either differs from the float32 gradient); with {precision}=False they agree to float32 rounding"))


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
    router_loss: str = "per_micro_batch",
    progress: bool = True,
) -> Prepared:
    """Plan the Trainer's training, set its per-device batch and gradient accumulation, and make its
    loss rule exact for the model.

    Args:
        trainer: a ``transformers.Trainer`` (or a subclass: TRL's ``SFTTrainer``, ...), before
            ``train()``, not prepared already.
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
            ``warmup_steps`` (at most 10% of the run when its length is known).
        keep_target: on an out-of-memory retry of the Trainer's (``auto_find_batch_size``), train the
            largest equal micro-batch strictly below the one that failed, with the accumulation that
            keeps the target.
        router_loss: a mixture-of-experts model's load-balancing loss (``config.output_router_logits``),
            which the Trainer alone adds whole for every micro-batch: ``"per_micro_batch"`` (default: each
            micro-batch's own weighted by its tokens over the step's, how far from the big batch's measured
            on the first step) or ``"exact"`` (the big batch's, at one extra forward without gradients per
            step; one device). See :mod:`autotune.integrations.router_loss`.
        progress: say what the probe does on stderr when it takes more than a second.

    Returns:
        A :class:`Prepared`; ``str()`` of it says what was set and what trains.

    Raises:
        ImportError: transformers is not installed.
        ValueError: no train dataset, a target the devices cannot share equally, or a Trainer prepared
            already; a bad target or base batch, memory limit, headroom, LR rule or progress with the
            message ``autotune.plan`` gives (``TypeError`` where the value has the wrong type).

    Example:
        >>> prepared = prepare(trainer, target_batch=256, memory_limit="24GiB")  # doctest: +SKIP
        >>> trainer.train()                                                      # doctest: +SKIP
        >>> prepared.restore()                                                   # doctest: +SKIP
    """
    try:
        from transformers import Trainer
    except ImportError:  # pragma: no cover - the extra
        raise missing("transformers", "hf") from None
    if not isinstance(trainer, Trainer):
        raise TypeError(f"Invalid trainer of type {type(trainer).__name__}: pass a transformers.Trainer")
    shared = options(target_batch=target_batch, memory_limit=memory_limit, headroom=headroom, lr_rule=lr_rule, base_batch=base_batch,
                     progress=progress)
    trainer = cast(Any, trainer)  # its private fields are read and set below, on purpose
    if trainer.__dict__.get(_ACTIVE) is not None:
        raise ValueError(
            f"Invalid trainer: it is prepared already ({trainer.__dict__[_ACTIVE].settings.effective_batch} samples per step); "
            "call restore() on what prepare() returned first, then prepare it again"
        )
    args = trainer.args
    world = max(1, int(getattr(args, "world_size", 1)))
    check_router_loss(trainer.model, router_loss, loss_fn=None, distributed=world > 1)
    router = router_of(trainer.model)  # a load-balancing loss the model adds to each micro-batch's (None: none)
    described = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
    target = described if target_batch is None else target_batch
    model = trainer.model
    if trainer.optimizer is not None:
        optimizer = trainer.optimizer
    else:  # the optimizer the Trainer will build (its class and settings), made here for the plan only
        cls, kwargs = trainer.get_optimizer_cls_and_kwargs(args, model)
        optimizer = cls([p for p in model.parameters() if p.requires_grad], **kwargs)

    dataset = _dataset(trainer)
    rows = _rows(trainer, dataset)
    if router is not None and rows.per_sample > 1:
        raise ValueError(f"Invalid trainer {type(trainer).__name__} for {type(model).__name__}: its collator makes {rows.per_sample} rows "
                         "of each sample and the model adds a load-balancing loss to each micro-batch's, which autotune can weight only "
                         "on one row per sample; set output_router_logits=False in the model's config, or plan without prepare()")
    own_lr = _own_learning_rate(trainer, lr_rule)

    def loss_fn(model: Any, batch: Any) -> torch.Tensor:
        # compute_loss pops "labels" from the batch it is given (with a loss function or label smoothing): a copy, so
        # the trial's second micro-step has them too; given the count the Trainer would give (a compute_loss_func
        # written as the Trainer documents it divides by it)
        batch = rows.to_rows(dict(batch))
        return trainer.compute_loss(model, batch, num_items_in_batch=trainer_count(trainer, batch))

    with metrics_kept(trainer):
        shared = dataclasses.replace(shared, target_batch=target, base_batch=base_batch or described, precision=normalize_precision(_precision(args)))
        plan = plan_with(model, _loader(dataset, trainer.data_collator, rows, args.per_device_train_batch_size), shared, Probing(),
                         optimizer=optimizer, loss_fn=loss_fn, device=args.device)
    with coefficient_off(model) if router is not None else contextlib.nullcontext():  # the rule of the loss without it
        check = check_loss(trainer, next(iter(_loader(dataset, trainer.data_collator, rows, 4))), rows,
                           _first_two(_loader(dataset, trainer.data_collator, rows, 2)))
        fix = correction(trainer, model, check)
        if _per_sample(trainer.data_collator) is not trainer.data_collator:
            # the rule was measured on the sequences padded; what trains is a flattened row of them: compared with them apart
            packs = [dataset[i] for i in range(min(4, len(dataset)))] if hasattr(dataset, "__len__") else []
            if check is not None and len(packs) >= 2:
                check = dataclasses.replace(check, packed=check_packed(trainer, trainer.data_collator(packs),
                                                                       [trainer.data_collator([s]) for s in packs], check))
            fix = packed(fix, check, len(packs))
    fix = _rounded(fix, args)
    had_warmup = bool(getattr(args, "warmup_steps", 0)) or bool(getattr(args, "warmup_ratio", 0))
    settings = equal_settings(plan, lr_rule=lr_rule, learning_rate=args.learning_rate if own_lr is None else own_lr, warmup=warmup,
                              exactness=fix.exactness, had_warmup=had_warmup, run_steps=_run_steps(trainer, target))
    notes = list(settings.notes)
    if own_lr is not None and settings.learning_rate is not None:
        notes.append(f"the optimizer you gave the Trainer sets the learning rate, not its arguments: its groups' learning rates "
                     f"(and a scheduler's base rates) are scaled x{plan.lr_scale:.4g} (restore() puts them back)")
    if rows.per_sample > 1:
        notes.append(f"the data collator makes {rows.per_sample} rows of each sample (a preference pair's sequences): planned "
                     f"and weighted in samples, never cutting a sample's rows apart")
    if _per_sample(trainer.data_collator) is not trainer.data_collator:
        notes.append("planned on the packed sequences padded to the longest in each micro-batch; the Trainer trains them padding-free "
                     "(one flattened row per micro-batch), which holds no more than that; the loss rule was checked on those padded "
                     "batches, and a padding-free row against its sequences apart")
    if router is not None:  # the first step's micro-batches, routed: the per-micro-batch loss against the step's
        first = list(itertools.islice(iter(_loader(dataset, trainer.data_collator, rows, settings.micro_batch)), settings.accumulation_steps))
        notes.append(said(router, routed_step(trainer, router, first), len(first), router_loss, type(model).__name__))
    settings = dataclasses.replace(settings, notes=tuple(notes))
    prepared = _apply(trainer, settings, fix, check, rows, target // world if keep_target else None)
    if router is not None:  # the load-balancing loss added by autotune as router_loss says, not by the model
        put_back, undo = balanced(trainer, router, router_loss), prepared._restore

        def restore() -> None:
            if trainer.__dict__.get(_ACTIVE) is prepared:
                put_back()
            undo()

        prepared._restore = restore
    return prepared


def _rows(trainer: Any, dataset: Any) -> Rows:
    """What the Trainer's collator makes of a sample (:func:`rows_of`); refused when it makes no tensors:
    a trainer that builds its training batches itself in training (TRL's GRPO and RLOO generate
    completions from the prompts), which no plan of the collated batches describes."""
    collate = _per_sample(trainer.data_collator)
    samples = [dataset[i] for i in range(min(2, len(dataset)))] if hasattr(dataset, "__len__") else []
    if samples and not tensors(collate(samples[:1])):
        raise ValueError(
            f"Invalid trainer {type(trainer).__name__}: its data collator returns no tensors (a "
            f"{type(collate(samples[:1])).__name__}): such a trainer builds its training batches itself during training (TRL's "
            "GRPO and RLOO generate completions from the prompts); autotune plans the batches a collator makes, so it cannot "
            "plan this trainer: set per_device_train_batch_size and gradient_accumulation_steps yourself")
    return rows_of(collate, samples) if samples else ONE_ROW


def _first_two(loader: Any) -> Any:
    """The first two batches of ``loader`` (None when it has fewer)."""
    batches = list(itertools.islice(iter(loader), 2))
    return tuple(batches) if len(batches) == 2 else None


def _own_learning_rate(trainer: Any, lr_rule: str) -> float | None:
    """The learning rate of an optimizer the user gave the Trainer (None: the Trainer builds its own
    from its arguments), which a learning-rate rule scales; refused where its groups differ."""
    if trainer.optimizer is None:
        return None
    rates = {float(g["lr"]) for g in trainer.optimizer.param_groups}
    if lr_rule != "none" and len(rates) > 1:
        raise ValueError(
            f"Invalid lr_rule {lr_rule!r} for the optimizer given to the Trainer: its parameter groups have different learning "
            f"rates {sorted(rates)}; scale them yourself and pass lr_rule='none'")
    return rates.pop()


def _run_steps(trainer: Any, target: int) -> int | None:
    """Optimizer steps of the whole run, when the arguments and the dataset tell."""
    args = trainer.args
    if getattr(args, "max_steps", -1) and args.max_steps > 0:
        return int(args.max_steps)
    try:
        return math.ceil(len(trainer.train_dataset) / target) * max(1, math.ceil(float(args.num_train_epochs)))
    except TypeError:
        return None


def _apply(trainer: Any, settings: TrainerSettings, fix: Correction, check: LossCheck | None, rows: Rows, share: int | None) -> Prepared:
    """Set the Trainer's arguments, loss rule, learning rate and out-of-memory retry; the :class:`Prepared` that undoes them."""
    changes: dict[str, Any] = {
        "per_device_train_batch_size": settings.micro_batch,
        "gradient_accumulation_steps": settings.accumulation_steps,
    }
    if settings.learning_rate is not None:
        changes["learning_rate"] = settings.learning_rate
    if settings.warmup_steps is not None:
        changes["warmup_steps"] = settings.warmup_steps
    # Everything set on the Trainer below, as it was (an attribute it did not have is removed again).
    names = ("args", "_train_batch_size", "_loss_shifts_labels", "loss_is_scaled_for_ga", "compute_loss", "get_batch_samples",
             "_inner_training_loop")
    own = {name: trainer.__dict__[name] for name in names if name in trainer.__dict__}
    if fix.shift_labels:
        trainer._loss_shifts_labels = True
    if fix.rule is not None:
        step: dict[str, Any] = {}  # the step's samples and items, summed over the devices
        trainer.get_batch_samples = counting(trainer, trainer.get_batch_samples, fix.rule, rows, step)
        trainer.compute_loss = weighted(trainer, trainer.compute_loss, fix.rule, rows, step)
        trainer.loss_is_scaled_for_ga = True  # the wrapped loss is scaled for the step already
    rates = _scaled_rates(trainer, settings)
    # A shallow copy with the fields set (dataclasses.replace would run __post_init__ again, which
    # resets the process's accelerator state the Trainer already holds).
    trainer.args = copy.copy(trainer.args)
    for name, value in changes.items():
        setattr(trainer.args, name, value)
    trainer._train_batch_size = trainer.args.train_batch_size
    retries: list[tuple[int, int]] = []
    if share is not None:
        original = trainer._inner_training_loop

        def loop(batch_size: int | None = None, args: Any = None, **kwargs: Any) -> Any:
            failed = trainer.args.per_device_train_batch_size
            if batch_size is not None and batch_size != failed:
                # An out-of-memory retry (the finder shrinks by 0.9, which would map back onto the size that
                # just failed): the largest equal micro-batch strictly below the failed one, and the
                # accumulation that makes up the rest of the target.
                if failed <= 1:
                    raise AutotuneError(
                        "the Trainer ran out of memory at 1 sample per device: nothing smaller exists; lower the "
                        "memory the step needs (precision, gradient checkpointing) or shard the model")
                micro = largest_divisor(share, min(batch_size, failed - 1))
                trainer.args.per_device_train_batch_size = micro
                trainer.args.gradient_accumulation_steps = share // micro
                trainer._train_batch_size = trainer.args.train_batch_size
                retries.append((micro, share // micro))
                batch_size = micro
            return original(batch_size=batch_size, args=trainer.args, **kwargs)

        trainer._inner_training_loop = loop

    def restore() -> None:
        if trainer.__dict__.get(_ACTIVE) is not prepared:
            return
        rates()
        for name in names:
            if name in own:
                trainer.__dict__[name] = own[name]
            else:
                trainer.__dict__.pop(name, None)
        trainer.__dict__.pop(_ACTIVE, None)

    prepared = Prepared(settings, retries, check, restore)
    trainer.__dict__[_ACTIVE] = prepared
    return prepared


def _scaled_rates(trainer: Any, settings: TrainerSettings) -> Callable[[], None]:
    """Scale the learning rates of an optimizer the user gave the Trainer (and its scheduler's base
    rates) by the plan's factor; what puts them back."""
    optimizer, scheduler = trainer.optimizer, trainer.lr_scheduler
    if optimizer is None or settings.learning_rate is None:
        return lambda: None
    scale = settings.plan.lr_scale
    groups = [dict((k, g[k]) for k in ("lr", "initial_lr") if k in g) for g in optimizer.param_groups]
    bases = list(getattr(scheduler, "base_lrs", []) or [])
    for g in optimizer.param_groups:
        for k in ("lr", "initial_lr"):
            if k in g:
                g[k] = g[k] * scale
    if bases:
        scheduler.base_lrs = [b * scale for b in bases]

    def put_back() -> None:
        for g, was in zip(optimizer.param_groups, groups):
            g.update(was)
            if "initial_lr" in g:  # set by a scheduler the Trainer made in train(), from the scaled rate
                g["initial_lr"] = was.get("initial_lr", was["lr"])
        if bases:
            scheduler.base_lrs = bases
        made = trainer.lr_scheduler
        if made is not None and made is not scheduler and getattr(made, "base_lrs", None):
            made.base_lrs = [b / scale for b in made.base_lrs]

    return put_back
