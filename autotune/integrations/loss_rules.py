"""The Hugging Face Trainer's loss, measured and made the big batch's.

:func:`check_loss` evaluates the Trainer's own ``compute_loss`` (the model's loss, a
``compute_loss_func``, a label smoother, a TRL trainer's loss) on one batch of the Trainer's data, with
two item counts and on two halves, and learns its rule (:class:`LossCheck`): whether it divides by
the ``num_items_in_batch`` the Trainer passes, and whether it is a mean over the labelled items (the
Trainer's count, or the same over labels shifted by one position), a mean over samples, a sum, or
none of these (a loss that couples the samples of a batch, such as a contrastive one). Tolerances
follow the dtype the loss comes in.

:func:`correction` says what makes the Trainer's steps the big batch's for that rule, and
:func:`weighted` is the ``compute_loss`` that does it: each micro-batch's loss weighted by its share
of the step (its items or samples over the step's, summed over the devices, times the devices as
DDP averages), whatever the split, an epoch's short last step included. The step's totals come from
the Trainer's own ``get_batch_samples`` (:func:`counting`), which collects a step's micro-batches
before the first of them trains.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from autotune.batches import slice_batch
from autotune.integrations.rows import ONE_ROW, Rows
from autotune.rng import RNGState
from autotune.step import planning

__all__ = ["LossCheck", "check_loss", "check_packed", "correction", "counting", "packed", "trainer_count", "weighted"]

_TOLERANCE = {torch.float64: 1e-7, torch.float32: 1e-4}  # relative; half precision: 2e-2


def count(batch: Mapping[str, Any], *, shifted: bool) -> int:
    """The items the Trainer counts in ``batch`` (its ``_get_num_items_in_batch`` rule, on one batch)."""
    if "shift_labels" in batch:
        labels = batch["shift_labels"]
    else:
        labels = batch["labels"][..., 1:] if shifted else batch["labels"]
    return int(labels.ne(-100).sum())


def _labelled(batch: Any) -> bool:
    return isinstance(batch, Mapping) and torch.is_tensor(batch.get("labels"))


def _told(trainer: Any) -> bool:
    """The Trainer counts a step's items and passes them on (to the model or a ``compute_loss_func``)."""
    return bool(trainer.model_accepts_loss_kwargs) or trainer.compute_loss_func is not None


def trainer_count(trainer: Any, batch: Any) -> torch.Tensor | None:
    """The ``num_items_in_batch`` the Trainer would pass for a step of this one batch (None where it
    passes none): what planning hands a ``compute_loss_func`` that divides by it."""
    if not _told(trainer) or not _labelled(batch):
        return None
    return torch.tensor(count(batch, shifted=bool(getattr(trainer, "_loss_shifts_labels", False))), device=trainer.args.device)


def token_multiplier(trainer: Any) -> int:
    """What the Trainer multiplies a counted loss by: the processes, when the count is summed over
    them (``average_tokens_across_devices``), because DDP then averages the gradients."""
    if getattr(trainer.args, "average_tokens_across_devices", False):
        return max(1, int(getattr(trainer.accelerator, "num_processes", 1)))
    return 1


def _world(trainer: Any) -> int:
    return max(1, int(getattr(trainer.args, "world_size", 1)))


def _close(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol * max(abs(a), abs(b), 1e-30)


@contextlib.contextmanager
def metrics_kept(trainer: Any) -> Iterator[None]:
    """TRL's trainers record metrics in every ``compute_loss``: what planning and the loss check add
    to them is taken out again."""
    metrics = copy.deepcopy(trainer.__dict__.get("_metrics"))
    try:
        yield
    finally:
        if metrics is not None:
            trainer.__dict__["_metrics"] = metrics


@dataclasses.dataclass(frozen=True)
class LossCheck:
    """What the Trainer's loss does, measured on one batch.

    Attributes:
        uses_count: the loss divides by the ``num_items_in_batch`` it is given (True), ignores it
            (False), or neither (None: it depends on it some other way, or the batch has no labels
            to count).
        own_items: the items the loss averages over by itself on that batch, when it divides by the
            count (None when it cannot be told: it needs the count).
        counted: the items the Trainer counts on that batch (labels that are not -100; 0 without labels).
        shifted: the same over labels shifted by one position (what a causal LM predicts).
        mean_over_items: halves of the batch, weighted by the items the Trainer counts, give the whole
            batch's loss.
        mean_over_shifted: the same, by the items over shifted labels.
        mean_over_samples: halves weighted by their samples give the whole batch's loss.
        sum_over_samples: the halves' losses add up to the whole batch's.
        halves: the mean of the two halves' losses over the whole batch's (what equal weights, the
            Trainer's division by the accumulation steps, make of the loss), when it was measured.
        skips_first: a loss that divides by the count but needs it (``own_items`` None) is unchanged when
            the labels at position 0 are masked: its sum runs over labels shifted by one position (None:
            not measured).
        tolerance: the relative tolerance of the comparisons, from the dtype of the loss.
        packed: for a padding-free collator (one flattened row per micro-batch), the loss of a row of
            several packed sequences over the same sequences' losses each alone in a row, weighted as
            the rule weights micro-batches (:func:`check_packed`): 1 where the model keeps the packed
            sequences apart (None: not measured).
    """

    uses_count: bool | None
    own_items: float | None
    counted: int
    shifted: int
    mean_over_items: bool
    mean_over_shifted: bool
    mean_over_samples: bool
    sum_over_samples: bool
    halves: float | None
    tolerance: float
    skips_first: bool | None = None
    packed: float | None = None


def check_loss(trainer: Any, batch: Mapping[str, Any], rows: Rows = ONE_ROW,
               halves: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None) -> LossCheck | None:
    """Evaluate the Trainer's loss on ``batch`` (one sample per row, see :class:`Rows`; no gradient,
    every module in eval mode, under :func:`autotune.planning`) with two item counts and on two
    halves, and say what it does (:class:`LossCheck`). ``halves``: the two halves of the batch as
    the collator makes them (each padded to its own longest, as micro-batches are: a loss that
    depends on the padding then shows it); default: the batch cut in two. Nothing is changed: the
    modules' modes, the RNGs and the Trainer's recorded metrics are put back. None when the batch
    has fewer than two samples."""
    model = trainer.model
    n_rows = rows.samples_in(rows.to_rows(batch)) if isinstance(batch, Mapping) else 0
    if n_rows < 2:
        return None
    batch = trainer._prepare_inputs(dict(batch))
    own_shift = bool(getattr(trainer, "_loss_shifts_labels", False))
    labelled = _labelled(batch) and count(batch, shifted=own_shift) > 0
    counted = count(batch, shifted=own_shift) if labelled else 0
    shifted = count(batch, shifted=True) if labelled else 0
    modes = [(m, m.training) for m in model.modules()]
    rng = RNGState()
    dtypes = []

    def loss(b: Mapping[str, Any], n: int | None = None) -> float:
        items = None if n is None else torch.tensor(n, device=trainer.args.device)
        value = trainer.compute_loss(model, dict(rows.to_rows(b)), num_items_in_batch=items).detach()
        dtypes.append(value.dtype)
        return float(value.double().mean())

    try:
        model.eval()
        with torch.no_grad(), planning(), metrics_kept(trainer):
            uses: bool | None = None
            own_items = None
            skips_first = None
            if labelled:
                with_count, with_triple = loss(batch, counted), loss(batch, 3 * counted)
                tol = _TOLERANCE.get(dtypes[0], 2e-2)
                if _close(with_count, with_triple, tol):
                    uses = False
                elif _close(with_count * counted, with_triple * 3 * counted, tol):
                    uses = True
                    with contextlib.suppress(Exception):  # a compute_loss_func that needs the count
                        plain = loss(batch)
                        if plain != 0:
                            own_items = with_count / token_multiplier(trainer) * counted / plain
                    if own_items is None:
                        skips_first = _skips_first(batch, counted, with_count, loss, tol)
            else:
                tol = _TOLERANCE.get(torch.float64, 1e-7)

            def alone(b: Mapping[str, Any]) -> float:
                n = count(b, shifted=own_shift) if labelled and _told(trainer) else None
                return loss(b, n) / token_multiplier(trainer) if uses else loss(b, n)

            if halves is None:
                a, b = slice_batch(batch, 0, n_rows // 2), slice_batch(batch, n_rows // 2, n_rows)
            else:
                a, b = (trainer._prepare_inputs(dict(h)) for h in halves)
            half = rows.samples_in(rows.to_rows(a))
            found = dict(mean_over_items=False, mean_over_shifted=False, mean_over_samples=False, sum_over_samples=False)
            ratio = None
            if uses is not None or not labelled:
                whole, la, lb = alone(batch), alone(a), alone(b)
                if not labelled:
                    tol = _TOLERANCE.get(dtypes[-1], 2e-2)
                if labelled and count(a, shifted=own_shift) and count(b, shifted=own_shift):
                    for key, n, shift in (("mean_over_items", counted, own_shift), ("mean_over_shifted", shifted, True)):
                        ca, cb = count(a, shifted=shift), count(b, shifted=shift)
                        found[key] = _close(whole * n, la * ca + lb * cb, tol)
                found["mean_over_samples"] = _close(whole * n_rows, la * half + lb * (n_rows - half), tol)
                found["sum_over_samples"] = _close(whole, la + lb, tol)
                ratio = (la + lb) / 2 / whole if whole else None
    finally:
        for m, training in modes:
            m.training = training
        rng.restore()
    return LossCheck(uses, own_items, counted, shifted, halves=ratio, tolerance=tol, skips_first=skips_first, **found)


def _skips_first(batch: Mapping[str, Any], counted: int, with_count: float, loss: Callable[..., float], tol: float) -> bool | None:
    """Whether the loss, given the same count, is unchanged with the labels at position 0 masked (-100):
    then its sum leaves them out, as a causal LM's shifted loss does. None where no label there counts."""
    if "shift_labels" in batch:
        return None
    labels = batch["labels"].clone()
    labels[..., 0] = -100
    masked = {**batch, "labels": labels}
    if count(masked, shifted=False) == count(batch, shifted=False):
        return None
    return _close(loss(masked, counted), with_count, tol)


def check_packed(trainer: Any, whole: Mapping[str, Any], parts: list[Mapping[str, Any]], check: LossCheck | None) -> float | None:
    """The Trainer's loss on ``whole`` (several sequences flattened into one row, as a padding-free
    collator makes a micro-batch) over its losses on ``parts`` (the same sequences, each alone in a
    row), weighted as ``check``'s rule weights micro-batches: a loss that divides by the count it is
    told gets the whole's count for every part, a mean over the labelled items weights each part by its
    items, a sum adds them. 1, within the loss's precision, where the model keeps the packed sequences
    apart (attention within each sequence, positions restarting at each); another value where a token
    sees the sequences before it in the row. Evaluated as :func:`check_loss` evaluates (no gradient,
    eval mode; nothing changed). None where ``check`` found no such rule (a mean over samples: a
    flattened row is one sample to the loss) or the row counts no labelled items."""
    if check is None or not check.counted:
        return None
    model = trainer.model
    own_shift = bool(getattr(trainer, "_loss_shifts_labels", False))
    if check.uses_count:
        shift: bool | None = None
    elif check.mean_over_items or check.mean_over_shifted:
        shift = own_shift if check.mean_over_items else True
    elif check.sum_over_samples:
        shift = None
    else:
        return None
    modes = [(m, m.training) for m in model.modules()]
    rng = RNGState()
    try:
        model.eval()
        with torch.no_grad(), planning(), metrics_kept(trainer):
            row, alone = trainer._prepare_inputs(dict(whole)), [trainer._prepare_inputs(dict(p)) for p in parts]
            counted = count(row, shifted=own_shift) if _labelled(row) else 0
            if not counted:
                return None

            def loss(b: Mapping[str, Any], n: int | None) -> float:
                items = None if n is None else torch.tensor(n, device=trainer.args.device)
                return float(trainer.compute_loss(model, dict(b), num_items_in_batch=items).detach().double().mean())

            def told(b: Mapping[str, Any]) -> int | None:  # the count the Trainer passes a micro-batch alone, as check_loss does
                return count(b, shifted=own_shift) if _told(trainer) else None

            if check.uses_count:  # every micro-batch of a step is given the step's count
                got, apart = loss(row, counted), sum(loss(p, counted) for p in alone)
            elif shift is not None:
                if not count(row, shifted=shift):
                    return None
                got = loss(row, told(row))
                apart = sum(loss(p, told(p)) * count(p, shifted=shift) for p in alone) / count(row, shifted=shift)
            else:
                got, apart = loss(row, told(row)), sum(loss(p, told(p)) for p in alone)
    finally:
        for m, training in modes:
            m.training = training
        rng.restore()
    return got / apart if apart else None


@dataclasses.dataclass(frozen=True)
class Correction:
    """What makes the Trainer's loss rule exact for the model, and the note that says so.

    ``rule`` names what each micro-batch is weighted by in training (:func:`weighted`): ``"items"``
    or ``"shifted"`` (its items over the step's), ``"samples"``, ``"sum"`` (the devices only),
    ``"count"`` (the Trainer's count, summed over the devices), ``"steps"`` (the accumulation steps
    of the step, the Trainer's rule for a head that ignores the count it is told), or None (the
    Trainer's own rule stands).
    """

    exactness: str
    shift_labels: bool = False
    rule: str | None = None


_LAST_STEP = "for any split of a step, an epoch's short last step included"


def correction(trainer: Any, model: Any, check: LossCheck | None) -> Correction:
    """The Trainer's loss rule for this model, measured (:class:`LossCheck`), and what makes it exact."""
    found = _measured(trainer, model, check)
    if getattr(trainer, "calculate_KL", False) is True and found.exactness.startswith("exact"):
        # KTO: every sample's loss is taken against a reference point, the KL estimate over the whole (micro-)batch;
        # at the check the policy is the reference model, so that estimate is 0 on any batch and cannot show
        return dataclasses.replace(found, exactness=(
            f"not exact once the policy leaves the reference model: {type(trainer).__name__} takes each sample's loss against "
            "a KL estimate averaged over its micro-batch (detached), so k micro-batches use k estimates where the big batch "
            "uses one (not measurable at the start, where the policy is the reference and the estimate is 0); otherwise "
            + found.exactness))
    return found


def packed(found: Correction, check: LossCheck | None, samples: int) -> Correction:
    """``found`` (the rule measured on padded batches) for a Trainer that trains padding-free rows, by
    what :func:`check_packed` measured on a row of ``samples`` samples flattened (``check.packed``)."""
    ratio = None if check is None else check.packed
    if ratio is None:
        if not found.exactness.startswith("exact"):
            return found
        return dataclasses.replace(found, exactness=(
            "not checked on the padding-free rows the Trainer trains (a flattened row is compared with its samples apart only "
            "for a loss divided by the count it is told, a mean over the labelled items or a sum, on two labelled samples or "
            f"more); on the same sequences padded: {found.exactness}"))
    assert check is not None  # it holds the ratio
    if _close(ratio, 1.0, check.tolerance):
        return dataclasses.replace(found, exactness=(
            f"{found.exactness}; checked on the padding-free rows too: a row of {samples} samples flattened has the loss of "
            "those samples each alone in a row (the model keeps the packed sequences apart)"))
    return dataclasses.replace(found, exactness=(
        f"not exact: the Trainer trains padding-free rows, and the loss of a row of {samples} samples flattened is "
        f"{ratio:.6g} times theirs taken one per row: the model lets a token see the sequences before it in the row "
        "(its attention reads no sequence boundaries from position_ids: another attn_implementation, or use_cache=False, "
        "may keep them apart), so a micro-batch's gradient depends on which sequences share its row (far more than this loss "
        f"ratio shows) and no split is the big batch's; on the same sequences padded: {found.exactness}"))


def _measured(trainer: Any, model: Any, check: LossCheck | None) -> Correction:
    name = type(model).__name__
    told = _told(trainer)
    world = _world(trainer)
    across = world > 1 and not getattr(trainer.args, "average_tokens_across_devices", False)
    if check is None:
        return Correction("not checked: the batches hold fewer than two samples to compare; the Trainer's rule stands", rule="steps" if told else None)
    if check.uses_count:
        devices = (f"; with average_tokens_across_devices=False the {world} devices would weigh equally whatever items they count: "
                   "autotune passes the step's count summed over the devices instead, as True does") if across else ""
        rule = "count" if across else None
        unshifted_count = not getattr(trainer, "_loss_shifts_labels", True) and check.shifted != check.counted
        if check.own_items is None and check.skips_first and unshifted_count:
            return Correction(
                "exact against the Trainer's own big batch: it divides each micro-batch's summed loss by the items of the whole "
                f"step (num_items_in_batch), {_LAST_STEP}; but that count is not the items the loss sums: the loss leaves out "
                "the labels at position 0 (measured: masking them changes nothing, as a shifted causal-LM loss does) while the "
                f"Trainer counts them ({name}'s loss_type is unset), so every step's loss and gradient are (tokens - sequences) "
                f"/ tokens of the token mean's, with or without autotune: {check.shifted / check.counted:.3g} on a checked batch "
                f"({check.shifted} of {check.counted} labels). Setting model.loss_type = 'ForCausalLM' before building the "
                f"Trainer makes it count the shifted labels{devices}", rule=rule)
        if check.own_items is None or _close(check.own_items, check.counted, 1e-3):
            how = ("that its sum runs over the same items is not measured (the loss needs the count)" if check.own_items is None
                   else "checked")
            return Correction("exact: the Trainer divides each micro-batch's summed loss by the items of the whole step "
                              f"(num_items_in_batch), {_LAST_STEP}, and the loss divides by that count ({how}){devices}", rule=rule)
        if _close(check.own_items, check.shifted, 1e-3) and not getattr(trainer, "_loss_shifts_labels", True):
            return Correction(
                "exact: the Trainer divides each micro-batch's summed loss by the items of the whole step (num_items_in_batch); "
                f"it counted them over unshifted labels (position 0 of every sequence included) while {name}'s loss shifts them "
                "(its loss_type is unset), which scales each step by (tokens - sequences) / tokens: corrected for this Trainer "
                "(restore() puts it back); setting model.loss_type = 'ForCausalLM' before building a Trainer avoids it"
                f"{devices}", shift_labels=True, rule=rule)
        ratio = check.own_items / check.counted
        return Correction(
            f"not exact: the loss divides by num_items_in_batch, but on a batch where the Trainer counts {check.counted} items "
            f"it averages over {check.own_items:.6g} by itself, so each step is about {ratio:.4g} times the big batch's "
            "gradient; autotune.fit or autotune.accumulate weight each micro-batch by its items")
    if check.uses_count is None and check.counted:
        return Correction(
            "not checked: the loss depends on num_items_in_batch in a way autotune does not recognise (it neither ignores the "
            "count nor divides by it), so whether a step is the big batch's is not known; the Trainer's rule stands")
    # a Trainer subclass with its own compute_loss (TRL's) computes the loss itself
    owner = name if type(trainer).compute_loss.__qualname__ == "Trainer.compute_loss" else f"{type(trainer).__name__} (for {name})"
    if not check.counted:
        what = f"{owner}'s loss (the batches carry no labels tensor, so the Trainer counts no items)"
    elif told:
        what = f"{owner}'s loss ignores num_items_in_batch (k times the true gradient under the Trainer alone, transformers #47688)"
    else:
        what = f"{name}'s forward takes no loss keywords, so the Trainer divides each micro-batch's loss by the accumulation steps"
    weights = f"the big batch's loss {_LAST_STEP}, on any number of devices, logged loss included (restore() puts the Trainer's rule back)"
    if check.mean_over_items:
        return Correction(f"exact: {what}; it is the mean over the labelled items, and autotune weights each micro-batch's "
                          f"mean by its items over the step's (n_i / N): {weights}", rule="items")
    if check.mean_over_shifted:
        return Correction(f"exact: {what}; it is the mean over the labelled items after a shift by one position (position 0 of "
                          f"each sequence predicts nothing), and autotune weights each micro-batch's mean by those items over the "
                          f"step's: {weights}", rule="shifted")
    if check.mean_over_samples:
        return Correction(f"exact: {what}; it is the mean over samples, and autotune weights each micro-batch's mean by its "
                          f"samples over the step's: {weights}", rule="samples")
    if check.sum_over_samples:
        return Correction(f"exact: {what}; it is a sum over the batch, and autotune adds the micro-batches' sums undivided: "
                          f"the big batch's sum {_LAST_STEP}, logged loss included", rule="sum")
    factor = f"{check.halves:.4g}" if check.halves is not None else "an unmeasured factor"
    why = ("it couples the samples of a batch (a contrastive loss, or one normalised over the batch)" if not check.counted else
           "it is neither a mean over the labelled items (shifted or not), nor over samples, nor a sum")
    return Correction(
        f"not exact: {what}, and {why}: on a checked batch the mean of its two halves' losses is {factor} times the whole "
        "batch's loss, so no weighting of micro-batches makes a step the big batch's; autotune divides each micro-batch by "
        "the accumulation steps (equal weights)", rule="steps" if told else None)


def counting(trainer: Any, original: Callable[..., Any], rule: str, rows: Rows, step: dict[str, Any]) -> Callable[..., Any]:
    """``trainer.get_batch_samples`` that also records in ``step`` the step's samples and items (the
    rule's count), summed over the devices, before the step's first micro-batch trains."""
    shift = rule == "shifted" or bool(getattr(trainer, "_loss_shifts_labels", False))

    def get_batch_samples(epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        batch_samples, num_items = original(epoch_iterator, num_batches, device)
        totals = torch.tensor([[float(rows.samples_in(b)), float(count(b, shifted=shift) if _labelled(b) else 0)] for b in batch_samples]
                              or [[0.0, 0.0]], dtype=torch.float64).sum(0)
        if _world(trainer) > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            totals = totals.to(device)
            torch.distributed.all_reduce(totals)
        step["samples"], step["items"] = float(totals[0]), float(totals[1])
        return batch_samples, num_items

    return get_batch_samples


def weighted(trainer: Any, original: Callable[..., Any], rule: str, rows: Rows, step: dict[str, Any]) -> Callable[..., Any]:
    """``trainer.compute_loss`` with each micro-batch weighted by ``rule`` (:class:`Correction`), in
    training; the Trainer's own outside it."""
    world = _world(trainer)
    shift = rule == "shifted" or bool(getattr(trainer, "_loss_shifts_labels", False))

    def compute_loss(model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        if not model.training or "samples" not in step:
            return original(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        scale = 1.0
        if rule == "count":
            passed: Any = torch.tensor(step["items"], device=trainer.args.device).to(torch.int64)
            scale = world / token_multiplier(trainer)
        else:
            # The loss does not divide by a count: a model is not given one (one without **kwargs, told here that it
            # takes them, must not receive it); a compute_loss_func is given the Trainer's, as it would be.
            passed = num_items_in_batch if trainer.compute_loss_func is not None else None
            if passed is not None:
                scale /= token_multiplier(trainer)
            if rule in ("items", "shifted"):
                scale *= (count(inputs, shifted=shift) if _labelled(inputs) else 0) * world / max(step["items"], 1.0)
            elif rule == "samples":
                scale *= rows.samples_in(inputs) * world / max(step["samples"], 1.0)
            elif rule == "sum":
                scale *= world
            else:  # "steps"
                scale /= trainer.current_gradient_accumulation_steps
        out = original(model, inputs, return_outputs=return_outputs, num_items_in_batch=passed)
        loss, rest = (out[0], out[1:]) if return_outputs else (out, ())
        loss = loss * scale
        return (loss, *rest) if return_outputs else loss

    return compute_loss
