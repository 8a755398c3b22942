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

from dcsched import schedulers
from dcsched.graph.form import GraphForm, paused_gc
from dcsched.graph.nxview import check_order, to_fx, to_networkx


def order(graph: torch.fx.Graph, algo: str = "fast-free", **options) -> list[str]:
    """The node names of ``graph`` in the order scheduler ``algo`` picks (checked topological).

    A scheduler that takes the graph form gets it straight from the FX graph
    (no networkx view: at 10^5 nodes the view costs more than the order).
    """
    scheduler = schedulers.get(algo)
    with paused_gc():
        if scheduler.takes_form:
            form = GraphForm(graph)
            names = scheduler(form, **options)
            form.check_order(names)
        else:
            view = to_networkx(graph)
            names = scheduler(view, **options)
            check_order(view, names)
    return names


def schedule(graph: torch.fx.Graph, algo: str = "fast-free", **options) -> torch.fx.Graph:
    """A new FX graph with ``graph``'s nodes in the order scheduler ``algo`` picks.

    Works on any FX graph with dcsched's or DeepSpeed's ``dc`` ZeRO-3 ops; node
    costs come from ``node.meta['device_time']`` (ms) and ``['tensor_size']``
    (bytes). Options are the scheduler's keyword arguments, e.g.
    ``memory_budget`` in bytes for the algorithms that take one.
    """
    # One pause for the whole call: each time the collector comes back on, its first collections traverse
    # every object of the large graphs in memory.
    with paused_gc():
        return to_fx(graph, order(graph, algo, **options))
