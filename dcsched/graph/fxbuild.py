"""Rebuild an FX graph with its nodes in a given order (what :func:`dcsched.graph.nxview.to_fx` runs).

Two routes give the same graph. The public one creates each node with
``Graph.create_node`` and then sets its arguments. At 10^5 nodes that spends
most of its time in bookkeeping a copy does not need (a name check per node,
an argument walk looking for raw SymInts, a lookup-table update on every
attribute set), so where this torch's graph has the internals it expects
(:func:`linking_supported`), :func:`rebuild` constructs each ``torch.fx.Node``
with its final arguments and links it into the graph's node list, namespace
and node lookup table directly, as ``create_node`` does. Names, ops, targets,
arguments, ``type``, ``meta``, users and the lookup table come out identical
(``tests/test_fxbuild.py`` checks both routes against each other).

>>> import torch, torch.fx
>>> g = torch.fx.Graph()
>>> x = g.placeholder("x")
>>> y = g.create_node("call_function", torch.ops.aten.relu.default, (x,), name="relu")
>>> _ = g.output((y,))
>>> [n.name for n in rebuild(g, ["x", "relu", "output"]).nodes]
['x', 'relu', 'output']
"""

from __future__ import annotations

from typing import Iterable

import torch.fx

from dcsched.errors import GraphError

#: Graph attributes the linking route reads or writes (torch's own internals, checked before use).
_GRAPH_INTERNALS = ("_root", "_len", "_graph_namespace", "_find_nodes_lookup_table", "_insert")
_NAMESPACE_INTERNALS = ("_used_names", "_obj_to_name", "_base_count")


def linking_supported(graph: torch.fx.Graph) -> bool:
    """Whether ``graph`` (a new, empty graph) has the internals :func:`rebuild`'s fast route links into."""
    if not all(hasattr(graph, name) for name in _GRAPH_INTERNALS):
        return False
    namespace, table, root = graph._graph_namespace, graph._find_nodes_lookup_table, graph._root
    return (all(hasattr(namespace, name) for name in _NAMESPACE_INTERNALS)
            and isinstance(namespace._used_names, set) and isinstance(namespace._obj_to_name, dict)
            and isinstance(getattr(table, "table", None), dict) and hasattr(root, "_prepend")
            and graph._len == 0 and graph.owning_module is None
            # create_node inserts at graph._insert; the default is the root's prepend (append at the end)
            and getattr(graph._insert, "__self__", None) is root
            and getattr(graph._insert, "__name__", None) == "prepend")


def rebuild(graph: torch.fx.Graph, order: Iterable[str], *, link: bool | None = None) -> torch.fx.Graph:
    """A new FX graph holding ``graph``'s nodes (names, targets, args, type, meta) in ``order``.

    ``order`` must hold every node name of ``graph`` once, each after the
    nodes it reads. ``link``: force the fast route (True) or the public API
    (False); by default the fast route where :func:`linking_supported`.
    """
    by_name = {node.name: node for node in graph.nodes}
    order = list(order)
    if len(order) != len(by_name) or set(order) != set(by_name):
        raise GraphError(f"order holds {len(order)} names for a graph of {len(by_name)} nodes, "
                         "or names that are not in the graph")
    old_nodes = [by_name[name] for name in order]
    new_graph = torch.fx.Graph()
    if link is None:
        link = linking_supported(new_graph)
    elif link and not linking_supported(new_graph):
        raise RuntimeError("this torch's FX graph lacks the internals the linking route needs")
    try:
        if not (link and _link(new_graph, old_nodes)):
            _create(new_graph, old_nodes)
    except KeyError as error:
        node = error.args[0]
        raise GraphError(f"order runs a reader of {getattr(node, 'name', node)!r} before "
                         f"{getattr(node, 'name', node)!r} itself") from None
    return new_graph


def _create(new_graph: torch.fx.Graph, old_nodes: list[torch.fx.Node]) -> None:
    """The public route: ``create_node`` per node, then its arguments."""
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    lookup = env.__getitem__
    map_arg = torch.fx.node.map_arg
    for old in old_nodes:
        name = old.name
        # Created bare, then given its inputs: create_node would walk every
        # argument looking for raw SymInts; captured graphs hold none.
        new_node = new_graph.create_node(old.op, old.target, name=name, type_expr=old.type)
        if new_node.name != name:  # names are the schedulers' keys
            raise GraphError(f"node {name!r} could not keep its name in the rebuilt graph")
        if old.args:
            new_node.args = map_arg(old.args, lookup)
        if old.kwargs:
            new_node.kwargs = map_arg(old.kwargs, lookup)
        new_node.meta.update(old.meta)  # a shallow copy; assigning would re-index the node in the graph
        env[old] = new_node


def _base_counts(namespace, names: list[str]) -> dict[str, int] | None:
    """The namespace's counters per base name after ``create_name`` took ``names`` in turn, or None if it
    would have changed one of them (not an ASCII identifier, a keyword, a builtin's name)."""
    counts: dict[str, int] = {}
    probe = None
    for name in names:
        head, _, tail = name.rpartition("_")
        if head and tail.isdecimal() and name.isascii() and name.isidentifier():
            counts[head] = int(tail)  # 'relu_12': base 'relu', number 12
            continue
        if not (name.isascii() and name.isidentifier()):
            return None
        if probe is None:
            probe = type(namespace)()
        if probe.create_name(name, None) != name:  # a name FX reserves (keyword, builtin, 'torch', ...)
            return None
        counts.setdefault(name, 0)
    return counts


def _link(new_graph: torch.fx.Graph, old_nodes: list[torch.fx.Node]) -> bool:
    """The fast route: each node constructed with its arguments and linked in as ``create_node`` links it.

    False (and ``new_graph`` untouched) where ``create_node`` would have renamed a node.
    """
    namespace = new_graph._graph_namespace
    names = [old.name for old in old_nodes]
    counts = _base_counts(namespace, names)
    if counts is None:
        return False
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    lookup = env.__getitem__
    map_arg = torch.fx.node.map_arg
    Node = torch.fx.Node
    no_kwargs = torch.fx.immutable_collections.immutable_dict()
    new_nodes = []
    for old in old_nodes:
        new_node = Node(new_graph, old.name, old.op, old.target, map_arg(old.args, lookup) if old.args else (),
                        map_arg(old.kwargs, lookup) if old.kwargs else no_kwargs, old.type)
        new_node.meta.update(old.meta)
        env[old] = new_node
        new_nodes.append(new_node)
    # Linked only once every node is built: a failed lookup (KeyError) leaves the graph empty.
    prepend = new_graph._root._prepend
    for new_node in new_nodes:
        prepend(new_node)
    namespace._used_names.update(names)
    namespace._obj_to_name.update(zip(new_nodes, names))
    namespace._base_count.update(counts)
    _index_nodes(new_graph._find_nodes_lookup_table.table, new_nodes)
    new_graph._len += len(new_nodes)
    return True


def _index_nodes(table: dict, nodes: list[torch.fx.Node]) -> None:
    """Add ``nodes`` to the graph's node lookup table (keyed by (op, target of a call_function), each key's
    nodes in insertion order), hashing each target once: an OpOverload's hash runs Python code."""
    buckets: dict = {}  # id(target) or op -> (key, nodes)
    for node in nodes:
        op = node.op
        slot = id(node.target) if op == "call_function" else op
        try:
            buckets[slot][1][node] = None
        except KeyError:
            buckets[slot] = ((op, node.target if op == "call_function" else None), {node: None})
    keys = [key for key, _ in buckets.values()]
    if len(set(keys)) < len(keys) or any(table.get(key) for key in keys):  # equal targets that are not one object
        for node in nodes:
            table[(node.op, node.target if node.op == "call_function" else None)][node] = None
        return
    for key, bucket in buckets.values():
        table[key] = bucket
