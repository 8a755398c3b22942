"""``fsdp``: FSDP2's policy, one all-gather bucket per transformer block, prefetched one block ahead.

PyTorch FSDP2 wraps each transformer block as one unit: its parameters are
gathered by one collective before the block runs, the next block's gather is
issued when a block starts (prefetch one block ahead), and in the backward the
block's gradients are reduced by one collective once the block's backward is
done. This module gives that policy as a :class:`~dcsched.plan.Plan`
with buckets.

**Finding the blocks.** A :class:`~dcsched.graph.form.GraphForm` knows each
parameter's ``ds_id`` and sizes, not its module name, so blocks are found from
the graph's structure (:func:`blocks`): the all-gathers are taken in the input
order (where DeepCompile puts each right before its first use, so this is the
order the parameters are needed) and their byte sizes searched for the
period ``p`` (2 to :data:`MAX_BLOCK_PARAMS`) at which most of the sizes
(at least :data:`PERIOD_MATCH`) repeat ``p`` places later: a stack of
identical blocks. The periodic stretch is cut into buckets of ``p``
all-gathers; what comes before it (embeddings) is one bucket, what is left
after it (final norm, head) another. With no period, buckets of about
``sqrt(n)`` consecutive all-gathers stand in for blocks. Gradient reduces
follow the blocks of the parameters they reduce (the backward's own
all-gather buckets, matched by ``ds_id``), so a block's gradients are one
reduce bucket; a graph without all-gathers groups them by sizes instead.

**The order.** The input order, with each all-gather bucket moved (its members
one after another) to where the previous bucket's first member stood: bucket
k+1 is issued when block k's parameters are first needed. The first two
buckets go before the first use. Waits stay where they are, so a block's
compute waits for its bucket. Each reduce bucket moves to where its last
member stood (every gradient of the block is ready there); the output comes
last. A member whose inputs would not have run at its bucket's place (none in
DeepCompile graphs) stays alone at its own place.

>>> from dcsched.synthetic import layered_stack
>>> from dcsched.graph.form import GraphForm
>>> form = GraphForm(layered_stack(2).forward)
>>> plan = fsdp(form)
>>> form.check_order(list(plan.order))
>>> len(plan.buckets) < sum(1 for k in form.kind if k == ALLGATHER)
True
"""

from __future__ import annotations

import math
from typing import Hashable, Sequence

from dcsched.graph.form import ALLGATHER, REDUCE, GraphForm, output_last_indices, paused_gc
from dcsched.plan import Bucket, Plan
from dcsched.schedulers.registry import register

#: The most parameters one block may hold (the longest period searched).
MAX_BLOCK_PARAMS = 64
#: The share of sizes that must repeat one period later for a period to count as the block length.
PERIOD_MATCH = 0.7


def blocks(keys: Sequence[Hashable]) -> list[tuple[int, int]]:
    """Cut a sequence of parameters (each by a key, e.g. its bytes) into blocks: ``(start, end)`` ranges.

    The period ``p`` in 2..:data:`MAX_BLOCK_PARAMS` (and at most half the
    sequence) at which the largest share of the keys, at least
    :data:`PERIOD_MATCH`, equal the key ``p`` places later (ties: the shortest)
    is the block length (a weight and bias pair repeats at 2, a block at its
    length, more often). The blocks start where the
    first run of repeats starts; what comes before is one block, the rest
    after the last whole block another. No period: blocks of ``ceil(sqrt(n))``.

    Parameters
    ----------
    keys : sequence of hashable
        One key per parameter, in the order they are needed.

    Returns
    -------
    list of (int, int)
        Consecutive ranges covering ``range(len(keys))``.

    Examples
    --------
    >>> blocks([9, 1, 2, 3, 1, 2, 3, 1, 2, 3, 7])  # embedding, three blocks of three, head
    [(0, 1), (1, 4), (4, 7), (7, 10), (10, 11)]
    >>> blocks([5, 6, 7, 8])  # no period: about sqrt(n) each
    [(0, 2), (2, 4)]
    >>> blocks([])
    []
    """
    n = len(keys)
    if n <= 1:
        return [(0, n)] if n else []
    period, best = 0, PERIOD_MATCH
    for p in range(2, min(MAX_BLOCK_PARAMS, n // 2) + 1):
        ratio = sum(1 for i in range(n - p) if keys[i] == keys[i + p]) / (n - p)
        if ratio > best or (ratio == best and not period):
            period, best = p, ratio
    if not period:
        step = math.ceil(math.sqrt(n))
        return [(s, min(s + step, n)) for s in range(0, n, step)]
    start = next(i for i in range(n - period) if keys[i] == keys[i + period])
    ranges = [(0, start)] if start else []
    s = start
    while s + period <= n:
        ranges.append((s, s + period))
        s += period
    if s < n:
        ranges.append((s, n))
    return ranges


def blocks_of(form: GraphForm, kind: int) -> list[list[int]]:
    """The nodes of ``kind`` in input order, cut into blocks by their byte sizes."""
    nodes = [i for i in form.topo if form.kind[i] == kind]
    size = form.size
    return [nodes[s:e] for s, e in blocks([size[i] for i in nodes])]


def reduce_blocks(form: GraphForm, gathers: list[list[int]]) -> list[list[int]]:
    """The reduces in input order, cut where the block of the parameter they reduce changes.

    A parameter's block is its all-gather bucket in this graph (the backward gathers again the parameters its
    compute reads); a reduce of a parameter the graph does not gather joins the block before it. A graph
    without all-gathers falls back to blocks by byte sizes, as the all-gathers are found.
    """
    if not gathers:
        return blocks_of(form, REDUCE)
    block_of = {form.ds_id[m]: k for k, group in enumerate(gathers) for m in group}
    groups: list[list[int]] = []
    current = None
    for r in (i for i in form.topo if form.kind[i] == REDUCE):
        block = block_of.get(form.ds_id[r])
        if not groups or (block is not None and block != current):
            groups.append([])
        if block is not None:
            current = block
        groups[-1].append(r)
    return groups


def fsdp_indices(form: GraphForm, *, ahead: int = 1) -> tuple[list[int], list[list[int]]]:
    """The order (node numbers, output last) and the buckets (node numbers, in order) of :func:`fsdp`;
    ``ahead``: how many blocks ahead each block's bucket is issued (FSDP2's is 1)."""
    gathers = blocks_of(form, ALLGATHER)
    return bucketed(form, list(form.topo), gathers, reduce_blocks(form, gathers), ahead=ahead)


def bucketed(form: GraphForm, order: Sequence[int], gathers: Sequence[Sequence[int]],
             reduces: Sequence[Sequence[int]], *, ahead: int = 0) -> tuple[list[int], list[list[int]]]:
    """``order`` with each block of ``gathers`` and of ``reduces`` made one bucket.

    A block's all-gathers move to where the block ``ahead`` blocks before it
    (in ``gathers``' order, the order they are needed) has its first
    all-gather in ``order``, or its own first where that is earlier: ``ahead``
    0 issues each bucket when its first parameter would have been gathered,
    1 when the block before is (FSDP2's prefetch). A block's reduces move to
    where its last one stands (every gradient of the block is ready there).
    A member that cannot move (an all-gather whose input has not run by then,
    a reduce read before the last one: neither occurs in DeepCompile graphs)
    stays alone.

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

    Returns
    -------
    (list of int, list of list of int)
        The order (output last) and the buckets of two or more members, each in its order.

    Examples
    --------
    >>> from dcsched.synthetic import layered_stack
    >>> form = GraphForm(layered_stack(2).forward)
    >>> gathers = [[i for i in form.topo if form.kind[i] == ALLGATHER]]
    >>> order, buckets = bucketed(form, list(form.topo), gathers, [])
    >>> form.check_order(form.order_names(order)); len(buckets), len(buckets[0]) == len(gathers[0])
    (1, True)
    """
    pos = [0] * len(form.kind)
    for p, v in enumerate(order):
        pos[v] = p
    preds, succs = form.preds, form.succs
    before: dict[int, list[int]] = {}  # base position -> all-gathers issued right before the node there
    after: dict[int, list[int]] = {}  # base position -> reduces issued right after the node there
    moved: set[int] = set()
    buckets: list[list[int]] = []
    firsts = [min(pos[m] for m in group) if group else -1 for group in gathers]
    for k, group in enumerate(gathers):
        if not group:
            continue
        at = min(firsts[max(0, k - ahead)], firsts[k])
        members = sorted((m for m in group if all(pos[p] < at for p in preds[m])), key=pos.__getitem__)
        before.setdefault(at, []).extend(members)
        moved.update(members)
        buckets.append(members)
    for group in reduces:
        if not group:
            continue
        at = max(pos[m] for m in group)
        members = sorted((m for m in group if all(pos[s] > at for s in succs[m])), key=pos.__getitem__)
        later = [m for m in members if pos[m] != at]
        after.setdefault(at, []).extend(later)
        moved.update(later)
        buckets.append([order[at]] + later)  # as it runs: the last gradient's reduce, then the ones moved after it
    result: list[int] = []
    extend, append = result.extend, result.append
    for p, v in enumerate(order):
        if p in before:
            extend(before[p])
        if v not in moved:
            append(v)
        if p in after:
            extend(after[p])
    return output_last_indices(form.kind, result), [b for b in buckets if len(b) > 1]


@register("fsdp", description="FSDP2's policy: one all-gather bucket per transformer block, prefetched one block "
                              "ahead; one reduce bucket per block in the backward")
def fsdp(form: GraphForm) -> Plan:
    """FSDP2's per-block buckets and one-block-ahead prefetch of ``form`` (module docstring).

    Parameters
    ----------
    form : GraphForm
        The graph.

    Returns
    -------
    Plan
        The order, and one bucket per block of two or more all-gathers (or reduces).

    Examples
    --------
    >>> from dcsched.synthetic import layered_stack
    >>> plan = fsdp(GraphForm(layered_stack(1).backward))
    >>> {b.kind for b in plan.buckets} == {"allgather", "reduce"}
    True
    """
    with paused_gc():
        order, buckets = fsdp_indices(form)
    names, ds_id, kind = form.names, form.ds_id, form.kind
    return Plan([names[v] for v in order],
                buckets=[Bucket("allgather" if kind[b[0]] == ALLGATHER else "reduce", [names[v] for v in b],
                                [ds_id[v] for v in b]) for b in buckets])
