"""Checkpointing only as many blocks as a micro-batch needs: the count behind ``checkpointing="auto"``.

Full activation checkpointing recomputes every block's forward in the backward. Where a micro-batch fits with all of
the model's blocks checkpointed and not with none, checkpointing only some of them (the first ones, see
:mod:`autotune.memory.checkpointing`) recomputes less for the same micro-batch. The peak does not rise as more blocks
are checkpointed, so the fewest that fit are found by bisection over the count, one estimate per step
(:func:`fewest_blocks`). A plan with ``checkpointing="auto"`` takes the micro-batch it finds with every block
checkpointed, then that count, confirmed as the plan confirms any answer (a real step where it runs one): see
:func:`settle_auto`.
"""

from __future__ import annotations

from collections.abc import Callable

from autotune.memory.checkpointing import blocks
from autotune.probe.estimate import estimator_for
from autotune.probe.largest import probe
from autotune.probe.search import SearchResult
from autotune.probe.trial import Workload
from autotune.step import Snapshot

__all__ = ["fewest_blocks", "settle_auto"]


def fewest_blocks(work: Workload, b: int, budget: int, *, fits: Callable[[int], bool] | None = None,
                  confirm: bool = True) -> int:
    """The fewest of the model's blocks (the first ones) to checkpoint for micro-batch ``b`` to fit ``budget`` bytes.

    The peak does not rise with the count, so it is bisected between 0 and every block: about ``log2(blocks)`` steps.
    Every block is taken to fit (the caller found ``b`` with them); the answer is every block's count where no fewer do.

    Args:
        work: the workload (its model, optimizer, loss, batch, device and precision).
        b: the micro-batch.
        budget: the bytes the step may use.
        fits: ``fits(count) -> bool``, whether ``b`` fits with the first ``count`` blocks checkpointed (default: the
            estimate, :meth:`autotune.probe.estimate.Estimator.largest`, by the same rule the probe sizes with).
        confirm: with the default ``fits``, confirm the estimate's curve with a trace at ``b`` (see
            :meth:`~autotune.probe.estimate.Estimator.largest`).

    Returns:
        A count from 0 to the number of blocks.
    """
    total = len(blocks(work.model))
    if fits is None:

        def fits(count: int) -> bool:
            setting = True if count == total else (count or False)
            return estimator_for(work, checkpointing=setting).largest(budget, b, confirm=confirm)[0] >= b

    no, yes = -1, total  # fits(no) is taken as false, fits(yes) as true
    while yes - no > 1:
        mid = (no + yes) // 2
        if fits(mid):
            yes = mid
        else:
            no = mid
    return yes


def settle_auto(work: Workload, found: SearchResult, *, budget: int, snapshot: Snapshot, verify: bool) -> SearchResult:
    """``checkpointing="auto"``: the fewest blocks with which ``found``'s micro-batch (found with every block
    checkpointed) fits, set as ``work.checkpointing``, and the probe's answer with that count.

    The count comes from the estimate; the probe then answers again with it, capped at the micro-batch, so that the
    answer is confirmed as any other (by a real step where the plan runs one). Should that micro-batch not fit with the
    count after all, every block stays checkpointed, and a note says so. Without an estimate every block stays
    checkpointed (real steps would cost one trial per step of the bisection), also said in a note.
    """
    b, total = found.batch_size, len(blocks(work.model))
    if work.estimator is None:
        work.notes.append(f"checkpointing='auto': without an estimate, all {total} blocks checkpointed")
        return found
    count = fewest_blocks(work, b, budget, confirm=not (verify and work.device.type == "cpu"))
    if count == total:
        work.notes.append(f"checkpointing='auto': micro-batch {b} needs all {total} blocks checkpointed")
        return found
    kept = (work.estimator, work.curve, work.notes[:])
    work.checkpointing = count or False
    again = probe(work, upper=b, budget=budget, snapshot=snapshot, verify=verify)
    if again.batch_size < b:  # the confirming step disagrees with the estimate: keep what was found
        work.checkpointing, (work.estimator, work.curve, work.notes) = True, kept
        work.notes.append(f"checkpointing='auto': micro-batch {b} did not fit with {count} of {total} blocks checkpointed "
                          f"when run; all {total} checkpointed")
        return found
    if count == 0:
        work.notes.append(f"checkpointing='auto': no block checkpointed, micro-batch {b} fits without (estimated)")
    else:
        work.notes.append(f"checkpointing='auto': the first {count} of {total} blocks checkpointed, the fewest with which "
                          f"micro-batch {b} fits (estimated; {count - 1} do not); the others keep their activations and are "
                          "not recomputed")
    return again
