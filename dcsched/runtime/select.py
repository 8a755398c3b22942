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

Each runs the bundle's communication plan (``bundle.plans``, turned into a
:class:`~dcsched.runtime.commplan.CommPlan`): the distributed runtime issues
one collective per bucket and keeps 'kept' parameters gathered from the
forward to the backward; the single-process runtimes have nothing to
communicate and honour kept residency alone (inductor's inlined kernels
ignore the plan: they gather nothing). Replay and train both pick here, so
both run the plan.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from dcsched.collective_issue import PROCESS_GROUP, CollectiveIssue
from dcsched.runtime import ops
from dcsched.runtime.commplan import comm_plan


def process_group_active() -> bool:
    """Whether ``torch.distributed`` has a default process group in this process."""
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def runtime_for(params: Iterable, *, flat_shards: bool, group=None, issue: CollectiveIssue = PROCESS_GROUP,
                plans: Mapping[str, Any] | None = None,
                graph_ids: Mapping[str, int | None] | None = None) -> ops.Zero3Runtime:
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
    issue : CollectiveIssue
        How a process group's collectives are issued
        (:attr:`~dcsched.runtime.distributed.DistributedZero3Runtime.issue`;
        default :data:`~dcsched.collective_issue.PROCESS_GROUP`: all-gathers
        and reduce-scatters asynchronous, the reduce-scatters waited on at the
        end of the backward graph). The single-process runtimes issue none.
    plans : mapping of str to Plan, optional
        The communication plan by graph name (``bundle.plans``); none: every
        collective alone, every parameter sharded.
    graph_ids : mapping of str to int, optional
        ``bundle.graph_ids``: the graph_id each graph's ops carry (needed with ``plans``).

    Returns
    -------
    Zero3Runtime
        A fresh runtime running the plan, to install with :func:`dcsched.runtime.step.installed`.

    Raises
    ------
    DcschedError
        A plan the runtime cannot run (:func:`dcsched.runtime.commplan.comm_plan`).

    Examples
    --------
    >>> import torch
    >>> from dcsched.bundle.core import ParamInfo
    >>> params = [ParamInfo("w", (2, 2), torch.float32, 0)]
    >>> type(runtime_for(params, flat_shards=True)).__name__, type(runtime_for(params, flat_shards=False)).__name__
    ('LocalZero3Runtime', 'Zero3Runtime')
    >>> from dcsched.plan import Plan
    >>> sorted(runtime_for(params, flat_shards=True, plans={"forward": Plan(("w",), residency={0: "kept"})},
    ...                    graph_ids={"forward": 0, "backward": 1}).plan.kept)
    [0]
    """
    params = list(params)
    plan = comm_plan(plans, graph_ids or {})
    runtime: ops.Zero3Runtime
    if process_group_active():
        from dcsched.runtime.distributed import DistributedZero3Runtime
        runtime = DistributedZero3Runtime(params, group=group)
        runtime.issue = issue
    elif flat_shards:
        from dcsched.runtime.local import LocalZero3Runtime
        runtime = LocalZero3Runtime(params)
    else:
        runtime = ops.Zero3Runtime()
    runtime.set_plan(plan)
    return runtime
