"""A networkx view of an FX graph, and the way back from an order to an FX graph.

Schedulers and the simulator work on this view, so they are pure functions of
plain data. One vertex per FX node, keyed by the node's name, with attributes:

``role``         a :class:`dcsched.roles.Role` value ('compute', 'allgather', ...)
``ds_id``        the parameter id of a comm node, else None
``graph_id``     the graph id argument of a comm node, else None
``n_users``      for a release: how many releases free the buffer
``device_time``  milliseconds (None when the graph was never profiled)
``tensor_size``  bytes of the node's outputs (None when unknown); an input's derived from its shape when 0
                 or missing (:func:`dcsched.specs.input_size`)
``position``     index in the input order
``target``       qualified op name ('aten.mm.default'), '' for placeholder/output
``aliasing``     output aliases an input, as DeepSpeed's last-use analysis sees it
``view_like``    allocates nothing and keeps its source alive (simulator)

One edge per data dependency, args first and then kwargs, in the order the
node reads them (so ``view.pred[v]`` iterates the inputs in argument order).
Edge attribute ``via_kwargs`` is True for a dependency that only kwargs carry.
``view.graph['output']`` names the output node.

Random ops (:func:`dcsched.roles.is_random`: dropout, ``rand_like``, ...)
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

from .errors import GraphError
from .specs import input_size
from .roles import (COMM_ROLES, Role, ds_id_of, graph_id_of, is_aliasing, is_random, is_view_like, n_users_of,
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


def fx_node_records(graph: torch.fx.Graph) -> Iterator[tuple[torch.fx.Node, dict]]:
    """Each node of ``graph`` with its vertex attributes (see the module docstring), in input order."""
    # What depends only on (op, target) is worked out once per distinct target:
    # views of 10^5-node graphs repeat a few dozen targets.
    per_target: dict = {}
    for position, node in enumerate(graph.nodes):
        key = (node.op, node.target)
        try:
            role, target, aliasing, view_like, seeded = per_target[key]
        except (KeyError, TypeError):
            role = role_of(node)
            target = qualified_name(node.target) if node.op == "call_function" else ""
            aliasing, view_like = is_aliasing(node), is_view_like(node)
            seeded = isinstance(node.target, torch._ops.OpOverload) and \
                torch.Tag.nondeterministic_seeded in node.target.tags
            try:
                per_target[key] = (role, target, aliasing, view_like, seeded)
            except TypeError:  # an unhashable target
                pass
        comm = role in COMM_ROLES  # only comm nodes carry ids (asked per node, it costs a third of the view)
        yield node, {
            "role": role.value,
            "ds_id": ds_id_of(node) if comm else None,
            "graph_id": graph_id_of(node) if comm else None,
            "n_users": n_users_of(node) if role is Role.RELEASE else None,
            "device_time": node.meta.get("device_time"),
            "tensor_size": input_size(node) if node.op in _INPUT_OPS else node.meta.get("tensor_size"),
            "position": position,
            "target": target,
            "aliasing": aliasing,
            "view_like": view_like,
            "random": seeded and is_random(node),
        }


def to_networkx(graph: torch.fx.Graph) -> nx.DiGraph:
    """Build the networkx view of ``graph`` (see the module docstring)."""
    view = nx.DiGraph()
    output = None
    nodes = []
    edges = []
    random_ops: list[torch.fx.Node] = []
    for node, data in fx_node_records(graph):
        if data["role"] == Role.OUTPUT.value:
            output = node.name
        nodes.append((node.name, data))
        if data["random"]:
            random_ops.append(node)
        # Inputs: args first, then kwargs, each once, in reading order.
        from_args: dict = {}
        torch.fx.node.map_arg(node.args, lambda n: from_args.setdefault(n, None))
        from_kwargs: dict = {}
        torch.fx.node.map_arg(node.kwargs, lambda n: None if n in from_args else from_kwargs.setdefault(n, None))
        name = node.name
        for source in from_args:
            edges.append((source.name, name, {"via_kwargs": False}))
        for source in from_kwargs:
            edges.append((source.name, name, {"via_kwargs": True}))
    view.add_nodes_from(nodes)
    view.add_edges_from(edges)
    view.graph["output"] = output
    view.graph["order_only_edges"] = _chain_random_ops(view, random_ops)
    return view


def random_op_chain(random_ops: Sequence[torch.fx.Node]) -> list[tuple[str, str]]:
    """The ``order_only`` edges for ``random_ops`` (in input order): each op to the next one, unless it reads it.

    The one rule behind the view's chain and :class:`dcsched.graphform.GraphForm`'s, so the two cannot differ.
    """
    return [(earlier.name, later.name) for earlier, later in zip(random_ops, random_ops[1:])
            if earlier not in later.all_input_nodes]


def _chain_random_ops(view: nx.DiGraph, random_ops: list[torch.fx.Node]) -> list[tuple[str, str]]:
    """Add an ``order_only`` edge from each random op to the next (see the module docstring)."""
    chain = random_op_chain(random_ops)
    view.add_edges_from(chain, via_kwargs=False, order_only=True)
    return chain


def missing_costs(view: nx.DiGraph) -> dict[str, list[str]]:
    """Nodes lacking ``device_time`` or ``tensor_size``: {'device_time': [...], 'tensor_size': [...]}.

    Placeholders and the output node need neither.
    """
    missing: dict[str, list[str]] = {"device_time": [], "tensor_size": []}
    for name, data in view.nodes(data=True):
        if data["role"] in (Role.PLACEHOLDER.value, Role.OUTPUT.value):
            continue
        for key in missing:
            if data.get(key) is None:
                missing[key].append(name)
    return {key: names for key, names in missing.items() if names}


def check_order(view: nx.DiGraph, order: Sequence[str]) -> None:
    """Raise :class:`GraphError` unless ``order`` is a topological order of exactly ``view``'s vertices
    that keeps the placeholders in their input order."""
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


def to_fx(graph: torch.fx.Graph, order: Iterable[str]) -> torch.fx.Graph:
    """A new FX graph holding ``graph``'s nodes (names, targets, args, meta) in ``order``.

    ``order`` must be a topological order of all of ``graph``'s node names.
    """
    by_name = {node.name: node for node in graph.nodes}
    order = list(order)
    if len(order) != len(by_name) or set(order) != set(by_name):
        raise GraphError(f"order holds {len(order)} names for a graph of {len(by_name)} nodes, "
                         "or names that are not in the graph")
    new_graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}

    def lookup(node: torch.fx.Node) -> torch.fx.Node:
        try:
            return env[node.name]
        except KeyError:
            raise GraphError(f"order runs a reader of {node.name!r} before {node.name!r} itself") from None

    map_arg = torch.fx.node.map_arg
    for name in order:
        old = by_name[name]
        # Created bare, then given its inputs: create_node would walk every
        # argument looking for raw SymInts, which costs more than the rest of
        # the rebuild; captured graphs hold none (the bundle stores plain data).
        new_node = new_graph.create_node(old.op, old.target, name=name, type_expr=old.type)
        if new_node.name != name:  # names are the schedulers' keys
            raise GraphError(f"node {name!r} could not keep its name in the rebuilt graph")
        if old.args:
            new_node.args = map_arg(old.args, lookup)
        if old.kwargs:
            new_node.kwargs = map_arg(old.kwargs, lookup)
        new_node.meta.update(old.meta)  # a shallow copy; assigning would re-index the node in the graph
        env[name] = new_node
    return new_graph


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A node-for-node copy of ``graph`` (names, targets, args, meta), in the same order."""
    return to_fx(graph, [node.name for node in graph.nodes])
