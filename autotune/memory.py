"""Everything that reads device memory: limits, device facts, peaks, OOM detection, tensor accounting.

Two sources of truth:

- :class:`TensorLedger` counts the bytes of live tensor storages as operations create them (a
  ``TorchDispatchMode``) and raises ``torch.OutOfMemoryError`` as soon as an operation takes the
  count past its limit; the outputs of that operation are freed as the error unwinds. It works on
  every device, including fake and ``meta`` tensors (where it gives exact estimates at no cost), and is how a memory
  limit is enforced on CPU, where no graceful out-of-memory error exists, and how tests mock a limit.
- On CUDA, the caching allocator's own statistics (``max_memory_reserved``) add what the tensor count
  cannot see: block rounding, cached segments and fragmentation.
"""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .units import format_bytes

__all__ = [
    "CUDA_BLOCK",
    "CUDA_CONTEXT_ALLOWANCE",
    "CUDA_OUTSIDE",
    "DeviceMemory",
    "ResidentPeak",
    "TensorLedger",
    "allocator_cap",
    "cuda_memory_fraction",
    "default_headroom",
    "outside_allocator",
    "device_memory",
    "is_out_of_memory",
    "storage_bytes",
]

# The CUDA caching allocator hands out blocks in multiples of 512 bytes.
CUDA_BLOCK = 512

# What an estimate-only plan for CUDA sets aside for the CUDA context (outside torch's tensors):
# a few hundred MiB on current GPUs with lazy module loading.
CUDA_CONTEXT_ALLOWANCE = 512 * 2**20

# The set-aside entry for memory measured outside the CUDA allocator (context, library handles).
CUDA_OUTSIDE = "the CUDA context and libraries outside torch's allocator (measured)"

# Default headroom per device kind. CUDA: the allocator's caching and fragmentation and the
# cuDNN/cuBLAS workspaces vary by a few to ~15 % between runs; 10 % keeps clear of them. CPU: the
# count is exact, the headroom only absorbs inputs larger than those probed.
_HEADROOM = {"cuda": 0.10, "cpu": 0.05}

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


def default_headroom(device: torch.device) -> float:
    """The default fraction of the limit kept free: 0.10 on CUDA, 0.05 on CPU, else 0.10."""
    return _HEADROOM.get(device.type, 0.10)


class _Entry:
    __slots__ = ("ignored", "nbytes", "ref")

    def __init__(self, nbytes: int, *, ignored: bool = False) -> None:
        self.nbytes = nbytes
        self.ignored = ignored
        self.ref: Any = None


def _released(key: int, ledger: Any) -> Any:
    """The weakref callback of a counted storage: it died, so its bytes are no longer live."""

    def release(_ref: Any) -> None:
        owner = ledger()
        if owner is None:
            return
        entry = owner._entries.pop(key, None)
        if entry is not None and not entry.ignored:
            owner.live -= entry.nbytes

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
            function of the size (see :class:`autotune.search.MemoryCurve`).

    Attributes:
        live: bytes counted now.
        peak: the most bytes counted at once.
        trace: with ``trace=True``, the live bytes when counting started, then after each operation.
        ops: with ``trace=True``, the operation of each entry of ``trace`` after the first.
    """

    def __init__(
        self, device_type: str | tuple[str, ...], *, limit: int | None = None, block: int = 1, trace: bool = False
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
        """Run one operation (a subclass may run some elsewhere, see autotune.estimate)."""
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


@dataclass(frozen=True)
class DeviceMemory:
    """What a device has.

    Attributes:
        device: e.g. ``"cuda:0"`` or ``"cpu"``.
        name: e.g. ``"NVIDIA H200"``.
        total: bytes of memory.
        free: bytes free now (CUDA: the driver's view; CPU: psutil's ``available``).
        other_processes: bytes other processes hold on the device (CUDA with NVML only), else None.
    """

    device: str
    name: str
    total: int
    free: int
    other_processes: int | None = None


def _nvml_handle(pynvml: Any, index: int) -> Any:
    """NVML's handle for torch's CUDA device ``index``.

    Matched by UUID (then PCI bus id), never by index: under ``CUDA_VISIBLE_DEVICES`` torch's
    index 0 can be NVML's index 3.
    """
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        text = str(uuid)
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}")
        except Exception:
            pass
    bus_id = getattr(props, "pci_bus_id", None)
    if bus_id is not None:
        pci = f"{getattr(props, 'pci_domain_id', 0):08x}:{bus_id:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
        return pynvml.nvmlDeviceGetHandleByPciBusId(pci)
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def other_processes_bytes(usage: list[tuple[int, int]], me: int, reserved: int) -> int:
    """Bytes that other processes hold, from NVML's ``(pid, bytes)`` list for the device.

    This process is left out by its pid. Inside a container NVML reports host pids, so none
    matches: then the entry whose usage is closest above this process's own allocator cache
    (``reserved``) is taken to be this process (the context adds a few hundred MiB to it).

    Example:
        >>> other_processes_bytes([(101, 900), (7, 5000)], me=7, reserved=4000)
        900
        >>> other_processes_bytes([(40211, 4600), (40300, 900)], me=7, reserved=4000)  # a container
        900
    """
    if any(pid == me for pid, _ in usage):
        return sum(b for pid, b in usage if pid != me)
    if not usage:
        return 0
    candidates = [(b - reserved, i) for i, (_, b) in enumerate(usage) if b >= reserved]
    if not candidates:
        return sum(b for _, b in usage)
    mine = min(candidates)[1]
    return sum(b for i, (_, b) in enumerate(usage) if i != mine)


def _nvml_other_processes(index: int) -> int | None:
    """Bytes that other processes hold on CUDA device ``index``, via NVML; None when unknown."""
    try:
        import pynvml  # nvidia-ml-py: imported only when a CUDA device is asked about
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            handle = _nvml_handle(pynvml, index)
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            usage = [(int(p.pid), int(p.usedGpuMemory or 0)) for p in procs]
            return other_processes_bytes(usage, os.getpid(), int(torch.cuda.memory_reserved(index)))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML missing from the driver, no permission: unknown
        return None


def outside_allocator(device: torch.device) -> int | None:
    """Bytes this process holds on a CUDA device outside torch's caching allocator.

    The CUDA context, cuBLAS/cuDNN handles and workspaces, NCCL buffers: the driver's used memory
    less the allocator's reserved bytes less what other processes hold (NVML). None when other
    processes' usage is unknown (no NVML), or on other devices.
    """
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    other = _nvml_other_processes(index)
    if other is None:
        return None
    return max(0, int(total) - int(free) - int(torch.cuda.memory_reserved(index)) - other)


def device_memory(device: torch.device | str) -> DeviceMemory:
    """Facts about ``device``'s memory (CUDA via torch and NVML; CPU via psutil)."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(index)
        return DeviceMemory(
            device=f"cuda:{index}",
            name=torch.cuda.get_device_name(index),
            total=int(total),
            free=int(free),
            other_processes=_nvml_other_processes(index),
        )
    if device.type == "cpu":
        import psutil

        vm = psutil.virtual_memory()
        return DeviceMemory(
            device="cpu",
            name=platform.processor() or platform.machine() or "cpu",
            total=int(vm.total),
            free=int(vm.available),
        )
    raise ValueError(
        f"Cannot read the memory of device {str(device)!r}: pass memory_limit= (e.g. '16GiB')"
    )


def default_limit(device: torch.device, held: int) -> int:
    """The memory the training may use when no limit is given.

    ``held`` is what the training already holds on the device (model, gradients, optimizer state),
    which the free figure no longer includes. On CUDA the allocator's reserved cache counts as
    available too: it is this process's memory.
    """
    if device.type == "cuda":
        facts = device_memory(device)
        return facts.free + int(torch.cuda.memory_reserved(device))
    return device_memory(device).free + held


@contextlib.contextmanager
def cuda_memory_fraction(device: torch.device, limit: int | None) -> Iterator[None]:
    """Cap this process's CUDA allocator at ``limit`` bytes, restoring the old cap afterwards."""
    if device.type != "cuda" or limit is None:
        yield
        return
    total = torch.cuda.get_device_properties(device).total_memory
    # Not in every torch that autotune supports: without it the old cap is taken to be none (1.0).
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    old = float(getter(device)) if getter is not None else 1.0
    torch.cuda.set_per_process_memory_fraction(min(1.0, max(0.0, limit / total)), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(old, device)


def allocator_cap(limit: int, set_aside: Iterable[tuple[str, int]]) -> int:
    """The CUDA allocator's cap for a limit that counts everything: less what lives outside it."""
    return limit - sum(b for name, b in set_aside if name == CUDA_OUTSIDE)


def release_cached(device: torch.device, *, collect: bool | None = None) -> None:
    """Free unreachable tensors (and, on CUDA, the allocator's cache) between trials.

    ``collect`` runs the garbage collector (default: on CUDA, where the allocator holds what
    unreachable tensors took; on the CPU the tensor count never sees them, and a collection costs
    tens of milliseconds in a process that imported a large library). Never raises: after a
    failure on the device (a sticky CUDA error), emptying the cache can fail too, and that must not
    hide the error that matters.
    """
    if collect if collect is not None else device.type == "cuda":
        gc.collect()
    if device.type == "cuda":
        try:
            torch.cuda.empty_cache()
        except RuntimeError:
            pass


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so wall times include it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> int:
    """Start a CUDA peak measurement; returns the allocator's retry count so far (0 elsewhere)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def allocator_peak(device: torch.device) -> tuple[int, int]:
    """CUDA: (peak reserved bytes since :func:`reset_peak`, allocator retries); (0, 0) elsewhere."""
    if device.type != "cuda":
        return 0, 0
    torch.cuda.synchronize(device)
    stats = torch.cuda.memory_stats(device)
    return int(torch.cuda.max_memory_reserved(device)), int(stats.get("num_alloc_retries", 0))
