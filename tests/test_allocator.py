"""The caching allocator's replay against the rules c10/cuda/CUDACachingAllocator.cpp documents."""

import pytest

from autotune.memory.allocator import (
    CachingAllocator,
    cublas_workspace,
    expandable_segments,
    replay,
    round_size,
    scale_events,
    segment_size,
    steady_state,
)

KiB, MiB = 1024, 2**20


@pytest.mark.parametrize("request_bytes, block", [(1, 512), (511, 512), (512, 512), (513, 1024), (3 * MiB + 1, 3 * MiB + 512)])
def test_requests_are_rounded_to_512_byte_blocks(request_bytes, block):
    assert round_size(request_bytes) == block


@pytest.mark.parametrize(
    "block, segment",
    [(512, 2 * MiB), (MiB, 2 * MiB), (MiB + 512, 20 * MiB), (10 * MiB - 512, 20 * MiB), (10 * MiB, 10 * MiB), (11 * MiB, 12 * MiB),
     (21 * MiB + 512, 22 * MiB)],
    ids=["small", "small-edge", "large-small", "large-under-10", "10", "rounded-to-2", "rounded-up"],
)
def test_segments_by_pool(block, segment):
    assert segment_size(block) == segment


def test_small_requests_are_packed_into_2_mib_segments():
    a = CachingAllocator()
    for i in range(4):
        assert a.malloc(i, 512 * KiB)
    assert a.reserved == 2 * MiB and a.allocated == 2 * MiB
    a.malloc(4, 512 * KiB)
    assert a.reserved == 4 * MiB


def test_a_large_segment_is_split_and_its_rest_serves_the_next_request():
    a = CachingAllocator()
    a.malloc("a", 3 * MiB)
    assert a.reserved == 20 * MiB and a.allocated == 3 * MiB
    a.malloc("b", 5 * MiB)  # from the 17 MiB left of the first segment
    assert a.reserved == 20 * MiB and a.allocated == 8 * MiB


def test_a_large_block_is_not_split_for_a_remainder_of_1_mib_or_less():
    a = CachingAllocator()
    a.malloc("a", 19 * MiB + 512 * KiB)  # a 20 MiB segment, 0.5 MiB left over
    assert a.reserved == 20 * MiB and a.allocated == 20 * MiB  # the whole block is handed out
    b = CachingAllocator()
    b.malloc("a", 3 * MiB)
    b.free("a")
    b.malloc("b", 19 * MiB + 512)  # the merged free 20 MiB block, with under 1 MiB left: not split
    assert b.allocated == 20 * MiB and b.reserved == 20 * MiB


def test_the_pools_are_separate():
    a = CachingAllocator()
    a.malloc("large", 3 * MiB)
    a.free("large")  # a free 20 MiB block in the large pool
    a.malloc("small", 4 * KiB)
    assert a.reserved == 22 * MiB  # a small request takes a new 2 MiB segment, not the large block


def test_best_fit_and_merging_on_free():
    a = CachingAllocator()
    for key in "abcd":
        a.malloc(key, 4 * MiB)  # a, b, c, d from one 20 MiB segment, 4 MiB left at its end
    a.free("b")
    a.free("c")  # b and c merge: a free 8 MiB block between a and d
    a.malloc("e", 6 * MiB)  # the 8 MiB block (the end's 4 MiB does not fit)
    assert a.reserved == 20 * MiB
    a.malloc("f", 4 * MiB)  # best fit: the 4 MiB at the end (2 MiB of the 8 are left, too small)
    assert a.reserved == 20 * MiB and a.allocated == 18 * MiB  # a, d, e, f
    a.malloc("g", 3 * MiB)
    assert a.reserved == 40 * MiB  # nothing free is large enough: a new segment


def test_under_a_cap_free_segments_are_released_and_the_request_retried():
    a = CachingAllocator(cap=30 * MiB)
    assert a.malloc("a", 12 * MiB) and a.reserved == 12 * MiB
    a.free("a")
    assert a.malloc("b", 20 * MiB)  # 12 + 20 > 30: the free 12 MiB segment is released first
    assert a.retries == 1 and a.reserved == 20 * MiB
    assert not a.malloc("c", 12 * MiB)  # nothing left to release: out of memory
    assert a.retries == 2


def test_expandable_segments_grow_by_pages():
    a = CachingAllocator(expandable=True)
    a.malloc("a", 3 * MiB)
    a.malloc("b", 5 * MiB)
    assert a.reserved == 20 * MiB  # one 20 MiB page of the large pool's segment
    a.malloc("c", 30 * MiB)  # 12 MiB free at the end, 18 more needed: one more page
    assert a.reserved == 40 * MiB
    a.malloc("d", 4 * KiB)
    assert a.reserved == 42 * MiB  # the small pool's segment grows by 2 MiB pages


def test_expandable_segments_fragment_less_than_fixed_ones():
    # Requests of 11 MiB, each freed before a 13 MiB one: fixed segments cannot reuse the 12 MiB ones.
    events = []
    for i in range(4):
        events += [(f"a{i}", 11 * MiB), (f"a{i}", 0), (f"b{i}", 13 * MiB)]
    fixed, grown = replay(events), replay(events, expandable=True)
    # Fixed: each request has a segment of its own, 12 and 14 MiB, handed out whole (1 MiB left is
    # not split off in the large pool), and a 12 MiB one never serves a 13 MiB request.
    assert fixed.reserved == 4 * 14 * MiB + 12 * MiB and fixed.allocated == 4 * 14 * MiB
    # Expandable: the freed 11 MiB are the start of the next 13, and remainders of 512 bytes are split.
    assert grown.allocated == 4 * 13 * MiB and grown.reserved < fixed.reserved


def test_replay_reads_peaks_and_stops_at_an_out_of_memory_error():
    peaks = replay([("a", 3000), ("b", 3 * MiB), ("a", 0), ("c", 100)])
    assert peaks.allocated == 3072 + 3 * MiB and peaks.reserved == 22 * MiB and not peaks.out_of_memory
    assert replay([("a", 30 * MiB)], cap=20 * MiB).out_of_memory


def test_the_steady_state_frees_what_a_micro_step_leaves_and_meets_its_cache_twice():
    step = [(0, 5 * MiB), (1, 3 * MiB), (1, 0)]  # the batch (kept to the end) and a temporary
    events = steady_state([8 * MiB, 0, 8 * MiB], step, [(0, 2 * MiB), (0, 0)], workspace=32 * MiB)
    assert events[:3] == [(("held", 0), 8 * MiB), (("held", 2), 8 * MiB), ("cublas workspace", 32 * MiB)]
    assert (("micro 1", 0), 0) in events and events[-1] == (("micro 2", 0), 0)
    peaks = replay(events)
    # The held 8 + 8 MiB share a 20 MiB segment, 4 MiB left; the workspace has its own 32; the batch
    # takes a new 20 MiB segment; the temporary's 3 MiB take the 4 MiB block whole (1 MiB is not split off).
    assert peaks.allocated == 16 * MiB + 32 * MiB + 5 * MiB + 4 * MiB
    assert peaks.reserved == 20 * MiB + 32 * MiB + 20 * MiB


def test_events_at_another_size_follow_the_line_through_two():
    first, second = (2, [(0, 200), (1, 64), (2, 90), (1, 0)]), (3, [(0, 300), (1, 64), (2, 100), (1, 0)])
    assert scale_events(first, second, 10) == [(0, 1000), (1, 64), (2, 170), (1, 0)]
    assert scale_events(first, (3, [(0, 300)]), 10) is None  # other operations
    assert scale_events((2, [(0, 3)]), (3, [(0, 4)]), 10) is not None
    assert scale_events((2, [(0, 100)]), (4, [(0, 101)]), 3) is None  # fractional


def test_cublas_workspace_as_torch_sizes_it():
    assert cublas_workspace((9, 0), config="") == 32 * MiB
    assert cublas_workspace((8, 6), config="") == 4096 * KiB * 2 + 16 * KiB * 8
    assert cublas_workspace((9, 0), config=":4096:2:16:8") == 4096 * KiB * 2 + 16 * KiB * 8
    assert expandable_segments("expandable_segments:True") and not expandable_segments("expandable_segments:False")
