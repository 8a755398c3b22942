"""An integer-indexed, read-only form of the networkx view, for fast schedulers.

Schedulers that run many rounds over a graph of 10^5 nodes cannot afford
networkx lookups in their inner loops. :func:`index_view` turns the view into
plain lists indexed by position (the input order): predecessors in reading
order (args, then kwargs, each once), users in input order, roles, costs.

>>> import networkx as nx
>>> v = nx.DiGraph()
>>> v.add_node("x", role="placeholder", position=0, device_time=None, tensor_size=None,
...            ds_id=None, n_users=None, aliasing=False)
>>> v.add_node("y", role="compute", position=1, device_time=1.5, tensor_size=8,
...            ds_id=None, n_users=None, aliasing=False)
>>> v.add_edge("x", "y")
>>> g = index_view(v)
>>> g.names, g.preds, g.succs, g.time, g.size
(['x', 'y'], [(), (0,)], [[1], []], [0, 1.5], [0, 8])
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc

import networkx as nx

from ..errors import GraphError
from ..roles import Role

PLACEHOLDER = Role.PLACEHOLDER.value
ALLGATHER = Role.ALLGATHER.value
RELEASE = Role.RELEASE.value
REDUCE = Role.REDUCE.value
OUTPUT = Role.OUTPUT.value


@dataclasses.dataclass(frozen=True)
class IndexedGraph:
    """The view as lists indexed by input position (see the module docstring)."""

    names: list[str]
    index: dict[str, int]
    #: inputs of each node, in reading order, each once
    preds: list[tuple[int, ...]]
    #: readers of each node, in input order, each once
    succs: list[list[int]]
    role: list[str]
    ds_id: list[int | None]
    n_users: list[int | None]
    #: device_time in ms; a missing figure counts as 0
    time: list[float]
    #: tensor_size in bytes; a missing figure counts as 0
    size: list[int]
    aliasing: list[bool]
    #: position of the output node, or None
    output: int | None

    def __len__(self) -> int:
        return len(self.names)

    def is_allgather(self) -> list[bool]:
        return [r == ALLGATHER for r in self.role]

    def releases_by_ds_id(self) -> dict[int, list[int]]:
        """Release nodes per parameter id, in input order."""
        found: dict[int, list[int]] = {}
        for i, r in enumerate(self.role):
            if r == RELEASE:
                found.setdefault(self.ds_id[i], []).append(i)
        return found

    def order_names(self, order: list[int]) -> list[str]:
        names = self.names
        return [names[i] for i in order]


@contextlib.contextmanager
def paused_gc():
    """Pause Python's cyclic garbage collector for a scheduler run.

    A scheduler allocates O(N) small containers and no reference cycles; with a
    large FX graph in memory, that allocation triggers full collections that
    traverse every object of the graph, and at 10^5 nodes those cost more than
    the scheduling itself.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def index_view(view: nx.DiGraph) -> IndexedGraph:
    """The :class:`IndexedGraph` of ``view``; raises GraphError if an edge runs backwards in input order.

    The view of an FX graph is always in topological input order; a view
    edited by hand may not be, and the fast schedulers rely on it.
    """
    # networkx's own dicts (the public views build a wrapper per lookup, which
    # dominates at 10^5 nodes); same data, same order.
    data = getattr(view, "_node", None) or dict(view.nodes(data=True))
    pred_of = getattr(view, "_pred", None) or {name: dict(view.pred[name]) for name in data}
    names = list(data)
    positions = [data[name]["position"] for name in names]
    if any(a >= b for a, b in zip(positions, positions[1:])):  # views not built in input order
        names.sort(key=lambda name: data[name]["position"])
    index = {name: i for i, name in enumerate(names)}
    attrs = [data[name] for name in names]
    preds: list[tuple[int, ...]] = [tuple([index[p] for p in pred_of[name]]) for name in names]
    succs: list[list[int]] = [[] for _ in names]
    for i, ins in enumerate(preds):
        for p in ins:
            if p >= i:
                raise GraphError(f"node {names[i]!r} reads {names[p]!r}, which does not come before it "
                                 "(the graph has a cycle or is not in topological order)")
            succs[p].append(i)
    role = [a["role"] for a in attrs]
    ds_id = [a.get("ds_id") for a in attrs]
    n_users = [a.get("n_users") for a in attrs]
    time = [0 if t is None else t for t in (a.get("device_time") for a in attrs)]
    size = [0 if s is None else int(s) for s in (a.get("tensor_size") for a in attrs)]
    aliasing = [bool(a.get("aliasing")) for a in attrs]
    output = view.graph.get("output")
    return IndexedGraph(names, index, preds, succs, role, ds_id, n_users, time, size, aliasing,
                        index.get(output) if output is not None else None)


def schedule_indexed(view: nx.DiGraph, indices_of) -> list[str]:
    """The order ``indices_of(IndexedGraph)`` computes for ``view``, as node names (collector paused).

    The shape of every index-based scheduler: index the view once, compute
    the order as input positions, name it.
    """
    with paused_gc():
        graph = index_view(view)
        return graph.order_names(indices_of(graph))
