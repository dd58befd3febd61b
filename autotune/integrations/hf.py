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

Exactness, found out per model, not assumed: :func:`prepare` evaluates the Trainer's loss on one
batch (no gradient, dropout off) with two different ``num_items_in_batch`` and on two halves of the
batch, and so learns whether the loss divides by the count the Trainer passes, and whether it is a
mean over the labelled items the Trainer counts or over samples. In transformers 5.x the Trainer
stops dividing by the accumulation steps whenever the model's ``forward`` takes ``**kwargs`` and
trusts the model to divide by ``num_items_in_batch``; most heads (sequence and token classification,
masked LM, T5, Whisper) ignore it and return their micro-batch mean, so every step would be k times
the true gradient. For those, the Trainer's ``compute_loss`` is wrapped to weight each micro-batch's
mean by its items over the step's (``n_i / N``, summed over the devices), which is the big batch's
loss for any split; a causal LM whose loss shifts the labels while the Trainer counts them unshifted
gets the Trainer's count corrected. The notes say which rule holds; where none can be made exact they
say how far from exact, never "exact".
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import torch

from autotune.batches import batch_size as size_of
from autotune.batches import slice_batch
from autotune.errors import AutotuneError
from autotune.integrations.common import (
    TrainerSettings,
    equal_settings,
    missing,
)
from autotune.planning.options import Probing, options
from autotune.planning.planner import plan_with
from autotune.planning.report import largest_divisor
from autotune.rng import RNGState
from autotune.step import normalize_precision, planning

__all__ = ["LossCheck", "Prepared", "prepare"]

_ACTIVE = "_autotune_prepared"  # the Trainer's attribute that marks a preparation in force


@dataclasses.dataclass(frozen=True)
class LossCheck:
    """How the Trainer's loss treats a step's item count, measured on one batch.

    Attributes:
        uses_count: the loss divides by the ``num_items_in_batch`` it is given (True), ignores it
            (False), or neither (None: it depends on it some other way).
        own_items: the items the loss averages over by itself on that batch, when it divides by the
            count (None when it cannot be told).
        counted: the items the Trainer counts on that batch (labels that are not -100).
        shifted: the same over labels shifted by one position (what a causal LM predicts).
        mean_over_items: the loss is the mean over the counted items (halves of the batch, weighted
            by their items, give the whole batch's loss).
        mean_over_samples: the loss is the mean over samples.
    """

    uses_count: bool | None
    own_items: float | None
    counted: int
    shifted: int
    mean_over_items: bool
    mean_over_samples: bool


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
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, collate_fn=_per_sample(trainer.data_collator), shuffle=False)


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


def _count(batch: Mapping[str, Any], *, shifted: bool) -> int:
    """The items the Trainer counts in ``batch`` (its ``_get_num_items_in_batch`` rule, on one batch)."""
    if "shift_labels" in batch:
        labels = batch["shift_labels"]
    else:
        labels = batch["labels"][..., 1:] if shifted else batch["labels"]
    return int(labels.ne(-100).sum())


def _token_multiplier(trainer: Any) -> int:
    """What the Trainer multiplies a counted loss by: the processes, when the count is summed over
    them (``average_tokens_across_devices``), because DDP then averages the gradients."""
    if getattr(trainer.args, "average_tokens_across_devices", False):
        return max(1, int(getattr(trainer.accelerator, "num_processes", 1)))
    return 1


def _close(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol * max(abs(a), abs(b), 1e-30)


@contextlib.contextmanager
def _metrics_kept(trainer: Any) -> Iterator[None]:
    """TRL's trainers record metrics in every ``compute_loss``: what planning and the loss check add
    to them is taken out again."""
    metrics = copy.deepcopy(trainer.__dict__.get("_metrics"))
    try:
        yield
    finally:
        if metrics is not None:
            trainer.__dict__["_metrics"] = metrics


def check_loss(trainer: Any, batch: Mapping[str, Any]) -> LossCheck | None:
    """Evaluate the Trainer's loss on ``batch`` (no gradient, every module in eval mode, under
    :func:`autotune.planning`) with two item counts and on two halves, and say what it does with
    the count (:class:`LossCheck`). Nothing is changed: the modules' modes, the RNGs and the
    Trainer's recorded metrics are put back. None when the batch has no ``labels`` tensor."""
    model = trainer.model
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not torch.is_tensor(labels) or size_of(batch) < 1:
        return None
    batch = trainer._prepare_inputs(dict(batch))
    own_shift = bool(getattr(trainer, "_loss_shifts_labels", False))
    counted, shifted = _count(batch, shifted=own_shift), _count(batch, shifted=True)
    if counted == 0:
        return None
    modes = [(m, m.training) for m in model.modules()]
    rng = RNGState()
    dtypes = []

    def loss(b: Mapping[str, Any], n: int | None = None) -> float:
        count = None if n is None else torch.tensor(n, device=trainer.args.device)
        value = trainer.compute_loss(model, dict(b), num_items_in_batch=count).detach()
        dtypes.append(value.dtype)
        return float(value.double().mean())

    try:
        model.eval()
        with torch.no_grad(), planning(), _metrics_kept(trainer):
            with_count, with_triple = loss(batch, counted), loss(batch, 3 * counted)
            # rounding of the loss's own dtype (transformers computes some losses in float32 for float64 models)
            tol = 1e-9 if dtypes[0] == torch.float64 else 1e-4
            if _close(with_count, with_triple, tol):
                uses: bool | None = False
            elif _close(with_count * counted, with_triple * 3 * counted, tol):
                uses = True
            else:
                uses = None
            own_items = None
            if uses:
                try:
                    plain = loss(batch)
                    if plain != 0:
                        own_items = with_count / _token_multiplier(trainer) * counted / plain
                except Exception:  # a compute_loss_func that needs the count: the Trainer's own rule stands
                    own_items = None

            def alone(b: Mapping[str, Any]) -> float:
                return loss(b, _count(b, shifted=own_shift)) / _token_multiplier(trainer) if uses else loss(b)

            rows = size_of(batch)
            over_items = over_samples = False
            if rows >= 2 and uses is not None:
                half = rows // 2
                a, b = slice_batch(batch, 0, half), slice_batch(batch, half, rows)
                ca, cb = _count(a, shifted=own_shift), _count(b, shifted=own_shift)
                if ca and cb:
                    whole, la, lb = alone(batch), alone(a), alone(b)
                    over_items = _close(whole * counted, la * ca + lb * cb, tol)
                    over_samples = _close(whole * rows, la * half + lb * (rows - half), tol)
    finally:
        for m, training in modes:
            m.training = training
        rng.restore()
    return LossCheck(uses, own_items, counted, shifted, over_items, over_samples)


def _weighted_loss(trainer: Any, original: Callable[..., Any], per_items: bool) -> Callable[..., Any]:
    """``trainer.compute_loss`` for a head that ignores ``num_items_in_batch``: in training, its
    micro-batch mean times the micro-batch's items over the step's (``per_items``; the step's count
    summed over the devices, times the devices, as DDP averages), or over the accumulation steps."""

    def compute_loss(model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        # The head ignores the count, so it is never passed on: a model without **kwargs (told here that
        # it takes them, so that the Trainer counts a step's items) must not receive it.
        shift = bool(getattr(trainer, "_loss_shifts_labels", False))
        items = _count(inputs, shifted=shift) if per_items and num_items_in_batch is not None and "labels" in inputs else None
        out = original(model, inputs, return_outputs=return_outputs, num_items_in_batch=None)
        if not model.training:
            return out
        loss, rest = (out[0], out[1:]) if return_outputs else (out, ())
        if items is not None:
            loss = loss * (items * _token_multiplier(trainer)) / num_items_in_batch
        else:
            loss = loss / trainer.current_gradient_accumulation_steps
        return (loss, *rest) if return_outputs else loss

    return compute_loss


@dataclasses.dataclass
class _Correction:
    """What :func:`prepare` sets on the Trainer so that its loss rule is right for the model."""

    exactness: str
    shift_labels: bool = False
    wrap: bool = False
    per_items: bool = False  # weight by items: the Trainer must then count each step's items too


def _correction(trainer: Any, model: Any, check: LossCheck | None) -> _Correction:
    """The Trainer's loss rule for this model, measured (:class:`LossCheck`), and what makes it exact."""
    name = type(model).__name__
    told = bool(trainer.model_accepts_loss_kwargs) or trainer.compute_loss_func is not None
    equal_only = ("each micro-batch's loss divided by the accumulation steps: exact for these equal micro-batches of a loss that "
                  "is the mean over samples")
    if check is None:
        return _Correction(f"the batches carry no labels tensor, so the Trainer counts no items: {equal_only}; not checked further")
    if check.uses_count:
        if check.own_items is None or _close(check.own_items, check.counted, 1e-3):
            return _Correction("exact: the Trainer divides each micro-batch's summed loss by the items of the whole step "
                               "(num_items_in_batch), padding included, and the loss divides by that count (checked)")
        if _close(check.own_items, check.shifted, 1e-3) and not getattr(trainer, "_loss_shifts_labels", True):
            return _Correction(
                f"exact: the Trainer divides each micro-batch's summed loss by the items of the whole step (num_items_in_batch); "
                f"it counted them over "
                f"unshifted labels (position 0 of every sequence included) while {name}'s loss shifts them (its loss_type is unset), "
                "which scales each step by (tokens - sequences) / tokens: corrected for this Trainer (restore() puts it back); "
                "setting model.loss_type = 'ForCausalLM' before building a Trainer avoids it", shift_labels=True)
        ratio = check.own_items / check.counted
        return _Correction(
            f"not exact: the loss divides by num_items_in_batch, but on a batch where the Trainer counts {check.counted} items "
            f"it averages over {check.own_items:.6g} by itself, so each step is about {ratio:.4g} times the big batch's "
            "gradient; autotune.fit or autotune.accumulate weight each micro-batch by its items")
    if check.uses_count is None:
        return _Correction(
            "not checked: the loss depends on num_items_in_batch in a way autotune does not recognise (it neither ignores the "
            "count nor divides by it), so whether a step is the big batch's is not known")
    ignored = (f"{name}'s loss ignores num_items_in_batch and returns its micro-batch mean" if told else
               f"{name}'s forward takes no loss keywords, so the Trainer divides each micro-batch's mean by the accumulation steps")
    if check.mean_over_items:
        across = ""
        if getattr(trainer.args, "world_size", 1) > 1 and not getattr(trainer.args, "average_tokens_across_devices", False):
            across = ("; the devices weigh equally (average_tokens_across_devices=False): exact across devices only when "
                      "they count the same items")
        return _Correction(
            f"exact: {ignored}{' (k times the true gradient under the Trainer alone, transformers #47688)' if told else ''}; "
            "autotune weights each micro-batch's mean by its items over the step's (n_i / N, the Trainer's count), "
            f"the big batch's loss for any split, logged loss included{across} (restore() puts the Trainer's rule back)",
            wrap=True, per_items=True)
    if check.mean_over_samples:
        if told:
            return _Correction(f"exact: {ignored} (k times the true gradient under the Trainer alone, transformers #47688); "
                               f"autotune divides it by the accumulation steps: {equal_only} (checked)", wrap=True)
        return _Correction(f"exact: {ignored}: {equal_only} (checked)")
    return _Correction(
        f"not checked: {ignored}, and it is neither the mean over its labelled items nor over samples, so the step is the "
        "big batch's only if equal micro-batches weigh equally in it; autotune divides each by the accumulation steps",
        wrap=told)


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

    with _metrics_kept(trainer):
        shared = dataclasses.replace(shared, target_batch=target, base_batch=base_batch or described, precision=normalize_precision(_precision(args)))
        plan = plan_with(model, _loader(trainer, args.per_device_train_batch_size), shared, Probing(), optimizer=optimizer,
                         loss_fn=loss_fn, device=args.device)
    check = check_loss(trainer, next(iter(_loader(trainer, 4))))
    fix = _correction(trainer, model, check)
    had_warmup = bool(getattr(args, "warmup_steps", 0)) or bool(getattr(args, "warmup_ratio", 0))
    settings = equal_settings(plan, lr_rule=lr_rule, learning_rate=args.learning_rate, warmup=warmup, exactness=fix.exactness,
                              had_warmup=had_warmup, run_steps=_run_steps(trainer, target))
    if _per_sample(trainer.data_collator) is not trainer.data_collator:
        settings = dataclasses.replace(settings, notes=(*settings.notes, (
            "planned on the packed sequences padded to the longest in each micro-batch; the Trainer trains them padding-free "
            "(one flattened row per micro-batch), which holds no more than that; the loss rule was checked on those padded "
            "batches")))
    return _apply(trainer, settings, fix, check, target // world if keep_target else None)


def _run_steps(trainer: Any, target: int) -> int | None:
    """Optimizer steps of the whole run, when the arguments and the dataset tell."""
    args = trainer.args
    if getattr(args, "max_steps", -1) and args.max_steps > 0:
        return int(args.max_steps)
    try:
        return math.ceil(len(trainer.train_dataset) / target) * max(1, math.ceil(float(args.num_train_epochs)))
    except TypeError:
        return None


def _apply(trainer: Any, settings: TrainerSettings, fix: _Correction, check: LossCheck | None, share: int | None) -> Prepared:
    """Set the Trainer's arguments, loss rule and out-of-memory retry; the :class:`Prepared` that undoes them."""
    changes: dict[str, Any] = {
        "per_device_train_batch_size": settings.micro_batch,
        "gradient_accumulation_steps": settings.accumulation_steps,
    }
    if settings.learning_rate is not None:
        changes["learning_rate"] = settings.learning_rate
    if settings.warmup_steps is not None:
        changes["warmup_steps"] = settings.warmup_steps
    # Everything set on the Trainer below, as it was (an attribute it did not have is removed again).
    names = ("args", "_train_batch_size", "_loss_shifts_labels", "model_accepts_loss_kwargs", "loss_is_scaled_for_ga",
             "compute_loss", "_inner_training_loop")
    own = {name: trainer.__dict__[name] for name in names if name in trainer.__dict__}
    if fix.shift_labels:
        trainer._loss_shifts_labels = True
    if fix.wrap:
        trainer.compute_loss = _weighted_loss(trainer, trainer.compute_loss, fix.per_items)
        trainer.loss_is_scaled_for_ga = True  # the wrapped loss is scaled for the step already
        if fix.per_items:
            trainer.model_accepts_loss_kwargs = True  # so that the Trainer counts each step's items
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
        for name in names:
            if name in own:
                trainer.__dict__[name] = own[name]
            else:
                trainer.__dict__.pop(name, None)
        trainer.__dict__.pop(_ACTIVE, None)

    prepared = Prepared(settings, retries, check, restore)
    trainer.__dict__[_ACTIVE] = prepared
    return prepared
