"""The CUDA caching allocator, replayed: what ``max_memory_allocated`` and ``max_memory_reserved`` read.

A tensor count (:mod:`autotune.memory.ledger`) says what tensors hold. The card's allocator hands out
more: it rounds every request up to 512-byte blocks and takes memory from the driver in *segments*,
which it caches and splits, so a step's reserved bytes (what the per-process cap, and the device,
see) are above its allocated bytes. This module replays a step's allocations and frees, in order,
through the allocator's documented rules (``c10/cuda/CUDACachingAllocator.cpp``):

- every request is rounded up to a multiple of 512 bytes (``kMinBlockSize``);
- requests up to 1 MiB (``kSmallSize``) come from the *small pool*, whose segments are 2 MiB
  (``kSmallBuffer``); larger ones from the *large pool*: a 20 MiB segment (``kLargeBuffer``) for
  requests under 10 MiB (``kMinLargeAlloc``), else the request rounded up to 2 MiB (``kRoundLarge``);
- a request takes the smallest cached free block of its pool that fits (best fit), and splits it
  when what remains is at least 512 bytes (small pool) or more than 1 MiB (large pool); otherwise
  the whole block is handed out (and counted as allocated);
- a freed block merges with free neighbours of its segment;
- when a new segment would pass the cap, every cached segment that is entirely free is released
  and the request retried (``num_alloc_retries``); if it still does not fit, it is an out-of-memory
  error;
- with ``expandable_segments:True`` each pool is one segment that grows by pages (2 MiB in the
  small pool, 20 MiB in the large) and any remainder of at least 512 bytes is split off.

cuBLAS takes its workspace from the same allocator, once per handle and stream, on the first
matrix multiplication: :func:`cublas_workspace` gives its size as torch chooses it.

Pure Python: no torch, no device.
"""

from __future__ import annotations

import bisect
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "MIN_BLOCK",
    "AllocatorPeaks",
    "CachingAllocator",
    "cublas_workspace",
    "expandable_segments",
    "replay",
    "round_size",
    "scale_events",
    "segment_size",
    "steady_state",
]

MIN_BLOCK = 512  # kMinBlockSize: every block is a multiple of this
SMALL_SIZE = 1 << 20  # kSmallSize: requests up to this come from the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: the small pool's segments
LARGE_BUFFER = 20 << 20  # kLargeBuffer: segments for requests between 1 and 10 MiB
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge: larger requests are rounded up to this


def round_size(nbytes: int) -> int:
    """A request's block size: at least 512 bytes, rounded up to a multiple of 512.

    Example:
        >>> round_size(1), round_size(512), round_size(513)
        (512, 512, 1024)
    """
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(block: int) -> int:
    """The segment the allocator asks the driver for when no cached block fits a ``block``-byte request.

    Example:
        >>> [segment_size(round_size(n)) >> 20 for n in (4096, 2 << 20, 11 << 20)]
        [2, 20, 12]
    """
    if block <= SMALL_SIZE:
        return SMALL_BUFFER
    if block < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-block // ROUND_LARGE) * ROUND_LARGE


def cublas_workspace(compute_capability: tuple[int, int] = (9, 0), config: str | None = None) -> int:
    """Bytes of the workspace torch gives cuBLAS on one handle and stream.

    ``CUBLAS_WORKSPACE_CONFIG`` (``":SIZE_KiB:COUNT"`` pairs, read from the environment when
    ``config`` is None) sets it; without it torch takes 32 MiB on compute capability 9 and newer
    (Hopper: H100, H200) and 4096 KiB x 2 + 16 KiB x 8 before.

    Example:
        >>> cublas_workspace((9, 0), config="") >> 20
        32
        >>> cublas_workspace((8, 0), config=":4096:8")
        33554432
    """
    if config is None:
        config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    pairs = re.findall(r":(\d+):(\d+)", config)
    if pairs:
        return sum(int(size) * 1024 * int(count) for size, count in pairs)
    if compute_capability >= (9, 0):
        return 4096 * 1024 * 8
    return 4096 * 1024 * 2 + 16 * 1024 * 8


@dataclass(frozen=True)
class AllocatorPeaks:
    """What the allocator's statistics would read after a replay.

    Attributes:
        allocated: the peak of allocated bytes (``max_memory_allocated``: blocks handed out).
        reserved: the peak of reserved bytes (``max_memory_reserved``: segments taken from the driver).
        retries: how often cached segments were released to make room (``num_alloc_retries``).
        out_of_memory: whether a request did not fit under the cap even after that.
    """

    allocated: int
    reserved: int
    retries: int = 0
    out_of_memory: bool = False


class _Block:
    __slots__ = ("free", "next", "offset", "pool", "prev", "segment", "size")

    def __init__(self, segment: int, offset: int, size: int, pool: str) -> None:
        self.segment, self.offset, self.size, self.pool = segment, offset, size, pool
        self.free = True
        self.prev: _Block | None = None
        self.next: _Block | None = None

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.segment, self.offset)


class CachingAllocator:
    """The caching allocator's bookkeeping (see the module docstring), without memory.

    Args:
        cap: bytes the reserved segments may not pass (``set_per_process_memory_fraction``), or None.
        expandable: ``expandable_segments:True``.
    """

    def __init__(self, *, cap: int | None = None, expandable: bool = False) -> None:
        self.cap = cap
        self.expandable = expandable
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self.retries = 0
        self._free: dict[str, list[tuple[int, int, int]]] = {"small": [], "large": []}
        self._blocks: dict[tuple[int, int, int], _Block] = {}
        self._segments: dict[int, tuple[int, str]] = {}  # id -> (bytes, pool)
        self._tails: dict[str, _Block] = {}  # expandable: each pool's last block
        self._live: dict[object, _Block] = {}
        self._next_segment = 0

    def malloc(self, key: object, nbytes: int) -> bool:
        """Hand out a block for ``nbytes`` under ``key``; False when it does not fit under the cap."""
        size = round_size(nbytes)
        pool = "small" if size <= SMALL_SIZE else "large"
        block = self._best_fit(pool, size)
        if block is None:
            block = self._grow(pool, size)
            if block is None:
                return False
        self._take(block)
        remaining = block.size - size
        if remaining >= MIN_BLOCK and (pool == "small" or self.expandable or remaining > SMALL_SIZE):
            rest = _Block(block.segment, block.offset + size, remaining, pool)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            if self._tails.get(pool) is block:
                self._tails[pool] = rest
            self._give(rest)
        block.free = False
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return True

    def free(self, key: object) -> None:
        """Return ``key``'s block to its pool, merged with its free neighbours."""
        block = self._live.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._take(neighbour)
                first, second = (neighbour, block) if neighbour is block.prev else (block, neighbour)
                first.size += second.size
                first.next = second.next
                if second.next is not None:
                    second.next.prev = first
                if self._tails.get(first.pool) is second:
                    self._tails[first.pool] = first
                block = first
        self._give(block)

    def _give(self, block: _Block) -> None:
        bisect.insort(self._free[block.pool], block.key())
        self._blocks[block.key()] = block

    def _take(self, block: _Block) -> None:
        free = self._free[block.pool]
        free.pop(bisect.bisect_left(free, block.key()))
        del self._blocks[block.key()]

    def _best_fit(self, pool: str, size: int) -> _Block | None:
        free = self._free[pool]
        at = bisect.bisect_left(free, (size, -1, -1))
        return self._blocks[free[at]] if at < len(free) else None

    def _grow(self, pool: str, size: int) -> _Block | None:
        """A new segment (or, expandable, more pages at the end of the pool's one) for ``size``."""
        if self.expandable:
            page = SMALL_BUFFER if pool == "small" else LARGE_BUFFER
            tail = self._tails.get(pool)
            spare = tail.size if tail is not None and tail.free else 0
            more = -(-(size - spare) // page) * page
            if not self._room(more):
                return None
            self.reserved += more
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            if spare:
                assert tail is not None
                self._take(tail)
                tail.size += more
                self._give(tail)
                return tail
            offset = tail.offset + tail.size if tail is not None else 0
            block = _Block(0 if pool == "small" else 1, offset, more, pool)
            block.prev = tail
            if tail is not None:
                tail.next = block
            self._tails[pool] = block
            self._give(block)
            return block
        grown = segment_size(size)
        if not self._room(grown):
            return None
        segment = self._next_segment
        self._next_segment += 1
        self._segments[segment] = (grown, pool)
        self.reserved += grown
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        block = _Block(segment, 0, grown, pool)
        self._give(block)
        return block

    def _room(self, more: int) -> bool:
        """Whether ``more`` bytes may be reserved: releasing the entirely free segments first if the
        cap requires it (a retry), as the allocator does before it gives up."""
        if self.cap is None or self.reserved + more <= self.cap:
            return True
        self.retries += 1
        whole = [b for b in self._blocks.values()
                 if b.prev is None and b.next is None and b.segment in self._segments and b.size == self._segments[b.segment][0]]
        for block in whole:
            self._take(block)
            self.reserved -= self._segments.pop(block.segment)[0]
        return self.reserved + more <= self.cap


def replay(
    events: Iterable[tuple[object, int]], *, cap: int | None = None, expandable: bool = False
) -> AllocatorPeaks:
    """Replay allocations and frees through the caching allocator.

    Args:
        events: ``(key, nbytes)`` in order: ``nbytes > 0`` allocates a block for ``key``, ``0`` frees
            ``key``'s block.
        cap: the per-process cap on reserved bytes, or None.
        expandable: ``expandable_segments:True``.

    Example:
        >>> peaks = replay([("a", 3000), ("b", 3 << 20), ("a", 0), ("c", 100)])
        >>> peaks.allocated, peaks.reserved >> 20
        (3148800, 22)
    """
    allocator = CachingAllocator(cap=cap, expandable=expandable)
    for key, nbytes in events:
        if nbytes > 0:
            if not allocator.malloc(key, nbytes):
                return AllocatorPeaks(allocator.peak_allocated, allocator.peak_reserved, allocator.retries, True)
        else:
            allocator.free(key)
    return AllocatorPeaks(allocator.peak_allocated, allocator.peak_reserved, allocator.retries)


def expandable_segments(conf: str | None = None) -> bool:
    """Whether ``PYTORCH_CUDA_ALLOC_CONF`` (read from the environment when ``conf`` is None) turns on
    expandable segments.

    Example:
        >>> expandable_segments("max_split_size_mb:128,expandable_segments:True")
        True
    """
    if conf is None:
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    return bool(re.search(r"expandable_segments:\s*true", conf, re.IGNORECASE))


def steady_state(
    held: Iterable[int],
    micro_step: Iterable[tuple[int, int]],
    optimizer_step: Iterable[tuple[int, int]] = (),
    *,
    workspace: int = 0,
) -> list[tuple[object, int]]:
    """The allocations and frees of training's steady state, in order, for :func:`replay`.

    What a window holds (``held``: the sizes of the parameters, buffers, gradients and optimizer
    state, allocated first), the cuBLAS ``workspace``, then a micro-step, the optimizer step and a
    second micro-step, which meets the cache the first and the step left. Each micro-step's events
    (its batch included) are ``(serial, nbytes)`` as :class:`autotune.memory.ledger.TensorLedger`
    records them; what a step leaves allocated at its end is freed then (the batch, the loss).
    """
    events: list[tuple[object, int]] = [(("held", i), n) for i, n in enumerate(held) if n > 0]
    if workspace:
        events.append(("cublas workspace", workspace))
    step = list(micro_step)
    for part, recorded in (("micro 1", step), ("optimizer", list(optimizer_step)), ("micro 2", step)):
        live: set[int] = set()
        for serial, n in recorded:
            events.append(((part, serial), n))
            if n > 0:
                live.add(serial)
            else:
                live.discard(serial)
        events.extend(((part, serial), 0) for serial in sorted(live))
    return events


def scale_events(
    first: tuple[int, list[tuple[int, int]]], second: tuple[int, list[tuple[int, int]]], size: int
) -> list[tuple[int, int]] | None:
    """The events of a step at micro-batch ``size`` from the same step's events at two sizes
    ``(b, events)``: each allocation's bytes along the line through the two (exact where they are
    affine in the micro-batch, as a fixed shape's tensors are). None when the two do not pair up
    (other operations at the two sizes) or a size comes out fractional or negative.

    Example:
        >>> scale_events((2, [(0, 100), (1, 40), (0, 0)]), (3, [(0, 150), (1, 40), (0, 0)]), 10)
        [(0, 500), (1, 40), (0, 0)]
    """
    (b1, e1), (b2, e2) = first, second
    if len(e1) != len(e2) or b1 == b2:
        return None
    out = []
    for (k1, n1), (k2, n2) in zip(e1, e2):
        if k1 != k2 or (n1 == 0) != (n2 == 0):
            return None
        n, rest = divmod(n1 * (b2 - size) + n2 * (size - b1), b2 - b1)
        if rest or n < 0 or (n == 0 and n1 > 0):
            return None
        out.append((k1, n))
    return out
