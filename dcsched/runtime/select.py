"""The one place that picks the ZeRO-3 runtime a step runs on, for replay, training and profiling alike.

Three runtimes execute the ZeRO-3 ops (:mod:`dcsched.runtime.ops`):

* :class:`~dcsched.runtime.distributed.DistributedZero3Runtime` whenever a
  process group is initialised (``torchrun``): parameters are 1-D shards,
  gathers and reduce-scatters are real collectives;
* :class:`~dcsched.runtime.local.LocalZero3Runtime` in one process when the
  parameters are 1-D shards (training a module ``dcsched.shard`` sharded
  alone);
* :class:`~dcsched.runtime.ops.Zero3Runtime` in one process when the graph's
  parameter inputs are the full parameters (replaying or profiling a bundle).

Bucketed collectives and resident parameters (the communication plan) go in
these runtimes, so replay and train get them at once.
"""

from __future__ import annotations

from typing import Iterable

from dcsched.runtime import ops


def process_group_active() -> bool:
    """Whether ``torch.distributed`` has a default process group in this process."""
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def runtime_for(params: Iterable, *, flat_shards: bool, group=None,
                async_reduce: bool = False) -> ops.Zero3Runtime:
    """The ZeRO-3 runtime for a step over ``params`` in this process.

    Parameters
    ----------
    params : iterable of ParamInfo
        The bundle's parameter table (full shapes by ``ds_id``).
    flat_shards : bool
        Whether the step's parameter inputs are 1-D shards (training) rather
        than full parameters (replay and profiling in one process). Under a
        process group they are always shards.
    group : ProcessGroup, optional
        The group to gather over; the default group when None.
    async_reduce : bool
        Issue reduce-scatters asynchronously, waited on at the end of the
        backward graph (training on CUDA).

    Returns
    -------
    Zero3Runtime
        A fresh runtime, to install with :func:`dcsched.runtime.step.installed`.

    Examples
    --------
    >>> import torch
    >>> from dcsched.bundle.core import ParamInfo
    >>> params = [ParamInfo("w", (2, 2), torch.float32, 0)]
    >>> type(runtime_for(params, flat_shards=True)).__name__, type(runtime_for(params, flat_shards=False)).__name__
    ('LocalZero3Runtime', 'Zero3Runtime')
    """
    params = list(params)
    if process_group_active():
        from dcsched.runtime.distributed import DistributedZero3Runtime
        runtime = DistributedZero3Runtime(params, group=group)
        runtime.async_reduce = async_reduce
        return runtime
    if flat_shards:
        from dcsched.runtime.local import LocalZero3Runtime
        return LocalZero3Runtime(params)
    return ops.Zero3Runtime()
