"""The simulator's two streams: compute in program order, communication issued in program order, one at a time.

:class:`Timeline` is a part of :class:`dcsched.sim.simulate.CompiledGraph`; the rules are in that module's
docstring and docs/simulator.md. A collective issued blocking
(:attr:`dcsched.collective_issue.CollectiveIssue.blocks_step`) also holds the compute stream until it ends
(:meth:`Timeline._fused_timeline`).
"""

from __future__ import annotations

import itertools
from typing import Sequence

from dcsched.graph.form import ALLGATHER
from dcsched.sim.fused import HELD, Fused
from dcsched.sim.result import Clocks


class Timeline:
    """The compute and communication clocks of an order (node numbers) over the compiled graph's tables."""

    # Built by CompiledGraph (dcsched.sim.simulate): the graph's lists, indexed by node number.
    names: list
    duration: list
    gates: list
    is_comm: list
    timed: list
    kind: list

    def clocks(self, idx: list[int]) -> Clocks:
        """The step time and each position's reach, start and end (ms) for the node numbers ``idx``
        (unchecked): :meth:`simulate`'s timing without its memory model, at a third of its cost."""
        step, reach, start, end = self._timeline(idx, True)
        return Clocks(idx, step, reach, start, end)

    def _timeline(self, idx: list[int], record: bool) -> tuple[float, list, list, list]:
        """The two streams' clocks: the step's end and, if ``record``, each position's reach, start and end (ms)."""
        is_comm, dur, gates = self.is_comm, self.duration, self.gates
        tc = tq = 0.0  # compute stream's clock; when the communication stream is next free
        done: list = [None] * len(self.names)
        reach: list[float] = []
        start: list[float] = []
        end: list[float] = []
        if not record:  # nodes that take no time and wait for nothing leave both clocks as they are
            for i in itertools.compress(idx, map(self.timed.__getitem__, idx)):
                if is_comm[i]:
                    s = tc if tc > tq else tq
                    tq = done[i] = s + dur[i]
                else:
                    for g in gates[i]:
                        e = done[g]
                        if e > tc:
                            tc = e
                    tc += dur[i]
            return (tc if tc > tq else tq), reach, start, end
        add_reach, add_start, add_end = reach.append, start.append, end.append
        for i in idx:
            if is_comm[i]:
                s = tc if tc > tq else tq
                tq = done[i] = s + dur[i]
                add_reach(tc)
                add_start(s)
                add_end(tq)
            else:
                add_reach(tc)
                for g in gates[i]:
                    e = done[g]
                    if e > tc:
                        tc = e
                add_start(tc)
                tc += dur[i]
                add_end(tc)
        return (tc if tc > tq else tq), reach, start, end

    def _fused_timeline(self, idx: list[int], record: bool, fused: Fused) -> tuple[float, list, list, list]:
        """:meth:`_timeline` with buckets: a bucket's first member issues the fused collective; the later
        members take no time and end with it (their reach, start and end are the bucket's).

        Where some collectives block the host that issues them (``fused.issue``: ``async_gather`` or
        ``async_reduce`` False, priced as :attr:`blocks_step
        <dcsched.collective_issue.CollectiveIssue.blocks_step>` says), such a collective starts when the
        communication stream is free and the compute stream waits at its issue point until it ends, so its
        whole time, and any wait for the collectives before it, is on the critical path; an asynchronous one
        runs beside the compute. The planner's inner loop (``record`` False, nothing blocking) is
        :func:`run_fused`, the same arithmetic with nothing recorded."""
        is_comm, dur, gates, kind = self.is_comm, self.duration, self.gates, self.kind
        issue = fused.issue
        blocking = issue.blocks_step
        blocks = (blocking and not issue.async_gather, blocking and not issue.async_reduce)  # (all-gathers, reductions)
        lead, time = fused.lead, fused.time
        tc = tq = 0.0
        done: list = [None] * len(self.names)
        issued: dict[int, tuple[float, float]] = {}
        reach: list[float] = []
        start: list[float] = []
        end: list[float] = []
        if not record and not blocking:
            tc, tq = run_fused(self, idx, fused, done, (tc, tq))
            return (tc if tc > tq else tq), reach, start, end
        for i in idx:
            if is_comm[i]:
                first = lead[i]
                if first == HELD:  # gathered since the forward: ready when reached, no collective
                    done[i] = r = s = tc
                elif first < 0 or first == i:
                    s = tc if tc > tq else tq
                    tq = done[i] = s + (dur[i] if first < 0 else time[i])
                    issued[i] = (tc, s)
                    r = tc
                    if blocks[kind[i] != ALLGATHER]:  # the host waits in the call until it ends
                        tc = tq
                else:  # a later member: issued with its bucket (the host waited there already, if it blocks)
                    done[i] = done[first]
                    r, s = issued[first]
                if record:
                    reach.append(r)
                    start.append(s)
                    end.append(done[i])
            else:
                if record:
                    reach.append(tc)
                for g in gates[i]:
                    e = done[g]
                    if e > tc:
                        tc = e
                if record:
                    start.append(tc)
                tc += dur[i]
                if record:
                    end.append(tc)
        return (tc if tc > tq else tq), reach, start, end


def run_fused(graph, chunk: Sequence[int], fused: Fused, done: list, clocks: tuple[float, float],
              was: Sequence | None = None, changed: list[int] | None = None) -> tuple[float, float]:
    """Time ``chunk`` (node numbers in order) with ``fused``'s buckets from ``clocks`` (the compute stream's,
    the communication stream's), nothing recorded, no collective blocking: the planner's inner loop.

    ``done`` (by node number) receives each timed node's end; nodes that take no time and wait for nothing
    leave both clocks alone. With ``was`` (an earlier run's ``done``), each collective whose end differs from
    it is appended to ``changed``. Returns the two clocks after the chunk.
    """
    is_comm, dur, gates = graph.is_comm, graph.duration, graph.gates
    lead, time = fused.lead, fused.time
    tc, tq = clocks
    for i in itertools.compress(chunk, map(graph.timed.__getitem__, chunk)):
        if is_comm[i]:
            first = lead[i]
            if first == HELD:  # gathered since the forward: ready when reached
                done[i] = tc
            elif first < 0 or first == i:
                s = tc if tc > tq else tq
                tq = done[i] = s + (dur[i] if first < 0 else time[i])
            else:  # a later member: ends with its bucket
                done[i] = done[first]
            if was is not None and done[i] != was[i]:
                changed.append(i)  # type: ignore[union-attr]
        else:
            for g in gates[i]:
                e = done[g]
                if e > tc:
                    tc = e
            tc += dur[i]
    return tc, tq
