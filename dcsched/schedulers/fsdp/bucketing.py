"""An order with its blocks made buckets: :func:`bucketed`, in two parts a planner can redo locally.

:func:`landings` says where each block's members land (all-gathers before a
base position, reduces after one) and which members move; :func:`emit` lays
the base order out with them, a stretch of base positions at a time. A
planner that buckets one order many ways with a few blocks changed each time
(:mod:`dcsched.schedulers.overlap_plan.splice`) lays out only the stretch the
changed blocks touch and keeps the rest of the order it had.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

from dcsched.graph.form import GraphForm, output_last_indices
from dcsched.schedulers.fsdp.waits_first import waits_first

#: The key under which :func:`landings`' ``known`` counts the node numbers it holds (its owner may empty it).
KNOWN_SIZE = _SIZE = "size"
#: :func:`placement`'s figures of an order: per node its position, its last predecessor's, its first successor's.
Placement = tuple[list[int], list[int], list[int]]


@dataclasses.dataclass
class Landings:
    """Where :func:`bucketed` puts each block's members in its base order.

    ``before[p]``: the all-gathers issued right before the node at base
    position ``p``; ``after[p]``: the reduces issued right after it;
    ``land``: each moved member's landing position (a member that cannot move
    is in none); ``buckets``: every block's bucket, all-gather blocks first,
    in block order (one member or none included).
    """

    before: dict[int, list[int]]
    after: dict[int, list[int]]
    land: dict[int, int]
    buckets: list[list[int]]


def placement(form: GraphForm, order: Sequence[int]) -> Placement:
    """Per node, its position in ``order``, its last predecessor's and its first successor's (-1 and
    ``len(order)`` where it has none): what :func:`bucketed` reads of ``order``, computed once for an order
    bucketed many ways.

    >>> from dcsched.synthetic import layered_stack
    >>> form = GraphForm(layered_stack(1).forward)
    >>> pos, last_pred, first_succ = placement(form, list(form.topo))
    >>> first = form.topo[0]
    >>> pos[first], last_pred[first], first_succ[first] == min(pos[s] for s in form.succs[first])
    (0, -1, True)
    """
    pos = [0] * len(form.kind)
    for p, v in enumerate(order):
        pos[v] = p
    end = len(order)
    last_pred = [max((pos[p] for p in preds), default=-1) for preds in form.preds]
    first_succ = [min((pos[s] for s in succs), default=end) for succs in form.succs]
    return pos, last_pred, first_succ


def landings(order: Sequence[int], gathers: Sequence[Sequence[int]], reduces: Sequence[Sequence[int]],
             ahead: int, placed: Placement, known: dict | None = None) -> Landings:
    """Where :func:`bucketed` lands each block's members in ``order`` (``placed``: its :func:`placement`).

    ``known``: what earlier calls on the same order found per block, kept there and given back as the same
    lists (a planner buckets one order many ways with most blocks the same; the same list shows a bucket
    unchanged at a glance). Nothing else may change those lists.

    >>> found = landings([0, 1, 2, 3], [[1, 3]], [], 0, ([0, 1, 2, 3], [-1, -1, -1, -1], [4, 4, 4, 4]))
    >>> found.before, found.land, found.buckets
    ({1: [1, 3]}, {1: 1, 3: 1}, [[1, 3]])
    """
    pos, last_pred, first_succ = placed
    known = {} if known is None else known
    found = Landings({}, {}, {}, [])
    firsts = []
    for group in gathers:
        key = ("first", tuple(group))
        if key not in known:
            known[key] = min(map(pos.__getitem__, group)) if group else -1
            known[_SIZE] = known.get(_SIZE, 0) + len(group)
        firsts.append(known[key])
    for k, group in enumerate(gathers):
        if not group:
            continue
        at = min(firsts[max(0, k - ahead)], firsts[k])
        gkey: tuple = ("gather", tuple(group), at)
        members = known.get(gkey)
        if members is None:
            members = known[gkey] = sorted([m for m in group if last_pred[m] < at], key=pos.__getitem__)
            known[_SIZE] = known.get(_SIZE, 0) + 2 * len(group)
        found.before.setdefault(at, []).extend(members)
        found.land.update(zip(members, itertools.repeat(at)))
        found.buckets.append(members)
    for group in reduces:
        if not group:
            continue
        key = ("reduce", tuple(group))
        if key not in known:
            at = max(map(pos.__getitem__, group))
            members = sorted([m for m in group if first_succ[m] > at], key=pos.__getitem__)
            later = [m for m in members if pos[m] != at]
            # as it runs: the last gradient's reduce, then those moved after it
            known[key] = (at, later, [order[at]] + later)
            known[_SIZE] = known.get(_SIZE, 0) + 3 * len(group)
        at, later, bucket = known[key]
        found.after.setdefault(at, []).extend(later)
        found.land.update(zip(later, itertools.repeat(at)))
        found.buckets.append(bucket)
    return found


def emit(order: Sequence[int], found: Landings, lo: int = 0, hi: int | None = None) -> list[int]:
    """The base positions ``lo`` to ``hi`` (inclusive; default: all) of ``order`` laid out with ``found``: each
    moved member at its landing, the rest where they stand.

    >>> emit([0, 1, 2, 3], Landings({1: [1, 3]}, {}, {1: 1, 3: 1}, [[1, 3]]))
    [0, 1, 3, 2]
    """
    hi = len(order) - 1 if hi is None else hi
    before, after = found.before, found.after
    result: list[int] = []
    gone = found.land.__contains__
    done = lo  # up to here placed: between the positions where something lands, copied less what moved
    for p in sorted(p for p in before.keys() | after.keys() if lo <= p <= hi):
        result.extend(itertools.filterfalse(gone, order[done:p]))
        result.extend(before.get(p, ()))
        if order[p] not in found.land:
            result.append(order[p])
        result.extend(after.get(p, ()))
        done = p + 1
    result.extend(itertools.filterfalse(gone, order[done:hi + 1]))
    return result


def bucketed(form: GraphForm, order: Sequence[int], gathers: Sequence[Sequence[int]],
             reduces: Sequence[Sequence[int]], *, ahead: int = 0, placed: Placement | None = None
             ) -> tuple[list[int], list[list[int]]]:
    """``order`` with each block of ``gathers`` and of ``reduces`` made one bucket.

    A block's all-gathers move to where the block ``ahead`` blocks before it
    (in ``gathers``' order, the order they are needed) has its first
    all-gather in ``order``, or its own first where that is earlier: ``ahead``
    0 issues each bucket when its first parameter would have been gathered,
    1 when the block before is (FSDP2's prefetch). A block's reduces move to
    where its last one stands (every gradient of the block is ready there).
    A wait then goes before the buckets issued right before it
    (:func:`~dcsched.schedulers.waits_first.waits_first`: the same step, less
    memory), so a prefetch is issued once the block before has waited, as
    FSDP2 issues it. A member that cannot move (an all-gather whose input
    has not run by then, a reduce read before the last one: neither occurs
    in DeepCompile graphs) stays alone.

    Parameters
    ----------
    form : GraphForm
        The graph.
    order : sequence of int
        A topological order (node numbers).
    gathers, reduces : sequence of sequences of int
        The blocks (node numbers).
    ahead : int, optional
        How many blocks ahead a bucket of all-gathers is issued (default 0).
    placed : Placement, optional
        :func:`placement` of ``order`` (computed here where not given).

    Returns
    -------
    (list of int, list of list of int)
        The order (output last) and the buckets of two or more members, each in its order.

    Examples
    --------
    >>> from dcsched.graph.form import ALLGATHER
    >>> from dcsched.synthetic import layered_stack
    >>> form = GraphForm(layered_stack(2).forward)
    >>> gathers = [[i for i in form.topo if form.kind[i] == ALLGATHER]]
    >>> order, buckets = bucketed(form, list(form.topo), gathers, [])
    >>> form.check_order(form.order_names(order)); len(buckets), len(buckets[0]) == len(gathers[0])
    (1, True)
    """
    found = landings(order, gathers, reduces, ahead, placement(form, order) if placed is None else placed)
    buckets = [b for b in found.buckets if len(b) > 1]
    return output_last_indices(form.kind, waits_first(form, emit(order, found), buckets)), buckets
