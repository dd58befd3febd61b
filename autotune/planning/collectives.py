"""FSDP2's collectives and the time of a sharded step, per rank, on a card of the catalogue.

A run of :func:`autotune.fit` on a model sharded with ``fully_shard`` (each block, then the model) over ``n`` ranks
moves, per rank:

- **per micro-step, an all-gather of every parameter for the forward** (each block's before it runs, the root's
  parameters, those in no block, before the first), **and of every block's again for the backward**: a block reshards
  after its forward (``reshard_after_forward=True``, ``fully_shard``'s default) and after its backward, also while a
  window accumulates; the root does not reshard after its forward (FSDP2 sets it so for the root, whose parameters the
  backward needs at once), so its parameters are gathered once a micro-step;
- **per optimizer step, a reduce-scatter of the trainable gradients**: autotune's windows sync the gradients on their
  last micro-batch only (``set_requires_gradient_sync(False)`` before the others, :mod:`autotune.train.sharded`), so a
  window of ``k`` micro-batches reduce-scatters once, not ``k`` times.

Each is a ring collective of the unsharded bytes in the parameters' own dtype (no ``MixedPrecisionPolicy``: the
estimate is of the model as given, under autocast where asked): a rank sends and receives ``bytes x (n-1)/n``, at
the link's bandwidth per direction (:attr:`autotune.memory.gpus.Gpu.link`: NVLink on SXM parts, PCIe x16 otherwise)
times NCCL's bus-bandwidth efficiency (:data:`NCCL_BUS`): :func:`ring_seconds`. This is nccl-tests' own arithmetic:
its ``busbw`` of an all-gather or a reduce-scatter is ``bytes / time x (n-1)/n``.

**Overlap.** FSDP2 issues its collectives on their own streams and prefetches: the next block's all-gather runs while
one block computes, and a block's reduce-scatter while the blocks before it run their backward. What no compute can
hide is the all-gather before the first operation (the root's parameters and the first block's) and the reduce-scatter
after the last (the root's gradients and the first block's). The rule, per micro-step::

    micro-step = first all-gather + max(compute, the rest of its collectives) [+ last reduce-scatter, on the syncing one]

where ``compute`` is the rank's forward and backward at its micro-batch as :func:`autotune.memory.timing.predict`
gives it from the estimate's trace, and the collectives of the syncing micro-step include the window's reduce-scatter.
An optimizer step is ``k`` micro-steps and the rank's optimizer step, over its shard (``1/n`` of the step's bytes and
FLOPs; its kernels launched as on one device). A model with no blocks is one unit: all of it gathered before the
forward and reduced after the backward, nothing overlapped.

One node only: the ranks talk over the card's link (through NVSwitch on SXM parts). Over more than eight devices a run
spans nodes and its collectives cross the network, which is slower and not modelled: the time says it is a lower bound.
Not modelled either: the collectives' latency (small at the sizes of a block's parameters), NVLink SHARP, and the
contention of collectives and compute for the card's memory bandwidth.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autotune.batches import tokens_per_sample
from autotune.memory.gpus import Gpu, estimate_limit, gpu_named
from autotune.memory.timing import StepTime, predict, seconds
from autotune.memory.work import Work
from autotune.planning.plans import split_evenly
from autotune.units import parse_bytes

__all__ = ["NCCL_BUS", "BusEfficiency", "ShardTime", "Traffic", "all_reduce_seconds", "bus_bandwidth", "card_and_limit", "ring_seconds", "row_time",
           "shard_step_time", "traffic"]

NODE = 8  # devices in one node (an HGX board): beyond it the ranks would cross the network


@dataclass(frozen=True)
class BusEfficiency:
    """The fraction of a link's bandwidth per direction that NCCL's ring collectives reach (nccl-tests' ``busbw`` at
    large sizes over the link's figure), by kind of link.

    Attributes:
        nvlink: over NVLink (and NVSwitch).
        pcie: over PCIe, where the traffic between cards crosses the host's root complex or a PCIe switch.
        source: where the figures come from.
    """

    nvlink: float
    pcie: float
    source: str


NCCL_BUS = BusEfficiency(
    nvlink=0.7, pcie=0.5,
    source="nccl-tests' busbw at large sizes: about 200 GB/s on 8 A100-SXM4-80GB over NVLink 3's 300 GB/s a direction "
           "(NVIDIA/nccl-tests issue 149), 0.67; 28 GB/s on 8 and 35 GB/s on 4 RTX 5090s over PCIe 5.0 x16's 64 GB/s "
           "(NVIDIA/nccl issue 1639, where NCCL's maintainer notes a PCIe system is bound by the host's CPU and memory), "
           "0.44-0.55",
)


def bus_bandwidth(card: Gpu, efficiency: BusEfficiency = NCCL_BUS) -> float:
    """Bytes/s a ring collective reaches between ``card``s: its link per direction times the efficiency of its kind."""
    return card.link * (efficiency.nvlink if card.link_kind.startswith("NVLink") else efficiency.pcie)


def ring_seconds(nbytes: int | float, ranks: int, card: Gpu, *, efficiency: BusEfficiency = NCCL_BUS) -> float:
    """Seconds of a ring all-gather or reduce-scatter of ``nbytes`` (the unsharded size) over ``ranks`` of ``card``:
    ``nbytes x (ranks-1)/ranks / (link x efficiency)``; none over one rank.

    Raises:
        ValueError: ``ranks`` below 1 or ``nbytes`` negative.

    Example:
        >>> from autotune.memory.gpus import gpu_named
        >>> round(ring_seconds(10**9, 4, gpu_named("h100-sxm")) * 1e3, 2)  # 0.75 GB at 450 GB/s x 0.7
        2.38
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"Invalid ranks {ranks!r}: give how many devices take part, at least 1")
    if nbytes < 0:
        raise ValueError(f"Invalid nbytes {nbytes!r}: give the collective's size in bytes, at least 0")
    return float(nbytes) * (ranks - 1) / ranks / bus_bandwidth(card, efficiency)


def all_reduce_seconds(nbytes: int | float, ranks: int, card: Gpu, *, efficiency: BusEfficiency = NCCL_BUS) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``ranks`` of ``card``: a reduce-scatter and an all-gather,
    ``2 x nbytes x (ranks-1)/ranks`` at the bus bandwidth (nccl-tests' all-reduce ``busbw`` is ``bytes / time x
    2(n-1)/n``); none over one rank.

    Example:
        >>> from autotune.memory.gpus import gpu_named
        >>> round(all_reduce_seconds(10**9, 4, gpu_named("h100-sxm")) * 1e3, 2)  # twice the ring's 2.38 ms
        4.76
    """
    return 2 * ring_seconds(nbytes, ranks, card, efficiency=efficiency)


@dataclass(frozen=True)
class Traffic:
    """The bytes (unsharded) FSDP2's collectives move, by when they run (see the module docstring).

    Attributes:
        gather_forward: every parameter, all-gathered once a micro-step for the forward.
        gather_backward: the blocks' parameters, all-gathered again for the backward.
        reduce_scatter: the trainable gradients, reduce-scattered once a window.
        first_gather: the part of ``gather_forward`` no compute hides: the root's parameters and the first block's.
        last_reduce: the part of ``reduce_scatter`` no compute hides: the root's gradients and the first block's.
    """

    gather_forward: int
    gather_backward: int
    reduce_scatter: int
    first_gather: int
    last_reduce: int


def traffic(units: Sequence[tuple[int, int]], *, parameters: int, gradients: int) -> Traffic:
    """The :class:`Traffic` of a model of ``parameters`` bytes (``gradients`` of them trainable) whose ``fully_shard``
    units are ``units``: each block's ``(parameter bytes, trainable gradient bytes)``, in the order they run. No units:
    the model is one unit, the root's."""
    outside = parameters - sum(p for p, _ in units)
    outside_gradients = gradients - sum(g for _, g in units)
    first = units[0] if units else (0, 0)
    return Traffic(gather_forward=parameters, gather_backward=parameters - outside, reduce_scatter=gradients,
                   first_gather=outside + first[0], last_reduce=outside_gradients + first[1])


@dataclass(frozen=True)
class ShardTime:
    """The time of one optimizer step of an FSDP2 run, per rank (every rank waits for the slowest: the one with the
    largest share of the batch, whose figures these are).

    Attributes:
        ranks: devices the model is sharded over.
        compute: the rank's forward and backward at its micro-batch, and its shard's optimizer step, without the
            collectives (:func:`autotune.memory.timing.predict`).
        gather: seconds of one micro-step's all-gathers (forward and backward).
        reduce_scatter: seconds of one window's reduce-scatter.
        first_gather: of ``gather``, the seconds before any compute.
        last_reduce: of ``reduce_scatter``, the seconds after the last compute.
        target_batch: samples per optimizer step over all ranks.
        tokens: tokens per optimizer step over all ranks, where the batch has tokens.
        basis: what the figures rest on: the card, the link and its efficiency.
    """

    ranks: int
    compute: StepTime
    gather: float
    reduce_scatter: float
    first_gather: float
    last_reduce: float
    target_batch: int
    tokens: int | None
    basis: str

    @property
    def micro_step(self) -> float:
        """Seconds of a micro-step that does not sync (see the module docstring's rule)."""
        return self.first_gather + max(self.compute.micro_step, self.gather - self.first_gather)

    @property
    def syncing_micro_step(self) -> float:
        """Seconds of a window's last micro-step, whose backward reduce-scatters the gradients."""
        hidden = self.gather - self.first_gather + self.reduce_scatter - self.last_reduce
        return self.first_gather + max(self.compute.micro_step, hidden) + self.last_reduce

    @property
    def step(self) -> float:
        """Seconds per optimizer step."""
        return (self.compute.accumulation - 1) * self.micro_step + self.syncing_micro_step + self.compute.optimizer

    @property
    def communication(self) -> float:
        """Seconds of collectives per optimizer step, overlapped or not."""
        return self.compute.accumulation * self.gather + self.reduce_scatter

    @property
    def exposed(self) -> float:
        """Seconds per optimizer step the collectives add to the compute alone."""
        return self.step - self.compute.step

    @property
    def samples_per_second(self) -> float:
        """Samples a second over all ranks."""
        return self.target_batch / self.step

    @property
    def tokens_per_second(self) -> float | None:
        """Tokens a second over all ranks, where the batch has tokens."""
        return None if self.tokens is None else self.tokens / self.step

    def rate(self) -> str:
        """The throughput over all ranks, e.g. ``"12.5 samples/s, 51,200 tokens/s over 4 devices"``."""
        per = self.samples_per_second
        rate = f"{per:,.0f} samples/s" if per >= 100 else f"{per:.3g} samples/s"
        if self.tokens_per_second is not None:
            rate += f", {self.tokens_per_second:,.0f} tokens/s"
        return f"{rate} over {self.ranks} devices"

    def describe(self) -> str:
        """One line: the optimizer step's time, the throughput over all ranks and the collectives' time."""
        return (f"{seconds(self.step)} per optimizer step ({self.rate()}; collectives "
                f"{seconds(self.communication)}, {seconds(self.exposed)} of it not hidden by compute)")

    def brief(self) -> str:
        """A few words for a row: the optimizer step's time and the collectives' part not hidden by compute."""
        spans = f"; over more than {NODE} devices, a lower bound (the network between nodes not modelled)" if self.ranks > NODE else ""
        return f"{seconds(self.step)} a step ({seconds(self.exposed)} of it collectives not hidden by compute{spans})"

    def lines(self) -> list[str]:
        """The report's rows: the step, its compute and collectives, the throughput, the basis."""
        c = self.compute
        return [f"time per step      {seconds(self.step)}  ({c.accumulation} micro-step{'s' if c.accumulation > 1 else ''} and the "
                "optimizer step over the rank's shard)",
                f"  compute          {seconds(c.step)} a rank ({seconds(c.micro_step)} a micro-step, optimizer {seconds(c.optimizer)})",
                f"  collectives      {seconds(self.communication)} (all-gathers {seconds(self.gather)} a micro-step, reduce-scatter "
                f"{seconds(self.reduce_scatter)} a window); not hidden by compute: {seconds(self.exposed)}",
                f"  throughput       {self.rate()}",
                f"  basis            {self.basis}"]

    def to_dict(self) -> dict[str, Any]:
        """Plain values for ``--json``: the parts, the rank's compute and the derived seconds and throughput."""
        return {"ranks": self.ranks, "step": self.step, "micro_step": self.micro_step, "syncing_micro_step": self.syncing_micro_step,
                "compute": self.compute.to_dict(), "gather": self.gather, "reduce_scatter": self.reduce_scatter,
                "first_gather": self.first_gather, "last_reduce": self.last_reduce, "communication": self.communication,
                "exposed": self.exposed, "target_batch": self.target_batch, "tokens": self.tokens,
                "samples_per_second": self.samples_per_second, "tokens_per_second": self.tokens_per_second, "basis": self.basis}


def _rank_shard(work: Work, ranks: int) -> Work:
    """``work`` with its optimizer step's FLOPs and bytes over one rank's shard (its kernels launched as many times)."""
    parts = tuple((ph, dt, kind, -(-f // ranks), -(-b // ranks)) if ph == "step" else (ph, dt, kind, f, b)
                  for ph, dt, kind, f, b in work.parts)
    return Work(parts, work.launches)


def shard_step_time(work: Work, card: Gpu, flows: Traffic, *, ranks: int, accumulation: int, samples: int,
                    target_batch: int, tokens_per_sample: int | None = None,
                    efficiency: BusEfficiency = NCCL_BUS) -> ShardTime:
    """The time of an optimizer step of FSDP2 over ``ranks`` of ``card``, per rank (the rule of the module docstring).

    Args:
        work: one micro-step's work at the rank's micro-batch, unsharded (:meth:`autotune.probe.estimate.Estimator.work`).
        card: the card every rank runs on.
        flows: the bytes of the collectives (:func:`traffic`).
        ranks: devices the model is sharded over.
        accumulation: micro-steps per optimizer step on the rank.
        samples: samples per optimizer step on the rank.
        target_batch: samples per optimizer step over all ranks.
        tokens_per_sample: tokens in a sample, where the batch has tokens.
        efficiency: NCCL's bus-bandwidth efficiency by link (default: :data:`NCCL_BUS`).
    """
    tokens = None if tokens_per_sample is None else tokens_per_sample * samples
    compute = predict(_rank_shard(work, ranks), card, accumulation=accumulation, samples=samples, tokens=tokens)
    share = bus_bandwidth(card, efficiency) / card.link
    basis = (f"predicted for {ranks} x {card.describe()}, FSDP2's collectives over {card.link_kind} at "
             f"{card.link / 1e9:.0f} GB/s a direction x {share:g} (NCCL's bus bandwidth), one node")
    if ranks > NODE:
        basis += f": over more than {NODE} devices a run spans nodes, whose network is not modelled (a lower bound)"

    def ring(nbytes: int) -> float:
        return ring_seconds(nbytes, ranks, card, efficiency=efficiency)

    return ShardTime(ranks=ranks, compute=compute, gather=ring(flows.gather_forward + flows.gather_backward),
                     reduce_scatter=ring(flows.reduce_scatter), first_gather=ring(flows.first_gather),
                     last_reduce=ring(flows.last_reduce), target_batch=target_batch,
                     tokens=None if tokens_per_sample is None else tokens_per_sample * target_batch, basis=basis)


def card_and_limit(gpu: str | None, device: torch.device, memory_limit: int | str | None) -> tuple[Gpu | None, int | str | None]:
    """``shard_plan(gpu=...)``: the card, and each device's memory limit (the card's, or ``memory_limit`` where given, at
    most the card's); without ``gpu``, None and ``memory_limit`` as given.

    Raises:
        ValueError: a name the catalogue lacks (with its names), a device that is not CUDA, a limit above the card's.
    """
    if gpu is None:
        return None, memory_limit
    card = gpu_named(gpu)
    if device.type != "cuda":
        raise ValueError(f"Invalid device {str(device)!r} with gpu={card.name!r}: the card is a CUDA device; leave device "
                         "out, or give device='cuda'")
    limit, _ = estimate_limit(card, parse_bytes(memory_limit) if memory_limit is not None else None)
    return card, limit


def row_time(row: Any, *, card: Gpu | None, work_at: Callable[[int], Work], flows: Traffic, batch: Any) -> ShardTime | None:
    """The time of a :class:`autotune.planning.sharding.ShardEstimate` ``row`` on ``card`` (None without a card, or where
    nothing fits), for the rank with the largest share, its micro-steps timed at the row's micro-batch (an upper bound
    by a smaller last one's share). ``work_at(b)``: one micro-step's work at ``b`` samples like ``batch``."""
    if card is None or not row.fits:
        return None
    share = split_evenly(row.target_batch, row.ranks)[0]
    return shard_step_time(work_at(row.micro_batch), card, flows, ranks=row.ranks, accumulation=row.accumulation_steps,
                           samples=share, target_batch=row.target_batch, tokens_per_sample=tokens_per_sample(batch))
