"""PyTorch's CUDA caching allocator, as a model of what a set of live tensors costs on a GPU.

Constants from ``c10/cuda/CUDACachingAllocator.cpp`` (PyTorch 2.x; the same in
``c10/cuda/CUDAAllocatorConfig.h`` where they moved):

- ``kMinBlockSize = 512``: every allocation is rounded up to a multiple of 512 bytes
  (``round_size``); ``torch.cuda.max_memory_allocated`` counts these rounded blocks;
- ``kSmallSize = 1 MiB``: allocations up to it come from the small pool, carved out of
  ``kSmallBuffer = 2 MiB`` segments;
- larger allocations come from the large pool: below ``kMinLargeAlloc = 10 MiB`` from
  ``kLargeBuffer = 20 MiB`` segments, from it on a segment of their own rounded up to
  ``kRoundLarge = 2 MiB``.

:func:`cuda_footprint` gives the allocated figure (exact for the tensors
given) and the reserved figure the same tensors need with their segments
packed perfectly: a lower bound on ``torch.cuda.max_memory_reserved`` at that
moment (fragmentation and segments cached from earlier only add to it;
:mod:`dcsched.sim.caching_allocator` simulates them over a step's allocations
and frees).

>>> fp = cuda_footprint([100, 3 * MiB, 50 * MiB])
>>> fp.allocated_bytes == 512 + 3 * MiB + 50 * MiB, fp.reserved_bytes == 2 * MiB + 20 * MiB + 50 * MiB
(True, True)
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

MiB = 1 << 20
#: c10/cuda/CUDACachingAllocator.cpp ``kMinBlockSize``: allocation sizes are rounded up to a multiple of it.
MIN_BLOCK_SIZE = 512
#: ``kSmallSize``: the largest allocation served by the small pool.
SMALL_SIZE = 1 * MiB
#: ``kSmallBuffer``: the small pool's segment size.
SMALL_BUFFER = 2 * MiB
#: ``kLargeBuffer``: the segment size of large-pool allocations below :data:`MIN_LARGE_ALLOC`.
LARGE_BUFFER = 20 * MiB
#: ``kMinLargeAlloc``: from this size on an allocation gets a segment of its own.
MIN_LARGE_ALLOC = 10 * MiB
#: ``kRoundLarge``: such a segment is rounded up to a multiple of it.
ROUND_LARGE = 2 * MiB
#: Where the constants come from (printed by the report beside the figures).
SOURCE = "PyTorch c10/cuda/CUDACachingAllocator.cpp (kMinBlockSize 512 B, kSmallBuffer 2 MiB, kLargeBuffer 20 MiB, " \
         "kMinLargeAlloc 10 MiB, kRoundLarge 2 MiB)"


def _ceil_to(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def round_size(nbytes: int) -> int:
    """The block the allocator hands out for ``nbytes`` (``round_size``: 512-byte multiples, at least 512).

    >>> round_size(1), round_size(512), round_size(513)
    (512, 512, 1024)
    """
    return MIN_BLOCK_SIZE if nbytes < MIN_BLOCK_SIZE else _ceil_to(nbytes, MIN_BLOCK_SIZE)


@dataclasses.dataclass(frozen=True)
class CudaFootprint:
    """What a set of live tensors costs under the caching allocator: ``allocated_bytes`` (the rounded blocks,
    ``max_memory_allocated``'s figure) and ``reserved_bytes`` (the segments holding them: packed perfectly by
    :func:`cuda_footprint`, a lower bound on ``max_memory_reserved``'s; in a step's figure the allocator
    simulated over the step, :mod:`dcsched.sim.caching_allocator`). ``packed_reserved_bytes``: in a step's
    figure, the perfectly packed segments (the lower bound), else None."""

    allocated_bytes: int
    reserved_bytes: int
    source: str = SOURCE
    packed_reserved_bytes: int | None = None

    def to_json(self) -> dict:
        return {"allocated_bytes": self.allocated_bytes, "reserved_bytes": self.reserved_bytes,
                "packed_reserved_bytes": self.packed_reserved_bytes, "source": self.source}


def cuda_footprint(sizes: Iterable[int]) -> CudaFootprint:
    """The caching allocator's allocated and reserved bytes for live tensors of ``sizes`` (bytes; 0s skipped)."""
    allocated = small = medium = large = 0
    for size in sizes:
        if size <= 0:
            continue
        block = round_size(int(size))
        allocated += block
        if block <= SMALL_SIZE:
            small += block
        elif block < MIN_LARGE_ALLOC:
            medium += block
        else:
            large += _ceil_to(block, ROUND_LARGE)
    reserved = _ceil_to(small, SMALL_BUFFER) + _ceil_to(medium, LARGE_BUFFER) + large
    return CudaFootprint(allocated, reserved)
