"""Learning-rate scaling rules, warm-up lengths and the BatchNorm momentum correction (pure).

Notation: ``kappa = effective_batch / base_batch``, where ``base_batch`` is the batch the learning
rate was tuned at.

- ``"linear"``: ``lr * kappa`` (Goyal et al. 2017, *Accurate, Large Minibatch SGD*), for SGD.
- ``"sqrt"``: ``lr * sqrt(kappa)`` (Malladi et al. 2022, *On the SDEs and Scaling Rules for Adaptive
  Gradient Algorithms*), for Adam-family optimizers.
- ``"none"``: keep the learning rate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "LRRule",
    "OptimizerSettings",
    "adjusted_bn_momentum",
    "auto_lr_rule",
    "lr_scale",
    "cap_warmup",
    "follow_batch",
    "warmup_steps",
]

# A warm-up longer than this share of the run is capped to it (a common warm-up ratio).
WARMUP_SHARE = 0.1

LRRule = Literal["linear", "sqrt", "none"]
LR_RULES: tuple[str, ...] = ("auto", "linear", "sqrt", "none")

# Class names, lower case, matched against the optimizer's class and its bases.
_LINEAR = {"sgd", "asgd"}
_SQRT = {
    "adam",
    "adamw",
    "adamax",
    "nadam",
    "radam",
    "sparseadam",
    "adagrad",
    "adadelta",
    "adafactor",
    "rmsprop",
}
# Layer-wise trust-ratio optimizers normalise the update themselves; they rely on warm-up alone.
_NONE = {"lars", "lamb", "lbfgs"}


def auto_lr_rule(class_names: Iterable[str]) -> LRRule:
    """Pick a scaling rule from an optimizer's class names (its own first, then its bases).

    SGD-like optimizers get ``"linear"``, Adam-family and other adaptive ones ``"sqrt"``, LARS, LAMB
    and L-BFGS ``"none"``; an optimizer autotune does not know also gets ``"none"``: we do not change
    what we do not understand.

    Example:
        >>> auto_lr_rule(["AdamW", "Adam", "Optimizer", "object"])
        'sqrt'
    """
    for name in class_names:
        key = name.lower()
        if key in _LINEAR:
            return "linear"
        if key in _SQRT:
            return "sqrt"
        if key in _NONE:
            return "none"
    return "none"


def lr_scale(kappa: float, rule: LRRule) -> float:
    """The factor to multiply every param group's learning rate by.

    Args:
        kappa: ``effective_batch / base_batch``; must be positive.
        rule: ``"linear"``, ``"sqrt"`` or ``"none"``.

    Example:
        >>> lr_scale(4.0, "sqrt")
        2.0
    """
    if not kappa > 0:
        raise ValueError(f"Invalid kappa {kappa!r}: effective_batch / base_batch must be positive")
    if rule == "linear":
        return kappa
    if rule == "sqrt":
        return math.sqrt(kappa)
    if rule == "none":
        return 1.0
    raise ValueError(f"Invalid lr_rule {rule!r}: use one of {', '.join(LR_RULES)}")


def warmup_steps(
    scale: float,
    rule: LRRule,
    *,
    beta2: float | None = None,
    steps_per_epoch: int | None = None,
) -> int | None:
    """Recommended linear warm-up length in optimizer steps, or ``None`` when none is needed.

    Warm-up is recommended whenever the learning rate grows (``scale > 1``):

    - ``"linear"`` (SGD): 5 epochs (Goyal et al. 2017); ``None`` if the epoch length is unknown.
    - ``"sqrt"`` (Adam family): ``2 / (1 - beta2)`` steps (Ma and Yarats 2021), 2000 for
      ``beta2=0.999``.
    """
    if scale <= 1.0:
        return None
    if rule == "linear":
        return 5 * steps_per_epoch if steps_per_epoch else None
    if rule == "sqrt":
        return math.ceil(2.0 / (1.0 - (0.999 if beta2 is None else beta2)))
    return None


def cap_warmup(steps: int | None, run_steps: int | None) -> tuple[int | None, str | None]:
    """Cap a recommended warm-up at :data:`WARMUP_SHARE` of the run when the run's length is known.

    Returns:
        ``(steps, note)``: the warm-up to use and, when it was capped, a sentence saying so.

    Example:
        >>> cap_warmup(2000, 120)
        (12, 'warm-up capped at 12 steps, 10% of a run of 120 steps (the rule gives 2000)')
    """
    if steps is None or run_steps is None or steps <= WARMUP_SHARE * run_steps:
        return steps, None
    capped = max(1, math.floor(WARMUP_SHARE * run_steps))
    return capped, f"warm-up capped at {capped} steps, {WARMUP_SHARE:.0%} of a run of {run_steps} steps (the rule gives {steps})"


def adjusted_bn_momentum(momentum: float, accumulation_steps: int) -> float:
    """BatchNorm momentum that keeps the per-optimizer-step decay of one big batch.

    With ``k`` micro-batch forwards per optimizer step the running statistics decay by
    ``(1 - m_k) ** k``; choosing ``m_k = 1 - (1 - m) ** (1 / k)`` makes that exactly ``1 - m``.

    Example:
        >>> round(adjusted_bn_momentum(0.1, 4), 6)
        0.025996
    """
    if not 0.0 <= momentum <= 1.0:
        raise ValueError(f"Invalid BatchNorm momentum {momentum!r}: it must lie in [0, 1]")
    if accumulation_steps < 1:
        raise ValueError(f"Invalid accumulation_steps {accumulation_steps!r}: it must be at least 1")
    return 1.0 - (1.0 - momentum) ** (1.0 / accumulation_steps)


@dataclass(frozen=True)
class OptimizerSettings:
    """Adam-family settings that follow the batch: the square-root SDE rule on every term.

    Malladi, Lyu, Panigrahi and Arora 2022, "On the SDEs and Scaling Rules for Adaptive Gradient
    Algorithms": for a batch ``kappa`` times larger, ``lr * sqrt(kappa)``, ``1 - beta1`` and
    ``1 - beta2`` times ``kappa``, ``eps / sqrt(kappa)``. Decoupled weight decay (AdamW) times
    ``sqrt(kappa)``, which keeps its timescale ``B / (lr * wd * D)`` constant (Wang and Aitchison
    2025). Warm-up ``2 / (1 - beta2)`` steps at the new beta2 (Ma and Yarats 2021), which is the same
    number of samples at any batch. The rule holds while ``kappa * (1 - beta) << 1``; the notes say
    when it does not.

    Attributes:
        kappa: target batch over the batch the settings were tuned at.
        betas: the new ``(beta1, beta2)``, kept in ``[0, 1)``.
        eps: the new epsilon.
        weight_decay: the new weight decay (None when unchanged: coupled L2 decay).
        warmup_steps: warm-up at the target batch, in optimizer steps.
        warmup_samples: the same warm-up in samples.
        notes: where the rule stretches.
    """

    kappa: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float | None
    warmup_steps: int
    warmup_samples: int
    notes: tuple[str, ...] = ()

    def apply(self, group: dict[str, Any]) -> dict[str, Any]:
        """The param group's settings moved to the target batch (its scheduled values transformed)."""
        out: dict[str, Any] = {}
        if "betas" in group:
            b1, b2 = group["betas"]
            out["betas"] = (_beta(b1, self.kappa), _beta(b2, self.kappa))
        if "eps" in group and group["eps"] is not None:
            out["eps"] = group["eps"] / math.sqrt(self.kappa)
        if self.weight_decay is not None and "weight_decay" in group:
            out["weight_decay"] = group["weight_decay"] * math.sqrt(self.kappa)
        return out


def _beta(beta: float, kappa: float) -> float:
    return min(max(1.0 - kappa * (1.0 - beta), 0.0), 1.0 - 1e-12)


def follow_batch(
    kappa: float, *, betas: tuple[float, float], eps: float, weight_decay: float, decoupled: bool, effective_batch: int
) -> OptimizerSettings:
    """:class:`OptimizerSettings` for a batch ``kappa`` times the one the settings were tuned at.

    Example:
        >>> s = follow_batch(4.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, decoupled=True, effective_batch=256)
        >>> [round(b, 6) for b in s.betas], s.eps, s.weight_decay, s.warmup_steps
        ([0.6, 0.996], 5e-09, 0.02, 500)
    """
    if not kappa > 0:
        raise ValueError(f"Invalid kappa {kappa!r}: effective_batch / base_batch must be positive")
    b1, b2 = _beta(betas[0], kappa), _beta(betas[1], kappa)
    notes = []
    for name, beta in (("beta1", betas[0]), ("beta2", betas[1])):
        if kappa * (1 - beta) > 0.5:
            notes.append(
                f"{name}={beta} at kappa={kappa:.3g}: kappa * (1 - {name}) = {kappa * (1 - beta):.2f} is not small, where the "
                "square-root rule stops holding; treat the new value as a starting point"
            )
    wd = weight_decay * math.sqrt(kappa) if (decoupled and weight_decay) else None
    if weight_decay and not decoupled:
        notes.append("coupled (L2) weight decay left as it is: the timescale rule is for decoupled decay (AdamW)")
    steps = math.ceil(2.0 / (1.0 - b2))
    return OptimizerSettings(kappa, (b1, b2), eps / math.sqrt(kappa), wd, steps, steps * effective_batch, tuple(notes))
