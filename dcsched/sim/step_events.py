"""The training step's allocations and frees in order, for the caching-allocator simulation.

:func:`step_events` writes out, as ``("alloc", key, nbytes)`` / ``("free", key)`` events, what the
simulator's memory model (:meth:`dcsched.sim.memory.MemoryModel.memory_with_frees`) does over a whole step,
and replays two steps, so that the second starts with the segments the first left cached (the optimizer's
states are allocated in the first step's update, after its forward and backward, as ``torch.optim`` does
lazily):

1. before the first step: the parameter shards;
2. each step's forward, in its plan's order: at each position the storages that start there (a node's
   output, a bucket's members where its first member runs), then those freed after it; the batch and other
   non-parameter inputs at its start;
3. the backward likewise: its tangents at its start; a saved tensor is the forward's storage it lives in
   (aliases of one storage free it when the last is freed); what the backward leaves (its gradients) stays to
   the update, what the forward left unread (user outputs, parameters kept gathered) is freed at its end;
4. the update: in the first step the optimizer's states (``zeros_like`` per shard), then its temporaries
   (allocated together, freed together), then the gradients (``zero_grad(set_to_none=True)``).

Not in the events: buckets' flat buffers and gloo's staging copies (the step's figure counts them; the
allocator model adds what the events leave out of the peak, :func:`dcsched.sim.step_memory.step_memory`).
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

from dcsched.collective_issue import SIMULATOR, CollectiveIssue
from dcsched.graph.form import OUTPUT, PLACEHOLDER, REDUCE
from dcsched.sim.fused import HELD


def graph_events(compiled, plan, graph: str, *, issue: CollectiveIssue = SIMULATOR
                 ) -> tuple[list[tuple[str, int]], list[int]]:
    """One graph's storages in its plan's order: ``(["alloc"|"free", node number] ..., inputs)``: the events of
    the storages its nodes allocate (allocations at a position before its frees) and of the inputs it frees
    (the graph's outputs are not: they outlive it), and its resident input storages (allocated before it runs)."""
    from dcsched.sim.plans import plan_fused
    idx, fused = plan_fused(compiled, plan, graph, issue=issue, check=False)
    _, _, free = compiled.memory_with_frees(idx, fused=fused)
    position = {i: p for p, i in enumerate(idx)}
    lead = fused.lead if fused is not None else None
    allocs: list[list[int]] = [[] for _ in idx]
    frees: list[list[int]] = [[] for _ in idx]
    inputs = []
    for r in compiled.owners:
        if compiled.is_input[r]:
            inputs.append(r)
        elif lead is not None and lead[r] == HELD:
            continue  # kept gathered since an earlier graph: not allocated here
        else:
            at = compiled.part_of[r] if compiled.part_of[r] >= 0 else \
                (lead[r] if lead is not None and lead[r] >= 0 else r)
            allocs[position[at]].append(r)
        if free[r] >= 0 and compiled.kind[idx[free[r]]] != OUTPUT:  # the graph's outputs outlive it
            frees[free[r]].append(r)
    events: list[tuple[str, int]] = []
    for p in range(len(idx)):
        events += [("alloc", r) for r in allocs[p]] + [("free", r) for r in frees[p]]
    return events, inputs


class _Live:
    """The storages allocated and not yet freed, writing the events."""

    def __init__(self) -> None:
        self.keys: set = set()

    def alloc(self, key, nbytes: int) -> list[tuple[Any, ...]]:
        if nbytes <= 0:
            return []
        self.keys.add(key)
        return [("alloc", key, nbytes)]

    def free(self, key) -> list[tuple[Any, ...]]:
        if key not in self.keys:
            return []
        self.keys.discard(key)
        return [("free", key)]


def step_events(bundle, shards: list[int], states: list[int], temporaries: list[int], *,
                plans: Mapping, issue: CollectiveIssue = SIMULATOR, steps: int = 2) -> Iterator[tuple[Any, ...]]:
    """The allocations and frees of ``steps`` training steps of ``bundle`` run as ``plans`` say (see the module
    docstring); ``shards``, ``states``, ``temporaries``: the bytes of the parameter shards, the optimizer's
    states and its update's temporaries (:func:`dcsched.sim.step_memory.step_memory`'s)."""
    from dcsched.plan import Plan
    from dcsched.sim.collectives import latency_from_provenance
    from dcsched.sim.reuse import compiled

    latency = latency_from_provenance(bundle.provenance)
    forward = compiled(bundle.forward, comm_latency_ms=latency)
    forward_events, forward_inputs = graph_events(forward, plans.get("forward") or Plan(()), "forward", issue=issue)
    backward = compiled(bundle.backward, comm_latency_ms=latency) if bundle.backward is not None else None
    backward_events = _backward_events(bundle, backward, plans.get("backward") or Plan(()), issue) \
        if backward is not None else None
    yield from (("alloc", ("shard", k), s) for k, s in enumerate(shards) if s)
    for step in range(steps):
        live = _Live()
        for r in forward_inputs:
            yield from live.alloc(("f", step, r), forward.owned[r])
        for what, r in forward_events:
            yield from (live.alloc(("f", step, r), forward.owned[r]) if what == "alloc" else live.free(("f", step, r)))
        gradients: list = []
        if backward is not None and backward_events is not None:
            yield from _backward(backward, backward_events, step, live)
            gradients = sorted(k for k in live.keys if k[0] == "b" and backward.kind[k[2]] == REDUCE)
        for key in sorted(k for k in live.keys if k not in gradients):  # what the graphs left unread
            yield from live.free(key)
        if step == 0:
            yield from (("alloc", ("state", k), s) for k, s in enumerate(states) if s)
        yield from (("alloc", ("temporary", step, k), s) for k, s in enumerate(temporaries) if s)
        yield from (("free", ("temporary", step, k)) for k, s in enumerate(temporaries) if s)
        for key in gradients:
            yield from live.free(key)


def _backward_events(bundle, backward, plan, issue: CollectiveIssue
                     ) -> tuple[list[tuple[str, int]], list[int], dict[int, int]]:
    """The backward's storages in its plan's order (:func:`graph_events`: events, inputs) and the forward's storage
    each saved placeholder lives in (``{placeholder: forward root}``), the same every step."""
    from dcsched.sim.saved_storage import _saved_roots
    events, inputs = graph_events(backward, plan, "backward", issue=issue)
    groups = _saved_roots(bundle)[0]
    placeholders = [i for i, k in enumerate(backward.kind) if k == PLACEHOLDER]
    saved_in = {placeholders[k]: root for root, members in groups.items() for k in members if k < len(placeholders)}
    return events, inputs, saved_in


def _backward(backward, parts: tuple[list[tuple[str, int]], list[int], dict[int, int]], step: int, live: _Live
              ) -> Iterator[tuple[Any, ...]]:
    """The backward's events (``parts``: :func:`_backward_events`): its tangents at its start, then its plan's; a
    saved placeholder is the forward's storage it lives in, freed when the last alias of it is."""
    events, inputs, saved_in = parts
    readers: dict[int, int] = {}
    for root in saved_in.values():
        readers[root] = readers.get(root, 0) + 1
    for r in inputs:
        if r not in saved_in:  # a tangent (or an input the forward did not give): made at the backward's start
            yield from live.alloc(("b", step, r), backward.owned[r])
    for what, r in events:
        if what == "alloc":
            yield from live.alloc(("b", step, r), backward.owned[r])
        elif r in saved_in:
            readers[saved_in[r]] -= 1
            if readers[saved_in[r]] == 0:
                yield from live.free(("f", step, saved_in[r]))
        else:
            yield from live.free(("b", step, r))
