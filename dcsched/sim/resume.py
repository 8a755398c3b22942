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
import weakref
from typing import Sequence

from dcsched.sim.fused import HELD, Fused
from dcsched.sim.timeline import run_fused

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
                   end: int | None = None, buckets: Sequence[Sequence[int]] = ()) -> Clocks:
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
    buckets : sequence of sequences of int, optional
        The buckets ``fused`` was made of: with ``current``, what else reads a first member's end (its bucket's
        later members).

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
    # The collectives that end otherwise than in ``current`` (from ``mark``'s position on, where this run
    # starts, so every node reading them runs in it) and the nodes run: the run may stop at a mark where
    # both clocks are ``current``'s and every node reading such an end has run.
    changed: list[int] = []
    ran: set[int] = set()
    members: dict[int, list[int]] = {}  # each bucket's first member's bucket, made where a check first needs it
    for at in range(mark * MARK_EVERY, n, MARK_EVERY):
        c = at // MARK_EVERY
        if current is not None and at >= end and tc == current.compute[c] and tq == current.comm[c] \
                and not _still_read(graph, changed, ran, fused, (members, buckets)):
            return Clocks(done, compute + current.compute[c:], comm + current.comm[c:], current.step)
        compute.append(tc)
        comm.append(tq)
        chunk = order[at:at + MARK_EVERY]
        tc, tq = run_fused(graph, chunk, fused, done, (tc, tq), current.done if current is not None else None, changed)
        if changed:
            ran.update(chunk)
    return Clocks(done, compute, comm, tc if tc > tq else tq)


def _still_read(graph, changed: list[int], ran: set[int], fused: Fused,
                buckets: tuple[dict[int, list[int]], Sequence[Sequence[int]]]) -> bool:
    """Whether a node not yet ``ran`` reads the end of a ``changed`` collective (waiting on it, or issued in
    its bucket); ``changed`` keeps only those still read. ``buckets``: each first member's bucket (filled
    here, :func:`bucket_members`, where a changed collective is a first member) and the buckets."""
    readers = _readers(graph)
    members, listed = buckets
    lead = fused.lead
    if not members and any(lead[i] == i for i in changed):
        members.update(bucket_members(fused, listed))
    still = [i for i in changed
             if not ran.issuperset(readers[i]) or (lead[i] == i and not ran.issuperset(members.get(i, ())))]
    changed[:] = still
    return bool(still)


def bucket_members(fused: Fused, buckets: Sequence[Sequence[int]]) -> dict[int, list[int]]:
    """Each bucket's first member issuing (as ``fused`` has it: held members left out) and the members
    issuing with it.

    >>> bucket_members(Fused([0, 0, -2], {0: 1.0}, 0.0, 1), [[2, 0, 1]])
    {0: [0, 1]}
    """
    found = {}
    for bucket in buckets:
        issuing = [m for m in bucket if fused.lead[m] != HELD]
        if issuing:
            found[issuing[0]] = issuing
    return found


def _readers(graph) -> list[list[int]]:
    """Per node, the nodes that wait on it (it is in their gates), found once per graph."""
    found = _READERS.get(graph)
    if found is None:
        found = [[] for _ in graph.names]
        for i, gates in enumerate(graph.gates):
            for g in gates:
                found[g].append(i)
        _READERS[graph] = found
    return found


_READERS: "weakref.WeakKeyDictionary[object, list[list[int]]]" = weakref.WeakKeyDictionary()
