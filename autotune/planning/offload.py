"""Offloading to host memory on one device: FSDP2's ``CPUOffloadPolicy``, estimated for a what-if row.

Where a model's weights, gradients and optimizer state fill the card before any sample does, ``fully_shard`` with
``offload_policy=CPUOffloadPolicy()`` on one rank keeps all three in host memory (``torch.distributed.fsdp``, PyTorch
2.13): each unit's parameters are copied to the card before its forward and again before its backward, its gradients
are copied back to the host once it has reduced them, and the optimizer steps on the CPU. Nothing here runs it: the
row is offered, never applied (:data:`APPLY` is the code that applies it).

**What the card holds** at micro-batch ``b`` (the units are those :mod:`autotune.planning.sharding` shards: the blocks of
:func:`autotune.memory.checkpointing.blocks`, then the model, whose own parameters, those in no block, are the root's):

- two consecutive units' parameters unsharded (the one running and the one prefetched) and the root's, which FSDP2
  does not reshard after the forward (the backward needs them at once); the buffers, which are not offloaded;
- the gradients of the unit being reduced and the flat copy the reduce reads, and the root's gradients, held from
  the moment each is computed until the root reduces them after the whole backward;
- the activations and temporaries of the micro-batch's forward and backward, as on one device without offloading
  (the estimator's steady-state peak less what it holds resident; under autocast they include the low-precision copies
  of the weights that autocast keeps for the backward);
- no optimizer state and no optimizer step;
- on a CUDA target, cuBLAS's workspace, counted in what fits as a one-device estimate counts it (the allocator's
  rounding of tensors into segments is left to the budget's headroom).

**What the host holds**: the parameters, the gradients and the optimizer state (FSDP2 pins the parameters and the
gradients, ``pin_memory=True`` by default: of the host's memory, those bytes cannot be swapped), plus the CPU
optimizer step's own temporaries (none for torch's fused step; foreach's whole-model ones otherwise), not counted.

**How long**: FSDP2 syncs the gradients on every micro-step (holding them unsharded on the card for a window, with
``set_requires_gradient_sync(False)``, would bring back what offloading frees), so every micro-step copies to the card
every unit's parameters twice (the root's once) and to the host every gradient, and from the second micro-step of a
window on the host adds each gradient to the one it holds (FSDP2 then copies synchronously, and the CPU's sum blocks
the thread that launches the card's kernels). A micro-step takes the longer of the card's forward and backward
(:func:`autotune.memory.timing.predict`) and the copies over the host link at its nominal rate per direction
(:meth:`autotune.memory.gpus.Gpu.to_host`; pinned copies reach somewhat less: a lower bound of that part), the two
directions' bytes added (the copy back, synchronous while a window accumulates, holds up the next copies in), plus the
host's sums; an optimizer step ``k`` of those and the CPU optimizer's step over the state. The host's work runs at
:data:`HOST_RATE`: one core's rate measured (torch runs its CPU kernels on every core, up to the host's memory
bandwidth, so a host with more free cores is faster at that part).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from autotune.memory.allocator import cublas_workspace
from autotune.memory.checkpointing import blocks
from autotune.memory.curve import MemoryCurve
from autotune.memory.ledger import storage_bytes
from autotune.memory.timing import StepTime, seconds
from autotune.probe.search import estimated_max
from autotune.units import format_bytes

__all__ = ["APPLY", "HOST_RATE", "HostRate", "Offload", "host_optimizer", "offload_time", "offloaded", "shard_units", "trainable_bytes"]

APPLY = ("from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard  # one rank: torch.distributed.init_process_group first\n"
         "for block in blocks: fully_shard(block, offload_policy=CPUOffloadPolicy())\n"
         "fully_shard(model, offload_policy=CPUOffloadPolicy())  # the model's parameters on the CPU before these calls\n"
         "optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)  # steps on the CPU")


@dataclass(frozen=True)
class HostRate:
    """Bytes a second the host moves through memory for the CPU's share of an offloaded step: the optimizer's step
    (each parameter, gradient and state read, each parameter and state written) and the gradients' sums.

    Attributes:
        bytes_per_second: the rate.
        source: where it comes from.
    """

    bytes_per_second: float
    source: str


HOST_RATE = HostRate(
    bytes_per_second=16.5e9,
    source="torch 2.13's fused AdamW step on the CPU (fused=True, fp32), measured on one core of a Xeon: 1.7 ns a parameter "
           "over 134M parameters, 28 bytes moved a parameter; one core's rate (more cores run it faster, to the host's "
           "memory bandwidth)",
)


@dataclass(frozen=True)
class Offload:
    """One device under FSDP2 with ``CPUOffloadPolicy`` (estimated; see the module docstring).

    Attributes:
        micro_batch: the largest micro-batch that fits on the device (0: not even the smallest).
        device_peak: bytes the device holds at ``micro_batch`` (at the smallest where none fits).
        device: ``device_peak`` by part: ``parameters`` (two units' and the root's, and the buffers), ``gradients``
            (the unit being reduced, twice, and the root's), ``activations``.
        parameters, gradients, optimizer_state: bytes of each in host memory.
        root_parameters: bytes of the parameters in no unit, copied to the device once a micro-step.
        per_sample: bytes each sample adds to ``device_peak`` around ``micro_batch``.
    """

    micro_batch: int
    device_peak: int
    device: dict[str, int]
    parameters: int
    gradients: int
    optimizer_state: int
    root_parameters: int
    per_sample: int = 0

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory: parameters, gradients and optimizer state."""
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def pinned(self) -> int:
        """Bytes of ``host_bytes`` that FSDP2 pins (the parameters and the gradients)."""
        return self.parameters + self.gradients

    @property
    def copied_in(self) -> int:
        """Bytes copied to the device a micro-step: every unit's parameters for the forward and again for the
        backward, the root's once."""
        return 2 * self.parameters - self.root_parameters

    @property
    def copied_out(self) -> int:
        """Bytes copied to the host a micro-step: the gradients."""
        return self.gradients

    def describe(self) -> str:
        """The row's change in words, with the host memory it needs."""
        return (f"FSDP2 with CPUOffloadPolicy: parameters, gradients and optimizer state in host memory, "
                f"{format_bytes(self.host_bytes)} of it ({format_bytes(self.pinned)} pinned)")


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules ``fully_shard`` wraps before the model (here and in :mod:`autotune.planning.sharding`): the blocks
    holding parameters, else the children, where there are two or more; else none (the model is one unit)."""
    for found in (blocks(model), list(model.children())):
        holding = [m for m in found if any(True for _ in m.parameters())]
        if len(holding) >= 2:
            return holding
    return []


def trainable_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters that train (their gradients' bytes)."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def offloaded(estimator: Any, model: nn.Module, *, budget: int, upper: int, lower: int = 1) -> Offload:
    """What one device holds under FSDP2's ``CPUOffloadPolicy`` and the largest micro-batch in ``[lower, upper]`` that
    fits ``budget`` (bytes), read off the line through ``estimator``'s two traces of ``model``'s step (their forward and
    backward's, or their peaks' where the two ran different operations), as a what-if row is: no new trace
    (:class:`autotune.probe.estimate.Estimator`).

    Args:
        estimator: the estimator of the step as given (its precision, checkpointing and optimizer).
        model: the whole model (on any device, meta included: only its parameters' sizes are read).
        budget: bytes the step may use on the device.
        upper, lower: the micro-batches to search between.
    """
    units = shard_units(model)
    sizes = [storage_bytes(u.parameters()) for u in units]
    parameters = storage_bytes(model.parameters())
    root = parameters - sum(sizes) if units else parameters
    root_grads = trainable_bytes(model) - sum(trainable_bytes(u) for u in units)
    held = {"parameters": max((a + b for a, b in zip(sizes, sizes[1:])), default=0) + root + storage_bytes(model.buffers()),
            "gradients": 2 * max((trainable_bytes(u) for u in units), default=0) + root_grads}
    resident = estimator.resident()
    b1, b2 = estimator.sizes
    # The line of the two traces' forward and backward; through their peaks where their operations differ.
    curve = estimator.backward_curve() or MemoryCurve.through(b1, estimator.trace(b1).backward_peak, b2, estimator.trace(b2).backward_peak)

    def activations(b: int) -> int:
        return max(0, round(curve(b)) - resident)

    # What fits counts cuBLAS's workspace on a CUDA target too, as a one-device estimate's size does; the row's bytes
    # are the tensors', as the other rows' are.
    beside = cublas_workspace() if estimator.target == "cuda" else 0
    size, _ = estimated_max(lambda b: sum(held.values()) + activations(b) + beside, budget, upper, lower=lower)
    at = {**held, "activations": activations(size or lower)}
    return Offload(micro_batch=size, device_peak=sum(at.values()), device=at, parameters=parameters, gradients=trainable_bytes(model),
                   optimizer_state=estimator.optimizer_state_bytes(), root_parameters=root,
                   per_sample=activations((size or lower) + 1) - at["activations"])


def offload_time(offload: Offload, compute: StepTime, card: Any, *, host: HostRate = HOST_RATE) -> StepTime:
    """The optimizer step of ``compute`` (the card's forward and backward at the row's micro-batch, as
    :func:`autotune.memory.timing.predict` gives them) under offloading: each micro-step the longer of the card's
    work and the copies over ``card``'s host link, plus the host's sums of the gradients from the second micro-step
    on; then the CPU optimizer's step instead of the card's (see the module docstring).

    Example:
        >>> from autotune.memory.gpus import gpu_named
        >>> o = Offload(1, 0, {}, parameters=64 * 10**9, gradients=64 * 10**9, optimizer_state=128 * 10**9, root_parameters=0)
        >>> t = StepTime(micro_step=1.0, optimizer=0.1, accumulation=1, samples=1, tokens=None, flops=0.0, peak=None,
        ...              basis="predicted", bound="compute")
        >>> offload_time(o, t, gpu_named("h100-sxm")).micro_step  # 2 x 64 GB in and 64 GB out at 64 GB/s a direction
        3.0
    """
    link, kind = card.to_host()
    copies = (offload.copied_in + offload.copied_out) / link
    k = compute.accumulation
    sums = (k - 1) / k * 3 * offload.gradients / host.bytes_per_second  # each sum reads two gradients, writes one
    step = (3 * offload.gradients + 2 * offload.optimizer_state) / host.bytes_per_second
    micro = max(compute.micro_step, copies) + sums
    basis = (f"{compute.basis}; offloaded over {kind} at {link / 1e9:.0f} GB/s a direction, {format_bytes(offload.copied_in)} "
             f"to the device and {format_bytes(offload.copied_out)} back a micro-step ({seconds(copies)}), the CPU's work at "
             f"{host.bytes_per_second / 1e9:.3g} GB/s")
    return replace(compute, micro_step=micro, optimizer=step, basis=basis, bound="host link" if copies > compute.micro_step else compute.bound)


def host_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` can step on the CPU as FSDP2 offloads it: one of torch's own (bitsandbytes' and other
    libraries' optimizers are kernels for the card)."""
    return type(optimizer).__module__.startswith("torch.optim")
