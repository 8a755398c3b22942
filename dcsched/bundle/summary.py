"""What a bundle holds, as plain data (``dcsched show``)."""

from __future__ import annotations

from collections import Counter

from dcsched.bundle.core import Bundle
from dcsched.graph.nxview import to_networkx
from dcsched.graph.roles import Role


def summarize(bundle: Bundle) -> dict:
    """Per graph: node counts by role, compute and communication time; parameters; provenance.

    Times are milliseconds, sizes bytes; a figure the bundle lacks counts as 0
    and the node is listed under ``unprofiled``.
    """
    graphs = {}
    for name, graph in bundle.graphs.items():
        view = to_networkx(graph)
        roles = Counter(data["role"] for _, data in view.nodes(data=True))
        compute = comm = 0.0
        unprofiled = 0
        for _, data in view.nodes(data=True):
            if data["role"] in (Role.PLACEHOLDER.value, Role.OUTPUT.value):
                continue
            time = data["device_time"]
            if time is None:
                unprofiled += 1
                continue
            if data["role"] in (Role.ALLGATHER.value, Role.REDUCE.value):
                comm += time
            elif data["role"] == Role.COMPUTE.value:
                compute += time
        graphs[name] = {
            "graph_id": bundle.graph_ids.get(name),
            "nodes": view.number_of_nodes(),
            "roles": {role.value: roles.get(role.value, 0) for role in Role},
            "compute_ms": compute,
            "comm_ms": comm,
            "unprofiled": unprofiled,
        }
    params = [{"name": p.name, "ds_id": p.ds_id, "shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch."),
               "bytes": p.nbytes} for p in bundle.params]
    return {
        "graphs": graphs,
        "params": params,
        "param_bytes": sum(p["bytes"] for p in params),
        "inputs": [{"name": i.name, "shape": list(i.shape), "dtype": str(i.dtype).removeprefix("torch."),
                    "stored": i.value is not None} for i in bundle.inputs],
        "provenance": bundle.provenance,
    }
