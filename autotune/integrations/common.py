"""What the trainer integrations share: a plan turned into equal micro-batches, said in words."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from autotune.planning.plans import Plan
from autotune.planning.report import equal_split
from autotune.planning.scaling import cap_warmup

__all__ = ["TrainerSettings", "equal_settings", "missing", "scale_gradients"]


def missing(package: str, extra: str) -> ImportError:
    """The error for a trainer that is not installed, naming the extra that installs it."""
    return ImportError(f"{package} is not installed: pip install 'torch-autotune[{extra}]' (or pip install {package})")


@dataclass(frozen=True)
class TrainerSettings:
    """A plan in a trainer's terms: equal micro-batches, as these trainers need.

    Attributes:
        plan: the plan (``plan.micro_batch`` is the largest micro-batch that fits; the trainer gets
            the largest equal one that reaches the target exactly).
        micro_batch: samples per device per micro-batch (the trainer's per-device batch).
        accumulation_steps: micro-batches per optimizer step.
        world_size: devices.
        learning_rate: the learning rate set (None: left as it was, ``lr_rule="none"``).
        warmup_steps: the warm-up set (None: left as it was).
        notes: what a user should know: the split's cost against the plan's uneven one, the learning
            rate left or scaled, where the trainer's accumulation is inexact.
    """

    plan: Plan
    micro_batch: int
    accumulation_steps: int
    world_size: int
    learning_rate: float | None = None
    warmup_steps: int | None = None
    notes: tuple[str, ...] = ()

    @property
    def effective_batch(self) -> int:
        """Samples per optimizer step over all devices: the target, exactly."""
        return self.micro_batch * self.accumulation_steps * self.world_size

    def to_dict(self) -> dict[str, Any]:
        """Plain values (JSON-ready): what :meth:`from_dict` reads back."""
        data = dataclasses.asdict(self)
        data["plan"], data["notes"] = self.plan.to_dict(), list(self.notes)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerSettings:
        """The settings :meth:`to_dict` wrote."""
        return cls(**{**data, "plan": Plan.from_dict(data["plan"]), "notes": tuple(data["notes"])})

    def __str__(self) -> str:
        lines = [
            f"{self.micro_batch} per device x {self.accumulation_steps} accumulation steps x {self.world_size} device(s) = "
            f"{self.effective_batch} samples per optimizer step (largest micro-batch that fits: {self.plan.micro_batch})"
        ]
        if self.learning_rate is not None:
            lines.append(f"learning rate {self.learning_rate:.6g} ({self.plan.lr_rule} rule, x{self.plan.lr_scale:.4g})")
        if self.warmup_steps is not None:
            lines.append(f"warm-up {self.warmup_steps} steps")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def _base_momentum(plan: Plan) -> float:
    """The model's BatchNorm momentum, from the plan's adjusted one for its own accumulation."""
    assert plan.bn_momentum is not None
    return 1 - (1 - plan.bn_momentum) ** plan.accumulation_steps


def equal_settings(plan: Plan, *, lr_rule: str, learning_rate: Any = None, warmup: bool = True, exactness: str | None = None,
                   had_warmup: bool = False, run_steps: int | None = None) -> TrainerSettings:
    """The trainer's settings for ``plan``: the largest equal micro-batch that reaches the target
    exactly on every device (:func:`autotune.planning.report.equal_split`: under data parallelism, from the
    smallest rank's micro-batch), the learning rate when a rule is asked, warm-up when the learning
    rate grows and none is set (at most 10% of ``run_steps`` when the run's length is known), and
    the notes.

    Raises:
        ValueError: the target does not divide evenly over the devices (these trainers need the same
            micro-batch on every device).
    """
    split = equal_split(plan)
    if split.per_device is None or split.steps is None:
        raise ValueError(f"Invalid target_batch {plan.effective_batch}: {split.note}")
    notes = [split.note] if split.note else []
    lr = None
    if lr_rule == "none":
        notes.append("learning rate left as it is (lr_rule='none'); pass lr_rule='auto', 'sqrt' or 'linear' to scale it to the target")
    elif learning_rate is not None and plan.lr_scale != 1.0:
        lr = float(learning_rate) * plan.lr_scale
        notes.append(f"learning rate scaled x{plan.lr_scale:.4g} ({plan.lr_rule} rule) from batch {plan.base_batch} ({plan.base_batch_source})")
    steps = None
    if warmup and lr is not None and plan.lr_scale > 1 and plan.warmup_steps and not had_warmup:
        steps, capped = cap_warmup(plan.warmup_steps, run_steps)
        if capped:
            notes.append(capped)
    if exactness:
        notes.append(exactness)
    if plan.bn_momentum is not None and split.steps > 1:
        notes.append(
            f"BatchNorm: every micro-batch updates its running statistics, {split.steps} times per step; a momentum of "
            f"{1 - (1 - _base_momentum(plan)) ** (1 / split.steps):.4g} per micro-batch keeps the big batch's decay per step "
            "(autotune.fit sets it for you)"
        )
    return TrainerSettings(plan, split.per_device, split.steps, plan.world_size, lr, steps, tuple(notes))


def scale_gradients(optimizer: Any, scale: float) -> None:
    """Multiply the gradients of ``optimizer``'s parameters by ``scale``, in place (a step's sums over
    items become its mean, in the item-weighted accumulation of the Lightning and Accelerate integrations)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad.mul_(scale)
