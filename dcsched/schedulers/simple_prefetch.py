"""``simple-prefetch``: DeepCompile's one-step-ahead all-gather prefetcher, exact and fast.

The order is exactly the one DeepSpeed 0.19.8's ``simple_prefetch`` gives (see
``docs/schedulers.md``). The nodes without inputs start the order; everything
that can then run without another all-gather follows (a depth-first sweep,
last-found first). Each round then *tries* every runnable all-gather: the nodes
it would unblock (the same sweep, started from its readers) and their device
time. The all-gather that unblocks the most time wins (ties: the first in
input order); it is placed *before* the work unblocked by the previous
round's winner, and its own unblocked work is held back for the next round. So
every all-gather is issued one round ahead of the compute that needs it.

Re-scoring every runnable all-gather each round is quadratic. Here a trial is
recomputed only when its result can change: a trial depends on the scheduled
set only through the readers it found blocked, and one of those can unblock
only when its count of unscheduled inputs falls to the number of inputs the
trial itself supplies. Each such reader carries a watch list keyed by that
number; everything else about a trial is unaffected by what the other rounds
schedule.

>>> from dcsched.synthetic import layered_stack
>>> from dcsched.nxview import to_networkx, check_order
>>> view = to_networkx(layered_stack(2).forward)
>>> check_order(view, simple_prefetch(view))
"""

from __future__ import annotations

import heapq

import networkx as nx

from ..errors import GraphError
from ..graphform import GraphForm, schedule_indexed
from .registry import register


@register("simple-prefetch", description="DeepCompile's simple_prefetch (DeepSpeed 0.19.8 order): "
                                         "issue each all-gather one step before the work it unblocks")
def simple_prefetch(view: nx.DiGraph) -> list[str]:
    return schedule_indexed(view, simple_prefetch_indices)


def simple_prefetch_indices(g: GraphForm) -> list[int]:
    """The simple-prefetch order as input positions (see the module docstring)."""
    n = len(g)
    preds, succs, time = g.preds, g.succs, g.time
    is_ag = g.is_allgather()
    missing = [len(p) for p in preds]  # inputs not yet decided
    decided = bytearray(n)
    order: list[int] = []

    def decide(v: int, found_ags: list[int]) -> None:
        decided[v] = 1
        for u in succs[v]:
            m = missing[u] - 1
            missing[u] = m
            if is_ag[u]:
                if not m:
                    found_ags.append(u)
                continue
            bucket = watch[u]
            if bucket is not None:
                stale = bucket.pop(m, None)
                if stale:
                    for ag, version in stale:
                        if versions[ag] == version:
                            versions[ag] += 1
                            dirty.append(ag)
                if not bucket:
                    watch[u] = None

    watch: list[dict | None] = [None] * n
    versions = [0] * n
    dirty: list[int] = []
    new_ags: list[int] = []

    start = [i for i in range(n) if not preds[i]]
    for v in start:
        order.append(v)
    for v in start:
        decide(v, new_ags)

    # The first sweep: everything runnable without an all-gather.
    stack = [i for i in range(n) if not decided[i] and not is_ag[i] and missing[i] == 0]
    held: list[int] = []
    while stack:
        v = stack.pop()
        for u in succs[v]:
            if missing[u] == 1 and not is_ag[u]:
                stack.append(u)
        decide(v, new_ags)
        held.append(v)

    heap: list[tuple] = []

    def trial(ag: int) -> None:
        # What running `ag` now would unblock, as DeepSpeed's sweep finds it.
        local: dict[int, int] = {}
        found: list[int] = []
        stack = [ag]
        while stack:
            v = stack.pop()
            for u in succs[v]:
                if is_ag[u]:
                    continue
                m = local.get(u, missing[u]) - 1
                local[u] = m
                if not m:
                    stack.append(u)
            if v != ag:
                found.append(v)
        version = versions[ag]
        for u, m in local.items():
            if m:
                supplied = missing[u] - m
                bucket = watch[u]
                if bucket is None:
                    bucket = watch[u] = {}
                bucket.setdefault(supplied, []).append((ag, version))
        unblocked = sum([time[v] for v in found])
        heapq.heappush(heap, (-unblocked, ag, version, found))

    for ag in new_ags:
        trial(ag)
    new_ags.clear()

    remaining = n - len(order) - len(held)
    while remaining:
        for ag in dirty:
            if not decided[ag]:
                trial(ag)
        dirty.clear()
        while heap:
            _, ag, version, found = heap[0]
            if decided[ag] or versions[ag] != version:
                heapq.heappop(heap)
                continue
            break
        else:
            raise GraphError("simple-prefetch found no runnable all-gather (the graph has a cycle)")
        heapq.heappop(heap)
        versions[ag] += 1
        # DeepSpeed places the all-gather before the held work; when the all-gather
        # reads some of that work (never in DeepCompile graphs) that order would be
        # invalid, so it goes right after the last held node it reads instead.
        held_at = {v: k for k, v in enumerate(held)}
        after = max((held_at[p] for p in preds[ag] if p in held_at), default=-1)
        order.extend(held[:after + 1])
        order.append(ag)
        order.extend(held[after + 1:])
        decide(ag, new_ags)
        for v in found:
            decide(v, new_ags)
        held = found
        remaining -= 1 + len(found)
        for new in new_ags:
            trial(new)
        new_ags.clear()
    order.extend(held)
    return order
