"""The layout of a bucketed collective: several parameters' shards in one flat tensor, and back.

A bucket of parameters with shard sizes ``S_i`` (each the padded numel over
W) travels as one flat tensor of ``S = sum(S_i)`` elements per rank, member i
at offset ``off_i``:

* **all-gather**: rank r sends the concatenation of its shards; the output,
  ``W * S`` elements, is rank-major, so viewed as ``(W, S)`` row r is rank r's
  input and member i's full padded parameter is the column block
  ``[:, off_i:off_i + S_i]`` read row by row (:func:`unpack_gathered`);
* **reduce-scatter**: the input, ``W * S`` elements viewed as ``(W, S)``, has
  member i's padded gradient, cut into W rows of ``S_i``, in the column block
  ``[:, off_i:off_i + S_i]`` (:func:`pack_gradient`), so that the scatter gives
  rank r row r: the concatenation of its shards of every member, member i's at
  ``[off_i:off_i + S_i]``.

Both are what running each member alone gives, element for element: the
bucket changes which bytes travel together, not what is computed.

>>> offsets([3, 2, 4])
[0, 3, 5]
>>> out = torch.arange(12.0)            # W=2, S=6: members of shard sizes 2 and 4
>>> full = torch.empty(4)
>>> unpack_gathered(out, 2, 0, 2, full.view(2, 2)); full
tensor([0., 1., 6., 7.])
"""

from __future__ import annotations

from typing import Sequence

import torch


def offsets(sizes: Sequence[int]) -> list[int]:
    """Each member's offset in a bucket of members of shard sizes ``sizes``."""
    result, at = [], 0
    for size in sizes:
        result.append(at)
        at += size
    return result


def unpack_gathered(output: torch.Tensor, world_size: int, offset: int, size: int, into: torch.Tensor) -> None:
    """Copy one member's full padded parameter out of a bucket's all-gather ``output``.

    ``into`` is ``(world_size, size)``: row r receives rank r's shard
    (``output.view(W, S)[r, offset:offset + size]``), so flattened it is the
    padded parameter.

    Examples
    --------
    >>> out = torch.tensor([1., 2., 3., 10., 20., 30.])      # ranks' inputs: [1, 2, 3] and [10, 20, 30]
    >>> into = torch.empty(2, 2)
    >>> unpack_gathered(out, 2, 1, 2, into); into.reshape(-1)  # member at offset 1, shard size 2
    tensor([ 2.,  3., 20., 30.])
    """
    rows = output.view(world_size, -1)
    into.copy_(rows[:, offset:offset + size])


def pack_gradient(grad: torch.Tensor, slot: torch.Tensor) -> None:
    """Write ``grad`` flattened and zero-padded into ``slot``, a ``(W, size)`` column block of a bucket's input.

    Element k of the padded gradient lands in row ``k // size``, column
    ``k % size``, as ``padded.view(W, size)`` would put it, without making the
    padded copy; the padding is zeros, as the unbucketed reduce pads.

    Examples
    --------
    >>> bucket = torch.full((3, 5), -1.0)                # W=3: a member of 7 elements, shard size 3, at column 2
    >>> pack_gradient(torch.arange(1.0, 8.0), bucket[:, 2:5]); bucket
    tensor([[-1., -1.,  1.,  2.,  3.],
            [-1., -1.,  4.,  5.,  6.],
            [-1., -1.,  7.,  0.,  0.]])
    """
    flat = grad.reshape(-1)
    world_size, size = slot.shape
    full_rows, rest = divmod(flat.numel(), size)
    if full_rows:
        slot[:full_rows].copy_(flat[:full_rows * size].view(full_rows, size))
    if full_rows < world_size:
        if rest:
            slot[full_rows, :rest].copy_(flat[full_rows * size:])
        slot[full_rows, rest:].zero_()
        slot[full_rows + 1:].zero_()
