"""A bundle's sizes for a world size: ``tensor_size`` of every node with ZeRO-3 sharding over ``W`` ranks.

A parameter placeholder holds its shard (``ceil(numel/W) * itemsize``), an
all-gather the gathered parameter (full size), a reduce-grad this rank's
gradient shard; every other node its outputs' bytes. :func:`resharded` re-sizes
a profiled bundle for another world size, its times kept.
"""

from __future__ import annotations

from dcsched.bundle.core import Bundle
from dcsched.graph.nxview import copy_graph
from dcsched.graph.roles import Role, role_of
from dcsched.graph.specs import node_bytes, sharded_bytes


def tensor_sizes(bundle: Bundle, world_size: int) -> dict[str, dict[str, int]]:
    """``tensor_size`` (bytes) per node of each graph, ZeRO-3 sharding over ``world_size`` ranks applied."""
    param_placeholders = {"forward": _param_placeholder_names(bundle, "forward"),
                          "backward": _param_placeholder_names(bundle, "backward")}
    sizes: dict[str, dict[str, int]] = {}
    for name, graph in bundle.graphs.items():
        out = {}
        for node in graph.nodes:
            role = role_of(node)
            if role is Role.OUTPUT:
                out[node.name] = 0
            elif (role is Role.PLACEHOLDER and node.name in param_placeholders[name]) or role is Role.REDUCE:
                out[node.name] = sharded_bytes(node, world_size)
            else:
                out[node.name] = node_bytes(node)
        sizes[name] = out
    return sizes


def resharded(bundle: Bundle, world_size: int) -> Bundle:
    """A copy of ``bundle`` whose ``tensor_size`` figures are those of a run over ``world_size`` ranks.

    Times are kept; only shard-dependent sizes (parameter shards, reduced
    gradients) change, so a bundle profiled for 8 ranks can be compared with a
    single-process replay.
    """
    sizes = tensor_sizes(bundle, world_size)
    graphs = {}
    for name, graph in bundle.graphs.items():
        copy = copy_graph(graph)
        for node in copy.nodes:
            if "tensor_size" in node.meta:
                node.meta["tensor_size"] = sizes[name][node.name]
        graphs[name] = copy
    result = bundle.with_graphs(**graphs)
    result.plans = dict(bundle.plans)  # the same nodes (sizes alone change): the plans still hold
    result.provenance["world_size"] = world_size
    return result


def _param_placeholder_names(bundle: Bundle, graph_name: str) -> set[str]:
    """Placeholders holding a parameter shard: the forward's params, and the backward's saved copies of them.

    The backward reads a saved parameter under its forward placeholder name.
    """
    forward = [n for n in bundle.forward.nodes if n.op == "placeholder"]
    names = {node.name for node, kind in zip(forward, bundle.forward_placeholders) if kind.get("kind") == "param"}
    graph = bundle.graphs.get(graph_name)
    if graph_name == "forward" or graph is None:
        return names if graph is not None else set()
    return {n.name for n in graph.nodes if n.op == "placeholder" and n.name in names}
