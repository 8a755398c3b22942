"""How to cut a graph's first all-gathers into buckets, so its compute starts as early as it can.

A graph waits on its first bucket before any compute that reads a parameter,
and every bucket pays the collective's latency once. One bucket for the
first block makes the compute wait for all of it; one collective per
parameter pays every latency. Between them lie the pieces that arrive just
as the compute reaches them. :func:`head_pieces` finds, for each number of
pieces, the consecutive pieces (members in the order the compute needs them)
whose total wait is least, by dynamic programming over this model:

* the pieces are issued one after another where the first member's
  all-gather stands (after ``issue`` ms of compute) and run back to back:
  piece ``p`` (from 1) ending at member ``j`` arrives at
  ``issue + p * latency + C[j]``, where ``C[j]`` is the members' transfer time
  (``device_time`` less the latency) up to ``j``;
* the compute needs member ``m`` after ``need[m]`` ms of the compute before
  its wait in ``order``, plus every wait so far; a piece is waited on where its
  first member is needed, then nothing waits until the next piece.

So the total wait after piece ``p`` ending at ``j`` and starting at ``i`` is
``E[p][j] = min_i max(E[p-1][i-1], issue + p * latency + C[j] - need[i])``. The model
leaves out what else the communication stream carries and the blocks after
these; the planner simulates each answer (:mod:`dcsched.schedulers.overlap_plan.scheduler`).
"""

from __future__ import annotations

import itertools
from typing import Sequence

from dcsched.graph.form import COMPUTE, WAIT, GraphForm
from dcsched.sim.collectives import latency_time_ms, transfer_time_ms


def need_times(form: GraphForm, order: Sequence[int], members: Sequence[int]) -> tuple[dict[int, float], float]:
    """For each all-gather of ``members``, the compute time (ms) ``order`` runs before its first wait; and
    the compute time before the first of them is issued.

    Examples
    --------
    >>> from dcsched.synthetic import layered_stack
    >>> form = GraphForm(layered_stack(1).forward)
    >>> from dcsched.graph.form import ALLGATHER
    >>> gathers = [i for i in form.topo if form.kind[i] == ALLGATHER]
    >>> times, issue = need_times(form, form.topo, gathers)
    >>> min(times.values()), issue, len(times) == len(gathers)
    (0.0, 0.0, True)
    """
    wanted = set(members)
    wait_of = {w: m for m in wanted for w in form.succs[m] if form.kind[w] == WAIT}
    need: dict[int, float] = {}
    clock, issue = 0.0, None
    for v in order:
        if issue is None and v in wanted:
            issue = clock
        m = wait_of.get(v)
        if m is not None and m not in need:
            need[m] = clock
        if form.kind[v] == COMPUTE:
            clock += form.time[v]
    for m in wanted - need.keys():  # not in order, or never read: needed last
        need[m] = clock
    return need, clock if issue is None else issue


def head_pieces(form: GraphForm, order: Sequence[int], members: Sequence[int], most: int,
                latency_ms: float) -> dict[int, list[list[int]]]:
    """The least-waiting cut of ``members`` into 1 to ``most`` consecutive buckets (module docstring).

    Parameters
    ----------
    form : GraphForm
        The graph.
    order : sequence of int
        The order the graph runs in (node numbers), which says when the compute needs each member.
    members : sequence of int
        All-gathers (node numbers), issued first in the graph.
    most : int
        The most pieces to cut them into.
    latency_ms : float
        The latency each collective pays once (included in each member's ``device_time``).

    Returns
    -------
    dict of int to list of list of int
        For each number of pieces ``k`` (1 to ``most``, at most one piece per member), the pieces, in
        the order they are needed.

    Examples
    --------
    The first layer's parameters of a two-layer stack, in two buckets: the first piece small, so the
    compute starts early.

    >>> from dcsched.synthetic import layered_stack
    >>> from dcsched.graph.form import ALLGATHER
    >>> stack = GraphForm(layered_stack(2).forward)
    >>> first = [i for i in stack.topo if stack.kind[i] == ALLGATHER][:17]
    >>> one, two = head_pieces(stack, stack.topo, first, 2, latency_ms=0.02).values()
    >>> len(one), [len(piece) for piece in two]
    (1, [1, 16])
    """
    need, issue = need_times(form, order, members)
    ranked = sorted(members, key=lambda m: need[m])
    n = len(ranked)
    transfer = list(itertools.accumulate(transfer_time_ms(form.time[m], latency_ms=latency_ms) for m in ranked))
    # Units of consecutive members, cut as wholes: one member each up to HEAD_UNITS members (the model
    # as written), else about HEAD_UNITS equal runs, so a head of N members costs O(HEAD_UNITS^2) a
    # piece count, not O(N^2) (a fan-in's 2,000 parameters in one block).
    width = -(-n // HEAD_UNITS) if n > HEAD_UNITS else 1
    firsts = list(range(0, n, width))
    lasts = [min(f + width, n) - 1 for f in firsts]
    cuts = _least_waiting_cuts([need[ranked[f]] for f in firsts], [transfer[e] for e in lasts], issue, most,
                               latency_ms)
    return {count: [ranked[firsts[a]:lasts[b] + 1] for a, b in units] for count, units in cuts.items()}


#: The most units :func:`head_pieces` cuts a head into (more members: runs of them as units).
HEAD_UNITS = 256


def _least_waiting_cuts(needs: Sequence[float], transfer: Sequence[float], issue: float, most: int,
                        latency_ms: float) -> dict[int, list[tuple[int, int]]]:
    """For each piece count, the pieces (first and last unit) of least total wait (the module's model):
    ``needs`` when each unit's first member is needed, ``transfer`` the transfer time up to its last."""
    n = len(needs)
    inf = float("inf")
    # waits[p][j]: the least total wait with units 0..j in p pieces; start[p][j]: where the last one starts
    waits = [[inf] * n for _ in range(min(most, n) + 1)]  # row 0 unused: pieces count from 1
    start = [[0] * n for _ in waits]
    found: dict[int, list[tuple[int, int]]] = {}
    for p in range(1, len(waits)):
        before, row, starts = waits[p - 1], waits[p], start[p]
        paid = latency_time_ms(p, latency_ms=latency_ms)
        for j in range(p - 1, n):
            arrives = issue + paid + transfer[j]
            if p == 1:  # the first piece starts at the first unit
                late = arrives - needs[0]
                row[j] = late if late > 0.0 else 0.0
                continue
            # the least over the last piece's first unit i of the larger of the wait before it and its own
            # (written out: this loop is most of the planner's time on a long head)
            best, at = inf, 0
            for i in range(p - 1, j + 1):
                earlier, late = before[i - 1], arrives - needs[i]
                wait = earlier if earlier >= late else late
                if wait < best:
                    best, at = wait, i
            row[j], starts[j] = best, at
        pieces, end = [], n - 1
        for q in range(p, 0, -1):
            begin = start[q][end]
            pieces.append((begin, end))
            end = begin - 1
        found[p] = pieces[::-1]
    return found
