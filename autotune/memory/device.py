"""Device facts and limits: what a device has, what others hold on it, its allocator's peaks.

On CUDA the caching allocator's own statistics (``max_memory_reserved``) add what the tensor count
(:mod:`autotune.memory.ledger`) cannot see: block rounding, cached segments and fragmentation; pynvml
tells the device's total memory and other processes' use; ``set_per_process_memory_fraction`` enforces a
limit below the physical one. On CPU the limit is the ledger's.
"""

from __future__ import annotations

import contextlib
import gc
import os
import platform
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "CUDA_BLOCK",
    "CUDA_CONTEXT_EAGER",
    "CUDA_CONTEXT_LAZY",
    "CUDA_CONTEXT_VARIABLE",
    "CUDA_OUTSIDE",
    "ContextAllowance",
    "DeviceMemory",
    "allocator_cap",
    "allocator_peak",
    "cuda_context_allowance",
    "cuda_memory_fraction",
    "default_headroom",
    "default_limit",
    "device_memory",
    "other_processes_bytes",
    "outside_allocator",
    "release_cached",
    "reset_peak",
    "synchronize",
]


# The CUDA caching allocator hands out blocks in multiples of 512 bytes.
CUDA_BLOCK = 512


# What an estimate-only plan for CUDA sets aside for the CUDA context and the libraries' handles (outside
# torch's tensors), as measured by benchmarks/gpu_validate.py on an H200 (CUDA 13.0, driver 580.159, PyTorch
# 2.11, 2026-12-04): with CUDA's lazy module loading (its default) 781 MiB outside the allocator after a training
# run (the context, cuBLAS, flash attention); with CUDA_MODULE_LOADING=EAGER 1778 MiB after the context, a cuBLAS
# matmul and flash attention. Transformers' single-GPU training page measured 1343 MiB on a V100 with CUDA 11.2
# (eager: before lazy loading). AUTOTUNE_CUDA_CONTEXT gives another figure.
CUDA_CONTEXT_LAZY = 781 * 2**20
CUDA_CONTEXT_EAGER = 1778 * 2**20
CUDA_CONTEXT_VARIABLE = "AUTOTUNE_CUDA_CONTEXT"


@dataclass(frozen=True)
class ContextAllowance:
    """What an estimate-only CUDA plan sets aside for the CUDA context, and where the figure comes from."""

    bytes: int
    source: str


def cuda_context_allowance() -> ContextAllowance:
    """The CUDA context's bytes for a plan that does not run on the device: ``AUTOTUNE_CUDA_CONTEXT`` (a size such
    as ``"1GiB"``) where set, else the figure measured for the module loading in effect (``CUDA_MODULE_LOADING``).

    Raises:
        ValueError: ``AUTOTUNE_CUDA_CONTEXT`` is not a size.
    """
    given = os.environ.get(CUDA_CONTEXT_VARIABLE)
    if given is not None:
        from autotune.units import parse_bytes

        try:
            return ContextAllowance(parse_bytes(given), f"{CUDA_CONTEXT_VARIABLE}={given}")
        except (TypeError, ValueError):
            raise ValueError(f"Invalid {CUDA_CONTEXT_VARIABLE}={given!r}: give the CUDA context's size, e.g. "
                             f"{CUDA_CONTEXT_VARIABLE}=1GiB, or unset it for the measured figure") from None
    if os.environ.get("CUDA_MODULE_LOADING", "").strip().upper() == "EAGER":
        return ContextAllowance(CUDA_CONTEXT_EAGER, "measured on an H200 with CUDA 13 and CUDA_MODULE_LOADING=EAGER; "
                                f"{CUDA_CONTEXT_VARIABLE} sets another")
    return ContextAllowance(CUDA_CONTEXT_LAZY, "measured on an H200 with CUDA 13, lazy module loading; "
                            f"{CUDA_CONTEXT_VARIABLE} sets another")


# The set-aside entry for memory measured outside the CUDA allocator (context, library handles).
CUDA_OUTSIDE = "the CUDA context and libraries outside torch's allocator (measured)"


# Default headroom per device kind. CUDA: the allocator's caching and fragmentation and the
# cuDNN/cuBLAS workspaces vary by a few to ~15 % between runs; 10 % keeps clear of them. CPU: the
# count is exact, the headroom only absorbs inputs larger than those probed.
_HEADROOM = {"cuda": 0.10, "cpu": 0.05}


def default_headroom(device: torch.device) -> float:
    """The default fraction of the limit kept free: 0.10 on CUDA, 0.05 on CPU, else 0.10."""
    return _HEADROOM.get(device.type, 0.10)


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
