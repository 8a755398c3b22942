"""``list``: greedy list scheduling by memory delta (the evident intent of DeepCompile's ``list_schedule``).

The rule: repeatedly run, among the runnable nodes (all inputs already run),
the one whose *memory delta* is smallest, ties broken by input order. The delta
of a node is

- ``+tensor_size`` of an all-gather (the buffer it gathers);
- ``-size`` of the parameter's gathered buffer at the release that frees it:
  the ``n_users``-th release of that parameter since it was gathered;
- ``0`` for every other node (compute, wait, earlier releases, reduce-grad).

So gathers run as late as possible and frees as early as possible: the order
that keeps gathered memory lowest, at the cost of overlap.

(DeepSpeed's ``list_schedule`` unpacks three of the six values its helper
returns and fails on every graph; its memory table subtracts the release
node's own tensor size at *every* release and at reduce-grad. dcsched uses
the rule above.)

>>> from dcsched.synthetic import layered_stack
>>> from dcsched.graph.nxview import to_networkx, check_order
>>> view = to_networkx(layered_stack(1).forward)
>>> from dcsched.graph.form import GraphForm
>>> order = list(list_order(GraphForm(view)).order)
>>> check_order(view, order)
>>> order.index("output") == len(order) - 1
True
"""

from __future__ import annotations

import heapq


from dcsched.errors import GraphError
from dcsched.graph.form import ALLGATHER, RELEASE, GraphForm, schedule_indexed
from dcsched.plan import Plan
from dcsched.schedulers.registry import register


@register("list", description="greedy: run the runnable node with the smallest memory delta "
                              "(+gather, -final release), ties by input order")
def list_order(form: GraphForm) -> Plan:
    """The ``list`` order of ``form``: the runnable node with the smallest memory delta first.

    Parameters
    ----------
    form : GraphForm
        The graph.

    Returns
    -------
    Plan
        The order (node names); no buckets, every parameter sharded.

    Examples
    --------
    >>> from dcsched.synthetic import layered_stack
    >>> list_order(GraphForm(layered_stack(1).forward)).order[-1]
    'output'
    """
    return Plan(schedule_indexed(form, list_indices))


def list_indices(g: GraphForm) -> list[int]:
    """The ``list`` order as input positions (see the module docstring)."""
    n = len(g)
    preds, succs, kind, size, ds_id, n_users = g.preds, g.succs, g.kind, g.size, g.ds_id, g.n_users
    missing = [len(p) for p in preds]
    gathered: dict = {}       # ds_id -> bytes of its live gathered buffer
    released: dict = {}       # ds_id -> releases since it was gathered
    runnable_releases: dict = {}  # ds_id -> set of runnable release nodes
    version = [0] * n
    heap: list[tuple[int, int, int]] = []

    def delta(v: int) -> int:
        r = kind[v]
        if r == ALLGATHER:
            return size[v]
        if r == RELEASE:
            d = ds_id[v]
            if released.get(d, 0) + 1 >= n_users[v]:
                return -gathered.get(d, 0)
        return 0

    def push(v: int) -> None:
        heapq.heappush(heap, (delta(v), v, version[v]))

    def param_changed(d) -> None:
        # A release's delta depends on its parameter's state: re-rank the runnable ones.
        for r in runnable_releases.get(d, ()):
            version[r] += 1
            push(r)

    for v in range(n):
        if not missing[v]:
            if kind[v] == RELEASE:
                runnable_releases.setdefault(ds_id[v], set()).add(v)
            push(v)
    order: list[int] = []
    while heap:
        _, v, ver = heapq.heappop(heap)
        if ver != version[v]:
            continue
        version[v] += 1
        order.append(v)
        r = kind[v]
        if r == ALLGATHER:
            d = ds_id[v]
            gathered[d] = size[v]
            released[d] = 0
            param_changed(d)
        elif r == RELEASE:
            d = ds_id[v]
            runnable_releases[d].discard(v)
            count = released.get(d, 0) + 1
            if count >= n_users[v]:
                gathered.pop(d, None)
                count = 0
            released[d] = count
            param_changed(d)
        for u in succs[v]:
            missing[u] -= 1
            if not missing[u]:
                if kind[u] == RELEASE:
                    runnable_releases.setdefault(ds_id[u], set()).add(u)
                push(u)
    if len(order) != n:
        raise GraphError("the graph has a cycle: some nodes never become runnable")
    return order
