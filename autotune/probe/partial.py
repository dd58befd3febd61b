"""Checkpointing only as many blocks as a micro-batch needs: the count behind ``checkpointing="auto"``.

Full activation checkpointing recomputes every block's forward in the backward. Where a micro-batch fits with all of
the model's blocks checkpointed and not with none, checkpointing only some of them (the first ones, see
:mod:`autotune.memory.checkpointing`) recomputes less for the same micro-batch. The peak does not rise as more blocks
are checkpointed, so the fewest that fit are found by bisection over the count, one estimate per step
(:func:`fewest_blocks`). A plan with ``checkpointing="auto"`` takes the micro-batch it finds with every block
checkpointed, then that count, confirmed as the plan confirms any answer (a real step where it runs one): see
:func:`settle_auto`.

Where the plan is for a card whose step time can be predicted (:mod:`autotune.memory.timing`), a smaller micro-batch
with fewer blocks checkpointed may be the faster: the recomputed forwards are about a third more compute for every
block checkpointed, against a matmul that runs a little less efficiently at fewer samples, and more micro-steps of
the host's dispatch. "auto" then weighs the largest micro-batch and its halves down to an eighth, each with the fewest
blocks it needs, and takes the shortest predicted optimizer step for the target (:func:`fastest_setting`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autotune.memory.checkpointing import blocks
from autotune.memory.timing import predict, seconds
from autotune.probe.estimate import estimator_for
from autotune.probe.largest import probe
from autotune.probe.search import SearchResult
from autotune.probe.trial import Workload
from autotune.step import Snapshot, min_micro_batch

__all__ = ["fastest_setting", "fewest_blocks", "settle_auto"]


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


def fastest_setting(work: Workload, b: int, budget: int, *, card: Any, share: int, confirm: bool = True) -> tuple[int, int, list[str]]:
    """The micro-batch and count of checkpointed blocks with the shortest predicted optimizer step of ``share`` samples
    on ``card``: ``b`` (found with every block checkpointed) and its halves down to an eighth, each split evenly over
    the share and with the fewest blocks it needs (:func:`fewest_blocks`); and each candidate's words for the note.
    The halving stops where no block is checkpointed (a smaller micro-batch recomputes nothing less)."""
    total, lower = len(blocks(work.model)), min_micro_batch(work.model)
    best: tuple[float, int, int] | None = None
    said = []
    for m in dict.fromkeys(b >> i for i in range(4) if b >> i >= lower):
        steps = -(-share // m)
        m = -(-share // steps)  # the even split of the share at that many micro-steps
        count = fewest_blocks(work, m, budget, confirm=confirm)
        setting = True if count == total else (count or False)
        step = predict(estimator_for(work, checkpointing=setting).work(m), card, accumulation=steps, samples=share).step
        said.append(f"micro-batch {m} with {count} of {total} blocks checkpointed: {seconds(step)} a step")
        if best is None or step < best[0]:
            best = (step, m, count)
        if count == 0:
            break
    assert best is not None
    return best[1], best[2], said


def settle_auto(work: Workload, found: SearchResult, *, budget: int, snapshot: Snapshot, verify: bool, card: Any = None,
                share: int | None = None) -> SearchResult:
    """``checkpointing="auto"``: the fewest blocks with which ``found``'s micro-batch (found with every block
    checkpointed) fits, set as ``work.checkpointing``, and the probe's answer with that count.

    The count comes from the estimate; the probe then answers again with it, capped at the micro-batch, so that the
    answer is confirmed as any other (by a real step where the plan runs one). Should that micro-batch not fit with the
    count after all, every block stays checkpointed, and a note says so. Without an estimate every block stays
    checkpointed (real steps would cost one trial per step of the bisection), also said in a note. With a ``card`` (and
    the ``share`` of the target on this device), the micro-batch and count are the fastest predicted
    (:func:`fastest_setting`) instead.
    """
    b, total = found.batch_size, len(blocks(work.model))
    if work.estimator is None:
        work.notes.append(f"checkpointing='auto': without an estimate, all {total} blocks checkpointed")
        return found
    confirm = not (verify and work.device.type == "cpu")
    weighed: list[str] = []
    if card is not None and share:
        b, count, weighed = fastest_setting(work, b, budget, card=card, share=share, confirm=confirm)
    else:
        count = fewest_blocks(work, b, budget, confirm=confirm)
    if len(weighed) > 1:
        work.notes.append(f"checkpointing='auto' weighed, predicted: {'; '.join(weighed)}")
    if count == total and b == found.batch_size:
        work.notes.append(f"checkpointing='auto': micro-batch {b} needs all {total} blocks checkpointed")
        return found
    kept = (work.estimator, work.curve, work.notes[:])
    work.checkpointing = True if count == total else (count or False)
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
