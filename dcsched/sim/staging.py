"""Gloo's staging copies: the flat tensors a collective allocates for itself while it runs.

On the CPU, gloo neither gathers into the caller's output nor reduces from the caller's input directly. An
all-gather (``all_gather_into_tensor``) gathers into a flat tensor of its own, of the output's size, then
copies it into the output; a reduce-scatter (``reduce_scatter_tensor``) reduces a clone of its input. Both
live for as long as the collective runs (an all-reduce works in place). The torch profiler's allocation
events show them (``aten::empty < gloo:all_gather``, ``aten::clone < c10d::_reduce_scatter_base_``:
``benchmarks/peak_allocations.py``); no graph node returns them, so the memory series counts them only when
asked (``simulate(..., issue=CollectiveIssue(staging=True))``, :mod:`dcsched.collective_issue`).

How long each lives is modelled as the runtime (:mod:`dcsched.runtime.distributed`) can bound it, from the
program's side: an asynchronous all-gather's copy from its issue until the first wait on any of its members
(the program blocks there until it is done), an asynchronous reduce-scatter's until just before the next
reduce is issued (one in flight: issuing the next waits on it) or to the graph's end; a synchronous
collective's at its issue alone.

>>> from dcsched.sim.fused import Fused
>>> from dcsched.collective_issue import CollectiveIssue
>>> from dcsched.graph.form import ALLGATHER, WAIT
>>> kind, owned = [ALLGATHER, WAIT, 0, 0], [8, 0, 0, 0]
>>> staging_series([0, 2, 1, 3], kind, owned, [0] * 4, [[], [0], [], []], [[1], [], [], []],
...                Fused([-1] * 4, {}, 0.0, 1, issue=CollectiveIssue(staging=True)))
[8, 8, 0, 0]
"""

from __future__ import annotations

import itertools
from typing import Sequence

from dcsched.graph.form import ALLGATHER, REDUCE, WAIT
from dcsched.sim.fused import HELD, Fused


def staging_series(idx: Sequence[int], kind: Sequence[int], owned: Sequence, size: Sequence,
                   preds: Sequence[Sequence[int]], succs: Sequence[Sequence[int]], fused: Fused) -> list:
    """The bytes of the staging copies alive while each position of ``idx`` (node numbers) runs.

    Parameters
    ----------
    idx : sequence of int
        The order, as node numbers.
    kind, owned, size, preds, succs : sequences indexed by node number
        The compiled graph's tables (:class:`dcsched.sim.simulate.CompiledGraph`): an all-gather's ``owned``
        bytes are its gathered buffer's, a reduce's first input (``preds[i][0]``) is its gradient.
    fused : Fused
        The plan as the simulation reads it: buckets (one collective, one copy of all its members' bytes),
        held all-gathers (no collective), the all-reduces (in place: no copy) and how the gathers and
        reduces are issued (:attr:`Fused.issue`: asynchronous or blocking).

    Returns
    -------
    list
        One figure per position, to add to the memory series.
    """
    position = {i: p for p, i in enumerate(idx)}
    lead = fused.lead
    gathers: dict[int, list[int]] = {}  # a collective's first member -> its members
    reduces: dict[int, list[int]] = {}
    for i in idx:
        if kind[i] == ALLGATHER and lead[i] != HELD:
            gathers.setdefault(i if lead[i] < 0 else lead[i], []).append(i)
        elif kind[i] == REDUCE:
            reduces.setdefault(i if lead[i] < 0 else lead[i], []).append(i)
    change = [0] * (len(idx) + 1)

    def alive(first: int, last: int, nbytes) -> None:
        change[first] += nbytes
        change[last + 1] -= nbytes

    for members in gathers.values():
        issued = position[members[0]]
        last = issued
        if fused.issue.async_gather:
            waits = [position[w] for m in members for w in succs[m] if kind[w] == WAIT and w in position]
            last = max(issued, min(waits, default=issued) - 1)
        alive(issued, last, sum(owned[m] for m in members))
    # a reduce bucket is issued when its last member's gradient has arrived
    issues = sorted((max(map(position.__getitem__, members)), first) for first, members in reduces.items())
    for k, (issued, first) in enumerate(issues):
        if first in fused.all_reduces:
            continue
        last = issued
        if fused.issue.async_reduce:
            last = max(issued, issues[k + 1][0] - 1) if k + 1 < len(issues) else len(idx) - 1
        alive(issued, last, sum(size[preds[m][0]] for m in reduces[first]))
    return list(itertools.accumulate(change[:-1]))
