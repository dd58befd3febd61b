"""After an out-of-memory error in a window: undo this rank's attempt and cut the window smaller.
The one place where training lowers a micro-batch (the plan's, or a shape's cap)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from autotune.errors import AutotuneWarning, NothingFits
from autotune.memory.device import release_cached
from autotune.planning.plans import even_micro_batches, peak_at
from autotune.planning.scaling import adjusted_bn_momentum
from autotune.train.accumulate import Window

__all__ = ["lower", "retry_at_floor", "retry_smaller"]


def retry_smaller(run: Any, window: Window, failure: BaseException, bn_saved: list[list[torch.Tensor]]) -> Window:
    """Undo this rank's attempt and cut its window smaller (half the micro-batch that failed).

    With a shape model only the failed shape and longer ones get the smaller micro-batch;
    shorter ones keep theirs. Without one (fixed shapes) the plan's micro-batch is lowered.
    ``run`` is the :class:`autotune.train.run.Run`.
    """
    failed_size = getattr(failure, "autotune_micro_batch", window.micro_batch)
    failed_shape = getattr(failure, "autotune_micro_size", 0)
    failure.__traceback__ = None  # drop the frames that hold the attempt's tensors
    run.optimizer.zero_grad(set_to_none=True)
    for p in run.outside:
        p.grad = None
    run.restore_bn(bn_saved)
    release_cached(run.device, collect=True)
    floor = run.plan.min_micro_batch
    if failed_size <= floor and retry_at_floor(run, failed_size):
        return window
    if failed_size <= floor:
        raise NothingFits(
            f"Out of memory while training at micro_batch={failed_size}, twice (the window was retried once at that size): "
            "a batch of the loader is larger than anything the memory allows; shorten the longest samples, use "
            "precision='bf16', or raise memory_limit",
            needed=0,
            budget=run.plan.budget,
            limit=run.plan.memory_limit,
            micro_batch=failed_size,
        )
    smaller = max(floor, failed_size // 2)
    warnings.warn(
        f"Out of memory at micro_batch={failed_size}; retrying the window with micro_batch={smaller}",
        AutotuneWarning,
        stacklevel=5,  # retry_smaller, the mode's window, fit's loop, fit, the caller
    )
    if run.plan.shape_model is None:
        lower(run, smaller)
        return window.with_micro_batch(smaller)
    run.caps.correct(failed_shape, smaller)
    # The plan says what trains from here: the micro-batch its own (probed) shape now gets, and the
    # peak the ledger counts from now on (attempt replaces it), not the probe's.
    plan = run.plan
    micro = min(plan.micro_batch, run.caps.cap(plan.probed_size)) if plan.probed_size else plan.micro_batch
    share = sum(plan.micro_batches)
    sizes = even_micro_batches(share, micro) if micro < plan.micro_batch else plan.micro_batches
    run.lowered, run.measured = True, None
    run.plan = dataclasses.replace(
        plan, micro_batch=micro, micro_batches=sizes, accumulation_steps=len(sizes),
        notes=plan.notes + (
            f"out of memory while training at micro-batch {failed_size} of per-sample size {failed_shape}: "
            f"that size and longer ones capped at {smaller}",
        ),
    )
    return window.with_cap(run.caps.cap)


def retry_at_floor(run: Any, micro_batch: int) -> bool:
    """An out-of-memory error at the smallest micro-batch: the first in a window may be transient (memory
    another process held for a moment, the allocator's fragmentation), so the window is retried once at
    that size, the cache emptied first (True); a second in the same window is not (False)."""
    if run.retried_at_floor:
        return False
    run.retried_at_floor = True
    warnings.warn(
        f"Out of memory at micro_batch={micro_batch}, the smallest: retrying the window once at that size, the cached "
        "memory freed (the shortage may have been transient)",
        AutotuneWarning,
        stacklevel=6,  # here, retry_smaller (or the FSDP2 window's), the mode's window, fit's loop, fit, the caller
    )
    return True


def lower(run: Any, micro_batch: int, *, why: str = "") -> None:
    """Lower the plan's micro-batch for the rest of the run; every field follows. ``why``: said in the
    plan's note after the new size (default: this rank ran out of memory)."""
    plan = run.plan
    share = sum(plan.micro_batches)
    sizes = even_micro_batches(share, micro_batch)
    base = next((m for m, _ in run.bnc._saved if m is not None), None)
    run.lowered = True
    run.measured = None
    ranks = list(plan.rank_micro_batches)
    if ranks:
        ranks[run.rank] = micro_batch
    run.plan = dataclasses.replace(
        plan,
        micro_batch=micro_batch,
        accumulation_steps=len(sizes),
        micro_batches=sizes,
        rank_micro_batches=tuple(ranks),
        bn_momentum=None if (plan.bn_momentum is None or base is None) else adjusted_bn_momentum(base, len(sizes)),
        peak_memory=peak_at(plan, micro_batch),
        notes=plan.notes + (f"out of memory while training: micro-batch lowered to {micro_batch}{' ' + why if why else ''}",),
    )
