"""A candidate bucketed again with a few blocks changed, laid out and timed again only where they reach.

``overlap-plan``'s refinement (:mod:`dcsched.schedulers.overlap_plan.refine`)
tries thousands of candidates, each its current candidate with one or two
blocks cut, merged or moved. Made whole, each costs the graph's length
three times over: :func:`~dcsched.schedulers.fsdp.bucketing.bucketed`, its
:func:`~dcsched.schedulers.fsdp.waits_first.waits_first` pass and the timeline.
:func:`spliced` makes the same candidate from its current one's
:class:`Bucketing`, to the same node and the same bit:

* the blocks' :func:`~dcsched.schedulers.fsdp.bucketing.landings` compared
  with the current ones give the base positions where anything lands, moves or
  changes bucket (:func:`touched`); outside them the base order is laid out as
  before, so only that stretch is laid out again
  (:func:`~dcsched.schedulers.fsdp.bucketing.emit`) and put between the
  current layout's head and tail;
* the waits pass moves nodes only within runs of all-gathers and waits, so it
  runs again on the runs that stretch touches;
* the timeline resumes where the orders part and stops where it meets the
  current one's again (:func:`dcsched.sim.resume.resumed_clocks`).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from typing import Sequence

from dcsched.graph.form import ALLGATHER, OUTPUT, WAIT, GraphForm, output_last_indices
from dcsched.schedulers.fsdp.bucketing import Landings, Placement, emit, landings
from dcsched.schedulers.fsdp.waits_first import waits_first_until
from dcsched.sim.collectives import bucket_time_ms
from dcsched.sim.fused import HELD, Fused
from dcsched.sim.resume import Clocks, resumed_clocks

#: The kinds :func:`~dcsched.schedulers.fsdp.waits_first.waits_first` may move: it works within their runs.
_MOVABLE = (ALLGATHER, WAIT)


@dataclasses.dataclass
class Bucketing:
    """One candidate's bucketed order in the parts :func:`spliced` reuses: the base order and how far
    ahead it buckets, the held parameters (ds_ids), the blocks' landings, the base laid out with them
    (``raw``), that after the waits pass (``spread``), the order (output last), the buckets of two or more
    members, and its clocks."""

    base: list[int]
    ahead: int
    held: frozenset
    found: Landings
    raw: list[int]
    spread: list[int]
    order: list[int]
    buckets: list[list[int]]
    fused: Fused
    clocks: Clocks
    #: where the waits pass over ``raw`` is quiet, ascending
    #: (:func:`~dcsched.schedulers.fsdp.waits_first.waits_first_until`)
    quiet: list[int]
    #: sorted base positions of the moved members, and of where they land (:meth:`raw_start`, made once)
    _counts: tuple[list[int], list[int]] | None = None

    def raw_start(self, p: int, pos: Sequence[int]) -> int:
        """Where in ``raw`` base position ``p``'s stretch starts (``pos``: each node's base position):
        ``p``, less the members moved from before it, plus those landing before it."""
        if self._counts is None:
            self._counts = (sorted(pos[m] for m in self.found.land), sorted(self.found.land.values()))
        moved, landed = self._counts
        return p - bisect.bisect_left(moved, p) + bisect.bisect_left(landed, p)


def full(form: GraphForm, compiled, placed: Placement, base: list[int], groups: tuple, ahead: int,
         held: frozenset, known: dict | None = None) -> Bucketing:
    """``base`` bucketed with the blocks ``groups`` (all-gather blocks, reduce blocks) ``ahead`` blocks
    ahead, and timed with the ``held`` parameters (ds_ids), on ``compiled`` (``form``'s
    :class:`~dcsched.sim.simulate.CompiledGraph`): what
    :func:`~dcsched.schedulers.fsdp.bucketing.bucketed` and
    :meth:`~dcsched.sim.simulate.CompiledGraph.timeline_figures` give, in parts (``known``: as
    :func:`~dcsched.schedulers.fsdp.bucketing.landings` takes it)."""
    found = landings(base, groups[0], groups[1], ahead, placed, known)
    buckets = [b for b in found.buckets if len(b) > 1]
    raw = emit(base, found)
    quiet: list[int] = []
    spread = waits_first_until(form, raw, buckets, quiet)[0]
    order = output_last_indices(form.kind, spread)
    fused = compiled._fused([list(b) for b in buckets], compiled._held_gathers(held))
    clocks = resumed_clocks(compiled, order, fused)
    return Bucketing(base, ahead, held, found, raw, spread, order, buckets, fused, clocks, quiet)


def spliced(current: Bucketing, form: GraphForm, compiled, placed: Placement, groups: tuple,
            known: dict | None = None) -> Bucketing | None:
    """:func:`full` of ``current``'s base, ahead and held parameters with the blocks ``groups``, made from
    ``current`` (module docstring); None where the output does not end both orders (then :func:`full`).
    ``known``: as :func:`~dcsched.schedulers.fsdp.bucketing.landings` takes it (the same as ``current``
    was made with, or a bucket left as it was may look changed, which costs time, never a figure)."""
    pos = placed[0]
    found = landings(current.base, groups[0], groups[1], current.ahead, placed, known)
    buckets = [b for b in found.buckets if len(b) > 1]
    ids = set(map(id, buckets))
    was_ids = set(map(id, current.buckets))
    gone = [b for b in current.buckets if id(b) not in ids]  # the same list: the same bucket (landings' known)
    new = [b for b in buckets if id(b) not in was_ids]
    where = touched(current.found, found, gone + new, pos)
    if not where:  # laid out as before, the same buckets
        return dataclasses.replace(current, found=found, buckets=buckets, _counts=None)
    lo, hi = min(where), max(where)
    head, tail = current.raw_start(lo, pos), current.raw_start(hi + 1, pos)
    middle = emit(current.base, found, lo, hi)
    if len(middle) != tail - head:  # cannot be (the stretch holds the same nodes): made whole instead
        return None
    raw = current.raw[:head] + middle + current.raw[tail:]
    spread, quiet, head, tail = _passed(form, current, raw, buckets, head, tail)
    kind = form.kind
    if kind[spread[-1]] != OUTPUT or kind[current.spread[-1]] != OUTPUT:
        return None
    fused = _refused(compiled, current.fused, gone, new)
    clocks = resumed_clocks(compiled, spread, fused, current.clocks, start=head, end=tail,
                            buckets=buckets)
    return Bucketing(current.base, current.ahead, current.held, found, raw, spread, spread, buckets, fused, clocks,
                     quiet)


def _passed(form: GraphForm, current: Bucketing, raw: list[int], buckets: list[list[int]], changed: int,
            end: int) -> tuple[list[int], list[int], int, int]:
    """The waits pass over ``raw``, which differs from ``current.raw`` only in ``changed`` to ``end``: run
    from the last position before ``changed`` where the pass starts afresh (``current``'s last quiet one, or
    the start of the run of all-gathers and waits there) to the first from ``end`` on where both passes do
    (quiet in both, or the end of the run of all-gathers and waits there), ``current``'s pass taken for the
    rest. Returns the pass's order, its quiet positions, and where the two passes may part and meet again."""
    was, kind, n = current.quiet, form.kind, len(raw)
    head = was[bisect.bisect_right(was, changed) - 1]
    start = changed
    while start > head and kind[raw[start - 1]] in _MOVABLE:  # the pass works within these runs
        start -= 1
    head = start
    tail = end
    while tail < n and kind[raw[tail]] in _MOVABLE:
        tail += 1
    stretch = raw[head:tail]
    quiet: list[int] = []
    out, stopped = waits_first_until(form, stretch, buckets, quiet,
                                     functools.partial(_meets, was, head, end, len(stretch)))
    tail = head + (len(stretch) if stopped is None else stopped)
    return current.spread[:head] + out + current.spread[tail:], \
        was[:bisect.bisect_left(was, head)] + [head + q for q in quiet] + was[bisect.bisect_right(was, tail):], \
        head, tail


def _refused(compiled, fused: Fused, gone: list[list[int]], new: list[list[int]]) -> Fused:
    """``fused`` with the buckets ``gone`` taken out and ``new`` put in, each first member's time computed as
    :meth:`~dcsched.sim.simulate.CompiledGraph._fused` computes it (the saved time is not kept: 0)."""
    lead, time = fused.lead.copy(), dict(fused.time)
    collectives = fused.collectives
    for bucket in gone:
        issuing = [m for m in bucket if lead[m] != HELD]
        if issuing:
            del time[issuing[0]]
            for m in issuing:
                lead[m] = -1
            collectives += len(issuing) - 1
    dur, latency = compiled.duration, compiled.comm_latency_ms
    for bucket in new:
        issuing = [m for m in bucket if lead[m] != HELD]
        if issuing:
            for m in issuing:
                lead[m] = issuing[0]
            time[issuing[0]] = bucket_time_ms([dur[m] for m in issuing], latency_ms=latency)
            collectives -= len(issuing) - 1
    return dataclasses.replace(fused, lead=lead, time=time, saved_ms=0.0, collectives=collectives)


def touched(was: Landings, now: Landings, changed: list[list[int]], pos: Sequence[int]) -> list[int]:
    """The base positions whose stretch two landings lay out differently: where the members landing differ,
    where a member moves in one and not the other, and where each member of a ``changed`` bucket (in one and
    not the other) stands in either (``pos``: each node's base position).

    >>> one = Landings({0: [1, 2]}, {}, {1: 0, 2: 0}, [[1, 2]])
    >>> two = Landings({0: [1], 3: [2]}, {}, {1: 0, 2: 3}, [[1], [2]])
    >>> sorted(set(touched(one, two, [[1, 2]], [0, 1, 2, 3])))
    [0, 3]
    """
    where = [at for at in was.before.keys() | now.before.keys() if was.before.get(at) != now.before.get(at)]
    where += [at for at in was.after.keys() | now.after.keys() if was.after.get(at) != now.after.get(at)]
    if was.land != now.land:
        where += [pos[m] for m in was.land.keys() ^ now.land.keys()]
    for bucket in changed:
        for m in bucket:
            where += (was.land.get(m, pos[m]), now.land.get(m, pos[m]))
    return where


def _meets(was: list[int], head: int, end: int, length: int, p: int) -> bool:
    """Whether the waits pass run from ``head`` over ``length`` positions may stop at its quiet position
    ``p``: past the change (``end``), quiet in the current order's pass too (``was``), and not where the
    stretch it ran over was cut short (its last segment may go on)."""
    at = bisect.bisect_left(was, p + head)
    return p + head >= end and p < length and at < len(was) and was[at] == p + head


class BucketingRef:
    """A candidate's :class:`Bucketing`, made when first needed (most candidates are never refined): made
    already (``value``), or to be made from another candidate's (``parent``: None, from the base) with the
    blocks ``groups``."""

    __slots__ = ("value", "parent", "base", "groups", "ahead", "held")

    def __init__(self, value: Bucketing | None, parent: BucketingRef | None, base: list[int], groups: tuple,
                 ahead: int, held: frozenset) -> None:
        self.value, self.parent, self.base, self.groups, self.ahead, self.held = \
            value, parent, base, groups, ahead, held

    def made(self, form: GraphForm, compiled, placed: Placement, known: dict | None = None) -> Bucketing:
        """The :class:`Bucketing`, made (and its parents, oldest first) where not yet."""
        chain: list[BucketingRef] = []
        ref: BucketingRef | None = self
        while ref is not None and ref.value is None:
            chain.append(ref)
            ref = ref.parent
        for ref in reversed(chain):
            parent = ref.parent.value if ref.parent is not None else None
            value = spliced(parent, form, compiled, placed, ref.groups, known) if parent is not None else None
            ref.value = value if value is not None else full(form, compiled, placed, ref.base, ref.groups,
                                                             ref.ahead, ref.held, known)
            ref.parent = None  # made: its parents may go
        assert self.value is not None
        return self.value
