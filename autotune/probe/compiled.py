"""Compiled models: which parts ``torch.compile`` compiled, the fake copy run eager, and a compiled step's bytes.

A model given compiled (``torch.compile(model)``, an ``OptimizedModule``; blocks replaced by ``torch.compile(block)``;
modules compiled in place with ``module.compile()``) runs differently from its eager self: AOTAutograd's partitioner
recomputes cheap operations in the backward instead of saving their inputs, and the inductor fuses element-wise
temporaries away. Its step is planned as it runs, with three rules:

- **Never under a dispatch mode.** Dynamo does not compile a frame while a non-infrastructure ``TorchDispatchMode`` is
  active (a tensor ledger, an operation counter), and it marks the frame's code to be skipped from then on: one call of
  a compiled model under a ledger, and it runs eager ever after (torch 2.13: none of its compiled graphs ran again, in
  the trial or in training). Real trials of a compiled model therefore run without the ledger, and the fake copy of an
  estimate runs each compiled part's original module (:func:`run_eager`): the copy shares the model's code, so its
  calls would otherwise mark that code too.
- **Real trials measure the compiled step.** The inductor allocates its buffers without the dispatcher, where no ledger
  sees them. On the CPU the step's bytes are the CPU allocator's own count (:class:`CpuAllocations`: every allocation
  and free with its running total, as torch's profiler reports them); on CUDA the caching allocator's statistics,
  read for every trial anyway. The step is run once at each size before it is measured (its first call at a shape
  compiles it), and the budget is checked after the step, not during it.
- **The estimate is the eager step's, said so.** Fake tensors cannot run the inductor's kernels, and the partitioned
  graphs run operation by operation materialise the element-wise chains the inductor fuses (a GPT-2 block's GELU
  recomputed in the backward: four temporaries of the MLP's width at once), so compiling on fake tensors is no closer.
  The estimate traces the eager step, which saves more for backward: it is above the compiled step's peak, and the
  plan's note says so (:func:`note`), with the measured figures where real trials ran.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from autotune.units import format_bytes

__all__ = ["CpuAllocations", "backend_of", "compiled_parts", "measured", "note", "run_eager"]


def compiled_parts(model: nn.Module) -> tuple[str, ...]:
    """The names of ``model``'s compiled modules, outermost first (``""``: the model itself), or ``()`` for an
    eager model. A compiled module is an ``OptimizedModule`` (``torch.compile(module)``) or a module compiled in
    place (``module.compile()``); the modules inside a compiled one are not listed."""
    found: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{outer}.") or outer == "" for outer in found):
            continue
        if _is_wrapper(module) or module.__dict__.get("_compiled_call_impl") is not None:
            found.append(name)
    return tuple(found)


def _is_wrapper(module: nn.Module) -> bool:
    return type(module).__name__ == "OptimizedModule" and "_orig_mod" in module._modules


def run_eager(copy: nn.Module) -> None:
    """Make ``copy`` (a copy of a model, never the model itself) run its compiled parts eagerly: each
    ``OptimizedModule`` calls its original module, each module compiled in place its own forward. Its
    parameters and names stay as they are."""
    for module in copy.modules():
        if _is_wrapper(module):
            module.__dict__.pop("_forward", None)
            module.forward = module._orig_mod.__call__
        if module.__dict__.get("_compiled_call_impl") is not None:
            module._compiled_call_impl = None


class CpuAllocations:
    """The CPU allocator's own count of the bytes it holds, while a block runs: how far it grew above its
    count at the start (:attr:`growth`, bytes).

    Torch's profiler, with its memory events on, reports every allocation and free of the CPU allocator with
    the allocator's running total; the growth is the largest total less the total at the start (read from a
    marker allocated first). Every tensor the CPU makes goes through that allocator, the inductor's buffers
    included; storage outside it (a library's own scratch memory) is not counted.
    """

    def __init__(self) -> None:
        self.growth = 0
        self._profile: Any = None

    def __enter__(self) -> CpuAllocations:
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _silent_stderr():  # the profiler's C++ side writes a line to the process's stderr as it starts and stops
            self._profile.__enter__()
        marker = torch.empty(1, dtype=torch.uint8)
        self._marker = marker.data_ptr()
        del marker
        return self

    def __exit__(self, *exc: Any) -> None:
        with _silent_stderr():
            self._profile.__exit__(*exc)
        if exc[0] is None:
            self.growth = self._growth()
        self._profile = None

    def _growth(self) -> int:
        from torch._C._profiler import _EventType

        totals: list[int] = []
        marks: list[tuple[int, int]] = []  # (time, the count before it) of each allocation at the marker's address
        stack = list(self._profile.profiler.kineto_results.experimental_event_tree())
        while stack:
            event = stack.pop()
            stack.extend(event.children)
            if event.tag != _EventType.Allocation or event.extra_fields.device.type != "cpu":
                continue
            fields = event.extra_fields
            totals.append(fields.total_allocated)
            if fields.ptr == self._marker and fields.alloc_size == 1:
                marks.append((event.start_time_ns, fields.total_allocated - 1))
        assert marks, "the profiler reported no allocation of the marker"
        return max(totals) - min(marks)[1]


@contextlib.contextmanager
def _silent_stderr() -> Iterator[None]:
    """The process's stderr (file descriptor 2, which C++ writes to) sent to the null device while the block runs."""
    import os
    import sys

    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


@contextlib.contextmanager
def measured(device: torch.device) -> Iterator[CpuAllocations | None]:
    """The device's own count of a compiled step's bytes: the CPU allocator's (:class:`CpuAllocations`); on other
    devices None (the caching allocator's statistics are read after every trial)."""
    if device.type != "cpu":
        yield None
        return
    with CpuAllocations() as count:
        yield count


def backend_of(model: nn.Module) -> str | None:
    """The name of the backend ``model``'s compiled parts were compiled with (``"inductor"``, ``"aot_eager"``, a
    callable's name), or None where it cannot be read (a module compiled in place) or the parts differ."""
    from torch._dynamo.eval_frame import innermost_backend

    names = set()
    for module in model.modules():
        if _is_wrapper(module):
            names.add(getattr(innermost_backend(module.dynamo_ctx.callback), "compiler_name", None))
        elif module.__dict__.get("_compiled_call_impl") is not None:
            names.add(None)
    return names.pop() if len(names) == 1 else None


def note(parts: tuple[str, ...], *, backend: str | None, estimated: int | None = None, measured: int | None = None,
         size: int | None = None) -> str:
    """What a plan of a compiled model says: what was verified, what was estimated and the direction of the estimate's
    error: measured where a real trial ran at ``size`` (``measured`` and ``estimated`` given), else expected from the
    ``backend``."""
    what = "the model is compiled" if parts == ("",) else "compiled modules (" + ", ".join(parts[:3]) + (", ..." if len(parts) > 3 else "") + ")"
    what += f" with {backend}" if backend else ""
    if estimated is None or measured is None or size is None or measured <= 0:
        if backend == "inductor":
            return (f"{what}: planned as its eager step, whose estimate is above the compiled step's peak (the inductor "
                    "recomputes cheap operations in the backward and fuses element-wise temporaries away): the "
                    "micro-batch errs on the small side; a real trial measures the compiled step")
        return (f"{what}: planned as its eager step; the compiled step's peak may be above or below it (what the "
                "backend saves for backward decides): a real trial measures the compiled step")
    error = estimated / measured - 1
    return (f"{what}: real trials measured the compiled step; the estimate is of the eager step, {abs(error) * 100:.1f}% "
            f"{'above' if error >= 0 else 'below'} the compiled step's peak at micro-batch {size} ({format_bytes(estimated)} "
            f"against {format_bytes(measured)} measured)")
