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
blocks it needs, and takes the shortest predicted optimizer step for the target (:func:`fastest_setting`). A count is
traced on the whole model (its checkpointed and plain blocks are not alike), so a candidate's count is first read off
the line through none and every block's bytes, which shallow copies give, and searched only where the candidate could
then be the fastest. Where the plan runs real steps (a GPU here) and other candidates are predicted within :data:`CLOSE` of the fastest, closer than
the prediction's error, each is confirmed at its micro-batch and count and timed by its real steps, and the fastest
measured is taken; a note gives every figure.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from autotune.memory.allocator import cublas_workspace, expandable_segments, replay, steady_state
from autotune.memory.checkpointing import blocks
from autotune.memory.timing import predict, seconds
from autotune.memory.work import on_line, work_at
from autotune.probe.depth import DepthEstimator
from autotune.probe.estimate import Estimator, estimator_for
from autotune.probe.largest import probe
from autotune.probe.search import SearchResult, Trial, timed_at
from autotune.probe.trial import Workload
from autotune.step import Snapshot, min_micro_batch

__all__ = ["fastest_setting", "fewest_blocks", "needed", "settle_auto", "weighed"]


def fewest_blocks(work: Workload, b: int, budget: int, *, fits: Callable[[int], bool] | None = None,
                  confirm: bool = True, most: int | None = None) -> int:
    """The fewest of the model's blocks (the first ones) to checkpoint for micro-batch ``b`` to fit ``budget`` bytes.

    The peak does not rise with the count, so it is searched between 0 and every block, each step at the middle or,
    once two counts' bytes are estimated, where their line meets the budget (:func:`_next_count`), one estimate a step:
    on the Llama-3-8B shape 4 steps where bisecting took 6, and never more than twice a bisection's. The line's first
    two points are none and every block checkpointed where shallow copies estimate them (:func:`_copies_bytes`, no
    trace of the whole model): there the first count tried is the answer or next to it, 2-3 steps.
    Every block is taken to fit (the caller found ``b`` with them); the answer is every block's count where no fewer do.

    Args:
        work: the workload (its model, optimizer, loss, batch, device and precision).
        b: the micro-batch.
        budget: the bytes the step may use.
        fits: ``fits(count) -> bool``, whether ``b`` fits with the first ``count`` blocks checkpointed (default: the
            estimate at ``b``, :func:`needed`).
        confirm: with the default ``fits``, where the estimate is made of shallow copies (every block checkpointed,
            or none), confirm its curve with a trace at ``b`` (see :meth:`~autotune.probe.estimate.Estimator.largest`).
        most: a count known to fit (default: every block), the bisection's upper end: a smaller micro-batch needs no
            more blocks than a larger one did.

    Returns:
        A count from 0 to ``most``.
    """
    total = len(blocks(work.model))
    no, yes = -1, total if most is None else most  # fits(no) is taken as false, fits(yes) as true
    needs: dict[int, int | None] = {}  # the bytes each count tried needs, where its estimate gives them
    if fits is None:

        def fits(count: int) -> bool:  # each count tried is a trial of the plan, at b with that count
            estimator, told = estimator_for(work, checkpointing=_setting(count, total)), []
            estimator.on_trace = lambda trace, reused: told.append(0.0 if reused else trace.seconds)
            copies = needs.get(count)  # none or every block: the bytes shallow copies gave, where they did
            try:
                ok, needs[count] = needed(estimator, b, budget, confirm=confirm)
            finally:
                estimator.on_trace = None
            said = copies if needs[count] is None else needs[count]
            if said is not None:
                work.record(Trial(b, said, ok, sum(told), estimate=True, checkpointing=_setting(count, total)))
            return ok

        for count in (0, total):  # the line's first two points, where copies of few blocks give them (none, every block)
            needs[count] = _copies_bytes(estimator_for(work, checkpointing=_setting(count, total)), b)
    tries, bound = 0, (yes - no).bit_length()  # past a bisection's steps, the middle: never more than twice its steps
    while yes - no > 1:
        mid = _next_count(no, yes, needs, budget) if tries < bound else (no + yes) // 2
        tries += 1
        if fits(mid):
            yes = mid
        else:
            no = mid
    return yes


def _next_count(no: int, yes: int, needs: dict[int, int | None], budget: int) -> int:
    """The count to try between ``no`` (does not fit) and ``yes`` (fits): where the line through the bytes two counts
    need meets the budget (``no`` and ``yes`` where both were estimated, else the last two estimated: a block
    checkpointed saves about the same bytes wherever it is, so the line lands on the answer or next to it), else the
    middle."""
    known = [(k, n) for k, n in needs.items() if n is not None]  # in the order tried
    pair = [(k, needs[k]) for k in (no, yes) if needs.get(k) is not None]
    (k1, n1), (k2, n2) = (pair if len(pair) == 2 else known[-2:]) if len(known) >= 2 else ((0, 0), (0, 0))
    if k1 == k2 or n1 == n2:
        return (no + yes) // 2
    return min(max(_where_line_meets(k1, n1, k2, n2, budget), no + 1), yes - 1)  # type: ignore[arg-type]


def _where_line_meets(k1: int, n1: int, k2: int, n2: int, budget: int) -> int:
    """The first count at which the line through two counts' bytes, ``(k1, n1)`` and ``(k2, n2)`` (``n1 != n2``), is
    within ``budget``."""
    return k1 + math.ceil((n1 - budget) * (k2 - k1) / (n1 - n2))


def _copies_bytes(estimator: Any, b: int) -> int | None:
    """The bytes micro-batch ``b`` needs by an estimate made of shallow copies (every block checkpointed, or none:
    :class:`autotune.probe.depth.DepthEstimator`), as :func:`needed` reads a whole model's (the caching allocator's
    reserved bytes for a CUDA target, else the tensors' peak); None for an estimate of the whole model, whose trace
    at ``b`` would cost as much as trying the count."""
    if not isinstance(estimator, DepthEstimator) or estimator._whole is not None:
        return None
    return int(estimator.allocator(b).reserved if estimator.target == "cuda" else estimator(b))


def needed(estimator: Any, b: int, budget: int, *, confirm: bool = True) -> tuple[bool, int | None]:
    """Whether micro-batch ``b`` fits ``budget`` bytes by ``estimator``, and the bytes it needs: from its one trace at
    ``b``, the tensors' peak and, for a CUDA target, the caching allocator's replay of that trace's own allocations (it
    fits when the replay under a cap of ``budget`` serves every request; the bytes are what it reserves under that cap,
    else at least ``budget + 1``, as :func:`autotune.probe.search.within_allocator` says them), as
    :meth:`~autotune.probe.estimate.Estimator.largest` decides a size without the curve's two other traces (a count of
    blocks checkpointed is traced whole, its blocks not alike). An estimate made of shallow copies
    (:class:`autotune.probe.depth.DepthEstimator`) answers by its own ``largest``, without the bytes (None)."""
    if not isinstance(estimator, Estimator):
        return bool(estimator.largest(budget, b, confirm=confirm)[0] >= b), None
    at = estimator.trace(b)
    if estimator.target != "cuda":
        return at.peak <= budget, at.peak
    events = steady_state(at.held, list(at.events), estimator.step_events(), workspace=cublas_workspace())
    capped = replay(events, cap=budget, expandable=expandable_segments())
    if not capped.out_of_memory:  # what it reserves under the cap (it may release cached segments to stay within it)
        return at.peak <= budget, capped.reserved
    return False, max(budget + 1, replay(events, expandable=expandable_segments()).reserved)


# Two settings whose predicted steps are within this fraction of each other are not told apart by the prediction: its
# validation cases run 0.83-1.16 of what was measured (benchmarks/step_time.py). Where the plan runs real steps, both are timed.
CLOSE = 0.2


def fastest_setting(work: Workload, b: int, budget: int, *, card: Any, share: int, confirm: bool = True,
                    close: float = 0.0) -> tuple[int, int, list[tuple[float, int, int, str]]]:
    """The micro-batch and count of checkpointed blocks with the shortest predicted optimizer step of ``share`` samples
    on ``card``: ``b`` (found with every block checkpointed) and its halves down to an eighth, each split evenly over
    the share and with the fewest blocks it needs (:func:`fewest_blocks`); and every candidate weighed, in order:
    ``(predicted seconds a step, micro-batch, count, its words for the note)``. The halving stops where no block is
    checkpointed (a smaller micro-batch recomputes nothing less).

    Where shallow copies give the bytes of none and every block checkpointed (:func:`_read_counts`), each candidate's
    count is first read off their line, and its step predicted with :data:`SLACK` blocks fewer and more than read (the
    work is on the line through none and every block's: each block recomputed adds the same). Only candidates that
    could then be within ``close`` of the fastest (0: be the fastest) are searched, a trace of the whole model for each
    count tried; the others are weighed at the count read, and their words say "about" (:func:`weighed`).
    """
    total, lower = len(blocks(work.model)), min_micro_batch(work.model)
    sizes = []
    for m in dict.fromkeys(b >> i for i in range(4) if b >> i >= lower):
        steps = -(-share // m)
        sizes.append((-(-share // steps), steps))  # the even split of the share at that many micro-steps
    read = _read_counts(work, sizes, budget, total)
    searched = {m for m, _ in sizes}
    if read is not None:
        sizes = sizes[:len(read)]
        span = {m: (_on_line_step(work, m, max(k - SLACK, 0), total, card, steps, share),
                    _on_line_step(work, m, min(k + SLACK, total), total, card, steps, share)) for (m, steps), k in zip(sizes, read)}
        best = min(hi for _, hi in span.values())
        searched = {m for m, (lo, _) in span.items() if lo <= best * (1 + close)}
    options: list[tuple[float, int, int, str]] = []
    most = total
    for i, (m, steps) in enumerate(sizes):
        if m not in searched:
            count = read[i]  # type: ignore[index]
            step = _on_line_step(work, m, count, total, card, steps, share)
            options.append((step, m, count, f"micro-batch {m} with about {count} of {total} blocks checkpointed: {seconds(step)} a step"))
            continue
        count = most = fewest_blocks(work, m, budget, confirm=confirm, most=most)
        if count in (0, total) and read is not None:  # none or every block: the copies' line, as read
            step = _on_line_step(work, m, count, total, card, steps, share)
        else:  # a count between: the whole model's trace at m, made to decide it
            step = predict(estimator_for(work, checkpointing=_setting(count, total)).work(m), card, accumulation=steps, samples=share).step
        options.append((step, m, count, f"micro-batch {m} with {count} of {total} blocks checkpointed: {seconds(step)} a step"))
        if count == 0:
            break
    _, fastest, fewest, _ = min((o for o in options if o[1] in searched), key=lambda o: o[0])
    return fastest, fewest, options


# A candidate's count read off the line through none and every block's bytes was never below the count the search
# found, and at most this many blocks above it: on the Llama-3-8B shape (bf16, AdamW, H200; 4096 and 2048 tokens,
# micro-batches 16 to 1) 32 for 31, 23 for 22, 2 for 1, 0 for 0; on small Llama shapes of 12, 16 and 24 layers, CPU and
# CUDA targets, budgets a quarter to three quarters of the way, up to 2 above (tests/test_partial_checkpointing.py).
# A candidate's predicted step is taken as lying between those with this many blocks fewer and more than read.
SLACK = 2


def _read_counts(work: Workload, sizes: list[tuple[int, int]], budget: int, total: int) -> list[int] | None:
    """Each micro-batch's count of blocks to checkpoint read off the line through the bytes of none and every block
    checkpointed, as shallow copies give them (:func:`_copies_bytes`), down to the first that needs none; None where
    the copies do not give them (the model is traced whole: trying a count costs what reading it would)."""
    counts: list[int] = []
    for m, _ in sizes:
        none = _copies_bytes(estimator_for(work, checkpointing=False), m)
        every = _copies_bytes(estimator_for(work, checkpointing=True), m)
        if none is None or every is None:
            return None
        if none <= budget:
            return counts + [0]
        counts.append(total if every >= none else min(max(_where_line_meets(0, none, total, every, budget), 1), total))
    return counts


def _on_line_step(work: Workload, m: int, count: int, total: int, card: Any, steps: int, share: int) -> float:
    """The predicted optimizer step at micro-batch ``m`` with the first ``count`` blocks checkpointed, its work read off
    the line through none and every block's (from the shallow copies)."""
    none, every = (work_at(estimator_for(work, checkpointing=setting), m) for setting in (False, True))
    return predict(on_line((0, none), (total, every), count), card, accumulation=steps, samples=share).step


def weighed(options: list[tuple[float, int, int, str]], *, close: float) -> str:
    """The note of the candidates :func:`fastest_setting` weighed, and what "about" means where a count was read, not
    searched."""
    said = f"checkpointing='auto' weighed, predicted: {'; '.join(words for *_, words in options)}"
    if any(" with about " in words for *_, words in options):
        slower = f"over {close:.0%} slower than the fastest" if close else "slower than the fastest"
        said += (f" (about: the count read off the line through none and every block's bytes, not searched: {slower} even "
                 f"with {SLACK} blocks fewer)")
    return said


def _setting(count: int, total: int) -> bool | int:
    return True if count == total else (count or False)


def _timed(work: Workload, options: list[tuple[float, int, int, str]], *, budget: int, snapshot: Snapshot,
           share: int) -> tuple[int, int, SearchResult | None, str]:
    """The fastest predicted candidate and those predicted within :data:`CLOSE` of it, each confirmed by the probe at its
    micro-batch with its count (real steps, counted in the plan's trials) and timed by them: the one whose real steps
    make the shortest optimizer step of ``share`` samples (``ceil(share / m)`` steady micro-steps and an optimizer step,
    as the trials timed them: :func:`autotune.probe.search.timed_at`), its probe's answer (its estimator, curve and notes set on ``work``), and
    the words for the note. A candidate that does not fit when run is left out; where none fits, the fastest predicted
    with no answer (None)."""
    total = len(blocks(work.model))
    fastest = min(o[0] for o in options)
    close = sorted((o for o in options if o[0] <= fastest * (1 + CLOSE)), key=lambda o: o[0])
    kept = (work.estimator, work.curve, work.notes[:])
    runs: list[tuple[float, int, int, SearchResult, Any, Any, list[str], int]] = []
    said = []
    for _, m, count, _ in close:
        work.estimator, work.curve, work.notes = kept[0], kept[1], kept[2][:]
        work.checkpointing = _setting(count, total)
        start = len(work.trials)
        again = probe(work, upper=m, budget=budget, snapshot=snapshot, verify=True)
        timed = timed_at(work.trials[start:], m)
        if again.batch_size < m or timed is None:
            said.append(f"micro-batch {m} with {count} of {total} blocks checkpointed: did not fit when run")
            continue
        step = -(-share // m) * timed[0] + timed[1]
        said.append(f"micro-batch {m} with {count} of {total} blocks checkpointed: {seconds(step)} a step")
        runs.append((step, m, count, again, work.estimator, work.curve, work.notes[:], start))
    words = f"checkpointing='auto' timed the {len(close)} predicted within {CLOSE:.0%} of the fastest, on this device: {'; '.join(said)}"
    if not runs:
        work.estimator, work.curve, work.notes = kept[0], kept[1], kept[2][:]
        return close[0][1], close[0][2], None, words
    _, m, count, again, work.estimator, work.curve, work.notes, work.settled = min(runs, key=lambda r: r[0])
    work.checkpointing = _setting(count, total)
    return m, count, again, words


def settle_auto(work: Workload, found: SearchResult, *, budget: int, snapshot: Snapshot, verify: bool, card: Any = None,
                share: int | None = None) -> SearchResult:
    """``checkpointing="auto"``: the fewest blocks with which ``found``'s micro-batch (found with every block
    checkpointed) fits, set as ``work.checkpointing``, and the probe's answer with that count.

    The count comes from the estimate; the probe then answers again with it, capped at the micro-batch, so that the
    answer is confirmed as any other (by a real step where the plan runs one). Should that micro-batch not fit with the
    count after all, every block stays checkpointed, and a note says so. Without an estimate every block stays
    checkpointed (real steps would cost one trial per step of the bisection), also said in a note. With a ``card`` (and
    the ``share`` of the target on this device), the micro-batch and count are the fastest predicted
    (:func:`fastest_setting`) instead, and where real steps run and others are predicted within :data:`CLOSE` of it,
    the fastest measured of those (:func:`_timed`).
    """
    b, total = found.batch_size, len(blocks(work.model))
    if work.estimator is None:
        work.notes.append(f"checkpointing='auto': without an estimate, all {total} blocks checkpointed")
        return found
    confirm = not (verify and work.device.type == "cpu")
    options: list[tuple[float, int, int, str]] = []
    if card is not None and share:
        b, count, options = fastest_setting(work, b, budget, card=card, share=share, confirm=confirm, close=CLOSE if verify else 0.0)
    else:
        count = fewest_blocks(work, b, budget, confirm=confirm)
    if len(options) > 1:
        work.notes.append(weighed(options, close=CLOSE if verify else 0.0))
    kept = (work.estimator, work.curve, work.notes[:])
    timed: SearchResult | None = None
    fastest = min((o[0] for o in options), default=0.0)
    if verify and sum(o[0] <= fastest * (1 + CLOSE) for o in options) > 1:  # not told apart by the prediction: run both
        b, count, timed, words = _timed(work, options, budget=budget, snapshot=snapshot, share=share or b)
        work.notes.append(words)
        kept = (kept[0], kept[1], kept[2] + [words])
    if count == total and b == found.batch_size:
        work.checkpointing, (work.estimator, work.curve, work.notes), work.settled = True, kept, 0
        work.notes.append(f"checkpointing='auto': micro-batch {b} needs all {total} blocks checkpointed")
        return found
    work.checkpointing = _setting(count, total)
    if timed is None:
        work.settled = len(work.trials)  # the trials before ran with every block checkpointed
    again = timed or probe(work, upper=b, budget=budget, snapshot=snapshot, verify=verify)
    if again.batch_size < b:  # the confirming step disagrees with the estimate: keep what was found
        work.checkpointing, (work.estimator, work.curve, work.notes), work.settled = True, kept, 0
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
