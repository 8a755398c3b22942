"""Step 1 of ``overlap``: the skeleton of a base compute order and each all-gather's window on it.

Pure functions of the simulator's form of a graph (:class:`~dcsched.sim.simulate.CompiledGraph`) and a base
order; :class:`~dcsched.schedulers.overlap.planner.OverlapPlanner` builds one skeleton per base order and
places the all-gathers on it. The skeleton is the base order without the movable all-gathers and their
waits; positions on it are *slots* (slot ``j`` is just before the ``j``-th skeleton node, slot
``len(skeleton)`` is the end). The rules and why they keep the simulator's bookkeeping are in
``docs/overlap.md``.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

from dcsched.graph.form import ALLGATHER, COMPUTE, REDUCE, WAIT
from dcsched.sim.simulate import CompiledGraph


class MovableParts(NamedTuple):
    """What step 1 takes from the graph alone, the same for every base order.

    ``is_gather`` per node; ``wait_of``: each movable all-gather's waits
    (node order); ``keep``: the skeleton's nodes; ``may_move``: the skeleton
    nodes that move up to right after their last input; ``readers_of``: each
    movable all-gather's readers in the skeleton (its own and its waits').
    """

    is_gather: list[bool]
    wait_of: dict[int, list[int]]
    keep: bytearray
    may_move: bytearray
    readers_of: dict[int, list[int]]


class GatherWindows(NamedTuple):
    """Each movable all-gather's window on one skeleton, all-gathers in need order.

    ``gathers``; ``need`` (its first reader's slot); ``lo`` (the earliest slot
    its inputs and its parameter's other all-gathers and releases allow);
    ``slot_of`` (skeleton node -> slot); ``wait_groups`` (slot -> the waits
    placed right before it) and ``wait_slots`` (those slots, sorted);
    ``next_comm`` (from each slot, the next slot holding a communication node).
    """

    gathers: list[int]
    need: list[int]
    lo: list[int]
    slot_of: dict[int, int]
    wait_groups: dict[int, list[int]]
    wait_slots: list[int]
    next_comm: list[int]


def movable_parts(c: CompiledGraph) -> MovableParts:
    """The movable all-gathers and waits of ``c``, and the skeleton nodes that may move up.

    Movable: an all-gather that reads no communication node, and the waits
    that read it (and no other gather or wait) and have readers. Anything
    else (ZeRO-3 ops wired unusually, a wait nobody reads) stays in the
    skeleton where the base order has it. ``may_move``: the reduces and
    releases, and the free views between a gradient and its reduce (a
    weight gradient's transpose).
    """
    kind, preds, succs = c.kind, c.preds, c.succs
    n = len(kind)
    is_gather = [k == ALLGATHER for k in kind]
    wait_of: dict[int, list[int]] = {
        v: [] for v in itertools.compress(range(n), is_gather)
        if not any(kind[p] in (ALLGATHER, WAIT) for p in preds[v])}
    keep = bytearray([1]) * n
    for v in wait_of:
        keep[v] = 0
    for v in itertools.compress(range(n), [k == WAIT for k in kind]):
        if not succs[v]:
            continue
        owners = [p for p in preds[v] if kind[p] in (ALLGATHER, WAIT)]
        if len(owners) == 1 and owners[0] in wait_of and not any(kind[s] == ALLGATHER for s in succs[v]):
            wait_of[owners[0]].append(v)
            keep[v] = 0
    # A view is on the way to a reduce when every reader is a reduce or such a view. Readers come
    # later in the input order (the planner checks it is topological), so one backward pass decides.
    may_move = bytearray(c.reduce_or_release)
    on_way = bytearray(n)
    root, duration = c.root, c.duration
    for v in reversed(range(n)):
        if keep[v] and kind[v] == COMPUTE and root[v] != v and not duration[v] and succs[v] \
                and all(kind[s] == REDUCE or on_way[s] for s in succs[v]):
            on_way[v] = may_move[v] = 1
    readers_of = {g: [r for r in succs[g] if keep[r]] + [r for w in waits for r in succs[w]]
                  for g, waits in wait_of.items()}
    return MovableParts(is_gather, wait_of, keep, may_move, readers_of)


def build_skeleton(c: CompiledGraph, parts: MovableParts, base: list[int]) -> tuple[list[int], dict[int, list[int]]]:
    """``(skeleton, wait_of)``: ``base`` without the movable nodes, the reduces, releases and views on the
    way to a reduce moved up to right after their last input; and each movable all-gather's waits in
    ``base``'s order."""
    preds = c.preds
    wait_of, keep, may_move = parts.wait_of, parts.keep, parts.may_move
    if any(len(waits) > 1 for waits in wait_of.values()):  # several waits: in base order
        position = {v: i for i, v in enumerate(base)}
        wait_of = {g: sorted(waits, key=position.__getitem__) if len(waits) > 1 else waits
                   for g, waits in wait_of.items()}
    skeleton = list(itertools.compress(base, map(keep.__getitem__, base)))
    # The sort key of a moved node extends its latest input's key (when every input is a skeleton
    # node). The free views between a gradient and its reduce move too, or the reduce would wait for
    # wherever the base order put them.
    m = len(skeleton)
    slot = dict(zip(skeleton, range(m)))
    key: dict[int, tuple] = {}  # of the moved nodes; a node that stays at slot j sorts as (j, 0, 0)
    counter = 0
    for i in itertools.compress(range(m), map(may_move.__getitem__, skeleton)):
        ins = preds[skeleton[i]]
        if ins and all(slot.get(p, m) < i for p in ins):  # every input an earlier skeleton node
            counter += 1
            key[skeleton[i]] = max(key.get(p) or (slot[p], 0, 0) for p in ins) + (1, counter)
    if key:
        keys = dict(zip(skeleton, zip(range(m), itertools.repeat(0), itertools.repeat(0))))
        keys.update(key)
        skeleton.sort(key=keys.__getitem__)
    return skeleton, wait_of


def gather_windows(c: CompiledGraph, parts: MovableParts, skeleton: list[int], wait_of: dict[int, list[int]],
                   base: list[int]) -> GatherWindows:
    """Each movable all-gather's need slot and earliest slot on ``skeleton`` (before the frees of
    just-in-time gathering narrow ``lo`` further), sorted by need, then by place in ``base``."""
    preds, succs, ds_id = c.preds, c.succs, c.ds_id
    m = len(skeleton)
    slot_of = dict(zip(skeleton, range(m)))
    is_gather = parts.is_gather
    base_pos = {base[i]: i for i in itertools.compress(range(len(base)), map(is_gather.__getitem__, base))}
    # Skeleton nodes that count in the simulator's release bookkeeping, per parameter.
    marks: dict = {}
    for j in itertools.compress(range(m), map(c.gather_or_release.__getitem__, skeleton)):
        marks.setdefault(ds_id[skeleton[j]], []).append(j)

    entries = []
    slot = slot_of.__getitem__
    readers_of = parts.readers_of
    for g in wait_of:
        readers = readers_of[g]
        lo = max(map(slot, preds[g])) + 1 if preds[g] else 0
        # Read by nobody at all: it stays at the skeleton node that followed it in the base.
        need = min(map(slot, readers)) if readers else max(lo, next(
            (slot_of[v] for v in base[base_pos[g]:] if v in slot_of), m))
        # Never cross a release or all-gather of the same parameter: the buffer is freed at
        # the n-th release after its all-gather, so that count must not change.
        before = [j for j in marks.get(ds_id[g], ()) if j < need]
        if before:
            lo = max(lo, before[-1] + 1)
        entries.append((need, base_pos[g], g, min(lo, need)))
    entries.sort()
    gathers = [g for _, _, g, _ in entries]
    # Waits: right before their own first reader (slot -> its waits).
    wait_groups: dict[int, list[int]] = {}
    for g in gathers:
        for w in wait_of[g]:
            wait_groups.setdefault(min(map(slot, succs[w])), []).append(w)
    # The next skeleton slot holding a communication node, from each slot on.
    next_comm: list[int] = []
    prev = 0
    for j in itertools.compress(range(m), map(c.is_comm.__getitem__, skeleton)):
        next_comm.extend([j] * (j + 1 - prev))
        prev = j + 1
    next_comm.extend([m] * (m + 1 - prev))
    return GatherWindows(gathers, [e[0] for e in entries], [e[3] for e in entries], slot_of, wait_groups,
                         sorted(wait_groups), next_comm)
