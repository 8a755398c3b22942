"""``overlap``'s third skeleton: fast-free's order with side branches moved to where their result is used."""

from __future__ import annotations

from ..graphform import ALLGATHER, COMPUTE, RELEASE, REDUCE, WAIT
from ..simulate import CompiledGraph


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
    position = {v: i for i, v in enumerate(order)}
    readers = [v for v in order if kind[v] == COMPUTE and dur[v] > 0 and any(kind[g] == ALLGATHER for g in gates[v])]
    key = {v: (i, 1) for i, v in enumerate(order)}
    for v, nxt in zip(readers, readers[1:]):
        # Is nxt a descendant of v? (a walk bounded by nxt's position)
        seen, stack, found = {v}, [v], False
        while stack and not found:
            for u in succs[stack.pop()]:
                if u == nxt:
                    found = True
                    break
                if u not in seen and position[u] < position[nxt]:
                    seen.add(u)
                    stack.append(u)
        if found:
            continue
        group = [v]
        members = {v}
        for u in order[position[v] + 1:]:
            if _follows(compiled, u, members):
                group.append(u)
                members.add(u)
            elif position[u] > position[v] + 4 * len(group) + 8:
                break  # followers sit right after their node in fast-free's order
        target = min((position[u] for w in group for u in succs[w] if u not in members), default=len(order))
        if target <= position[v] + len(group):
            continue
        for rank, w in enumerate(group):
            key[w] = (target, 0, position[v], rank)
    return sorted(order, key=key.__getitem__)


def _follows(compiled: CompiledGraph, u: int, members: set[int]) -> bool:
    """Whether ``u`` is a zero-cost node (a release, a reduce, a getitem or view) hanging off ``members``:
    every input other than an all-gather or wait is a member, and there is one."""
    kind = compiled.kind
    if not (kind[u] in (RELEASE, REDUCE) or (kind[u] == COMPUTE and not compiled.duration[u])):
        return False
    inputs = [p for p in compiled.preds[u] if kind[p] not in (ALLGATHER, WAIT)]
    return bool(inputs) and all(p in members for p in inputs)
