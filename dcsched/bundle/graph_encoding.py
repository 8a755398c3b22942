"""A graph as plain data and back: version 1's node form, checked on the way in.

:func:`encode_graph` turns an FX graph into one dict per node (name, op, target as a qualified name, args and
kwargs in the tagged encoding of :mod:`dcsched.bundle.arguments`, the kept meta); version 1 stores that list
as it is, and version 2 and 3 encode it further as columns (:func:`dcsched.bundle.columns.encode_fx`).
:func:`decode_graph` rebuilds the FX graph from it, refusing what a bundle may not hold: a call target
off the list of side-effect-free ops (:func:`resolve_target`), figures that are no believable measurement
(:func:`check_figures`, also the columns' check), dangling references and cycles.

Split from :mod:`dcsched.bundle.core` (the project keeps a module to one job and about 600 lines): the
:class:`~dcsched.bundle.core.Bundle` and its file live there, the node form of its graphs here.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Collection

import networkx as nx
import torch
import torch.fx

from dcsched import collectives
from dcsched.bundle import checks as loadchecks
from dcsched.bundle import op_allowlist
from dcsched.bundle.arguments import decode_argument

from dcsched.errors import BundleError
from dcsched.graph import commops
from dcsched.graph.roles import qualified_name

#: Python functions a graph may call, besides torch ops.
ALLOWED_OPERATORS = frozenset({
    "getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs",
    "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "not_", "invert", "lshift", "rshift",
})
#: Namespaces in which a stored name is looked up at all; within them, only the ops on the list of
#: side-effect-free ops load (:mod:`dcsched.bundle.op_allowlist`).
ALLOWED_OP_NAMESPACES = ("aten", "prims", *collectives.NAMESPACES)

_NODE_OPS = ("placeholder", "call_function", "get_attr", "output")
#: Largest figures a bundle may hold: beyond them a number is a corruption or a typo, not a measurement
#: (1 PiB in one tensor or parameter, :data:`dcsched.bundle.checks.MAX_BYTES`; a day of device time for one node).
MAX_BYTES = loadchecks.MAX_BYTES
MAX_NODE_MS = 24 * 3600 * 1000.0
#: Node meta kept in a bundle; everything else (FakeTensors, stack traces) is dropped.
KEPT_META = ("device_time", "tensor_size", "out", "ds_id", "time_source")


# ---------------------------------------------------------------------------
# Encoding graph arguments as plain data
# ---------------------------------------------------------------------------

def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _encode(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        return {"$node": value.name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return {"$dtype": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    if isinstance(value, torch.layout):
        return {"$layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"$memory_format": str(value).removeprefix("torch.")}
    if isinstance(value, slice):
        return {"$slice": [_encode(value.start), _encode(value.stop), _encode(value.step)]}
    if isinstance(value, tuple):  # torch.Size included
        return {"$tuple": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {"$dict": [[str(k), _encode(v)] for k, v in value.items()]}
    raise TypeError(f"cannot store a graph argument of type {type(value).__name__}")


def _decode(value: Any, env: dict[str, torch.fx.Node], refs: list[str]) -> Any:
    """``value`` decoded (:func:`dcsched.bundle.arguments.decode_argument`), each ``$node`` the FX node of
    that name in ``env``, its name appended to ``refs``."""

    def node(name: Any) -> torch.fx.Node:
        refs.append(name)
        return env[name]

    return decode_argument(value, node)


def _output_spec(val: Any) -> Any:
    """Shapes and dtypes of a node's output, from its FakeTensor ``meta['val']``."""
    if isinstance(val, torch.Tensor):
        return {"shape": [int(s) for s in val.shape], "dtype": dtype_name(val.dtype)}
    if isinstance(val, (tuple, list)):
        return [_output_spec(v) for v in val]
    return None


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def _encode_meta(node: torch.fx.Node) -> dict:
    meta = {key: node.meta[key] for key in KEPT_META if key in node.meta and _plain(node.meta[key])}
    if "out" not in meta and "val" in node.meta:
        meta["out"] = _output_spec(node.meta["val"])
    return meta


def encode_graph(graph: torch.fx.Graph) -> list[dict]:
    """The plain-data form of an FX graph: one dict per node, in graph order."""
    nodes = []
    for node in graph.nodes:
        if node.op not in _NODE_OPS:
            raise BundleError(None, f"node {node.name}: op {node.op!r} cannot be stored (only {_NODE_OPS})")
        target = node.target if node.op != "call_function" else qualified_name(node.target)
        try:
            args, kwargs = _encode(node.args), _encode(dict(node.kwargs))
        except TypeError as exc:
            raise BundleError(None, f"node {node.name}: {exc}") from None
        nodes.append({"name": node.name, "op": node.op, "target": target,
                      "args": args, "kwargs": kwargs, "meta": _encode_meta(node)})
    return nodes


def resolve_target(name: str):
    """The callable a stored qualified op name stands for: an ``operator`` function of
    :data:`ALLOWED_OPERATORS` or an op on the list of side-effect-free ops (:mod:`dcsched.bundle.op_allowlist`).

    Raises ValueError with the reason when the name is not allowed or unknown; an op off the list is refused
    by name (``op 'aten.from_file.default' is not allowed: ...``) before it is looked up.
    """
    namespace, _, rest = name.partition(".")
    if namespace == "operator":
        if rest not in ALLOWED_OPERATORS:
            raise ValueError(f"op '{name}' is not allowed: it is not an allowed operator function")
        return getattr(operator, rest)
    if namespace not in ALLOWED_OP_NAMESPACES:
        raise ValueError(f"op '{name}' is not allowed: a bundle calls only aten and prims ops on dcsched's list, "
                         "the ZeRO-3 ops and a few operator functions")
    if namespace == "dc":
        commops.ensure_deepspeed_ops()
    op_name, _, overload = rest.partition(".")
    overload = overload or "default"
    for part in (op_name, overload):
        loadchecks.check_op_name(part, name)
    loadchecks.check_registered_op(namespace, op_name, overload, name)
    op_allowlist.check_allowed(f"{namespace}.{op_name}.{overload}", registered=True)
    try:
        target = getattr(getattr(getattr(torch.ops, namespace), op_name), overload)
    except (AttributeError, RuntimeError):
        raise ValueError(f"unknown op '{name}' (not in torch {torch.__version__})") from None
    loadchecks.check_op(target, name)
    # The list was made from one torch; the schema in this one must agree that the op is side-effect free.
    why = op_allowlist.schema_refusal(target) if namespace in op_allowlist.DERIVED_NAMESPACES else None
    if why is not None:
        raise ValueError(f"op '{namespace}.{op_name}.{overload}' is not allowed: {why}")
    return target


def decode_graph(nodes: list[dict], graph_name: str, constants: set[str] | None = None, *,
                 graph_id: int | None = None, ds_ids: Collection[int] | None = None) -> torch.fx.Graph:
    """Rebuild an FX graph from :func:`encode_graph`'s form, checking it on the way.

    Raises ValueError naming the problem: a dangling node reference, a cycle,
    an unknown, disallowed or mutating op, a name that is not a plain
    identifier, arguments nested too deep (:mod:`dcsched.bundle.checks`), a
    malformed node, an output shape past belief, a ZeRO-3 op whose ``graph_id``
    is not ``graph_id`` (when given) or whose ``id`` is none of ``ds_ids`` (the
    parameter table's, when given). ``constants``: the names ``get_attr`` nodes may read.
    """
    if not isinstance(nodes, list):
        raise ValueError(f"graph '{graph_name}' is not a list of nodes")
    given = [n.get("name") if isinstance(n, dict) else None for n in nodes]
    names = [n for n in given if isinstance(n, str)]
    if len(names) != len(given):
        raise ValueError(f"graph '{graph_name}' holds a node without a name")
    if len(set(names)) != len(names):
        raise ValueError(f"graph '{graph_name}' holds two nodes of one name")
    allowance, used = loadchecks.arguments_allowance(len(nodes)), 0
    for entry in nodes:
        loadchecks.check_identifier(entry["name"], f"graph '{graph_name}': node name")
        left = allowance - used  # a pickle shares lists between nodes: the graph's total is bounded too
        try:
            used += loadchecks.check_arguments([entry.get("args"), entry.get("kwargs"), entry.get("meta")],
                                               f"graph '{graph_name}': node {entry['name']}",
                                               min(loadchecks.MAX_ITEMS, left))
        except loadchecks.TooManyValues:
            if left >= loadchecks.MAX_ITEMS:
                raise
            loadchecks.check_total_arguments(None, len(nodes), f"graph '{graph_name}'")
    _check_references(nodes, set(names), graph_name)
    for entry in nodes:
        meta = entry.get("meta") or {}
        check_figures(meta, f"graph '{graph_name}': node {entry['name']}")
        loadchecks.check_output_spec(meta.get("out"), f"graph '{graph_name}': node {entry['name']}")

    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    for entry in nodes:
        name, op = entry["name"], entry.get("op")
        if op not in _NODE_OPS:
            raise ValueError(f"node {name}: unknown node kind {op!r}")
        refs: list[str] = []
        args = _decode(entry.get("args", {"$tuple": []}), env, refs)
        kwargs = _decode(entry.get("kwargs", {"$dict": []}), env, refs)
        if not isinstance(args, tuple) or not isinstance(kwargs, dict):
            raise ValueError(f"node {name}: malformed args or kwargs")
        target = _node_target(entry, op, constants or set())
        if op == "call_function" and isinstance(target, torch._ops.OpOverload) and \
                target.namespace in collectives.NAMESPACES:
            loadchecks.check_comm_arguments(target._opname, args, kwargs, f"node {name}", graph_id=graph_id,
                                            ds_ids=ds_ids)
        node = graph.create_node(op, target, args, kwargs, name=name)
        if node.name != name:
            raise ValueError(f"node name {name!r} is not a valid FX node name")
        node.meta.update(entry.get("meta", {}))
        env[name] = node
    graph.lint()
    return graph


def _node_target(entry: dict, op: str, constants: set[str]):
    """A node's target: an allowed op, a placeholder's identifier (its argument name), a stored constant."""
    name = entry["name"]
    try:
        if op == "call_function":
            return resolve_target(entry["target"])
        target = entry.get("target", name)
        if op == "placeholder":
            loadchecks.check_identifier(target, "placeholder target")
        elif op == "get_attr":
            loadchecks.check_get_attr_target(target, constants)
        return target
    except ValueError as exc:
        raise ValueError(f"node {name}: {exc}") from None


def _check_number(value: Any, limit: float, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} is {value!r}, not a number")
    if not math.isfinite(value):
        raise ValueError(f"{what} is {value}, not a finite number")
    if value < 0:
        raise ValueError(f"{what} is negative ({value})")
    if value > limit:
        raise ValueError(f"{what} is {value:.6g}, over the largest believable ({limit:.6g})")


def check_figures(meta: dict, where: str) -> None:
    """Refuse a node's ``device_time`` (ms) / ``tensor_size`` (bytes) that is not a finite, believable figure.

    ``where`` names the node in the message. A missing figure (None) passes:
    the scheduler and simulator say what to do about those.

    >>> check_figures({"device_time": 0.5, "tensor_size": 64}, "node mm")
    >>> check_figures({"device_time": float("inf")}, "node mm")
    Traceback (most recent call last):
    ...
    ValueError: node mm: device_time is inf, not a finite number
    """
    for key, limit in (("device_time", MAX_NODE_MS), ("tensor_size", MAX_BYTES)):
        if meta.get(key) is not None:
            _check_number(meta[key], limit, f"{where}: {key}")


def _references(value: Any, out: list[str]) -> None:
    if isinstance(value, list):
        for v in value:
            _references(v, out)
    elif isinstance(value, dict):
        if set(value) == {"$node"}:
            out.append(value["$node"])
        else:
            for v in value.values():
                _references(v, out)


def _check_references(nodes: list[dict], names: set[str], graph_name: str) -> None:
    """Dangling references and cycles, reported before any graph is built."""
    deps = nx.DiGraph()
    out_of_order = None
    seen: set[str] = set()
    for entry in nodes:
        refs: list[str] = []
        _references([entry.get("args"), entry.get("kwargs")], refs)
        for ref in refs:
            if ref not in names:
                raise ValueError(f"graph '{graph_name}': node {entry['name']} refers to '{ref}', "
                                 "which is not in the graph")
            deps.add_edge(ref, entry["name"])
            if ref not in seen and out_of_order is None:
                out_of_order = (entry["name"], ref)
        seen.add(entry["name"])
    if out_of_order is None:
        return
    try:
        cycle = nx.find_cycle(deps)
    except nx.NetworkXNoCycle:
        raise ValueError(f"graph '{graph_name}': node {out_of_order[0]} reads {out_of_order[1]}, "
                         "which comes after it (nodes must be stored in a topological order)") from None
    path = " -> ".join([edge[0] for edge in cycle] + [cycle[0][0]])
    raise ValueError(f"graph '{graph_name}' has a cycle: {path}")
