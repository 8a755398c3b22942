"""Orders used by tests and examples: a graph's nodes scheduled latest first."""

from __future__ import annotations

import heapq

import torch
import torch.fx



def latest_first(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A valid reordering of ``graph``: placeholders first as they were, then always the
    ready node that came latest in the original order (a "reverse-ish" topological order)."""
    from dcsched.graph.nxview import to_fx, to_networkx

    view = to_networkx(graph)
    position = {name: data["position"] for name, data in view.nodes(data=True)}
    placeholders = [n for n in sorted(view.nodes, key=position.__getitem__) if view.nodes[n]["role"] == "placeholder"]
    waiting = {name: view.in_degree(name) for name in view.nodes}
    for name in placeholders:
        for succ in view.succ[name]:
            waiting[succ] -= 1
    ready = [(-position[n], n) for n in view.nodes if waiting[n] == 0 and n not in set(placeholders)]
    heapq.heapify(ready)
    order = list(placeholders)
    while ready:
        _, name = heapq.heappop(ready)
        order.append(name)
        for succ in view.succ[name]:
            waiting[succ] -= 1
            if waiting[succ] == 0:
                heapq.heappush(ready, (-position[succ], succ))
    return to_fx(graph, order)
