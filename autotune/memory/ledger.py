"""Tensor accounting: the bytes of live tensor storages, counted as operations create them.

:class:`TensorLedger` (a ``TorchDispatchMode``) counts the bytes of live tensor storages and raises
``torch.OutOfMemoryError`` as soon as an operation takes the count past its limit; the outputs of that
operation are freed as the error unwinds. It works on every device, including fake and ``meta``
tensors (where it gives exact estimates at no cost), and is how a memory limit is enforced on CPU,
where no graceful out-of-memory error exists, and how tests mock a limit. :class:`ResidentPeak`
samples the process's resident memory beside it. Out-of-memory errors are told apart here too.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from autotune.units import format_bytes

__all__ = [
    "ResidentPeak",
    "TensorLedger",
    "held_outside_parameters",
    "held_tensors",
    "is_out_of_memory",
    "storage_bytes",
]


# Messages of out-of-memory errors raised as a plain RuntimeError (matched only when the type is not
# torch.OutOfMemoryError):
_OOM_MESSAGES = (
    "DefaultCPUAllocator: can't allocate memory",  # CPU allocator
    "CUDA out of memory",  # CUDA allocator, older releases
    "CUDA error: out of memory",  # a kernel launch or the driver
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS workspace
    "CUDNN_STATUS_ALLOC_FAILED",  # cuDNN workspace
    "MPS backend out of memory",  # Apple MPS
    "CUDA driver error: out of memory",  # the driver API (e.g. cuMemAlloc through Triton)
    "Triton Error [CUDA]: out of memory",  # a Triton kernel launch
    "Cuda failure 'out of memory'",  # NCCL's own allocation (its message quotes CUDA's)
    "Cuda failure 2 'out of memory'",  # NCCL, with the CUDA error code
)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error (by type, else by a known backend message)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _OOM_MESSAGES)


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and repeats count once)."""
    storages: dict[int, Any] = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[id(storage)] = storage  # keep it alive while ids are compared
    return sum(s.nbytes() for s in storages.values())


class _Entry:
    __slots__ = ("ignored", "nbytes", "ref", "serial")

    def __init__(self, nbytes: int, *, ignored: bool = False) -> None:
        self.nbytes = nbytes
        self.ignored = ignored
        self.ref: Any = None
        self.serial = -1  # its number among the recorded events


def _released(key: int, ledger: Any) -> Any:
    """The weakref callback of a counted storage: it died, so its bytes are no longer live."""

    def release(_ref: Any) -> None:
        owner = ledger()
        if owner is None:
            return
        entry = owner._entries.pop(key, None)
        if entry is not None and not entry.ignored:
            owner.live -= entry.nbytes
            if owner.events is not None and entry.serial >= 0:
                owner.events.append((entry.serial, 0))

    return release


# Storage resizes in place are not tensor operations, so a dispatch mode never sees them; FSDP
# frees its unsharded parameters that way. While a ledger is active, ``UntypedStorage.resize_``
# tells the active ledgers.
_RESIZE_WATCHERS: list[Any] = []


_ORIGINAL_RESIZE = torch.UntypedStorage.resize_


def _watched_resize(self: Any, size: int) -> Any:
    out = _ORIGINAL_RESIZE(self, size)
    for ledger in list(_RESIZE_WATCHERS):
        ledger.resized(self)
    return out


class TensorLedger(TorchDispatchMode):
    """Counts live tensor bytes on one device type as operations allocate them.

    Use it as a context manager around the code to measure; call :meth:`track` first for tensors
    that already exist (parameters, buffers, gradients, optimizer state, the batch).

    Args:
        device_type: only storages on this device type count (``"cpu"``, ``"cuda"``, ``"meta"``),
            or on any of several, e.g. ``("meta", "cpu")``.
        limit: raise ``torch.OutOfMemoryError`` when the count passes this many bytes.
        block: round every storage up to a multiple of this (512 to mimic the CUDA allocator).
        trace: also record the live bytes after every operation (``trace``) and the operations
            (``ops``): two traces of the same step at two micro-batch sizes give memory as a
            function of the size (see :class:`autotune.memory.curve.MemoryCurve`).
        events: also record each storage's allocation and release, in order (``events``), for the
            caching allocator's replay (:mod:`autotune.memory.allocator`).

    Attributes:
        live: bytes counted now.
        peak: the most bytes counted at once.
        trace: with ``trace=True``, the live bytes when counting started, then after each operation.
        ops: with ``trace=True``, the operation of each entry of ``trace`` after the first.
        events: with ``events=True``, ``(serial, nbytes)`` for each storage counted (its bytes as
            allocated, unrounded) and ``(serial, 0)`` when it is released; serials number the storages
            in the order they were first counted.
    """

    def __init__(
        self, device_type: str | tuple[str, ...], *, limit: int | None = None, block: int = 1, trace: bool = False,
        events: bool = False,
    ) -> None:
        super().__init__()
        self.device_types = (device_type,) if isinstance(device_type, str) else tuple(device_type)
        self.limit = limit
        self.block = max(1, block)
        self.live = 0
        self.peak = 0
        # Keyed by the storage object's id: torch keeps a storage's Python object alive as long as
        # the storage lives, so its weakref callback fires exactly when the storage is freed.
        self._entries: dict[int, _Entry] = {}
        self._self_ref = weakref.ref(self)
        self.trace: list[int] | None = [] if trace else None
        self.ops: list[Any] | None = [] if trace else None
        self.events: list[tuple[int, int]] | None = [] if events else None

    def _size(self, nbytes: int) -> int:
        return -(-nbytes // self.block) * self.block

    def _add(self, t: torch.Tensor) -> None:
        local = getattr(t, "_local_tensor", None)  # a DTensor holds its shard in a local tensor
        if local is not None and isinstance(local, torch.Tensor):
            t = local
        if t.device.type not in self.device_types:
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
            return
        key = id(storage)
        entry = self._entries.get(key)
        if entry is None:
            size = self._size(storage.nbytes())
            entry = _Entry(size)
            if self.events is not None and storage.nbytes():  # an empty storage allocates nothing
                entry.serial = len(self.events)
                self.events.append((entry.serial, storage.nbytes()))
            # Keep the weakref alive with the entry: its callback fires when the storage dies.
            entry.ref = weakref.ref(storage, _released(key, self._self_ref))
            self._entries[key] = entry
            self.live += size
            if self.live > self.peak:
                self.peak = self.live
            return
        if entry.ignored:
            return
        size = self._size(storage.nbytes())
        if entry.nbytes != size:  # resized in place (e.g. an out= argument)
            self.live += size - entry.nbytes
            entry.nbytes = size
            if self.live > self.peak:
                self.peak = self.live

    def resized(self, storage: Any) -> None:
        """A storage counted here changed size in place (``UntypedStorage.resize_``, as FSDP frees
        and re-allocates its unsharded parameters): count its new size."""
        entry = self._entries.get(id(storage))
        if entry is None or entry.ignored:
            return
        size = self._size(storage.nbytes())
        self.live += size - entry.nbytes
        entry.nbytes = size
        self.peak = max(self.peak, self.live)

    def __enter__(self) -> TensorLedger:
        _RESIZE_WATCHERS.append(self)
        if len(_RESIZE_WATCHERS) == 1:
            torch.UntypedStorage.resize_ = _watched_resize  # type: ignore[method-assign]
        if self.trace is not None:
            self.trace.append(self.live)
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            _RESIZE_WATCHERS.remove(self)
            if not _RESIZE_WATCHERS:
                torch.UntypedStorage.resize_ = _ORIGINAL_RESIZE  # type: ignore[method-assign]

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that exist already (each storage once, however many views share it)."""
        for t in tensors:
            self._add(t)

    def ignore(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count these tensors' storages, nor views of them (e.g. a data set held in memory,
        whose samples a loader hands out as views)."""
        for t in tensors:
            storage = t.untyped_storage()
            key = id(storage)
            if key not in self._entries:
                entry = _Entry(0, ignored=True)
                entry.ref = weakref.ref(storage, _released(key, self._self_ref))
                self._entries[key] = entry

    def _run(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one operation (a subclass may run some elsewhere, see autotune.probe.estimate)."""
        return func(*args, **kwargs)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = self._run(func, args, kwargs or {})
        # Outputs are a tensor or a (nested) list of them: walked here, no pytree (this runs for
        # every operation).
        if isinstance(out, torch.Tensor):
            self._add(out)
        elif isinstance(out, (tuple, list)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    self._add(o)
                elif isinstance(o, (tuple, list)):
                    for p in o:
                        if isinstance(p, torch.Tensor):
                            self._add(p)
        if self.trace is not None:
            self.trace.append(self.live)
            self.ops.append(func)  # type: ignore[union-attr]
        if self.limit is not None and self.live > self.limit:
            live = self.live
            del out  # free the outputs before unwinding
            raise torch.OutOfMemoryError(
                f"autotune memory budget exceeded: {format_bytes(live)} of tensors would be live on "
                f"{'/'.join(self.device_types)}, the budget is {format_bytes(self.limit)} ({func})"
            )
        return out


class ResidentPeak:
    """The growth of this process's resident memory while a block runs, sampled every millisecond.

    What a CPU step really takes beyond its tensors' bytes (allocator fragmentation and caching,
    oneDNN and OpenMP scratch memory, Python objects) shows up only here. ``growth`` is None when
    the resident size cannot be read (no psutil, or an unusual platform).
    """

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.growth: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ResidentPeak:
        try:
            import psutil

            self._process = psutil.Process()
            self._start = self._peak = int(self._process.memory_info().rss)
        except Exception:
            return self
        self._thread = threading.Thread(target=self._sample, name="autotune-rss", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._peak = max(self._peak, int(self._process.memory_info().rss))
            except Exception:  # pragma: no cover - the process is going away
                return

    def __exit__(self, *exc: Any) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, int(self._process.memory_info().rss))
        self.growth = self._peak - self._start


def held_outside_parameters(model: nn.Module) -> Iterator[torch.Tensor]:
    """Tensors a model holds besides its parameters and buffers: the quantization state of quantized layers
    (:mod:`autotune.memory.quantized`), read from the weights' own attributes: a 4-bit weight's ``quant_state``
    (absmax, nested absmax, codes, offset), an 8-bit weight's row scales (``SCB``)."""
    for module in model.modules():
        weight = module.__dict__.get("_parameters", {}).get("weight")
        if weight is None:
            continue
        state = getattr(weight, "quant_state", None)
        while state is not None:
            yield from (t for t in (state.absmax, state.code, state.offset) if isinstance(t, torch.Tensor))
            state = state.state2
        for scales in (getattr(weight, "SCB", None), getattr(getattr(module, "state", None), "SCB", None)):
            if isinstance(scales, torch.Tensor):
                yield scales


def held_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Tensors training holds between steps: parameters, buffers, the quantization state of quantized layers,
    gradients, optimizer state."""
    yield from model.parameters()
    yield from model.buffers()
    yield from held_outside_parameters(model)
    for p in model.parameters():
        if p.grad is not None:
            yield p.grad
    for s in optimizer.state.values():
        yield from (v for v in s.values() if isinstance(v, torch.Tensor))
