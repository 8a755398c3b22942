"""PyTorch's CUDA caching allocator, simulated over a sequence of allocations and frees.

:class:`CachingAllocator` replays allocate / free events the way the native
allocator of ``c10/cuda/CUDACachingAllocator.cpp`` serves them on one stream
with its default configuration (no ``PYTORCH_CUDA_ALLOC_CONF``: no
``max_split_size_mb``, no ``roundup_power2_divisions``, no expandable
segments), with the constants of :mod:`dcsched.sim.allocator`. The rules, from
that file's header comment and its ``round_size``, ``get_pool``,
``get_allocation_size``, ``get_free_block``, ``should_split``,
``alloc_found_block`` and ``free_block`` / ``try_merge_blocks`` (PyTorch 2.x;
the "CUDA memory management" notes of the PyTorch docs describe the same):

- a request is rounded up to a multiple of 512 bytes (at least 512);
- requests up to 1 MiB are served by the small pool, larger ones by the large
  pool; a pool only hands out blocks of its own segments;
- **best fit**: the pool's smallest free block at least the request's size
  (among equals, the lowest address);
- none fits: a new segment (``cudaMalloc``): 2 MiB for the small pool, 20 MiB
  for a large request under 10 MiB, else the request rounded up to 2 MiB;
- **splitting**: a block larger than the request is split, the request taking
  its start, where the remainder is at least 512 bytes (small pool) or more
  than 1 MiB (large pool); otherwise the request gets the whole block (its
  ``allocated_bytes`` count the whole block);
- a freed block merges with free neighbours of its segment and goes back to
  its pool's cache;
- segments are never given back (no ``empty_cache``; the device is taken to
  have room, so no out-of-memory retry frees cached segments).

``reserved_bytes`` is the bytes in segments (``memory_stats()["reserved_bytes.all.current"]``), monotone here,
so its peak is its final value; ``peak_allocated_bytes`` the most bytes in blocks handed out at once
(``allocated_bytes.all.peak``).

>>> a = CachingAllocator()
>>> x = a.malloc(3 * MiB)            # a 20 MiB large-pool segment, split: 3 MiB taken
>>> y = a.malloc(4 * MiB)            # from the same segment's remainder
>>> a.free(x); z = a.malloc(2 * MiB)  # best fit: x's freed 3 MiB block, split? 1 MiB left is not > 1 MiB
>>> a.reserved_bytes == 20 * MiB, a.allocated_bytes == 3 * MiB + 4 * MiB
(True, True)
"""

from __future__ import annotations

import bisect
import dataclasses

from dcsched.sim.allocator import (LARGE_BUFFER, MIN_BLOCK_SIZE, MIN_LARGE_ALLOC, ROUND_LARGE, SMALL_BUFFER,
                                   SMALL_SIZE, MiB, round_size)

__all__ = ["CachingAllocator", "MiB", "allocation_size"]


def allocation_size(block: int) -> int:
    """The segment ``cudaMalloc``'d for a rounded request of ``block`` bytes that no cached block fits.

    >>> allocation_size(512) == 2 * MiB, allocation_size(3 * MiB) == 20 * MiB, allocation_size(11 * MiB) == 12 * MiB
    (True, True, True)
    """
    if block <= SMALL_SIZE:
        return SMALL_BUFFER
    if block < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-block // ROUND_LARGE) * ROUND_LARGE


@dataclasses.dataclass
class _Block:
    address: int
    size: int
    segment: int
    small: bool
    allocated: bool = False


class CachingAllocator:
    """One stream's caching allocator (see the module docstring): :meth:`malloc` gives a handle, :meth:`free`
    takes it back; ``reserved_bytes``, ``allocated_bytes`` (current) and ``peak_allocated_bytes``."""

    def __init__(self) -> None:
        self.reserved_bytes = 0
        self.allocated_bytes = 0
        self.peak_allocated_bytes = 0
        self.segments = 0
        self._next_address = 0
        # per pool (small: True), the free blocks as sorted (size, address) keys (best fit by bisection)
        self._free: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        # per pool, the free blocks' end addresses -> their addresses (a freed block's free predecessor in one look-up)
        self._free_ends: dict[bool, dict[int, int]] = {True: {}, False: {}}
        self._blocks: dict[int, _Block] = {}  # every block of every segment, by its address

    def malloc(self, nbytes: int) -> int:
        """Serve a request of ``nbytes``; returns the block's address (its handle for :meth:`free`)."""
        size = round_size(max(int(nbytes), 1))
        small = size <= SMALL_SIZE
        pool = self._free[small]
        at = bisect.bisect_left(pool, (size, -1))
        if at < len(pool):
            block = self._blocks[pool[at][1]]
            self._uncache(block)
        else:
            block = self._new_segment(allocation_size(size), small)
        remaining = block.size - size
        if remaining >= MIN_BLOCK_SIZE if small else remaining > SMALL_SIZE:
            rest = _Block(block.address + size, remaining, block.segment, small)
            self._blocks[rest.address] = rest
            self._cache(rest)
            block.size = size
        block.allocated = True
        self.allocated_bytes += block.size
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        return block.address

    def free(self, handle: int) -> None:
        """Give back the block ``handle`` names: merged with its segment's free neighbours, cached."""
        block = self._blocks[handle]
        if not block.allocated:
            raise ValueError(f"block at {handle} is not allocated")
        block.allocated = False
        self.allocated_bytes -= block.size
        following = self._blocks.get(block.address + block.size)
        if following is not None and not following.allocated and following.segment == block.segment:
            self._uncache(following)
            del self._blocks[following.address]
            block.size += following.size
        preceding = self._preceding(block)
        if preceding is not None:
            self._uncache(preceding)
            del self._blocks[block.address]
            preceding.size += block.size
            block = preceding
        self._cache(block)

    def _preceding(self, block: _Block) -> _Block | None:
        """The free block right before ``block`` in its segment, if any."""
        address = self._free_ends[block.small].get(block.address)
        if address is None:
            return None
        candidate = self._blocks[address]
        return candidate if candidate.segment == block.segment else None

    def _cache(self, block: _Block) -> None:
        """Put the free ``block`` in its pool's cache."""
        bisect.insort(self._free[block.small], (block.size, block.address))
        self._free_ends[block.small][block.address + block.size] = block.address

    def _uncache(self, block: _Block) -> None:
        """Take ``block`` (free, its size as cached) out of its pool's cache."""
        pool = self._free[block.small]
        del pool[bisect.bisect_left(pool, (block.size, block.address))]
        del self._free_ends[block.small][block.address + block.size]

    def _new_segment(self, size: int, small: bool) -> _Block:
        self.segments += 1
        self.reserved_bytes += size
        block = _Block(self._next_address, size, self.segments, small)
        self._next_address += size + MIN_BLOCK_SIZE  # a gap: blocks of two segments never touch
        self._blocks[block.address] = block
        return block


def replay(events) -> CachingAllocator:
    """Replay ``events`` — ``("alloc", key, nbytes)`` and ``("free", key)`` — on a fresh :class:`CachingAllocator`.

    Raises
    ------
    ValueError
        A key allocated twice while live, or freed while not allocated.

    >>> replay([("alloc", "a", 100), ("free", "a"), ("alloc", "b", 200)]).reserved_bytes == 2 * MiB
    True
    """
    allocator = CachingAllocator()
    handles: dict = {}
    for event in events:
        if event[0] == "alloc":
            if event[1] in handles:
                raise ValueError(f"{event[1]!r} allocated twice")
            handles[event[1]] = allocator.malloc(event[2])
        else:
            if event[1] not in handles:
                raise ValueError(f"{event[1]!r} freed but not allocated")
            allocator.free(handles.pop(event[1]))
    return allocator
