"""Waits before the all-gathers issued right before them: the same step, less memory.

Where an order issues an all-gather and then, with no compute between,
waits on a collective issued earlier, the new all-gather's buffers are alive
through that wait for nothing. The collectives run one after another in issue
order (one communication stream; one gloo process group), so the new one
could not start before the earlier one ends, which is when the wait returns:
issuing it just after the wait starts it no later. The memory is not the
same: a bucket's wait is where its flat output and its members' own buffers
are both alive (the copy-out), and the new bucket's buffers beside them made
that moment the backward's peak on the 2-rank GPT. FSDP2 orders them this way:
a block's prefetch is issued once the block's own unshard has waited.

:func:`waits_first` is that pass over a bucketed order; the planners' bucketed
orders (:func:`dcsched.schedulers.fsdp.scheduler.bucketed`) run it.
"""

from __future__ import annotations

import itertools
import re
import weakref
from typing import Callable, Sequence

from dcsched.graph.form import ALLGATHER, WAIT, GraphForm


def waits_first(form: GraphForm, order: Sequence[int], buckets: Sequence[Sequence[int]] = ()) -> list[int]:
    """``order`` with each wait moved before the all-gathers just before it that were issued after its own.

    Only a run of all-gathers directly before the wait is passed (no other
    node: a compute node between would make the move cost time), and only
    those issued after the wait's collective (a bucket is issued at its first
    member, so a wait never passes its own bucket's members). The waits keep
    their order among themselves, and so do the all-gathers: the collectives
    are issued in the same order, so they run as before.

    Parameters
    ----------
    form : GraphForm
        The graph.
    order : sequence of int
        A topological order (node numbers).
    buckets : sequence of sequences of int, optional
        The all-gather buckets (node numbers; others ignored), each one's members standing one after another
        in ``order`` (as :func:`~dcsched.schedulers.fsdp.scheduler.bucketed` places them): issued as one, where the
        first member stands.

    Returns
    -------
    list of int
        The order, still topological, with the same nodes.

    Examples
    --------
    >>> from dcsched.synthetic import layered_stack
    >>> form = GraphForm(layered_stack(2).forward)
    >>> gathers = [v for v in form.topo if form.kind[v] == ALLGATHER]
    >>> first, second = gathers[:2]
    >>> wait = next(w for w in form.succs[first] if form.kind[w] == WAIT)
    >>> order = [v for v in form.topo if v not in (second, wait)]
    >>> at = order.index(first) + 1
    >>> order[at:at] = [second, wait]                    # the second issued, then the first waited on
    >>> moved = waits_first(form, order)
    >>> moved[moved.index(first):moved.index(first) + 3] == [first, wait, second]
    True
    """
    return waits_first_until(form, order, buckets)[0]


def waits_first_until(form: GraphForm, order: Sequence[int], buckets: Sequence[Sequence[int]] = (),
                      quiet: list[int] | None = None, stop: Callable[[int], bool] | None = None
                      ) -> tuple[list[int], int | None]:
    """:func:`waits_first` of ``order``, noting the positions where the pass is *quiet* (every all-gather
    before them placed: from there it runs as if it started there), and stopping at the first quiet
    position ``stop`` accepts.

    Parameters
    ----------
    form, order, buckets
        As :func:`waits_first`.
    quiet : list of int, optional
        Filled with the quiet positions (in ``order``), ascending: 0, where each segment of all-gathers and
        waits starts, where each stretch in it ends with nothing left to place, and where each segment ends
        (but before all-gathers). Each is a position the pass may restart at on an order that agrees with
        ``order`` up to it (and one past it), whatever follows.
    stop : callable, optional
        Called with each quiet position; where it returns True the pass stops there.

    Returns
    -------
    (list of int, int or None)
        The pass's order of ``order`` up to where it stopped (all of it where it did not), and that
        position (None: it did not stop).

    Examples
    --------
    >>> from dcsched.synthetic import layered_stack
    >>> form = GraphForm(layered_stack(2).forward)
    >>> quiet = []
    >>> whole, stopped = waits_first_until(form, list(form.topo), quiet=quiet)
    >>> stopped is None and whole == waits_first(form, list(form.topo)) and quiet[0] == 0
    True
    >>> head, at = waits_first_until(form, list(form.topo), stop=lambda p: p >= quiet[-1])
    >>> head == whole[:at]
    True
    """
    kind = form.kind
    quiet = [] if quiet is None else quiet
    kinds = bytes(map(kind.__getitem__, order))
    quiet.append(0)
    if stop is not None and stop(0):
        return [], 0
    segments = list(_SEGMENT.finditer(kinds))  # C speed: most of an order is never looked at in Python
    if not segments:
        return list(order), None
    own_gather = _own_gathers(form)
    bucket_of: dict[int, int] = {}  # each bucket member's bucket, made where a wait first needs it
    result: list[int] = []
    done = 0
    for segment in segments:
        start, end = segment.span()
        result.extend(order[done:start])
        if start:
            quiet.append(start)
            if stop is not None and stop(start):
                return result, start
        # The all-gathers directly before the node being placed, in issue order: run[head:], each one's
        # place in run kept, so a wait on the run's k-th costs O(1) plus what it places (a fan-in's run of
        # N all-gathers and its N waits cost O(N^2) with list lookups and deletions).
        run: list[int] = []
        place: dict[int, int] = {}
        head = 0
        for stretch in _STRETCH.finditer(kinds, start, end):
            gathers = order[stretch.start(1):stretch.end(1)]  # a run of all-gathers, in one step
            place.update(zip(gathers, range(len(run), len(run) + len(gathers))))
            run.extend(gathers)
            waits = order[stretch.start(2):stretch.end(2)]  # then the waits after it, one by one
            owns = list(map(own_gather.__getitem__, waits))
            # (each wait's own all-gather's place in run, at C speed: run grows only before the waits)
            for v, own, at in zip(waits, owns, map(place.get, owns, itertools.repeat(-1))):
                if own < 0:  # no collective of its own to wait for: it stays
                    keep = len(run)
                elif at < head:  # issued before every all-gather of the run still to be placed: nothing to place
                    result.append(v)
                    continue
                else:  # issued in this run: the all-gathers of its own bucket stay before it
                    keep = _past_bucket(own, at, run, buckets, bucket_of)
                result.extend(run[head:keep])
                result.append(v)
                head = keep
            if head == len(run) and stretch.end(2) < end:  # nothing left to place: quiet
                quiet.append(stretch.end(2))
                if stop is not None and stop(stretch.end(2)):
                    return result, stretch.end(2)
        result.extend(run[head:])
        done = end
        # quiet once its run is placed; but where all-gathers follow, whether the segment ends here can
        # depend on nodes far ahead (their waits), so the position is no place to restart an order that
        # differs there: left out
        if end == len(kinds) or kinds[end] != ALLGATHER:
            quiet.append(end)
            if stop is not None and stop(end):
                return result, end
    result.extend(order[done:])
    return result, None


def _past_bucket(own: int, at: int, run: list[int], buckets: Sequence[Sequence[int]],
                 bucket_of: dict[int, int]) -> int:
    """Where in ``run`` a wait on ``own`` (``run[at]``) goes: after the all-gathers issued up to its own
    collective (its bucket whole), before those issued after it (``bucket_of`` filled on first need)."""
    if not bucket_of and buckets:
        bucket_of.update(zip(itertools.chain.from_iterable(buckets),
                             itertools.chain.from_iterable(itertools.repeat(k, len(b)) for k, b in enumerate(buckets))))
    keep = at + 1
    bucket = bucket_of.get(own)
    while bucket is not None and keep < len(run) and bucket_of.get(run[keep]) == bucket:
        keep += 1
    return keep


def _own_gathers(form: GraphForm) -> list[int]:
    """Per node, the all-gather among its inputs (the first), -1 where it has none (computed once a form)."""
    found = _OWN_GATHERS.get(form)
    if found is None:
        kind = form.kind
        found = [next((p for p in preds if kind[p] == ALLGATHER), -1) for preds in form.preds]
        _OWN_GATHERS[form] = found
    return found


#: A stretch of an order where the pass may move something: runs of all-gathers each followed by waits.
_SEGMENT = re.compile(b"(?:" + re.escape(bytes([ALLGATHER])) + b"+" + re.escape(bytes([WAIT])) + b"+)+")
#: Within a segment: a run of all-gathers (group 1), then the waits after it (group 2).
_STRETCH = re.compile(b"(" + re.escape(bytes([ALLGATHER])) + b"+)(" + re.escape(bytes([WAIT])) + b"+)")
#: :func:`_own_gathers` per form.
_OWN_GATHERS: "weakref.WeakKeyDictionary[GraphForm, list[int]]" = weakref.WeakKeyDictionary()
