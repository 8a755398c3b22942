"""A networkx view of an FX graph, and the way back from an order to an FX graph.

Schedulers and the simulator work on this view, so they are pure functions of
plain data. One vertex per FX node, keyed by the node's name, with attributes:

``role``         a :class:`dcsched.graph.roles.Role` value ('compute', 'allgather', ...)
``ds_id``        the parameter id of a comm node, else None
``graph_id``     the graph id argument of a comm node, else None
``n_users``      for a release: how many releases free the buffer
``device_time``  milliseconds (None when the graph was never profiled)
``tensor_size``  bytes of the node's outputs (None when unknown); an input's derived from its shape when 0
                 or missing (:func:`dcsched.graph.specs.input_size`)
``position``     index in the input order
``target``       qualified op name ('aten.mm.default'), '' for placeholder/output
``aliasing``     output aliases an input, as DeepSpeed's last-use analysis sees it
``view_like``    allocates nothing and keeps its source alive (simulator)

One edge per data dependency, args first and then kwargs, in the order the
node reads them (so ``view.pred[v]`` iterates the inputs in argument order).
Edge attribute ``via_kwargs`` is True for a dependency that only kwargs carry.
``view.graph['output']`` names the output node.

Random ops (:func:`dcsched.graph.roles.is_random`: dropout, ``rand_like``, ...)
each draw the next numbers of the device's one generator, so an order that
swaps two of them changes what the step computes. The view chains them: an
edge from each random op to the next one in input order (unless it already
reads it), with attribute ``order_only`` True, placed after the node's data
inputs in ``view.pred``. Every scheduler and order check sees it as an input,
so every order keeps the random ops in their input order; it carries no
value, so the simulator does not keep the earlier op's output alive for it.
``view.graph['order_only_edges']`` lists these edges as (source, reader).

>>> import torch, torch.fx
>>> g = torch.fx.Graph()
>>> x = g.placeholder("x")
>>> y = g.create_node("call_function", torch.ops.aten.relu.default, (x,), name="relu")
>>> _ = g.output((y,))
>>> v = to_networkx(g)
>>> list(v.nodes), v.nodes["relu"]["role"], list(v.edges)
(['x', 'relu', 'output'], 'compute', [('x', 'relu'), ('relu', 'output')])
>>> [n.name for n in to_fx(g, ["x", "relu", "output"]).nodes]
['x', 'relu', 'output']
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import networkx as nx
import torch.fx

from dcsched.errors import GraphError
from dcsched.graph.fxbuild import rebuild
from dcsched.graph.specs import input_size
from dcsched.graph.roles import (COMM_ROLES, Role, comm_ids, is_aliasing, is_random, is_view_like, n_users_of,
                    qualified_name, role_of)


def input_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes ``node`` reads, args before kwargs, each once, in reading order."""
    seen: dict[torch.fx.Node, bool] = {}
    torch.fx.node.map_arg(node.args, lambda n: seen.setdefault(n, False))
    torch.fx.node.map_arg(node.kwargs, lambda n: seen.setdefault(n, True))
    return list(seen)


def _kwarg_only_inputs(node: torch.fx.Node) -> set[torch.fx.Node]:
    in_args: set[torch.fx.Node] = set()
    torch.fx.node.map_arg(node.args, in_args.add)
    in_kwargs: set[torch.fx.Node] = set()
    torch.fx.node.map_arg(node.kwargs, in_kwargs.add)
    return in_kwargs - in_args


#: FX ops of graph inputs, whose size may have to be derived from the value's shape (DeepSpeed records 0).
_INPUT_OPS = ("placeholder", "get_attr")


class FxColumns:
    """The vertex attributes of an FX graph's nodes as columns (lists in input order), read in one pass.

    ``nodes``, ``names``, and one list per attribute of the module docstring
    (``role``, ``ds_id``, ``graph_id``, ``n_users``, ``device_time``,
    ``tensor_size``, ``target``, ``aliasing``, ``view_like``) and ``random``
    (a random op, chained in the view); ``output`` names the output node. The
    networkx view and :class:`dcsched.graph.form.GraphForm` both read a graph
    through these.
    """

    def __init__(self, graph: torch.fx.Graph):
        self.nodes = nodes = list(graph.nodes)
        self.names = [node.name for node in nodes]
        infos = _target_infos(nodes)
        self.role = [info[1] for info in infos]
        self.target = [info[2] for info in infos]
        self.aliasing = [info[3] for info in infos]
        self.view_like = [info[4] for info in infos]
        n = len(nodes)
        self.ds_id: list = [None] * n
        self.graph_id: list = [None] * n
        self.n_users: list = [None] * n
        self.random = [False] * n
        metas = [node.meta for node in nodes]
        self.device_time = [meta.get("device_time") for meta in metas]
        self.tensor_size = [meta.get("tensor_size") for meta in metas]
        self.output = None
        for i, info in enumerate(infos):
            if info[5]:  # a node whose attributes depend on more than its (op, target): a few per layer
                self._read_own(i, info[0], info[6])

    def _read_own(self, i: int, role: Role, seeded: bool) -> None:
        node = self.nodes[i]
        if role in COMM_ROLES:  # only comm nodes carry ids
            self.graph_id[i], self.ds_id[i] = comm_ids(node)
            if role is Role.RELEASE:
                self.n_users[i] = n_users_of(node)
        elif role is Role.OUTPUT:
            self.output = node.name
        elif node.op in _INPUT_OPS:
            self.tensor_size[i] = input_size(node)
        if seeded:
            self.random[i] = is_random(node)

    def records(self) -> Iterator[tuple[str, dict]]:
        """Each node's name and vertex attributes (a fresh dict), in input order."""
        keys = ("role", "ds_id", "graph_id", "n_users", "device_time", "tensor_size", "position", "target",
                "aliasing", "view_like", "random")
        columns = (self.role, self.ds_id, self.graph_id, self.n_users, self.device_time, self.tensor_size,
                   range(len(self.names)), self.target, self.aliasing, self.view_like, self.random)
        for name, values in zip(self.names, zip(*columns)):
            yield name, dict(zip(keys, values))

    def random_ops(self) -> list[torch.fx.Node]:
        """The random ops, in input order."""
        return [node for node, random in zip(self.nodes, self.random) if random]


def _target_infos(nodes: list[torch.fx.Node]) -> list[tuple]:
    """Per node, what depends only on its (op, target), worked out once per distinct target (views of
    10^5-node graphs repeat a few dozen): (role, role value, qualified target, aliasing, view_like,
    whether the node needs a look of its own, seeded)."""
    per_target: dict = {}
    infos = []
    for node in nodes:
        op, target = node.op, node.target
        # A call_function target by identity: hashing an OpOverload runs Python code.
        key = id(target) if op == "call_function" else (op, target)
        try:
            info = per_target[key]
        except (KeyError, TypeError):
            info = _target_info(node)
            try:
                per_target[key] = info  # the nodes list keeps each target (and so its id) alive
            except TypeError:  # an unhashable target
                pass
        infos.append(info)
    return infos


def _target_info(node: torch.fx.Node) -> tuple:
    role = role_of(node)
    seeded = isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags
    own_look = role in COMM_ROLES or role is Role.OUTPUT or node.op in _INPUT_OPS or seeded
    return (role, role.value, qualified_name(node.target) if node.op == "call_function" else "",
            is_aliasing(node), is_view_like(node), own_look, seeded)


def to_networkx(graph: torch.fx.Graph) -> nx.DiGraph:
    """Build the networkx view of ``graph`` (see the module docstring).

    Parameters
    ----------
    graph : torch.fx.Graph
        A graph with dcsched or DeepSpeed ``dc`` ZeRO-3 ops.

    Returns
    -------
    networkx.DiGraph
        One node per FX node, named alike, with its ``role``, ``position``
        and costs; an edge per value read (and per order-only dependency).

    Raises
    ------
    GraphError
        A node whose recorded metadata cannot be read.

    Examples
    --------
    >>> import torch, torch.fx
    >>> g = torch.fx.Graph()
    >>> x = g.placeholder("x")
    >>> _ = g.output((g.create_node("call_function", torch.ops.aten.relu.default, (x,), name="relu"),))
    >>> sorted(to_networkx(g).edges)
    [('relu', 'output'), ('x', 'relu')]
    """
    return view_of_columns(FxColumns(graph))


def view_of_columns(columns: FxColumns) -> nx.DiGraph:
    """The networkx view of the graph ``columns`` were read from."""
    view = nx.DiGraph()
    edges = []
    for node in columns.nodes:
        # Inputs: args first, then kwargs, each once, in reading order.
        name = node.name
        kwarg_only = _kwarg_only_inputs(node) if node.kwargs else ()
        for source in node.all_input_nodes:
            edges.append((source.name, name, {"via_kwargs": source in kwarg_only}))
    view.add_nodes_from(columns.records())
    view.add_edges_from(edges)
    view.graph["output"] = columns.output
    view.graph["order_only_edges"] = _chain_random_ops(view, columns.random_ops())
    return view


def random_op_chain(random_ops: Sequence[torch.fx.Node]) -> list[tuple[str, str]]:
    """The ``order_only`` edges for ``random_ops`` (in input order): each op to the next one, unless it reads it.

    The one rule behind the view's chain and :class:`dcsched.graph.form.GraphForm`'s, so the two cannot differ.
    """
    return [(earlier.name, later.name) for earlier, later in zip(random_ops, random_ops[1:])
            if earlier not in later.all_input_nodes]


def _chain_random_ops(view: nx.DiGraph, random_ops: list[torch.fx.Node]) -> list[tuple[str, str]]:
    """Add an ``order_only`` edge from each random op to the next (see the module docstring)."""
    chain = random_op_chain(random_ops)
    view.add_edges_from(chain, via_kwargs=False, order_only=True)
    return chain


def check_order(view: nx.DiGraph, order: Sequence[str]) -> None:
    """Raise :class:`GraphError` unless ``order`` is a topological order of exactly ``view``'s vertices
    that keeps the placeholders in their input order and ends with the output."""
    if len(order) != view.number_of_nodes() or set(order) != set(view.nodes):
        extra = set(order) - set(view.nodes)
        missing = set(view.nodes) - set(order)
        raise GraphError(
            f"order is not a permutation of the graph's nodes (missing {sorted(missing)[:5]}, "
            f"unknown {sorted(extra)[:5]}, {len(order)} given for {view.number_of_nodes()})")
    # Placeholders are the graph's calling convention (bundles map them by
    # position), so an order must keep them in their input order.
    placeholders = [name for name in order if view.nodes[name]["role"] == Role.PLACEHOLDER.value]
    if placeholders != sorted(placeholders, key=lambda name: view.nodes[name]["position"]):
        raise GraphError("order moves placeholders out of their input order (they are the graph's signature)")
    placed: set[str] = set()
    for name in order:
        for source in view.pred[name]:
            if source not in placed:
                raise GraphError(f"order runs {name!r} before its input {source!r}")
        placed.add(name)
    output = next((name for name in order if view.nodes[name]["role"] == Role.OUTPUT.value), None)
    if output is not None and order[-1] != output:
        from dcsched.graph.form import output_not_last
        raise GraphError(output_not_last(output, order[-1]))


def to_fx(graph: torch.fx.Graph, order: Iterable[str]) -> torch.fx.Graph:
    """A new FX graph holding ``graph``'s nodes (names, targets, args, meta) in ``order``.

    Parameters
    ----------
    graph : torch.fx.Graph
        The graph to reorder (left unchanged).
    order : iterable of str
        A topological order of all of ``graph``'s node names.

    Returns
    -------
    torch.fx.Graph
        A new graph (:func:`dcsched.graph.fxbuild.rebuild`).

    Raises
    ------
    GraphError
        ``order`` misses or repeats a node, names one the graph lacks, or puts
        a node before one it reads.

    Examples
    --------
    >>> import torch, torch.fx
    >>> g = torch.fx.Graph()
    >>> a, b = g.placeholder("a"), g.placeholder("b")
    >>> _ = g.output((a, b))
    >>> [n.name for n in to_fx(g, ["b", "a", "output"]).nodes]
    ['b', 'a', 'output']
    """
    return rebuild(graph, order)


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A node-for-node copy of ``graph`` (names, targets, args, meta), in the same order."""
    return to_fx(graph, [node.name for node in graph.nodes])
