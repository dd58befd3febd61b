"""A trace: one forward and backward of the trial step in the steady state, on fake tensors, as
:class:`autotune.probe.estimate.Estimator` records it (the live bytes after each operation, the
allocations for a CUDA target, where marked blocks run, each operation's FLOPs and bytes moved)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from autotune.memory.work import Work

__all__ = ["Trace"]


@dataclass(frozen=True)
class Trace:
    """One forward and backward in the steady state, on fake tensors.

    Attributes:
        size: the micro-batch.
        peak: the step's peak bytes at that size (the forward and backward, or the optimizer step).
        live: the live bytes when counting started, then after each operation, and last the
            optimizer step's peak at this size (what the step leaves plus its transient bytes).
        ops: the operations, for matching two traces (the last is ``"step"``).
        seconds: the wall time of the trace.
        held: for a CUDA target, the bytes of each tensor the steady state holds (parameters,
            buffers, gradients, optimizer state), in the order they were counted.
        events: for a CUDA target, the allocations and frees of the micro-step, its batch first
            (see :func:`autotune.memory.allocator.steady_state`).
        outputs: each operation's outputs in ``ops`` as ``(dtype, elements)`` (without the last, ``"step"``).
        marks: where in ``live`` the forward and the backward of each marked block (:meth:`Estimator.mark`)
            start and end, in order (empty when none is marked, or one was not seen).
        event_marks: the same points in ``events`` (a CUDA target).
        micro_peak: the forward and backward's peak as the ledger counted it (within an operation too).
        work: the FLOPs and bytes read and written of the forward, the backward (with any recomputed forward) and
            the optimizer step, by phase, dtype and kind (:class:`autotune.memory.work.Work`).
        op_work: each operation's ``(flops, bytes)`` in ``ops`` (without the last, ``"step"``).
    """

    size: int
    peak: int
    live: tuple[int, ...]
    ops: tuple[Any, ...]
    seconds: float
    held: tuple[int, ...] = ()
    events: tuple[tuple[int, int], ...] = ()
    outputs: tuple[tuple[tuple[torch.dtype, int], ...], ...] = ()
    marks: tuple[int, ...] = ()
    event_marks: tuple[int, ...] = ()
    micro_peak: int = 0
    work: Work = Work()
    op_work: tuple[tuple[int, int], ...] = ()

    @property
    def backward_peak(self) -> int:
        """The forward and backward's own peak (without the optimizer step's line)."""
        return max(self.live[:-1])
