"""What ``fit`` checks without the model: a plan given (its ranks, its target) and the arguments
beside it that it contradicts, and the item count on the loader's first batches."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from autotune.checks import check_count_value, is_one_shot
from autotune.parallel.ranks import is_distributed, world
from autotune.planning.plans import Plan
from autotune.planning.scaling import auto_lr_rule
from autotune.rng import RNGState
from autotune.train.accumulate import Count

__all__ = ["check_against_plan", "check_count", "check_plan", "check_within_an_epoch"]


def check_plan(plan: Any, target_batch: int | None) -> None:
    if plan is None:
        return
    if not isinstance(plan, Plan):
        hint = " (a plan saved with to_dict() comes back with autotune.Plan.from_dict(data))" if isinstance(plan, (dict, str)) else ""
        raise TypeError(f"Invalid plan of type {type(plan).__name__}: pass an autotune.Plan{hint}")
    plan.check()
    _, world_size = world()
    if plan.world_size != world_size:
        raise ValueError(
            f"Invalid plan: it was made for {plan.world_size} rank(s) and this run has {world_size}; "
            "make a new plan in this run (autotune.plan on every rank)"
        )
    if target_batch is not None and target_batch != plan.effective_batch:
        raise ValueError(
            f"Invalid target_batch {target_batch!r}: the plan given trains {plan.effective_batch} "
            "samples per step; leave target_batch out or make a new plan"
        )


def check_against_plan(plan: Plan | None, optimizer: Any, *, lr_rule: str, base_batch: int | None, headroom: float | None) -> None:
    """Arguments given beside ``plan=`` that the plan contradicts: refused (the plan's would win silently)."""
    if plan is None:
        return
    fix = "leave it out (the plan's holds), or make a new plan with it"
    if lr_rule != "auto" and lr_rule != plan.lr_rule:
        raise ValueError(f"Invalid lr_rule {lr_rule!r} with plan=: the plan scales the learning rate by its own rule {plan.lr_rule!r} "
                         f"(x{plan.lr_scale:.4g}); {fix}")
    if base_batch is not None and base_batch != plan.base_batch:
        raise ValueError(f"Invalid base_batch {base_batch!r} with plan=: the plan's learning rate is scaled from batch "
                         f"{plan.base_batch}; {fix}")
    if headroom is not None and headroom != plan.headroom:
        raise ValueError(f"Invalid headroom {headroom!r} with plan=: the plan was made with headroom {plan.headroom:g}; {fix}")
    if optimizer is not None and plan.lr_scale != 1.0 and plan.lr_rule in ("linear", "sqrt"):
        family = auto_lr_rule(c.__name__ for c in type(optimizer).__mro__)
        if family in ("linear", "sqrt") and family != plan.lr_rule:
            raise ValueError(
                f"Invalid optimizer {type(optimizer).__name__} for this plan: it was made for {plan.optimizer or 'an optimizer'} "
                f"and scales the learning rate by the {plan.lr_rule} rule (x{plan.lr_scale:.4g}), while "
                f"{type(optimizer).__name__} takes the {family} rule; make the plan with this optimizer "
                "(autotune.plan(..., optimizer=optimizer))"
            )


def check_count(loader: Iterable[Any], count: Count | None, group: Any = None, *, max_batches: int = 8) -> None:
    """Call ``count`` on the first batches (generators restored after), so a bad count fails now."""
    if count is None:
        return
    if not callable(count):
        raise TypeError(f"Invalid count {count!r}: pass a function count(batch) -> int, or None")
    if is_one_shot(loader):  # looking would consume it
        return
    rng = RNGState(loader)
    try:
        seen = total = 0
        for batch in loader:
            total += check_count_value(count(batch))
            seen += 1
            if seen >= max_batches:
                break
    finally:
        rng.restore()
    if seen and total == 0 and not is_distributed():  # one rank's shard may start with no items
        raise ValueError(
            f"Invalid count: it returned 0 items for each of the first {seen} batches, so there is no loss "
            "to train on; check that it counts the loss's items (e.g. int((labels != -100).sum()))"
        )


def check_within_an_epoch(loader: Iterable[Any], target: int | None, world_size: int) -> None:
    """A fixed target larger than an epoch's samples (over all ranks) can never be trained: refused."""
    try:
        sampler = getattr(loader, "sampler", None)
        samples = (len(sampler) if sampler is not None else len(loader.dataset)) * world_size  # type: ignore[arg-type,attr-defined]
    except (AttributeError, TypeError):
        return
    if target is not None and 0 < samples < target:
        raise ValueError(
            f"Invalid target_batch {target}: an epoch has {samples} samples, so no step can train {target} (every epoch "
            f"would be one step of {samples}, at the learning rate meant for {target}); give a target of at most "
            f"{samples}, or more data per epoch"
        )
