"""One integer-indexed form of a graph, shared by the schedulers and the simulator.

Schedulers that run many rounds over a graph of 10^5 nodes, and a simulator
that replays many orders of one graph, cannot afford networkx lookups in their
inner loops. :class:`GraphForm` holds the same graph as plain lists indexed by
node number, the node's position in the input order:

``names``, ``index``   node names, and name -> number
``preds``              inputs in reading order (args, then kwargs), each once (tuples)
``succs``              readers in input order, each once
``topo``               a topological order (the input order when every edge runs forward)
``kind``               a :class:`Kind` per node
``ds_id``, ``n_users`` the parameter id of a comm node (else None); a release's ``n_users`` (else 1)
``device_time``,       the figures as the graph gives them (None when missing) ...
``tensor_size``
``time``, ``size``     ... and with a missing figure counted as 0 (ms, bytes)
``aliasing``           output aliases an input, as DeepSpeed's last-use analysis sees it
``view_like``          allocates nothing and keeps its source alive (the simulator's storage model)
``getitem``            an ``operator.getitem`` node
``output``             the output node's number, or None

A form is built from the networkx view (:func:`dcsched.graph.nxview.to_networkx`,
read through networkx's public API) or straight from an FX graph (the same
attributes, without building the view); :class:`dcsched.sim.simulate.CompiledGraph`
extends it with the simulator's storage model.

>>> import networkx as nx
>>> v = nx.DiGraph()
>>> v.add_node("x", role="placeholder", position=0, device_time=None, tensor_size=None,
...            ds_id=None, n_users=None, aliasing=False)
>>> v.add_node("y", role="compute", position=1, device_time=1.5, tensor_size=8,
...            ds_id=None, n_users=None, aliasing=False)
>>> v.add_edge("x", "y")
>>> g = GraphForm(v)
>>> g.names, g.preds, g.succs, g.time, g.size, g.kind == [PLACEHOLDER, COMPUTE]
(['x', 'y'], [(), (0,)], [[1], []], [0, 1.5], [0, 8], True)
"""

from __future__ import annotations

import contextlib
import enum
import gc
from typing import Callable, Iterable

import networkx as nx
import torch.fx

from dcsched import collectives
from dcsched.errors import GraphError
from dcsched.graph.nxview import FxColumns, random_op_chain, to_networkx
from dcsched.graph.roles import Role


class Kind(enum.IntEnum):
    """What a node does, as a small int (the simulator's loop compares them)."""

    PLACEHOLDER = 0
    COMPUTE = 1
    ALLGATHER = 2
    WAIT = 3
    RELEASE = 4
    REDUCE = 5
    OUTPUT = 6
    #: a get_attr node: a tensor the graph holds, resident like an input
    CONSTANT = 7


# Module-level names: a global lookup is what a hot loop can afford (an attribute lookup is not).
PLACEHOLDER, COMPUTE, ALLGATHER, WAIT, RELEASE, REDUCE, OUTPUT, CONSTANT = Kind
#: Role names per kind ('placeholder', 'compute', ...; a constant is 'constant').
KIND_NAMES = tuple(kind.name.lower() for kind in Kind)
#: Kinds that run on the communication stream (the roles :mod:`dcsched.collectives` puts there).
COMM_KINDS = tuple(Kind[role.upper()] for role in collectives.STREAM_ROLES)
_KIND_OF_ROLE = {role.value: Kind[role.name] for role in Role}
_GETITEM = "operator.getitem"
#: Attributes a form consists of (what a form built from another form shares).
FIELDS = ("names", "index", "preds", "succs", "topo", "_forward", "kind", "ds_id", "n_users", "device_time",
          "tensor_size", "time", "size", "aliasing", "view_like", "getitem", "output", "order_only")


class GraphForm:
    """A graph as lists indexed by input position (see the module docstring).

    ``GraphForm(source)`` reads a networkx view, an FX graph, or another form
    (whose lists it shares). Raises :class:`GraphError` for a cycle (``label``
    names the graph in the message).
    """

    def __init__(self, source: nx.DiGraph | torch.fx.Graph | GraphForm, *, label: str = "graph"):
        if isinstance(source, GraphForm):
            for field in FIELDS:
                setattr(self, field, getattr(source, field))
            return
        if isinstance(source, torch.fx.Graph):
            read = _read_fx(source)
        elif isinstance(source, nx.DiGraph):
            read = _read_view(source)
        else:
            raise TypeError(f"a graph form is built from a networkx view or an FX graph, not {type(source).__name__}")
        self._read(*read)
        self.topo = self._topological(source, label)

    @classmethod
    def from_columns(cls, names: list[str], columns, preds: list[tuple[int, ...]], output=None,
                     order_only: Iterable[tuple[str, str]] = (), *, label: str = "graph") -> "GraphForm":
        """A form from columns read elsewhere (a version-2 bundle's, :mod:`dcsched.bundle.columns`): the
        attributes :class:`~dcsched.graph.nxview.FxColumns` gives, each node's inputs as node numbers, every
        input before its reader."""
        form = cls.__new__(cls)
        form._read(names, columns, preds, output, order_only)
        form._forward = all(p < i for i, ins in enumerate(preds) for p in ins)
        if not form._forward:
            raise GraphError(f"{label} is not in a topological order")
        form.topo = list(range(len(names)))
        return form

    def _read(self, names: list[str], columns, preds: list[tuple[int, ...]], output,
              order_only: Iterable[tuple[str, str]] = ()) -> None:
        """Fill the lists from the node names, the attribute columns (``role``, ``target``, ``ds_id``,
        ``n_users``, ``device_time``, ``tensor_size``, ``aliasing``, ``view_like``) and each node's inputs
        as node numbers, in input order."""
        self.names = names
        self.index = index = {name: i for i, name in enumerate(names)}
        self.preds = preds
        succs: list[list[int]] = [[] for _ in names]
        for i, ins in enumerate(preds):
            for p in ins:
                succs[p].append(i)
        self.succs = succs
        kind_of_role = _KIND_OF_ROLE
        self.kind = kind = [kind_of_role.get(role, COMPUTE) for role in columns.role]
        targets = columns.target
        for i, target in enumerate(targets):
            if target == "" and kind[i] == COMPUTE:
                kind[i] = CONSTANT  # a get_attr node
        self.getitem = [target == _GETITEM for target in targets]
        self.ds_id = list(columns.ds_id)
        self.n_users = [1 if u is None else int(u) for u in columns.n_users]
        self.device_time = list(columns.device_time)
        self.tensor_size = list(columns.tensor_size)
        # Shared with the figures as given when none is missing (the usual case of a profiled graph).
        self.time = self.device_time if None not in self.device_time else [
            0 if t is None else t for t in self.device_time]
        self.size = self.tensor_size if None not in self.tensor_size else [
            0 if s is None else s for s in self.tensor_size]
        self.aliasing = [bool(a) for a in columns.aliasing]
        self.view_like = [bool(v) for v in columns.view_like]
        self.output = index.get(output) if output is not None else None
        # (source, reader) edges that only order (random ops kept in stream order, dcsched.graph.nxview): no value read.
        self.order_only = [(index[a], index[b]) for a, b in order_only]

    def _topological(self, source, label: str) -> list[int]:
        self._forward = all(p < i for i, ins in enumerate(self.preds) for p in ins)
        if self._forward:
            return list(range(len(self.names)))
        view = source if isinstance(source, nx.DiGraph) else to_networkx(source)
        try:
            return [self.index[v] for v in nx.topological_sort(view)]
        except nx.NetworkXUnfeasible:
            cycle = nx.find_cycle(view)
            path = " -> ".join([edge[0] for edge in cycle] + [cycle[0][0]])
            raise GraphError(f"{label} has a cycle: {path}") from None

    def __len__(self) -> int:
        return len(self.names)

    def check_input_order(self) -> None:
        """Raise :class:`GraphError` unless every node comes after its inputs (what the fast schedulers need).

        The view of an FX graph is always in topological input order; a view
        edited by hand may not be.
        """
        if self._forward:
            return
        names = self.names
        for i, ins in enumerate(self.preds):
            for p in ins:
                if p >= i:
                    raise GraphError(f"node {names[i]!r} reads {names[p]!r}, which does not come before it "
                                     "(the graph has a cycle or is not in topological order)")

    def is_allgather(self) -> list[bool]:
        return [k == ALLGATHER for k in self.kind]

    def releases_by_ds_id(self) -> dict[int, list[int]]:
        """Release nodes per parameter id, in input order."""
        found: dict[int, list[int]] = {}
        for i, k in enumerate(self.kind):
            if k == RELEASE:
                found.setdefault(self.ds_id[i], []).append(i)
        return found

    def order_names(self, order: list[int]) -> list[str]:
        names = self.names
        return [names[i] for i in order]

    def check_order(self, order: list[str]) -> None:
        """Raise :class:`GraphError` unless ``order`` (names) is a topological order of exactly these nodes
        that keeps the placeholders in their input order and ends with the output (what
        :func:`dcsched.graph.nxview.check_order` checks)."""
        index = self.index
        n = len(self.names)
        try:
            idx = [index[name] for name in order]
        except (KeyError, TypeError):
            idx = None
        placed = bytearray(n)
        if idx is None or len(idx) != n or len(set(idx)) != n:
            given = set(order)
            missing = sorted(set(self.names) - given)[:5]
            unknown = sorted(str(v) for v in given - set(self.names))[:5]
            raise GraphError(f"order is not a permutation of the graph's nodes (missing {missing}, "
                             f"unknown {unknown}, {len(order)} given for {n})")
        kind, preds, names = self.kind, self.preds, self.names
        last_placeholder = -1
        for i in idx:
            if kind[i] == PLACEHOLDER:
                if i < last_placeholder:
                    raise GraphError("order moves placeholders out of their input order "
                                     "(they are the graph's signature)")
                last_placeholder = i
            for p in preds[i]:
                if not placed[p]:
                    raise GraphError(f"order runs {names[i]!r} before its input {names[p]!r}")
            placed[i] = 1
        if kind[idx[-1]] != OUTPUT and OUTPUT in kind:
            raise GraphError(output_not_last(names[next(i for i in idx if kind[i] == OUTPUT)], names[idx[-1]]))


class _ViewColumns:
    """The attribute columns of a networkx view's vertices (what :class:`FxColumns` gives for an FX graph)."""

    def __init__(self, attrs: list[dict]):
        for key in ("role", "target", "ds_id", "n_users", "device_time", "tensor_size", "aliasing", "view_like"):
            setattr(self, key, [data.get(key) for data in attrs])


def _read_view(view: nx.DiGraph) -> tuple:
    """Names, attribute columns and inputs of the vertices, in input order (networkx's public API only)."""
    nodes = list(view.nodes(data=True))
    if all("position" in data for _, data in nodes):
        positions = [data["position"] for _, data in nodes]
        if any(a >= b for a, b in zip(positions, positions[1:])):  # views not built in input order
            nodes.sort(key=lambda item: item[1]["position"])
    names = [name for name, _ in nodes]
    index = {name: i for i, name in enumerate(names)}
    # A vertex's predecessors come in edge insertion order: the reading order.
    preds = [tuple([index[p] for p in view.predecessors(name)]) for name in names]
    return names, _ViewColumns([data for _, data in nodes]), preds, view.graph.get("output"), \
        view.graph.get("order_only_edges", ())


def _read_fx(graph: torch.fx.Graph) -> tuple:
    """Names, attribute columns (those of the view) and inputs of the nodes, in input order."""
    columns = FxColumns(graph)
    nodes = columns.nodes
    position = {node: i for i, node in enumerate(nodes)}
    preds = [tuple([position[p] for p in node.all_input_nodes]) for node in nodes]
    random_ops = columns.random_ops()
    # Chained after the reader's data inputs, as the view does.
    order_only = random_op_chain(random_ops)
    if order_only:
        index = {name: i for i, name in enumerate(columns.names)}
        for earlier, later in order_only:
            preds[index[later]] += (index[earlier],)
    return columns.names, columns, preds, columns.output, order_only


def graph_form(graph: nx.DiGraph | torch.fx.Graph | GraphForm) -> GraphForm:
    """``graph`` itself if it is a form, else its form."""
    return graph if isinstance(graph, GraphForm) else GraphForm(graph)


@contextlib.contextmanager
def paused_gc():
    """Pause Python's cyclic garbage collector while working on a large graph.

    Building a form, scheduling or simulating allocates O(N) small containers
    and no reference cycles; with a large FX graph in memory, that allocation
    triggers full collections that traverse every object of the graph, and at
    10^5 nodes those cost more than the work itself.

    >>> with paused_gc():
    ...     gc.isenabled()
    False
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def output_not_last(output: str, last: str) -> str:
    """The message of an order whose last node is not the output."""
    return (f"order puts {output!r} before {last!r}: the graph would return before {last!r} runs "
            "(the output comes last in every order)")


def output_last_indices(kind: list, order: list[int]) -> list[int]:
    """``order`` (node numbers) with the output node last; ``kind``: each node's :class:`Kind`."""
    if not order or kind[order[-1]] == OUTPUT:
        return order
    return [v for v in order if kind[v] != OUTPUT] + [v for v in order if kind[v] == OUTPUT]


def output_last(graph: "nx.DiGraph | GraphForm", order: list[str]) -> list[str]:
    """``order`` with the output node moved to its end, where it must be: the generated code returns there.

    A chain that feeds nothing the graph returns (an all-gather, its wait, a
    compute node and the release, none read by the output) may otherwise come
    after the output in a greedy order, and would then never run.
    """
    if isinstance(graph, GraphForm):
        outputs = {graph.names[i] for i, k in enumerate(graph.kind) if k == OUTPUT}
    else:
        outputs = {v for v, role in graph.nodes(data="role") if role == Role.OUTPUT.value}
    if not outputs or order[-1] in outputs:
        return order
    return [v for v in order if v not in outputs] + [v for v in order if v in outputs]


def schedule_indexed(graph: nx.DiGraph | GraphForm, indices_of: Callable[[GraphForm], list[int]]) -> list[str]:
    """The order ``indices_of(form)`` computes for ``graph``, as node names (collector paused).

    The shape of every index-based scheduler: build the form once (or take the
    one given), compute the order as node numbers, name it.
    """
    with paused_gc():
        form = graph_form(graph)
        form.check_input_order()
        return form.order_names(indices_of(form))
