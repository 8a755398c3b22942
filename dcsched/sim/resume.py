"""The two streams' clocks of a bucketed order, kept so that an order changed in one stretch is timed again
from there (:func:`resumed_clocks`), not from its start.

A planner that tries many orders, each its current order with a few buckets
changed (:mod:`dcsched.schedulers.overlap_plan.splice`), times each the way
:meth:`dcsched.sim.timeline.Timeline._fused_timeline` does, to the same bit:
the same operations on the same values in the same order. What differs is
where it starts and stops. Up to the first changed position the clocks are
the current order's, so the run starts at the mark (kept every
:data:`MARK_EVERY` positions) at or before it, each collective's end where
the current order has it. Past the last changed position the two orders run
the same nodes with the same buckets; where both clocks equal the current
order's at a mark and no collective ends differently from there on, every
later figure is the current order's, the step included: the run stops there.

>>> from dcsched.synthetic import layered_stack
>>> from dcsched.sim.simulate import compile_view
>>> g = compile_view(layered_stack(2).forward)
>>> order = list(g.topo)
>>> fused = g._fused([])
>>> clocks = resumed_clocks(g, order, fused)
>>> clocks.step == g.timeline_figures(order)[0]
True
>>> resumed_clocks(g, order, fused, clocks, start=len(order) // 2).step == clocks.step
True
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from typing import Sequence

from dcsched.sim.fused import HELD, Fused

#: How many positions apart :class:`Clocks` keeps its marks: where a run resumes and where it may stop.
MARK_EVERY = 64


@dataclasses.dataclass
class Clocks:
    """One order's timing: each node's collective end (``done``, by node number: None where it has none),
    both clocks before every :data:`MARK_EVERY`-th position (compute's ``compute``, the communication stream's
    ``comm``), and the step (ms)."""

    done: list
    compute: list[float]
    comm: list[float]
    step: float


def resumed_clocks(graph, order: Sequence[int], fused: Fused, current: Clocks | None = None, *, start: int = 0,
                   end: int | None = None, sizes: dict[int, int] | None = None) -> Clocks:
    """The clocks of ``order`` (node numbers) with ``fused``, on ``graph`` (a
    :class:`~dcsched.sim.simulate.CompiledGraph`).

    Parameters
    ----------
    graph : CompiledGraph
        The graph's tables.
    order : sequence of int
        The order.
    fused : Fused
        Its buckets and held parameters.
    current : Clocks, optional
        The clocks of an order that runs the same nodes with the same buckets at every position before ``start``
        and from ``end`` on (None: time ``order`` from its start).
    start, end : int, optional
        The first and one past the last position where ``order`` or its buckets may differ from ``current``'s
        (``end`` default: the order's length).
    sizes : dict of int to int, optional
        Each bucket's first member (as ``fused`` has it) and how many members issue with it: needed with
        ``current`` (:func:`bucket_sizes`).

    Returns
    -------
    Clocks
        Its timing: the step equal, to the bit, to ``graph._fused_timeline(order, False, fused)[0]``.
    """
    n = len(order)
    end = n if end is None else end
    if current is None:
        mark, done, compute, comm, tc, tq = 0, [None] * len(graph.names), [], [], 0.0, 0.0
    else:
        mark = start // MARK_EVERY
        done, compute, comm = current.done.copy(), current.compute[:mark], current.comm[:mark]
        tc, tq = current.compute[mark], current.comm[mark]
    # Collectives that end otherwise than in ``current``, each with how many nodes still read its end: the
    # run may stop once none is left.
    pending: dict[int, int] = {}
    readers = _readers(graph) if current is not None else None
    sizes = {} if sizes is None else sizes
    for at in range(mark * MARK_EVERY, n, MARK_EVERY):
        c = at // MARK_EVERY
        if current is not None and at >= end and not pending and tc == current.compute[c] \
                and tq == current.comm[c]:
            return Clocks(done, compute + current.compute[c:], comm + current.comm[c:], current.step)
        compute.append(tc)
        comm.append(tq)
        tc, tq = _run(graph, order[at:at + MARK_EVERY], fused, done, (tc, tq), current, (pending, readers, sizes))
    return Clocks(done, compute, comm, tc if tc > tq else tq)


def _run(graph, chunk: list[int], fused: Fused, done: list, clocks: tuple[float, float], current: Clocks | None,
         tracked: tuple[dict[int, int], list[int] | None, dict[int, int]]) -> tuple[float, float]:
    """``chunk`` timed from ``clocks`` (compute's, the communication stream's; ``done`` filled in): the loop of
    :meth:`~dcsched.sim.timeline.Timeline._fused_timeline`, noting in ``tracked``'s pending each collective
    whose end differs from ``current``'s (None: nothing to compare) while nodes still read it (``tracked``:
    pending, readers per node, bucket sizes per first member)."""
    is_comm, dur, gates = graph.is_comm, graph.duration, graph.gates
    tc, tq = clocks
    pending, readers, sizes = tracked
    lead, time = fused.lead, fused.time
    was = current.done if current is not None else None
    for i in itertools.compress(chunk, map(graph.timed.__getitem__, chunk)):
        if is_comm[i]:
            first = lead[i]
            if first == HELD:
                done[i] = tc
            elif first < 0 or first == i:
                s = tc if tc > tq else tq
                tq = done[i] = s + (dur[i] if first < 0 else time[i])
            else:
                done[i] = done[first]
                if first in pending:
                    _read(pending, first)
            if was is not None and done[i] != was[i] and readers is not None:
                # a bucket's first member is also read by the later members
                left = readers[i] + (sizes[i] - 1 if first == i else 0)
                if left:
                    pending[i] = left
        else:
            for g in gates[i]:
                e = done[g]
                if e > tc:
                    tc = e
                if pending and g in pending:
                    _read(pending, g)
            tc += dur[i]
    return tc, tq


def bucket_sizes(fused: Fused, buckets: Sequence[Sequence[int]]) -> dict[int, int]:
    """Each bucket's first member issuing (as ``fused`` has it: held members left out) and how many members
    issue with it.

    >>> bucket_sizes(Fused([0, 0, -2], {0: 1.0}, 0.0, 1), [[2, 0, 1]])
    {0: 2}
    """
    sizes = {}
    for members in buckets:
        issuing = [m for m in members if fused.lead[m] != HELD]
        if issuing:
            sizes[issuing[0]] = len(issuing)
    return sizes


def _read(pending: dict[int, int], node: int) -> None:
    """One reader of ``node``'s end has run."""
    left = pending[node] - 1
    if left:
        pending[node] = left
    else:
        del pending[node]


def _readers(graph) -> list[int]:
    """Per node, how many nodes wait on it (it is in their gates), counted once per graph."""
    found = _READERS.get(graph)
    if found is None:
        found = [0] * len(graph.names)
        for gates in graph.gates:
            for g in gates:
                found[g] += 1
        _READERS[graph] = found
    return found


_READERS: "weakref.WeakKeyDictionary[object, list[int]]" = weakref.WeakKeyDictionary()
