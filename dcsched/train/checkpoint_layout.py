"""A rank's slice of a flattened tensor, stored in a checkpoint as full-shape blocks with their offsets.

``dcsched.shard`` gives each rank a contiguous range of the row-major
flattened parameter. Its rows need not be whole: with 2 ranks, a ``(5, 3)``
weight's 15 elements split 8 and 7, so rank 0 holds rows 0-1 and the first
two elements of row 2. A contiguous range of a row-major tensor is, though,
always a few rectangular blocks of the full shape, each itself contiguous in
the range: whole rows, and at either end a partial row that the same cut
splits again along the next dimension (:func:`blocks`). A checkpoint that
holds those blocks, each at its offset in the full shape, is what FSDP2 and
``torch.distributed.checkpoint`` (DCP) write for a sharded tensor: chunks of
a tensor of the full shape, which DCP reads into any other split (whole rows
per rank as FSDP2's ``Shard(0)``, one whole tensor as
``dcp_to_torch_save``), and whose blocks it reads back into any rank's range.

:class:`FlatPieces` hands DCP those blocks without copying: a tensor of the
full shape whose only data are views on the rank's range, implementing the
``__create_write_items__`` / ``__create_chunk_list__`` / ``__get_tensor_shard__``
hooks DCP's planners call for a DTensor. Saved, it writes its blocks; loaded
into, DCP reads each block (from whatever chunks the checkpoint holds) into
the range in place.

>>> blocks((5, 3), 0, 8)
[((0, 0), (2, 3), 0), ((2, 0), (1, 2), 6)]
>>> blocks((5, 3), 8, 15)
[((2, 2), (1, 1), 8), ((3, 0), (2, 3), 9)]
"""

from __future__ import annotations

import math

import torch

#: One block: its offsets and sizes in the full shape, and the flat index of its first element.
Block = tuple[tuple[int, ...], tuple[int, ...], int]


def blocks(shape: tuple[int, ...], start: int, stop: int) -> list[Block]:
    """The rectangular blocks that flat elements ``start`` to ``stop`` of a row-major ``shape`` make up, in order.

    Each block is contiguous in the flattened tensor; there are at most
    ``2 * len(shape) - 1`` of them.

    >>> blocks((2, 2, 2), 1, 7)
    [((0, 0, 1), (1, 1, 1), 1), ((0, 1, 0), (1, 1, 2), 2), ((1, 0, 0), (1, 1, 2), 4), ((1, 1, 0), (1, 1, 1), 6)]
    >>> blocks((), 0, 1)
    [((), (), 0)]
    """
    if start >= stop:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])  # not 0: the range is not empty
    first, last = start // inner, (stop - 1) // inner  # the rows the range touches

    def within(row: int, begin: int, end: int) -> list[Block]:
        """Elements ``begin`` to ``end`` of one row, as blocks of one row each."""
        return [((row, *offsets), (1, *sizes), row * inner + flat)
                for offsets, sizes, flat in blocks(shape[1:], begin, end)]

    if first == last and (start % inner or stop % inner):
        return within(first, start - first * inner, stop - first * inner)
    result: list[Block] = []
    whole_from, whole_to = -(-start // inner), stop // inner
    if start % inner:
        result += within(first, start % inner, inner)
    if whole_to > whole_from:
        rest = (0,) * (len(shape) - 1)
        result.append(((whole_from, *rest), (whole_to - whole_from, *shape[1:]), whole_from * inner))
    if stop % inner:
        result += within(last, 0, stop % inner)
    return result


class FlatPieces(torch.Tensor):
    """A tensor of shape ``shape`` holding, for DCP, only the blocks of flat elements ``start`` onwards that
    ``flat`` (a 1-D view on this rank's range) covers; see the module docstring.

    Any operation on it but DCP's hooks raises: it exists to be saved and loaded into.
    """

    _flat: torch.Tensor
    _blocks: list[Block]

    @staticmethod
    def __new__(cls, flat: torch.Tensor, start: int, shape: tuple[int, ...]) -> FlatPieces:
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=flat.dtype, device=flat.device)
        self._flat = flat
        self._blocks = blocks(tuple(shape), start, start + flat.numel())
        self._start = start
        return self

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"a FlatPieces tensor is only saved or loaded into by DCP, not run through {func}")

    def _piece(self, block: Block) -> torch.Tensor:
        _offsets, sizes, flat = block
        begin = flat - self._start
        return self._flat[begin:begin + math.prod(sizes)].view(sizes)

    def __create_write_items__(self, fqn: str, _object) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        properties = TensorProperties.create_from_tensor(self._flat)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                              properties=properties, size=self.size()))
                for offsets, sizes, _flat in self._blocks]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                for offsets, sizes, _flat in self._blocks]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        for block in self._blocks:
            if torch.Size(block[0]) == index.offset:
                return self._piece(block)
        raise ValueError(f"{index.fqn!r} has no block at {tuple(index.offset or ())} on this rank")

    def __repr__(self) -> str:
        return f"FlatPieces(shape={tuple(self.shape)}, elements {self._start}..{self._start + self._flat.numel()})"
