"""``overlap``'s third skeleton: fast-free's order with side branches moved to where their result is used."""

from __future__ import annotations

from dcsched.graph.form import ALLGATHER, COMPUTE, RELEASE, REDUCE, WAIT, output_last_indices
from dcsched.sim.simulate import CompiledGraph


def sink_readers(compiled: CompiledGraph, order: list[int]) -> list[int]:
    """``order`` with side branches that read a gathered parameter moved to just before their result's first use.

    A reader of a gathered parameter whose next such reader in ``order`` is
    not its descendant sits on a side branch (a skip convolution's backward
    between two layers of the main path). Where two large parameters fill
    the budget, its own parameter would have to be gathered there too;
    moved to where its result is first used, it runs after them. The
    zero-cost nodes hanging off it (getitems, its release, its gradient's
    reduce) move with it. With no side branch this returns ``order``.
    """
    kind, dur, succs, gates = compiled.kind, compiled.duration, compiled.succs, compiled.gates
    n = len(order)
    position = [0] * len(compiled.names)
    for i, v in enumerate(order):
        position[v] = i
    readers = [v for v in order if kind[v] == COMPUTE and dur[v] > 0 and any(kind[g] == ALLGATHER for g in gates[v])]
    # Moved nodes, by the position they go before: (position of their branch's reader, rank, node).
    moved: dict[int, list[tuple[int, int, int]]] = {}
    moved_from = {}
    for v, nxt in zip(readers, readers[1:]):
        if _descends(succs, position, v, nxt):
            continue
        group = [v]
        members = {v}
        start = position[v]
        for q in range(start + 1, n):
            u = order[q]
            if _follows(compiled, u, members):
                group.append(u)
                members.add(u)
            elif q > start + 4 * len(group) + 8:
                break  # followers sit right after their node in fast-free's order
        target = min((position[u] for w in group for u in succs[w] if u not in members), default=n)
        if target <= start + len(group):
            continue
        for rank, w in enumerate(group):
            # (a node moved twice keeps its last place, as a later key overwrites an earlier one)
            moved_from[w] = (target, start, rank)
    if not moved_from:
        return list(order)
    for w, (target, start, rank) in moved_from.items():
        moved.setdefault(target, []).append((start, rank, w))
    result: list[int] = []
    for i, v in enumerate(order):
        if i in moved:
            result.extend(w for _, _, w in sorted(moved[i]))
        if v not in moved_from:
            result.append(v)
    if n in moved:
        result.extend(w for _, _, w in sorted(moved[n]))
    # A branch whose result nothing reads goes to the end, but before the output (the code returns there).
    return output_last_indices(kind, result)


def _descends(succs: list, position: list[int], v: int, nxt: int) -> bool:
    """Whether ``nxt`` is a descendant of ``v`` (a walk bounded by ``nxt``'s position)."""
    seen, stack = {v}, [v]
    bound = position[nxt]
    while stack:
        for u in succs[stack.pop()]:
            if u == nxt:
                return True
            if u not in seen and position[u] < bound:
                seen.add(u)
                stack.append(u)
    return False


def _follows(compiled: CompiledGraph, u: int, members: set[int]) -> bool:
    """Whether ``u`` is a zero-cost node (a release, a reduce, a getitem or view) hanging off ``members``:
    every input other than an all-gather or wait is a member, and there is one."""
    kind = compiled.kind
    if not (kind[u] in (RELEASE, REDUCE) or (kind[u] == COMPUTE and not compiled.duration[u])):
        return False
    inputs = [p for p in compiled.preds[u] if kind[p] not in (ALLGATHER, WAIT)]
    return bool(inputs) and all(p in members for p in inputs)
