"""What an FSDP2 run over N devices would hold per rank: estimated from the unsharded model.

When parameters, gradients and optimizer state alone exceed one device, no micro-batch fits and
accumulation cannot help; sharding them with FSDP2 (``torch.distributed.fsdp.fully_shard``) over
N ranks can. This module estimates, without a GPU and without running the model, what one rank
would hold in a run of :func:`autotune.fit` on a model sharded block by block (``fully_shard`` on
each block, then on the model):

- its shard of the parameters and of the optimizer state (``1/N`` of each);
- the gradients: while a window accumulates, FSDP2 keeps each rank's gradients *unsharded* until
  the last micro-batch syncs them (``set_requires_gradient_sync``), so a rank holds the whole
  gradients (plus its shard once the sync reduce-scatters them); a window of one micro-batch
  holds its shard only;
- the reduce-scatter of a block's gradients: its unsharded gradients (counted above while
  accumulating) and the flat copy the collective reads;
- the parameters gathered at once: two consecutive blocks (the one running and the one
  prefetched) and the parameters outside any block (which the root gathers for the whole step); buffers whole;
- the activations and temporaries of the micro-batch's forward and backward, as on one device;
- or, when it is larger, the optimizer step: its shard of everything above and of the step's own
  temporaries;
- on a CUDA target, cuBLAS's workspace throughout (32 MiB), as a one-device estimate counts it. The caching
  allocator's rounding of tensors into segments is not replayed here (the one-device estimate replays it): the
  budget's headroom is what stands for it.

The blocks are those of :func:`autotune.memory.checkpointing.blocks`, else the model's children. Every
figure is an estimate from the same fake-tensor step as :class:`autotune.probe.estimate.Estimator`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from autotune.memory.allocator import cublas_workspace
from autotune.memory.device import (
    cuda_context_allowance,
    default_headroom,
    default_limit,
)
from autotune.memory.ledger import storage_bytes
from autotune.memory.quantized import fsdp2_refused
from autotune.planning.collectives import ShardTime, card_and_limit, row_time, traffic
from autotune.planning.offload import shard_units, trainable_bytes
from autotune.planning.options import check_target
from autotune.planning.plans import budget_of, split_evenly
from autotune.probe.estimate import estimator_for
from autotune.probe.search import estimated_max
from autotune.probe.trial import Workload, sample_batch
from autotune.rng import RNGState
from autotune.step import default_loss, min_micro_batch, normalize_precision
from autotune.units import format_bytes, parse_bytes

__all__ = ["ShardEstimate", "ShardParts", "fewest_devices", "shard_estimates", "shard_parts", "shard_plan", "sharding_notes"]


@dataclass(frozen=True)
class ShardParts:
    """The single-device bytes a sharded run divides (all in bytes).

    Attributes:
        parameters: all parameters.
        buffers: all buffers (not sharded).
        gradients: the trainable parameters' gradients.
        optimizer_state: the optimizer's state after a step (estimated).
        gathered_units: the parameters of the two consecutive blocks (``fully_shard`` units)
            that hold the most: FSDP2 gathers the next block while one runs.
        outside_units: parameters in no block (gathered by the root for the whole step).
        largest_unit_gradients: the gradients of the block with the most trainable parameters.
        step_temporaries: what the optimizer step allocates beyond the state, on one device.
        units: each block's parameter and trainable gradient bytes, in order (what FSDP2's collectives move).
        workspace: what each rank's libraries hold beside its tensors throughout the step: cuBLAS's workspace on a
            CUDA target (as the one-device estimate counts it), 0 elsewhere.
    """

    parameters: int
    buffers: int
    gradients: int
    optimizer_state: int
    gathered_units: int
    outside_units: int
    largest_unit_gradients: int = 0
    step_temporaries: int = 0
    units: tuple[tuple[int, int], ...] = ()
    workspace: int = 0

    @property
    def resident(self) -> int:
        """Parameters, buffers, gradients and optimizer state on one device."""
        return self.parameters + self.buffers + self.gradients + self.optimizer_state

    def per_rank(self, ranks: int, *, accumulating: bool) -> dict[str, int]:
        """What one of ``ranks`` ranks holds besides the activations (see the module docstring)."""
        return {
            "parameters": -(-self.parameters // ranks),
            "optimizer_state": -(-self.optimizer_state // ranks),
            "gradients": -(-self.gradients // ranks) + (self.gradients if accumulating else 0),
            "reduce_scatter": self.largest_unit_gradients * (1 if accumulating else 2),
            "gathered": self.gathered_units + self.outside_units + self.buffers,
            **({"cublas_workspace": self.workspace} if self.workspace else {}),
        }

    def peak(self, ranks: int, activations: int, *, accumulating: bool) -> int:
        """One rank's peak with ``activations`` bytes for its micro-batch: the forward and backward
        or the optimizer step, whichever holds more."""
        return max(sum(self.per_rank(ranks, accumulating=accumulating).values()) + activations, self.step_peak(ranks))

    def step_peak(self, ranks: int) -> int:
        """One rank's bytes during the optimizer step: shards of everything, buffers whole."""
        return -(-(self.parameters + self.gradients + self.optimizer_state + self.step_temporaries) // ranks) + self.buffers + self.workspace


@dataclass(frozen=True)
class ShardEstimate:
    """An FSDP2 run over ``ranks`` devices, per rank (estimated).

    Attributes:
        ranks: devices the model is sharded over.
        micro_batch: samples per micro-batch on each rank (0: not even the smallest fits).
        accumulation_steps: micro-batches per window on the rank with the largest share.
        target_batch: samples per optimizer step over all ranks.
        peak: bytes one rank needs at ``micro_batch`` (at the smallest, when none fits).
        budget: bytes a rank may use.
        parts: the per-rank breakdown of ``peak``: parameters, optimizer_state, gradients,
            reduce_scatter, gathered (parameters unsharded at once, and buffers), activations.
        notes: what such a run would meet that the figures do not show (:func:`sharding_notes`).
        time: the optimizer step's time on the card planned for (``gpu=``), collectives included, or None.
    """

    ranks: int
    micro_batch: int
    accumulation_steps: int
    target_batch: int
    peak: int
    budget: int
    parts: dict[str, int]
    notes: tuple[str, ...] = ()
    time: ShardTime | None = None

    @property
    def fits(self) -> bool:
        """Whether at least the smallest micro-batch fits on every rank."""
        return self.micro_batch > 0

    def __str__(self) -> str:
        parts = ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in self.parts.items())
        if not self.fits:
            return f"{self.ranks} ranks: does not fit ({format_bytes(self.peak)} per rank, budget {format_bytes(self.budget)}; {parts})"
        return (
            f"{self.ranks} ranks: micro_batch={self.micro_batch} x accumulation_steps={self.accumulation_steps} per rank, "
            f"{format_bytes(self.peak)} per rank of {format_bytes(self.budget)} ({parts})"
        ) + (f"; {self.time.describe()}" if self.time else "")

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        return {"ranks": self.ranks, "micro_batch": self.micro_batch, "accumulation_steps": self.accumulation_steps,
                "target_batch": self.target_batch, "peak": self.peak, "budget": self.budget, "fits": self.fits,
                "parts": dict(self.parts), "notes": list(self.notes),
                "time": self.time.to_dict() if self.time else None}


# What the estimate of a sharded bitsandbytes optimizer counts, and why it says so (measured with bitsandbytes 0.50.2 and
# torch 2.13 on the CPU, two ranks of fully_shard: the 8-bit step fails with "optimizer_update_8bit_blockwise got mixed
# torch.Tensor and DTensor", its absmax made at the whole parameter's size; the 32-bit step with "optimizer_update_32bit
# does not have a sharding strategy registered").
BITSANDBYTES_UNDER_FSDP2 = (
    "bitsandbytes' optimizers do not step on FSDP2's sharded (DTensor) parameters (bitsandbytes 0.50: its update kernels "
    "take no DTensor), so this run needs an optimizer that does: the optimizer state above is its states' shard of the "
    "rank, counted at bitsandbytes' size ({size})")


def sharding_notes(optimizer: torch.optim.Optimizer, model: nn.Module | None = None, precision: str = "fp32",
                   activations: int = 0) -> tuple[str, ...]:
    """What an FSDP2 run of ``optimizer`` on ``model`` would meet that the per-rank figures do not show: a bitsandbytes
    optimizer, which does not step on FSDP2's sharded parameters (:data:`BITSANDBYTES_UNDER_FSDP2`); and, under autocast,
    the low-precision copies of fp32 weights that every rank holds whatever the count of ranks, where they are a large
    part of a rank's ``activations`` (bytes)."""
    notes = []
    if type(optimizer).__module__.startswith("bitsandbytes"):
        bits = int(getattr(getattr(optimizer, "args", None), "optim_bits", 32) or 32)
        size = "8-bit: two uint8 states and a float32 absmax per 256 values, 2.03 bytes a parameter" if bits == 8 else "32-bit"
        notes.append(BITSANDBYTES_UNDER_FSDP2.format(size=size))
    copies = _autocast_copies(model, precision) if model is not None else 0
    if copies and 4 * copies >= activations:
        notes.append(
            f"autocast's {precision} copies of the fp32 weights of the linear layers ({format_bytes(copies)}) are counted in "
            "every rank's activations, whatever the count of ranks: each rank runs the whole forward, and autocast keeps the "
            "copy of each weight it casts until the forward ends (its cast cache; without checkpointing autograd saves them "
            "for the backward too)")
    return tuple(notes)


def _autocast_copies(model: nn.Module, precision: str) -> int:
    """Bytes of autocast's copies of the trained fp32 weights of ``model``'s linear layers under ``precision``."""
    if precision not in ("bf16", "fp16"):
        return 0
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}
    return sum(2 * p.numel() for p in weights.values() if p.requires_grad and p.dtype == torch.float32)


def shard_parts(model: nn.Module, optimizer_state: int, step_temporaries: int = 0) -> ShardParts:
    """The parts of ``model`` a sharded run divides, with ``optimizer_state`` bytes estimated."""
    units = shard_units(model)
    sizes = [storage_bytes(u.parameters()) for u in units]
    parameters = storage_bytes(model.parameters())
    return ShardParts(
        parameters=parameters,
        buffers=storage_bytes(model.buffers()),
        gradients=trainable_bytes(model),
        optimizer_state=optimizer_state,
        gathered_units=max((a + b for a, b in zip(sizes, sizes[1:])), default=parameters),
        outside_units=parameters - sum(sizes) if units else 0,
        largest_unit_gradients=max((trainable_bytes(u) for u in units), default=trainable_bytes(model)),
        step_temporaries=step_temporaries,
        units=tuple((size, trainable_bytes(u)) for size, u in zip(sizes, units)),
    )


def estimated(work: Any, lower: int) -> tuple[ShardParts, Callable[[int], int]]:
    """The parts of ``work``'s model and its activations at any micro-batch, on fake tensors.

    The activations are the steady-state forward and backward's peak less the weights, buffers,
    gradients and optimizer state; the optimizer state and the step's temporaries come from the
    estimator's optimizer step (the same estimator as the plan's, see :mod:`autotune.probe.estimate`).
    The peak at a size from the curve's two traces on is read off their curve (no new trace; a trace
    where their operations differ), below it traced: the same bytes as a trace on the CPU, and within
    the CUDA allocator's rounding of each tensor to 512 bytes for CUDA (0.1% on a small Llama).
    """
    estimator = estimator_for(work)
    cache: dict[int, int] = {}
    parts = shard_parts(work.model, estimator.optimizer_state_bytes(), estimator.step_transient())
    if work.device.type == "cuda":  # every rank's cuBLAS holds its workspace, as one device's does
        parts = replace(parts, workspace=cublas_workspace())
    resident = estimator.resident()
    curve: list[Any] = []  # made at the first size that reads it

    def activations(b: int) -> int:
        if b not in cache:
            if b >= estimator.sizes[0] and not curve:
                curve.append(estimator.backward_curve())
            peak = curve[0](b) if b >= estimator.sizes[0] and curve[0] is not None else estimator.trace(b).backward_peak
            cache[b] = max(0, round(peak) - resident)
        return cache[b]

    return parts, activations


def shard_estimates(
    parts: ShardParts,
    activations: Callable[[int], int],
    *,
    ranks: Iterable[int],
    budget: int,
    target_batch: int,
    lower: int = 1,
) -> list[ShardEstimate]:
    """One :class:`ShardEstimate` per number of ranks.

    ``activations(b)`` is what a forward and backward of ``b`` samples adds on one device to the
    weights and gradients (activations and temporaries).
    """
    out = []
    for n in ranks:
        if n < 1 or target_batch < n:
            raise ValueError(f"Invalid ranks {n!r}: give at least 1 and at most target_batch ({target_batch}) ranks")
        share = split_evenly(target_batch, n)[0]

        def need(b: int, n: int = n, share: int = share) -> tuple[int, dict[str, int]]:
            held = parts.per_rank(n, accumulating=b < share)
            held["activations"] = activations(b)
            return parts.peak(n, held["activations"], accumulating=b < share), held

        # A window of one micro-batch (the whole share) never holds the unsharded gradients, so it
        # can fit where smaller accumulating ones do not: tried first.
        best, (peak, held) = 0, need(share)
        if peak <= budget:
            best = share
        elif share > lower:  # the largest accumulating micro-batch (or, when none fits, the smallest's figures)
            best, _ = estimated_max(lambda b: need(b)[0], budget, share - 1, lower=lower)
            peak, held = need(best or lower)
        steps = math.ceil(share / best) if best else 0
        out.append(ShardEstimate(n, best, steps, target_batch, peak, budget, held))
    return out


def shard_plan(
    model: nn.Module,
    loader: Iterable[Any],
    *,
    target_batch: int,
    ranks: int | Sequence[int] | str = (2, 4, 8),
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: Any = None,
    device: torch.device | str = "cuda",
    memory_limit: int | str | None = None,
    headroom: float | None = None,
    precision: str | None = None,
    checkpointing: bool | int | str = False,
    gpu: str | None = None,
) -> list[ShardEstimate]:
    """Estimate an FSDP2 run of the unsharded ``model`` over each number of ``ranks`` devices.

    Nothing runs on a device and the model is not touched: the step is estimated on fake tensors
    (see the module docstring for what a rank holds). ``memory_limit`` is each device's memory
    (default: what ``device`` has, when this machine has it); the budget is taken from it as
    :func:`autotune.plan` takes it (less the CUDA context for CUDA, less the headroom).

    ``ranks="auto"``: the fewest devices that fit (:func:`fewest_devices`). ``gpu``: a card of the catalogue
    (:mod:`autotune.memory.gpus`): its memory is each device's (or ``memory_limit``, at most the card's), and each row
    that fits gets the time of its step with FSDP2's collectives (:mod:`autotune.planning.collectives`).
    ``checkpointing``: as :func:`autotune.plan` takes it, True (every block) or a count of the first blocks; "auto" is
    estimated with every block, and each row's notes say so (the plan of the sharded model finds the fewest).

    Returns:
        One :class:`ShardEstimate` per number of ranks, in the order given.

    Example:
        >>> for row in autotune.shard_plan(model, loader, target_batch=512, memory_limit="80GiB"):  # doctest: +SKIP
        ...     print(row)
    """
    counts = [] if ranks == "auto" else [ranks] if isinstance(ranks, int) else list(ranks)
    if ranks != "auto" and (not counts or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts)):
        raise ValueError(f"Invalid ranks {ranks!r}: give how many devices to shard over, e.g. 8 or (2, 4, 8), or 'auto'")
    check_target(target_batch)  # as plan and fit check it
    refused = fsdp2_refused(model)
    if refused:
        raise ValueError(f"{refused}: plan the quantized model on one device (autotune.plan), or shard it unquantized")
    device = torch.device(device)
    card, memory_limit = card_and_limit(gpu, device, memory_limit)
    if memory_limit is None:
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("Cannot read the memory of a CUDA device on a machine without one: pass memory_limit= (e.g. '80GiB')")
        limit = default_limit(device, 0)
    else:
        limit = parse_bytes(memory_limit)
    headroom = default_headroom(device) if headroom is None else headroom
    budget = budget_of(limit, cuda_context_allowance().bytes if device.type == "cuda" else 0, headroom)
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rng = RNGState(loader)
    try:
        batch = sample_batch(loader).batch
    finally:
        rng.restore()
    auto = checkpointing == "auto"
    work = Workload(model=model, optimizer=optimizer, loss_fn=loss_fn or default_loss, batch=batch, device=device,
                    precision=normalize_precision(precision), checkpointing=True if auto else checkpointing)  # type: ignore[arg-type]
    lower = min_micro_batch(model)
    parts, activations = estimated(work, lower)
    if ranks == "auto":
        rows = [fewest_devices(parts, activations, budget=budget, target_batch=target_batch, lower=lower)]
    else:
        rows = shard_estimates(parts, activations, ranks=counts, budget=budget, target_batch=target_batch, lower=lower)
    flows, work_at = traffic(parts.units, parameters=parts.parameters, gradients=parts.gradients), estimator_for(work).work
    said = ("checkpointing='auto': every block checkpointed in this estimate; autotune.plan on the sharded model (under "
            "torchrun) finds the fewest blocks with which its micro-batch fits",) if auto else ()
    return [replace(row, notes=sharding_notes(optimizer, model, work.precision, row.parts["activations"]) + said,
                    time=row_time(row, card=card, work_at=work_at, flows=flows, batch=batch)) for row in rows]


def fewest_devices(parts: ShardParts, activations: Callable[[int], int], *, budget: int, target_batch: int, lower: int = 1,
                   most: int = 1024) -> ShardEstimate:
    """The fewest devices, up to ``most``, over which FSDP2 fits (see :func:`shard_estimates`), not limited by the
    target batch: over more devices than ``target_batch`` every device trains one sample a step (the row's
    ``target_batch`` says so). When none fits, the row of ``most``."""

    def at(n: int) -> ShardEstimate:
        (row,) = shard_estimates(parts, activations, ranks=[n], budget=budget, target_batch=max(target_batch, n), lower=lower)
        return row

    below, n = 0, 1
    row = at(n)
    while not row.fits and n < most:  # doubling to a count that fits
        below, n = n, min(2 * n, most)
        row = at(n)
    while row.fits and n - below > 1:  # then the fewest between the last that did not and it
        middle = at((below + n) // 2)
        if middle.fits:
            n, row = middle.ranks, middle
        else:
            below = middle.ranks
    return row
