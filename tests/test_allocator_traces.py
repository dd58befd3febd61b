"""The caching allocator's replay (``autotune.memory.allocator``) against the card's own allocator traces.

``benchmarks/capture_allocator.py`` records, on a GPU, every allocation, free and segment of the ``gpu_validate``
steps (``torch.cuda.memory._record_memory_history``) and ships them in ``tests/data/allocator``. Here each trace's
own allocations and frees (sizes, order) are fed through the replay, and what it reserves is compared with what the
card reserved, event by event and at the peaks: reserved within 2%, allocated within 1% (the allocated bytes of
``max_memory_allocated`` are the blocks handed out, which the trace's requested sizes do not give). For the
fixed-length cases the estimate of the same step (planned on the CPU for a CUDA target) is compared with the
reserved peak the card measured: within 2%, never under by more than 1%.

Without traces the comparisons are skipped (they name the command that captures them); the harness itself is
checked always, on a sequence whose answer is worked out below by hand from CUDA's documented rules.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from autotune.memory.allocator import CachingAllocator

DATA = Path(__file__).resolve().parent / "data" / "allocator"
CAPTURE = "python benchmarks/capture_allocator.py"
MiB = 2**20
SEGMENT_ACTIONS = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


def load(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt") as f:
        return json.load(f)


@dataclass
class Comparison:
    """A trace replayed: at each allocation and free, the bytes (and, with fixed segments, the segments) the card had
    reserved and those the replay has; the peaks of both."""

    name: str
    measured_allocated: int
    measured_reserved: int
    trace_reserved: list[int] = field(default_factory=list)
    replay_reserved: list[int] = field(default_factory=list)
    trace_segments: list[int] = field(default_factory=list)
    replay_segments: list[int] = field(default_factory=list)
    where: list[str] = field(default_factory=list)  # each compared event, for the message
    replay_allocated: int = 0
    out_of_memory: bool = False
    streams: int = 1
    expandable: bool = False

    def problems(self) -> list[str]:
        """What is off, one line each; empty when the replay holds."""
        out = []
        peak_trace = max(self.trace_reserved, default=0)
        if peak_trace != self.measured_reserved:
            out.append(f"the trace's segments peak at {peak_trace} B, the card measured {self.measured_reserved} B: the trace is incomplete")
        replay_peak = max(self.replay_reserved, default=0)
        if abs(replay_peak - self.measured_reserved) > 0.02 * self.measured_reserved:
            out.append(f"reserved peak: replay {replay_peak} B, card {self.measured_reserved} B ({replay_peak / self.measured_reserved - 1:+.2%})")
        if abs(self.replay_allocated - self.measured_allocated) > 0.01 * self.measured_allocated:
            out.append(f"allocated peak: replay {self.replay_allocated} B, card {self.measured_allocated} B "
                       f"({self.replay_allocated / self.measured_allocated - 1:+.2%})")
        tolerance = 0.02 * self.measured_reserved
        off = [i for i, (t, r) in enumerate(zip(self.trace_reserved, self.replay_reserved)) if abs(t - r) > tolerance]
        if off:
            i = off[0]
            out.append(f"reserved bytes apart by more than 2% of the peak at {len(off)} of {len(self.where)} events, first at "
                       f"{self.where[i]}: card {self.trace_reserved[i]} B, replay {self.replay_reserved[i]} B")
        if not self.expandable:
            apart = [i for i, (t, r) in enumerate(zip(self.trace_segments, self.replay_segments)) if t != r]
            if apart:
                i = apart[0]
                out.append(f"segment counts differ at {len(apart)} of {len(self.where)} events, first at {self.where[i]}: "
                           f"card {self.trace_segments[i]}, replay {self.replay_segments[i]}")
        if self.out_of_memory:
            out.append("the replay ran out of memory where the card did not")
        if self.streams > 1:
            out.append(f"the trace uses {self.streams} streams; the replay keeps one pool for all (each stream has its own on the card)")
        return out


def compare(trace: dict[str, Any]) -> Comparison:
    """Replay ``trace``'s allocations and frees (a block returns to its pool when its free completes) through
    :class:`autotune.memory.allocator.CachingAllocator` under the trace's cap and segment setting."""
    actions = trace["actions"]
    named = [(actions[a], addr, size, stream) for a, addr, size, stream in trace["events"]]
    frees = "free_completed" if any(a == "free_completed" for a, *_ in named) else "free_requested"
    expandable = bool(trace["expandable"])
    allocator = CachingAllocator(cap=trace["settings"].get("cap"), expandable=expandable)
    result = Comparison(trace["case"], trace["measured"]["max_memory_allocated"], trace["measured"]["max_memory_reserved"],
                        streams=len({s for a, _, _, s in named if a == "alloc"}), expandable=expandable)
    reserved = segments = replay_segments = 0
    for i, (action, addr, size, _stream) in enumerate(named):
        if action in SEGMENT_ACTIONS:
            reserved += SEGMENT_ACTIONS[action] * size
            segments += SEGMENT_ACTIONS[action]
            continue
        if action not in ("alloc", frees):
            continue
        before = allocator.reserved
        if action == "alloc":
            if not allocator.malloc(addr, size):
                result.out_of_memory = True
                break
        else:
            allocator.free(addr)
        replay_segments += allocator.reserved > before  # without a cap a segment is only ever added
        result.trace_reserved.append(reserved)
        result.replay_reserved.append(allocator.reserved)
        result.trace_segments.append(segments)
        result.replay_segments.append(replay_segments)
        result.where.append(f"event {i} ({action} of {size} B)")
    result.replay_allocated = allocator.peak_allocated
    return result


# --- the harness, on a sequence worked out by hand --------------------------------------------------------------

# CUDA's caching allocator, as documented in c10/cuda/CUDACachingAllocator.cpp: a request is rounded up to a multiple of
# 512 bytes; up to 1 MiB it comes from the small pool, whose segments are 2 MiB; larger requests come from the large
# pool, from a 20 MiB segment below 10 MiB, else from a segment of the request rounded up to 2 MiB; the smallest free
# block that fits is taken, and split when the rest is at least 512 bytes (small pool) or more than 1 MiB (large).
S1, S2, S3, S4 = 0, 100 * MiB, 200 * MiB, 300 * MiB  # where the four segments below start (any distinct addresses)
BY_HAND = [
    ("segment_alloc", S1, 2 * MiB),  # 100 B -> 512 B, small pool: a 2 MiB segment
    ("alloc", S1, 100),
    ("alloc", S1 + 512, 1 * MiB),  # exactly 1 MiB is still small: the rest of the first segment, split
    ("segment_alloc", S2, 20 * MiB),  # 1 MiB + 1 B -> 1 MiB + 512 B, large pool, under 10 MiB: a 20 MiB segment
    ("alloc", S2, MiB + 1),
    ("alloc", S2 + MiB + 512, 9 * MiB),  # 9 MiB fits the rest of that segment (19 MiB - 512 B), split
    ("segment_alloc", S3, 12 * MiB),  # 12 MiB does not fit what is left (10 MiB - 512 B): its own 12 MiB segment
    ("alloc", S3, 12 * MiB),
    ("free_requested", S3, 12 * MiB),
    ("free_completed", S3, 12 * MiB),
    ("alloc", S3, 11 * MiB + 1),  # -> 11 MiB + 512 B: the free 12 MiB block; the rest (1 MiB - 512 B) is not split off
    ("free_requested", S2 + MiB + 512, 9 * MiB),
    ("free_completed", S2 + MiB + 512, 9 * MiB),  # merges with the rest of its segment: 19 MiB - 512 B free
    ("segment_alloc", S4, 20 * MiB),  # 19 MiB: 512 B more than that free block; 10 MiB or more: 19 MiB rounded up to 2 MiB
    ("alloc", S4, 19 * MiB),  # the rest of its segment is exactly 1 MiB: not split off
    ("alloc", S2 + MiB + 512, 3 * MiB),  # the free 19 MiB - 512 B of the second segment, split
    ("free_requested", S1, 100),
    ("free_completed", S1, 100),
    ("free_requested", S1 + 512, MiB),
    ("free_completed", S1 + 512, MiB),
    ("alloc", S1, 600_000),  # small: the first segment, whole and free again
]
# reserved: the four segments; allocated at its peak (just after the 3 MiB request): the 512 B block, the 1 MiB one,
# 1 MiB + 512 B, the whole 12 MiB block, the whole 20 MiB segment and 3 MiB (the 9 MiB and the first 12 MiB freed)
RESERVED_BY_HAND = (2 + 20 + 12 + 20) * MiB
ALLOCATED_BY_HAND = 512 + MiB + (MiB + 512) + 12 * MiB + 20 * MiB + 3 * MiB


def synthetic(events: list[tuple[str, int, int]], *, reserved: int, allocated: int) -> dict[str, Any]:
    """A trace in the shipped files' form (``capture_allocator.trimmed``) for ``events``."""
    actions = sorted({a for a, _, _ in events})
    return {"case": "by hand", "settings": {"cap": None}, "expandable": False, "actions": actions, "streams": [0],
            "events": [[actions.index(a), addr, size, 0] for a, addr, size in events],
            "measured": {"max_memory_allocated": allocated, "max_memory_reserved": reserved}}


def test_the_replay_of_a_sequence_worked_out_by_hand_has_its_peaks_event_by_event():
    assert RESERVED_BY_HAND == 54 * MiB and ALLOCATED_BY_HAND == 38_798_336
    got = compare(synthetic(BY_HAND, reserved=RESERVED_BY_HAND, allocated=ALLOCATED_BY_HAND))
    assert got.problems() == []
    assert max(got.replay_reserved) == RESERVED_BY_HAND and got.replay_allocated == ALLOCATED_BY_HAND
    assert got.replay_segments[-1] == 4 and len(got.where) == 9 + 4  # every allocation and completed free compared


def test_the_harness_reports_a_replay_that_differs_from_the_card():
    # as if the card had taken a 20 MiB segment for the 12 MiB request (the rule for requests under 10 MiB)
    other = [(a, addr, 20 * MiB if (a, addr) == ("segment_alloc", S3) else size) for a, addr, size in BY_HAND]
    got = compare(synthetic(other, reserved=RESERVED_BY_HAND + 8 * MiB, allocated=ALLOCATED_BY_HAND))
    problems = got.problems()
    assert any(p.startswith("reserved peak: replay 56623104 B, card 65011712 B") for p in problems), problems
    assert any(p.startswith("reserved bytes apart by more than 2% of the peak") and "event 7 (alloc of 12582912 B)" in p for p in problems)
    late = compare(synthetic(BY_HAND, reserved=RESERVED_BY_HAND, allocated=ALLOCATED_BY_HAND + MiB))
    assert [p for p in late.problems() if p.startswith("allocated peak")], "an allocated peak 1 MiB off (2.7%) must be reported"


# --- the card's traces ------------------------------------------------------------------------------------------

TRACES = sorted(DATA.glob("*.json.gz"))
NONE = pytest.param(None, marks=pytest.mark.skip(reason=f"no allocator traces in tests/data/allocator: capture them on a GPU with `{CAPTURE}`"))


@pytest.mark.parametrize("path", TRACES or [NONE], ids=[p.name.removesuffix(".json.gz") for p in TRACES] or ["no traces"])
def test_the_replay_holds_the_cards_reserved_bytes(path):
    trace = load(path)
    assert trace["format"] == 1 and trace["events"], path.name
    got = compare(trace)
    assert got.problems() == [], f"{path.name} ({trace['device']}, torch {trace['torch']}): " + "; ".join(got.problems())


FIXED = [p for p in TRACES if "-fixed-" in p.name]


@pytest.mark.slow  # full-size models estimated on the CPU
@pytest.mark.parametrize("path", FIXED or [NONE], ids=[p.name.removesuffix(".json.gz") for p in FIXED] or ["no traces"])
def test_the_estimate_holds_the_reserved_peak_the_card_measured(path, monkeypatch):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import capture_allocator
    import gpu_validate

    trace = load(path)
    settings = trace["settings"]
    case = capture_allocator.CASES[trace["case"]]
    if case.model == "qlora":
        pytest.importorskip("bitsandbytes")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", trace["alloc_conf"])
    if tuple(trace["capability"]) < (9, 0):  # the cuBLAS workspace torch takes before Hopper
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    net, opt = capture_allocator.build(case, torch.device("cpu"), settings["scale"])
    length = capture_allocator.length_at(case, max(case.lengths), settings["scale"])
    batch = case.base.batch(case.micro_batch, length, settings["scale"])
    estimated = gpu_validate.estimator(case.base, net, opt, batch).allocator(case.micro_batch, cap=settings["cap"]).reserved
    measured = trace["measured"]["max_memory_reserved"]
    assert -0.01 <= estimated / measured - 1 <= 0.02, f"{path.name}: estimate {estimated} B, card {measured} B ({estimated / measured - 1:+.2%})"


def test_the_capture_script_builds_and_steps_every_case_on_the_cpu(capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import capture_allocator

    quantized = importlib.util.find_spec("bitsandbytes") is not None  # QLoRA's layers
    names = [n for n in capture_allocator.CASES if quantized or not n.startswith("qlora")]
    assert capture_allocator.main(["--dry", "--cases", ",".join(names)]) == 0
    out = capsys.readouterr().out
    assert all(f"{n}: built and stepped on the CPU" in out for n in names), out


def test_a_snapshot_trimmed_for_shipping_replays_as_it_was_recorded():
    """``capture_allocator.trimmed`` on a snapshot in torch's form (absolute addresses, a request and a completion
    for each free, times and frames): what it keeps gives the harness the same answer as the events themselves."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import capture_allocator

    base = 0x7F0000000000
    trace = []
    for action, addr, size in BY_HAND:
        if action == "free_completed":
            continue
        trace.append({"action": action, "addr": base + addr, "size": size, "stream": 0, "time_us": 1, "frames": []})
        if action == "free_requested":
            trace.append({**trace[-1], "action": "free_completed"})
    segments = [{"device": 0, "address": base + a, "total_size": n, "stream": 0, "segment_type": "small" if n == 2 * MiB else "large"}
                for action, a, n in BY_HAND if action == "segment_alloc"]
    kept = capture_allocator.trimmed({"segments": segments, "device_traces": [trace]}, 0)
    assert kept["base"] == base and "free_requested" not in kept["actions"] and len(kept["events"]) == len(BY_HAND) - 4
    assert kept["segments"][-1] == [S4, 20 * MiB, 0, "large"]
    shipped = {"case": "by hand", "settings": {"cap": None}, "expandable": False,
               "measured": {"max_memory_allocated": ALLOCATED_BY_HAND, "max_memory_reserved": RESERVED_BY_HAND}, **kept}
    got = compare(shipped)
    assert got.problems() == [] and got.replay_reserved == compare(synthetic(BY_HAND, reserved=0, allocated=0)).replay_reserved


def test_the_capture_runs_every_case_under_both_settings_and_reports_them(capsys, monkeypatch, tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import capture_allocator

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ran = []

    def runner(name, setting, out, timeout):
        ran.append((name, setting))
        if name == "cnn-fixed" and setting == "expandable":
            return {"error": "over its time limit of 150 s"}
        return {"file": str(out / f"{name}-{setting}.json.gz"), "bytes": 2048, "events": 10, "max_memory_allocated": MiB,
                "max_memory_reserved": 2 * MiB, "seconds": 1.0}

    assert capture_allocator.main(["--out", str(tmp_path)], runner=runner) == 1  # one case failed
    assert sorted(ran) == sorted((n, s) for n in capture_allocator.CASES for s in ("default", "expandable"))
    out = capsys.readouterr().out
    assert "| cnn-fixed | expandable | - | - | - | - | - | over its time limit of 150 s |" in out
    assert f"{2 * len(capture_allocator.CASES) - 1} of {2 * len(capture_allocator.CASES)} captured" in out
    ran.clear()
    assert capture_allocator.main(["--cases", "gpt2", "--settings", "expandable", "--out", str(tmp_path)], runner=runner) == 0
    assert ran == [("gpt2-fixed", "expandable"), ("gpt2-varying", "expandable")]
    with pytest.raises(SystemExit, match="Invalid --cases 'bert'"):
        capture_allocator.main(["--cases", "bert"], runner=runner)
    with pytest.raises(SystemExit, match="Invalid --settings 'roomy'"):
        capture_allocator.main(["--settings", "roomy"], runner=runner)


def test_a_case_captured_writes_a_file_the_harness_reads(monkeypatch, tmp_path):
    """``capture_one`` on the CPU, the CNN made small, with the CUDA allocator's history functions faked to hand back
    the sequence worked out by hand: the file it writes holds the settings, the measured peaks and the events, and
    the harness replays it to the same answer."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import capture_allocator

    base = 0x7F0000000000
    history = [{"action": a, "addr": base + addr, "size": n, "stream": 0, "time_us": 1, "frames": []} for a, addr, n in BY_HAND]
    recorded = []
    fakes = {"synchronize": lambda d=None: None, "get_device_name": lambda d=None: "Fake GPU", "get_device_capability": lambda d=None: (9, 0),
             "memory_stats": lambda d=None: {"num_alloc_retries": 0}, "max_memory_allocated": lambda d=None: ALLOCATED_BY_HAND,
             "max_memory_reserved": lambda d=None: RESERVED_BY_HAND}
    for name, fn in fakes.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda enabled="all", **kw: recorded.append(enabled))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"segments": [], "device_traces": [history]})
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    summary = capture_allocator.capture_one("cnn-fixed", tmp_path, device=torch.device("cpu"), scale=0.06)
    assert recorded == ["all", None]  # recording on for the case, off after it
    trace = load(tmp_path / "cnn-fixed-default.json.gz")
    assert summary["events"] == len(BY_HAND) - 4 and summary["max_memory_reserved"] == RESERVED_BY_HAND
    assert trace["settings"]["model"] == "cnn" and trace["settings"]["micro_batch"] == 64 and trace["device"] == "Fake GPU"
    assert not trace["expandable"] and trace["capability"] == [9, 0] and trace["torch"] == torch.__version__
    got = compare(trace)
    assert got.problems() == [] and max(got.replay_reserved) == RESERVED_BY_HAND
