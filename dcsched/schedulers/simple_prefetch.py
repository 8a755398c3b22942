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
>>> from dcsched.graph.nxview import to_networkx, check_order
>>> view = to_networkx(layered_stack(2).forward)
>>> from dcsched.graph.form import GraphForm
>>> check_order(view, simple_prefetch(GraphForm(view)).order)
"""

from __future__ import annotations

import heapq


from dcsched.errors import GraphError
from dcsched.graph.form import GraphForm, schedule_indexed
from dcsched.plan import Plan
from dcsched.schedulers.registry import register


@register("simple-prefetch", description="DeepCompile's simple_prefetch (DeepSpeed 0.19.8 order): "
                                         "issue each all-gather one step before the work it unblocks")
def simple_prefetch(form: GraphForm) -> Plan:
    """DeepSpeed 0.19.8's ``simple_prefetch`` order of ``form``.

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
    >>> simple_prefetch(GraphForm(layered_stack(1).forward)).order[-1]
    'output'
    """
    return Plan(schedule_indexed(form, simple_prefetch_indices))


def simple_prefetch_indices(g: GraphForm) -> list[int]:
    """The simple-prefetch order as input positions (see the module docstring)."""
    return SimplePrefetchRun(g).run()


class SimplePrefetchRun:
    """One run of simple-prefetch over a graph form: the decided set, the trials and their watch lists."""

    def __init__(self, g: GraphForm):
        n = len(g)
        self.preds, self.succs, self.time = g.preds, g.succs, g.time
        self.is_ag = g.is_allgather()
        self.missing = [len(p) for p in g.preds]  # inputs not yet decided
        self.decided = bytearray(n)
        self.order: list[int] = []
        # watch[u]: {inputs a trial supplies to u: [(all-gather, trial version)]} for a reader u it found blocked
        self.watch: list[dict | None] = [None] * n
        self.versions = [0] * n
        self.dirty: list[int] = []  # all-gathers whose trial is stale
        self.new_ags: list[int] = []  # all-gathers that just became runnable
        self.heap: list[tuple] = []  # (-unblocked time, all-gather, version, what it unblocks)

    def run(self) -> list[int]:
        held = self._start()
        order, decided, heap, versions = self.order, self.decided, self.heap, self.versions
        remaining = len(decided) - len(order) - len(held)
        while remaining:
            for ag in self.dirty:
                if not decided[ag]:
                    self._trial(ag)
            self.dirty.clear()
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
            self._place(ag, held)
            self._decide(ag)
            for v in found:
                self._decide(v)
            held = found
            remaining -= 1 + len(found)
            self._try_new()
        order.extend(held)
        return order

    def _start(self) -> list[int]:
        """Place the nodes without inputs; return the first sweep (everything runnable without an all-gather)."""
        preds, succs, is_ag, missing, decided = self.preds, self.succs, self.is_ag, self.missing, self.decided
        n = len(preds)
        start = [i for i in range(n) if not preds[i]]
        self.order.extend(start)
        for v in start:
            self._decide(v)
        stack = [i for i in range(n) if not decided[i] and not is_ag[i] and missing[i] == 0]
        held: list[int] = []
        while stack:
            v = stack.pop()
            for u in succs[v]:
                if missing[u] == 1 and not is_ag[u]:
                    stack.append(u)
            self._decide(v)
            held.append(v)
        self._try_new()
        return held

    def _place(self, ag: int, held: list[int]) -> None:
        """Append the held work and the winning all-gather, the all-gather first.

        DeepSpeed places the all-gather before the held work; when the
        all-gather reads some of that work (never in DeepCompile graphs) that
        order would be invalid, so it goes right after the last held node it
        reads instead.
        """
        held_at = {v: k for k, v in enumerate(held)}
        after = max((held_at[p] for p in self.preds[ag] if p in held_at), default=-1)
        order = self.order
        order.extend(held[:after + 1])
        order.append(ag)
        order.extend(held[after + 1:])

    def _decide(self, v: int) -> None:
        """Mark ``v`` decided: note the all-gathers it makes runnable, and the trials it makes stale."""
        missing, is_ag, watch, versions = self.missing, self.is_ag, self.watch, self.versions
        self.decided[v] = 1
        for u in self.succs[v]:
            m = missing[u] - 1
            missing[u] = m
            if is_ag[u]:
                if not m:
                    self.new_ags.append(u)
                continue
            bucket = watch[u]
            if bucket is not None:
                stale = bucket.pop(m, None)
                if stale:
                    for ag, version in stale:
                        if versions[ag] == version:
                            versions[ag] += 1
                            self.dirty.append(ag)
                if not bucket:
                    watch[u] = None

    def _try_new(self) -> None:
        for ag in self.new_ags:
            self._trial(ag)
        self.new_ags.clear()

    def _trial(self, ag: int) -> None:
        """What running ``ag`` now would unblock, as DeepSpeed's sweep finds it; pushed on the heap."""
        succs, is_ag, missing, watch = self.succs, self.is_ag, self.missing, self.watch
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
        version = self.versions[ag]
        for u, m in local.items():
            if m:
                supplied = missing[u] - m
                bucket = watch[u]
                if bucket is None:
                    bucket = watch[u] = {}
                bucket.setdefault(supplied, []).append((ag, version))
        time = self.time
        unblocked = sum([time[v] for v in found])
        heapq.heappush(self.heap, (-unblocked, ag, version, found))
