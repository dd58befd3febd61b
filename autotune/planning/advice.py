"""What to say when nothing fits: the error with the measured or estimated figures, the smallest
change that would fit (from the what-if table) and, when the weights alone are too many for one
device, FSDP2 over more ranks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from autotune.errors import NothingFits
from autotune.memory.device import cuda_context_allowance
from autotune.memory.quantized import fsdp2_refused
from autotune.memory.work import along
from autotune.planning.collectives import row_time, traffic
from autotune.planning.sharding import estimated, shard_estimates
from autotune.probe.estimate import estimator_for
from autotune.probe.search import Trial
from autotune.probe.trial import Workload
from autotune.step import min_micro_batch
from autotune.units import format_bytes

__all__ = ["ALLOCATOR_WORDS", "check_limit_above_context", "nothing_fits", "shards_that_fit", "where_the_bytes_go"]

# Why an estimate for CUDA needs more than its tensors, where that decides.
ALLOCATOR_WORDS = "its tensors: {tensors}; the rest is cuBLAS's workspace and the segments it rounds tensors into"


def check_limit_above_context(limit: int, *, given: str | None = None, fix: str = "memory_limit='80GiB'",
                              other: str = "AUTOTUNE_CUDA_CONTEXT") -> None:
    """Refuse a CUDA estimate's limit at or below what is set aside for the CUDA context: nothing would be left to the
    step, and the search would estimate every size (and the what-if table) to say so. ``given``, ``fix`` and ``other``:
    the limit as given, the fix and the setting of another context, in the caller's words (the API's by default).

    Raises:
        ValueError: such a limit.
    """
    context = cuda_context_allowance()
    if limit <= context.bytes:
        raise ValueError(
            f"Invalid {given or f'memory_limit {format_bytes(limit)}'} for a CUDA estimate: it is not above the "
            f"{format_bytes(context.bytes)} set aside for the CUDA context ({context.source}), so nothing is left to the "
            f"training step; give the device's memory, e.g. {fix} (or set a smaller context with {other})"
        )


def shards_that_fit(work: Workload, budget: int, target_batch: int, card: Any = None) -> tuple[list[Any], bool, str | None]:
    """FSDP2 over 2, 4, 8 ranks and on, doubling (at most the target batch and 1024), estimated up to the first count
    that fits (and at least 8), whether the weights, gradients and optimizer state alone exceed ``budget``
    (accumulation cannot help then), and why FSDP2 is not offered at all, if it is not (weights quantized by
    bitsandbytes: :func:`autotune.memory.quantized.fsdp2_refused`). The counts are advice where those bytes alone are
    too many, or where one node's 8 devices fit (the rest held with activations); else, and when no count fits, there
    are none. With a ``card``, each count that fits gets its step's time, FSDP2's collectives included (the work read
    off the estimate's two traces: no new trace)."""
    lower = min_micro_batch(work.model)
    parts, activations = estimated(work, lower)
    alone = parts.resident > budget
    refused = fsdp2_refused(work.model)
    if refused:  # FSDP2 would not keep its quantized weights: no count to offer
        return [], alone, refused
    rows: list[Any] = []
    n = 2
    while n <= min(target_batch, 1024 if alone else 8) and not (rows and rows[-1].fits and n > 8):
        rows.extend(shard_estimates(parts, activations, ranks=[n], budget=budget, target_batch=target_batch, lower=lower))
        n *= 2
    if card is not None and any(r.fits for r in rows):
        estimator, flows = estimator_for(work), traffic(parts.units, parameters=parts.parameters, gradients=parts.gradients)
        rows = [replace(r, time=row_time(r, card=card, work_at=lambda b: along(estimator, b), flows=flows, batch=work.batch)) for r in rows]
    return (rows if any(r.fits for r in rows) else []), alone, None


def where_the_bytes_go(estimator: Any, lower: int) -> str:
    """What the smallest step holds, in words: the weights, gradients and optimizer state, and the rest, said as the
    optimizer step's when its peak is the step's."""
    held = {"weights": estimator.parameter_bytes(), "gradients": estimator.gradient_bytes(),
            "optimizer state": estimator.optimizer_state_bytes()}
    trace = estimator.trace(lower)
    words = ", ".join(f"{name} {format_bytes(b)}" for name, b in held.items())
    if trace.backward_peak < trace.peak:
        return f"{words}; the peak is the optimizer step's, whatever the micro-batch (its temporaries: {format_bytes(estimator.step_transient())})"
    return f"{words}; activations and temporaries of micro-batch {lower}: {format_bytes(max(0, trace.peak - sum(held.values())))}"


def nothing_fits(
    trials: list[Trial], peak: int, *, budget: int, limit: int, headroom: float, set_aside: list[tuple[str, int]],
    table: Any = None, shards: Sequence[Any] = (), out_of_memory_on: dict[int, str] | None = None, resident_too_big: bool = False,
    held: str | None = None, setting: Any = (), tensors: int | None = None, refused: str | None = None,
) -> NothingFits:
    """The error for a probe that found no size: measured numbers when a real step ran.
    ``out_of_memory_on``: under FSDP2, for each size whose trial ran out of memory on some rank, which
    ranks and their errors (every rank abandons such a trial, so every rank's error names them). ``setting``: what was
    planned (:func:`autotune.planning.setting.describe`), carried by the error. ``tensors``: for an estimate of a CUDA
    target (whose trials give what the caching allocator reserves), the tensors' peak at the smallest size (said where
    they alone would fit). ``refused``: why no FSDP2 answer is offered (:func:`autotune.memory.quantized.fsdp2_refused`)."""
    said = {"setting": setting, "set_aside": tuple(set_aside), "headroom": headroom, "resident_too_big": resident_too_big,
            "fsdp2_refused": refused}
    real = [t for t in trials if not t.estimate]
    pool = real or trials
    smallest = min(t.batch_size for t in pool)
    needed = max([peak if real else 0] + [t.peak_memory for t in pool if t.batch_size == smallest])
    measured = bool(real)
    aside = "".join(f" less {format_bytes(b)} for {name}," for name, b in set_aside)
    advice = _smallest_change(table) or "try precision='bf16', a smaller model, activation checkpointing, or a larger memory_limit"
    if shards:
        advice = _shard_advice(shards, resident_too_big) + "; or " + advice
    where = (out_of_memory_on or {}).get(smallest)
    if where:
        # Under FSDP2 every rank abandons a trial that ran out of memory on any rank: say on which.
        return NothingFits(
            f"Even micro_batch={smallest} ran out of memory under FSDP2 on {where}; every rank abandons a trial that "
            f"runs out of memory on any rank, so no size fits (the budget here: {format_bytes(budget)}, limit "
            f"{format_bytes(limit)},{aside} less {headroom:.0%} headroom): give that rank more memory, or " + advice,
            needed=needed, budget=budget, limit=limit, micro_batch=smallest, measured=measured, what_if=table, shards=shards, **said,
        )
    if measured and needed <= budget:
        # The step ran out of memory below its budget, twice: what is missing is not the step's.
        return NothingFits(
            f"Even micro_batch={smallest} ran out of memory with only {format_bytes(needed)} counted, within the budget "
            f"of {format_bytes(budget)} (limit {format_bytes(limit)},{aside} less {headroom:.0%} headroom), twice: the "
            "device's memory is taken by something outside this step (another process, or memory torch does not "
            "count); free it, or give a memory_limit below what is really free",
            needed=needed, budget=budget, limit=limit, micro_batch=smallest, measured=measured, what_if=table, shards=shards, **said,
        )
    allocator = ""
    if not measured and tensors is not None and tensors <= budget < needed:
        # The tensors fit; what the allocator reserves for them (cuBLAS's workspace, segments of 2 MiB and up) does not.
        allocator = f" reserved by CUDA's caching allocator ({ALLOCATOR_WORDS.format(tensors=format_bytes(tensors))})"
    return NothingFits(
        f"Even micro_batch={smallest} needs {'at least ' if measured else 'an estimated '}"
        f"{format_bytes(needed)}{allocator}, the budget is {format_bytes(budget)} (limit {format_bytes(limit)},{aside} less "
        f"{headroom:.0%} headroom){'; measured in a real step' if measured else ''}"
        f"{f' (held: {held})' if held else ''}: " + advice,
        needed=needed,
        budget=budget,
        limit=limit,
        micro_batch=smallest,
        measured=measured,
        what_if=table,
        shards=shards,
        held=held,
        tensors=tensors if allocator else None,
        **said,
    )


def _shard_advice(shards: Sequence[Any], resident_too_big: bool) -> str:
    """The message's words for FSDP2: the resident bytes alone too many for one device, or sharding them leaving
    room for a micro-batch."""
    per_rank = "; ".join(
        f"{s.ranks} ranks: {format_bytes(s.peak)}" + (f", micro_batch={s.micro_batch}" if s.fits else " (does not fit)")
        for s in shards
    )
    why = ("the weights, gradients and optimizer state alone exceed the budget, so no micro-batch can fit on one device: "
           if resident_too_big else "")
    return (
        f"{why}shard the model with FSDP2 (torch.distributed.fsdp.fully_shard on each block, then the model), which "
        f"autotune drives; estimated per rank: {per_rank} (err.shards; `autotune report --shard N`)"
    )


def _smallest_change(table: Any) -> str | None:
    """The message's advice from the what-if table: the fewest changes that make a micro-batch fit."""
    if table is None:
        return None
    best = table.smallest_change()
    if best is None:
        return "no combination of bf16, activation checkpointing and an optimizer with less state fits either: use a larger memory_limit, a smaller model, or shard it"
    kwargs = []
    if best.precision != "fp32":
        kwargs.append(f"precision={best.precision!r}")
    if best.checkpointing:
        kwargs.append(f"checkpointing={best.checkpointing!r}")  # every block, or your count of them
    if "(given)" not in best.optimizer:
        kwargs.append(f"an optimizer like {best.optimizer}")
    if best.offload:
        kwargs.append("fully_shard with CPUOffloadPolicy on one device")
    return (
        f"with {best.describe()} an estimated {best.micro_batch} samples per micro-batch fit ({', '.join(kwargs)}; "
        "err.what_if holds the table of what fits)"
    )
