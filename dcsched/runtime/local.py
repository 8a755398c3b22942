"""The world-size-1 ZeRO-3 runtime over 1-D shards: training in one process with the shards ``dcsched.shard`` makes.

>>> import torch
>>> from dcsched.bundle.core import ParamInfo
>>> rt = LocalZero3Runtime([ParamInfo("w", (2, 3), torch.float32, 0)])
>>> rt.allgather(torch.arange(6.0), 0, 0, None).shape
torch.Size([2, 3])
"""

from __future__ import annotations

from typing import Sequence

from dcsched.bundle.core import ParamInfo
from dcsched.graph.roles import Role
from dcsched.runtime import ops


class LocalZero3Runtime(ops.Zero3Runtime):
    """World size 1 with 1-D shards: the gather views the flat shard in the parameter's shape, into a fresh buffer.

    A communication plan's buckets change nothing here (nothing is
    communicated); kept parameters are held from the forward to the backward
    as :class:`~dcsched.runtime.ops.Zero3Runtime` describes. Under
    :meth:`inline_kernels` (inductor) no gather makes a buffer, so there is
    nothing to keep and the plan is ignored altogether.
    """

    def __init__(self, params: Sequence[ParamInfo]) -> None:
        super().__init__()
        self.shapes = {p.ds_id: tuple(p.shape) for p in params}

    def _gather(self, shard, graph_id, ds_id, dtype):
        full = shard.view(self.shapes[ds_id])
        return full.to(dtype=dtype, copy=True) if dtype is not None else full.clone()

    def reduce(self, grad, graph_id, ds_id):
        return self.in_reduce_dtype(grad, ds_id).reshape(-1)

    def gathered_like(self, shard, graph_id, ds_id, dtype):
        return shard.new_empty(self.shapes[ds_id], dtype=dtype if dtype is not None else shard.dtype)

    def reduced_shard_like(self, grad, graph_id, ds_id):
        return grad.new_empty(grad.numel(), dtype=self.reduce_dtypes.get(ds_id, grad.dtype))

    def inline_kernels(self) -> dict:
        """The ops as aten for inductor to trace in (:func:`dcsched.train.inductor.compile_graph`).

        With nothing to communicate, a gather is the flat shard viewed in the
        parameter's shape (no fresh buffer: nothing is freed at its release,
        which would free the parameter), a wait and a release pass their
        input on, a reduce flattens the gradient. The communication plan is
        ignored: every parameter is resident already, so kept residency and
        buckets would change nothing.
        """
        def allgather(shard, graph_id, ds_id, dtype=None):
            full = shard.view(self.shapes[ds_id])
            return full if dtype is None or dtype == full.dtype else full.to(dtype)

        def passed_on(value, *_ids):
            return value

        return {Role.ALLGATHER: allgather, Role.WAIT: passed_on, Role.RELEASE: passed_on,
                Role.REDUCE: lambda grad, graph_id, ds_id: self.in_reduce_dtype(grad, ds_id).reshape(-1)}
