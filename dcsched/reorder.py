"""``dcsched.schedule``: reorder an FX graph with a named scheduler.

>>> import torch, torch.fx
>>> g = torch.fx.Graph()
>>> x = g.placeholder("x")
>>> _ = g.output((x,))
>>> [n.name for n in schedule(g, "none").nodes]
['x', 'output']
"""

from __future__ import annotations

import torch.fx

from . import schedulers
from .nxview import check_order, to_fx, to_networkx
from .graphform import paused_gc


def order(graph: torch.fx.Graph, algo: str = "fast-free", **options) -> list[str]:
    """The node names of ``graph`` in the order scheduler ``algo`` picks (checked topological)."""
    with paused_gc():
        view = to_networkx(graph)
        names = schedulers.get(algo)(view, **options)
        check_order(view, names)
    return names


def schedule(graph: torch.fx.Graph, algo: str = "fast-free", **options) -> torch.fx.Graph:
    """A new FX graph with ``graph``'s nodes in the order scheduler ``algo`` picks.

    Works on any FX graph with dcsched's or DeepSpeed's ``dc`` ZeRO-3 ops; node
    costs come from ``node.meta['device_time']`` (ms) and ``['tensor_size']``
    (bytes). Options are the scheduler's keyword arguments, e.g.
    ``memory_budget`` in bytes for the algorithms that take one.
    """
    names = order(graph, algo, **options)
    with paused_gc():
        return to_fx(graph, names)
