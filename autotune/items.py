"""What a loss averages over, so that accumulation weights each micro-batch by its share of the step.

Accumulation is exact when micro-batch ``i``'s mean loss is weighted by ``n_i / N``, with ``n`` counted
in the units the loss averages over. A Transformers causal LM's own loss is the mean over its label
tokens shifted by one position (``labels[..., 1:] != -100``), a token classifier's over its labels that
are not -100, a sequence classifier's over samples: weighting a token mean by samples is the Trainer's
2024 gradient-accumulation bug, 8-17% off the big batch on variable-length data.

:func:`loss_items` tells which, by measurement where it can: the loss of two samples of a first batch
(those with the fewest and the most label tokens, so the rules disagree as much as they can), against
each sample's own loss weighted by its samples, its labels or its shifted labels. One rule reproduces the
pair's loss; it is the count. A batch that cannot tell (every sample with as many labels) leaves the
next one to; where none can, or nothing may run (an estimate on the meta device, ranks that must run the
same forwards), the model's kind decides (its ``loss_type``, e.g. ``ForCausalLM``; ``ForConditionalGeneration`` is a
vision-language model's causal LM loss, or an encoder-decoder's over its decoder's labels). Nothing changes: no
gradient, every module's mode and the RNGs put back.

For your own ``loss_fn`` nothing is assumed: ``count`` stays what you give, and where the measurement
shows that your loss is not a mean over samples the plan's notes say by how much weighting by samples
misses and which ``count=`` makes it exact.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from autotune import batches as B
from autotune.checks import is_one_shot
from autotune.rng import RNGState
from autotune.step import Precision, autocast, planning

__all__ = ["RULES", "WORDS", "Items", "count_for", "first_batch", "label_tokens", "labelled", "loss_items", "shifted_label_tokens"]

RULES = ("samples", "labels", "shifted labels")
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5}  # relative; half precision: 1e-2
_KINDS = {  # a Transformers model's loss_type -> what its own loss averages over
    "ForCausalLM": "shifted labels",
    "ForMaskedLM": "labels",
    "ForTokenClassification": "labels",
    "ForSequenceClassification": "samples",
    "ForImageClassification": "samples",
    "ForAudioClassification": "samples",
    "ForVideoClassification": "samples",
}
WORDS = {  # each rule of RULES in words
    "samples": "samples",
    "labels": "label tokens (labels != -100)",
    "shifted labels": "label tokens shifted by one position (labels[..., 1:] != -100)",
}
_FIX = {"labels": "autotune.label_tokens", "shifted labels": "autotune.shifted_label_tokens"}


def _labels(batch: Any) -> torch.Tensor | None:
    """The integer labels of a batch: a dict's ``labels``, or an ``(inputs, targets)`` pair's targets."""
    if isinstance(batch, Mapping):
        labels = batch.get("labels")
    elif isinstance(batch, (tuple, list)) and len(batch) == 2:
        labels = batch[1]
    else:
        return None
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        return None
    return labels


def label_tokens(batch: Any) -> int:
    """The labels of ``batch`` that are not -100 (a dict's ``labels``, or an ``(inputs, targets)`` pair's
    integer targets): what a token classifier's or a masked LM's loss, and ``F.cross_entropy`` with its
    default ``ignore_index``, average over. Pass it as ``count=`` to :func:`autotune.fit` or
    :func:`autotune.accumulate`.

    Raises:
        TypeError: the batch carries no integer labels.
    """
    labels = _labels(batch)
    if labels is None:
        raise TypeError(f"Invalid batch of type {type(batch).__name__} for label_tokens: it carries no integer labels "
                        "(a dict's 'labels', or an (inputs, targets) pair); pass a count of your own, count=lambda batch: ...")
    return int(labels.ne(-100).sum())


def shifted_label_tokens(batch: Any) -> int:
    """The labels of ``batch`` after the first position of each sequence that are not -100 (a dict's
    ``shift_labels`` as they are, when it has them): what a Transformers causal LM's own loss averages
    over, as the Trainer counts them. Pass it as ``count=`` to :func:`autotune.fit` or :func:`autotune.accumulate`.

    Raises:
        TypeError: the batch carries no integer labels.
    """
    if isinstance(batch, Mapping) and isinstance(batch.get("shift_labels"), torch.Tensor):
        return int(batch["shift_labels"].ne(-100).sum())
    labels = _labels(batch)
    if labels is None:
        raise TypeError(f"Invalid batch of type {type(batch).__name__} for shifted_label_tokens: it carries no integer labels "
                        "(a dict's 'labels'); pass a count of your own, count=lambda batch: ...")
    return int(labels[..., 1:].ne(-100).sum())


def count_for(rule: str) -> Callable[[Any], int] | None:
    """The ``count`` of a rule of :data:`RULES` (None for samples: accumulation's default)."""
    return {"samples": None, "labels": label_tokens, "shifted labels": shifted_label_tokens}[rule]


def _count(rule: str, batch: Any) -> int:
    counter = count_for(rule)
    return B.batch_size(batch) if counter is None else counter(batch)


@dataclasses.dataclass(frozen=True)
class Items:
    """What each micro-batch's loss is weighted by, and why.

    Attributes:
        rule: one of :data:`RULES`: what each micro-batch is weighted by.
        note: what the plan's notes say of it (None: nothing to say, a loss over samples as assumed).
    """

    rule: str = "samples"
    note: str | None = None


def first_batch(loader: Iterable[Any]) -> Any:
    """The loader's first batch, its generators put back (None for a one-shot iterator, or no batch)."""
    if is_one_shot(loader):
        return None
    rng = RNGState(loader)
    try:
        return next(iter(loader), None)
    finally:
        rng.restore()


def labelled(batch: Any) -> bool:
    """Whether ``batch`` carries integer labels to count: without them, and without a model of a known
    kind, there is nothing to tell and nothing is run."""
    return _labels(batch) is not None


def _kind(model: nn.Module) -> str | None:
    """A Transformers model's ``loss_type`` (``ForCausalLM``, ...), or None for other models."""
    try:
        kind = getattr(model, "loss_type", None)
    except Exception:  # a property of someone else's model that raises: no kind
        return None
    return kind if isinstance(kind, str) else None


def _own_rule(model: nn.Module, batch: Any) -> str | None:
    """What the default loss averages over, known without measuring: the model's kind for a
    Transformers model; for an ``(inputs, targets)`` pair, the default cross-entropy's non-ignored targets
    (integer targets) or mean squared error's samples."""
    kind = _kind(model)
    if isinstance(batch, Mapping):
        if kind == "ForConditionalGeneration":  # a vision-language model's own loss is its causal LM's; an encoder-decoder's
            # (T5, BART, Whisper) the mean over its decoder's labels, unshifted
            return "labels" if getattr(getattr(model, "config", None), "is_encoder_decoder", False) else "shifted labels"
        return _KINDS.get(kind) if kind is not None else None
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return "labels" if _labels(batch) is not None else "samples"
    return None


@dataclasses.dataclass
class _Measure:
    holds: set[str]  # the rules that reproduce the pair's loss
    tested: set[str]  # the rules that could be tried (items in both samples)
    ratio: float  # the pair's loss weighted by samples over its own loss


def _measure(model: nn.Module, loss_fn: Callable[..., Any], batch: Any, device: torch.device, precision: Precision, *,
             own: bool) -> _Measure | None:
    """Which rules reproduce the loss of the pair of samples whose label counts differ most (None when
    the batch cannot tell: fewer than two samples, or every sample with as many labels). Where labels
    cannot tell, the model's own loss is still checked to be a mean over samples (the batch's halves);
    your ``loss_fn`` is called only where labels can tell."""
    n = B.batch_size(batch)
    if n < 2:
        return None
    labels = _labels(batch)
    if labels is not None:
        per_sample = labels.reshape(n, -1).ne(-100).sum(1)
        countable = per_sample.masked_fill(per_sample < 2, -1)  # a sample with one label has no shifted one
        high = int(countable.argmax())
        low = int(countable.masked_fill(countable < 0, countable.max() + 1).argmin())
    if labels is not None and countable[low] >= 2 and countable[low] != countable[high]:
        pair = [B.slice_batch(batch, low, low + 1), B.slice_batch(batch, high, high + 1)]
        rules = RULES
    elif not own:
        return None
    else:  # nothing that tells labels from samples: whether the loss is a mean over samples at all
        pair = [B.slice_batch(batch, 0, n // 2), B.slice_batch(batch, n // 2, n)]
        rules = ("samples",)
    whole = B.concat(pair)

    def loss(b: Any) -> torch.Tensor:
        with autocast(device.type, precision):
            value = loss_fn(model, B.to_device(b, device))
        return value.detach().reshape(())

    values = [loss(whole), loss(pair[0]), loss(pair[1])]
    tol = _TOLERANCE.get(values[0].dtype, 1e-2)
    whole_loss, first, second = (float(v.double()) for v in values)
    holds, tested = set(), set()
    for rule in rules:
        a, b = _count(rule, pair[0]), _count(rule, pair[1])
        if a and b:
            tested.add(rule)
        if a and b and abs((first * a + second * b) / (a + b) - whole_loss) <= tol * max(abs(whole_loss), 1e-30):
            holds.add(rule)
    sizes = [B.batch_size(p) for p in pair]
    by_samples = (first * sizes[0] + second * sizes[1]) / n if len(rules) == 1 else (first + second) / 2
    return _Measure(holds, tested, by_samples / whole_loss if whole_loss else float("nan"))


def loss_items(model: nn.Module, loss_fn: Callable[..., Any] | None, loader: Iterable[Any], *, device: torch.device,
               precision: Precision = "fp32", measure: bool = True, max_batches: int = 4) -> Items:
    """What the loss averages over, and so what each micro-batch is weighted by (see the module docstring).

    Args:
        model: the module that trains, on ``device`` (unless ``measure`` is False).
        loss_fn: your loss, or None for the model's own (:func:`autotune.step.default_loss`).
        loader: the batches; its first ``max_batches`` are looked at, its generators put back.
        measure: run the loss (no gradient); False: the model's kind alone (an estimate without weights,
            or ranks whose forwards are collective).

    Returns:
        :class:`Items`: for the model's own loss, the rule it follows; for ``loss_fn``, samples (the rule
        of ``count=None``), with a note when the measurement shows the loss is a mean over other items.
    """
    from autotune.step import default_loss

    own = loss_fn is None or loss_fn is default_loss
    fn = loss_fn or default_loss
    first = None
    found: _Measure | None = None
    candidates = set(RULES)
    if measure and not is_one_shot(loader):
        rng = RNGState(loader)
        modes = [(m, m.training) for m in model.modules()]
        try:
            model.eval()
            with torch.no_grad(), planning():
                for batch in itertools.islice(loader, max_batches):
                    first = batch if first is None else first
                    try:
                        got = _measure(model, fn, batch, device, precision, own=own)
                    except Exception:  # the step itself will raise it, with its own context; here: not measured
                        break
                    if got is None:
                        continue
                    found = got
                    candidates &= got.holds | (set(RULES) - got.tested)
                    if not got.holds or len(candidates) <= 1:
                        break
        finally:
            for m, training in modes:
                m.training = training
            rng.restore()
    if first is None:
        first = first_batch(loader)
    known = _own_rule(model, first) if own else None
    return _decide(own, known, found, candidates, first, _kind(model), tried=measure)


def _decide(own: bool, known: str | None, found: _Measure | None, candidates: set[str], first: Any, kind: str | None, *,
            tried: bool = True) -> Items:
    """The rule, from what was measured and what the model's kind says."""
    whose = f"the model's own loss ({kind})" if own and kind else "the model's own loss" if own else "loss_fn"
    if found is not None and not found.holds:
        what = "nor over label tokens, shifted or not" if found.tested - {"samples"} else "(the batches carry no labels to count)"
        return Items("samples", (
            f"{whose} is not a mean over samples {what}: measured on a first batch, its parts weighted by their samples give "
            f"{found.ratio:.6g} times its loss, so no weighting of micro-batches makes a step the big batch's; each micro-batch "
            "is weighted by its samples"))
    measured = found is not None and len(candidates) == 1
    if measured:
        rule = next(iter(candidates))
    elif own and known in candidates:
        rule = known
    else:
        rule = "samples" if "samples" in candidates else sorted(candidates)[0]
    assert found is not None or not measured
    if not own:
        if rule == "samples" or found is None:
            return Items("samples")
        return Items("samples", (
            f"loss_fn is the mean over {WORDS[rule]}, not over samples (measured on two samples of a "
            f"first batch: weighted by their samples they give {found.ratio:.6g} times their loss, {abs(found.ratio - 1):.1%} "
            f"off), and with count=None each micro-batch is weighted by its samples, so steps are not the big batch's: pass "
            f"count={_FIX[rule]} (to fit or accumulate) for the big batch's gradient"))
    if kind is None and (rule == "samples" or not measured):
        return Items(rule)  # a default loss of ours, as documented: nothing found to say
    if measured and found is not None:
        why = "measured: the model's loss is their mean" + (
            f"; weighted by samples, two samples of a first batch give {found.ratio:.6g} times their loss "
            f"({abs(found.ratio - 1):.1%} off)" if rule != "samples" else "")
    else:
        source = f"by the model's kind, {kind}" if kind is not None and known == rule else "assumed"
        why = (f"{source}: the batches looked at could not tell, every sample holding as many label tokens" if tried else
               f"{source}: not measured, as nothing runs here (an estimate, or ranks that run every forward together)")
    held = ""
    if rule != "samples" and first is not None and _labels(first) is not None:
        held = f", {_count(rule, first):,} in the first batch"
    return Items(rule, f"{whose} is the mean over {WORDS[rule]}: each micro-batch is weighted by its own{held} ({why})")
