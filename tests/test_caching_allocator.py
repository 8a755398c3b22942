"""The CUDA caching-allocator simulation (:mod:`dcsched.sim.caching_allocator`) on hand-computed sequences and
random ones, and the step's allocation sequence it replays (:mod:`dcsched.sim.step_events`)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

import dcsched
from dcsched.sim.caching_allocator import CachingAllocator, MiB, replay


def test_a_freed_block_is_reused():
    a = CachingAllocator()
    x = a.malloc(4 * MiB)
    a.free(x)
    assert a.malloc(4 * MiB) == x and a.reserved_bytes == 20 * MiB and a.segments == 1


def test_a_block_is_split_only_where_more_than_1_mib_is_left():
    a = CachingAllocator()
    a.malloc(3 * MiB)  # a 20 MiB segment, split: 17 MiB left
    a.malloc(16 * MiB)  # best fit: the 17 MiB block; 1 MiB left is not more than 1 MiB: the whole block
    assert a.reserved_bytes == 20 * MiB and a.allocated_bytes == 20 * MiB
    b = CachingAllocator()
    b.malloc(3 * MiB)
    b.malloc(15 * MiB)  # 2 MiB left: split
    assert b.allocated_bytes == 18 * MiB and b.malloc(2 * MiB) and b.reserved_bytes == 20 * MiB


def test_small_requests_round_to_512_bytes_in_2_mib_segments():
    a = CachingAllocator()
    for _ in range(4096):  # 4096 blocks of 512 B: one 2 MiB segment exactly
        a.malloc(100)
    assert a.allocated_bytes == 2 * MiB and a.reserved_bytes == 2 * MiB
    a.malloc(1)
    assert a.reserved_bytes == 4 * MiB and a.segments == 2


def test_the_pools_do_not_share_segments():
    a = CachingAllocator()
    a.free(a.malloc(1 * MiB))  # small pool: a 2 MiB segment, cached
    a.malloc(1 * MiB + 512)  # large: the small pool's free 2 MiB cannot serve it
    assert a.reserved_bytes == 2 * MiB + 20 * MiB
    b = CachingAllocator()
    b.free(b.malloc(3 * MiB))  # large pool: a free 20 MiB segment
    b.malloc(1000)  # small: a segment of its own
    assert b.reserved_bytes == 22 * MiB


def test_a_large_request_does_not_fit_in_freed_pieces_of_other_segments():
    a = CachingAllocator()
    x, y = a.malloc(12 * MiB), a.malloc(12 * MiB)  # two segments of their own
    a.free(x)
    a.free(y)
    a.malloc(20 * MiB)  # 24 MiB free, in two 12 MiB segments: a third segment
    assert a.reserved_bytes == 44 * MiB and a.allocated_bytes == 20 * MiB


def test_freed_neighbours_merge_within_a_segment():
    a = CachingAllocator()
    x, y, z = a.malloc(4 * MiB), a.malloc(4 * MiB), a.malloc(4 * MiB)
    a.free(x)
    a.free(y)  # x and y: one free 8 MiB block before z; 8 MiB free after z
    assert a.malloc(8 * MiB) == x and a.reserved_bytes == 20 * MiB
    a.free(z)
    assert a.malloc(12 * MiB) == z - 0 and a.reserved_bytes == 20 * MiB  # z's block merged with the 8 MiB after it


def test_bad_sequences_are_refused():
    with pytest.raises(ValueError, match="allocated twice"):
        replay([("alloc", "a", 1), ("alloc", "a", 1)])
    with pytest.raises(ValueError, match="freed but not allocated"):
        replay([("free", "a")])


SIZES = st.one_of(st.integers(1, 4096), st.integers(1, 2 * MiB), st.integers(MiB, 30 * MiB))


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), SIZES, st.integers(0, 1000)), max_size=60))
def test_reserved_holds_the_allocated_blocks_which_hold_the_live_bytes(ops):
    allocator = CachingAllocator()
    live: list[tuple[int, int]] = []
    live_bytes = peak_live = reserved = 0
    for is_alloc, size, pick in ops:
        if is_alloc or not live:
            live.append((allocator.malloc(size), size))
            live_bytes += size
        else:
            handle, size = live.pop(pick % len(live))
            allocator.free(handle)
            live_bytes -= size
        peak_live = max(peak_live, live_bytes)
        assert allocator.reserved_bytes >= reserved  # segments are never given back
        reserved = allocator.reserved_bytes
        assert allocator.reserved_bytes >= allocator.allocated_bytes >= live_bytes
        blocks = allocator._blocks.values()
        assert sum(b.size for b in blocks) == allocator.reserved_bytes  # the blocks tile the segments
        free = [b for b in blocks if not b.allocated]
        assert sorted(key for pool in allocator._free.values() for key in pool) == \
            sorted((b.size, b.address) for b in free)  # the pools cache exactly the free blocks
        ends = {b.address + b.size: b for b in free}
        assert not any(b.address in ends and ends[b.address].segment == b.segment for b in free)  # neighbours merged
    assert allocator.reserved_bytes >= allocator.peak_allocated_bytes >= peak_live
    for handle, _ in live:
        allocator.free(handle)
    assert allocator.allocated_bytes == 0
    assert sorted(size for size, _ in allocator._free[True] + allocator._free[False]) == \
        sorted(b.size for b in allocator._blocks.values())  # every block free, each segment one block again
    assert len(allocator._blocks) == allocator.segments


@pytest.mark.parametrize("sample", ["gpt", "llama", "convnet"])
def test_the_steps_events_reach_its_simulated_peak(sample):
    from dcsched.sim import step_memory as sm
    from dcsched.sim.step_events import step_events
    bundle = dcsched.load(f"sample_graphs/{sample}.pt")
    memory = sm.step_memory(bundle, "adamw", gpu=True)
    model = sm.resolve_optimizer(bundle, "adamw")
    shards = sm._param_shard_bytes(bundle)
    states, temporaries = sm._optimizer_states(model, shards, True), sm._temporaries(model, shards, True)
    sizes: dict = {}
    live = peak = 0
    for event in step_events(bundle, shards, states, temporaries, plans=bundle.plans):
        if event[0] == "alloc":
            sizes[event[1]] = event[2]
            live += event[2]
        else:
            live -= sizes.pop(event[1])
        peak = max(peak, live)
    assert peak == memory.peak_bytes  # the events hold what the step's model holds, at its peak
    assert live == sum(shards) + sum(states)  # after two steps: the shards and the states
    cuda = memory.cuda
    assert cuda is not None and cuda.reserved_bytes >= cuda.packed_reserved_bytes >= cuda.allocated_bytes \
        >= memory.peak_bytes
