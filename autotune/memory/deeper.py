"""The caching allocator's events of a deeper stack of blocks, made from two shallower copies' events.

A model of repeated blocks traced with few of them (:mod:`autotune.probe.depth`) needs, for a CUDA
target, the allocations and frees of the full depth, which the allocator's replay
(:func:`autotune.memory.allocator.replay`) reads. They are made here from the events of two copies one
block apart: the runs of events the deeper copy adds (one more block's parameters, gradients and
optimizer state; its share of the optimizer step's temporaries) repeated, and the micro-step's events cut
into blocks by where the last block's forward and backward start and end, each block's passes repeated
with new tensors. Pure: lists of ``(serial, nbytes)`` in, lists out (``nbytes`` 0 is a free).
"""

from __future__ import annotations

import difflib
from typing import Any

__all__ = ["extended_micro_step", "extended_runs"]


def extended_runs(base: list[Any], step: list[Any], extra: int) -> list[Any] | None:
    """``step`` (``base`` with runs inserted: one more block's tensors) with each inserted run repeated ``extra``
    more times; events ``(serial, nbytes)`` (``nbytes`` 0: a free) are matched on their bytes, and a repeated
    run's tensors are new ones (``(serial, k)``). None when ``step`` is not ``base`` with runs inserted, or an
    inserted tensor is freed outside the runs (its copies would never be)."""
    events = bool(step) and isinstance(step[0], tuple)
    key = (lambda e: e[1]) if events else (lambda e: e)
    opcodes = difflib.SequenceMatcher(None, [key(e) for e in base], [key(e) for e in step], autojunk=False).get_opcodes()
    if any(tag not in ("equal", "insert") for tag, *_ in opcodes):
        return None
    runs = [(j1, j2) for tag, _, _, j1, j2 in opcodes if tag == "insert"]
    if events:
        runs = _freed_together(step, runs)
    inserted = {step[j][0] for a, z in runs for j in range(a, z) if events and step[j][1] > 0}
    if events and any(e[1] == 0 and e[0] in inserted and not any(a <= j < z for a, z in runs) for j, e in enumerate(step)):
        return None
    out: list[Any] = []
    last = 0
    for a, z in runs:
        out.extend(step[last:z])
        for k in range(1, extra + 1):
            if not events:
                out.extend(step[a:z])
                continue
            for serial, n in step[a:z]:
                if n == 0 and serial not in inserted:
                    return None  # a tensor from outside the run, freed once per copy
                out.append(((serial, k), n))
        last = z
    out.extend(step[last:])
    return out


def _freed_together(step: list[tuple[int, int]], runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The inserted runs, each run of frees moved to where the tensors of an inserted run of allocations are
    freed: blocks alike make runs of equal bytes at several places, and matching on bytes may take a run of
    frees that releases other tensors (the first block's, where the frees come last first)."""
    freed_at = {serial: j for j, (serial, n) in enumerate(step) if n == 0}
    out = list(runs)
    for a, z in runs:
        if not all(n > 0 for _, n in step[a:z]):
            continue
        where = sorted(freed_at[serial] for serial, _ in step[a:z] if serial in freed_at)
        if len(where) != z - a or where != list(range(where[0], where[0] + len(where))):
            continue
        window = (where[0], where[-1] + 1)
        for i, (a2, z2) in enumerate(out):
            if (z2 - a2 == len(where) and all(n == 0 for _, n in step[a2:z2])):
                out[i] = window
                break
    return sorted(out)


def extended_micro_step(base: tuple[list[tuple[int, int]], tuple[int, ...]], step: tuple[list[tuple[int, int]], tuple[int, ...]],
                        extra: int) -> list[tuple[Any, int]] | None:
    """The micro-step's allocations and frees of a stack ``extra`` blocks deeper than the ``step`` copy's, from the
    ``base`` copy's (one block less) and the step copy's, each ``(events, event_marks)`` (where its last block's
    forward and backward start and end).

    The step copy's events are cut into its blocks' forward and backward (the last block's, by the marks; the one
    before it: what the step copy has beyond the base copy; the one before that: as long again), and the deeper
    stack's are those, each block's forward and backward repeated with new tensors. A block's events refer to
    its own tensors and to its neighbours' (the input it saved, the gradient it was given): a reference to the
    block ``delta`` places away is to that block's tensor at the same place in the new stack. None when the
    pieces do not line up (blocks of other lengths, a shallower copy that is not a prefix and suffix)."""
    (evb, mb), (evs, ms) = base, step
    if len(mb) != 4 or len(ms) != 4:
        return None
    fs_b, _, _, be_b = mb
    fs, fe, bs, be = ms
    lx, ly = fs - fs_b, (len(evs) - be) - (len(evb) - be_b)
    sizes = lambda ev: [n for _, n in ev]  # noqa: E731
    # Each block's forward from its start to the next block's (what it frees on leaving is its own), its backward
    # from the gradient of its output to that of its input; the step copy's blocks d-2, d-1 and d (its last).
    forward = {-2: evs[fs_b - lx:fs_b], -1: evs[fs_b:fs], 0: evs[fs:fs + lx]}
    backward = {0: evs[bs:be], -1: evs[be:be + ly], -2: evs[be + ly:be + 2 * ly]}
    if (lx < 1 or fs_b < lx or fs + lx > bs or be - bs != ly or sizes(evs[:fs_b]) != sizes(evb[:fs_b])
            or sizes(evs[be + ly:]) != sizes(evb[be_b:])
            or len({tuple(sizes(c)) for c in forward.values()}) != 1 or len({tuple(sizes(c)) for c in backward.values()}) != 1):
        return None
    where: dict[int, tuple[str, int, int]] = {}  # a tensor's block (0: the step copy's last), pass and place
    for name, chunks in (("f", forward), ("b", backward)):
        for block, chunk in chunks.items():
            for j, (serial, n) in enumerate(chunk):
                if n > 0:
                    where[serial] = (name, block, j)
    last = extra  # the deeper stack's last block, counted as the step copy's: -2, -1 its own, 0 ... extra - 1 new

    def tensor(name: str, block: int, j: int) -> Any:
        if block <= -1 or block == last:
            return (forward if name == "f" else backward)[0 if block == last else block][j][0]
        return (name, block, j)

    def moved(chunk: list[tuple[int, int]], delta: int) -> list[tuple[Any, int]]:
        """A block's events as those of the block ``delta`` places on: its neighbours' tensors moved with it."""
        out = []
        for serial, n in chunk:
            found = where.get(serial)
            out.append((serial, n) if found is None else (tensor(found[0], found[1] + delta, found[2]), n))
        return out

    def around(chunk: list[tuple[int, int]]) -> list[tuple[Any, int]]:
        """Events that run once, outside the blocks (the head and the loss, the embedding's backward): the step
        copy's last block is the deeper stack's last, and what they do to the block before it (a cache of its
        keys and values released) they do to every new block after it, in order."""
        out: list[tuple[Any, int]] = []
        for serial, n in chunk:
            found = where.get(serial)
            if found is None or found[1] == -2:
                out.append((serial, n))
                continue
            out.append((tensor(found[0], last if found[1] == 0 else -1, found[2]), n))
            if found[1] == -1:
                out += [(tensor(found[0], k, found[2]), n) for k in range(extra)]
        return out

    made: list[tuple[Any, int]] = list(evs[:fs])  # up to the step copy's last block, as it is
    for k in range(1, extra + 1):  # the new blocks: the one before the last, moved on
        made += moved(forward[-1], k)
    made += moved(forward[0], extra)
    made += around(evs[fs + lx:bs])
    made += moved(backward[0], extra)
    for k in range(extra, 0, -1):
        made += moved(backward[-1], k)
    made += moved(evs[be:be + 2 * ly], 0)  # the step copy's blocks d-1 and d-2, as they are
    made += around(evs[be + 2 * ly:])
    return made
