"""What a bundle holds, as plain data (``dcsched show``)."""

from __future__ import annotations

from collections import Counter

from dcsched.bundle import saved_memory
from dcsched.bundle.core import Bundle
from dcsched.bundle.plans import plan_counts
from dcsched.graph.form import COMM_KINDS, COMPUTE, CONSTANT, KIND_NAMES, OUTPUT, PLACEHOLDER
from dcsched.graph.roles import Role


def summarize(bundle: Bundle) -> dict:
    """Per graph: node counts by role, compute and communication time, its plan; parameters; provenance.

    Times are milliseconds, sizes bytes; a figure the bundle lacks counts as 0
    and the node is listed under ``unprofiled``. A graph's ``plan`` counts its
    buckets, their members and the parameters by residency
    (:func:`dcsched.bundle.plans.plan_counts`; a graph without a stored plan:
    no bucket, every parameter sharded).
    """
    ds_ids = [p.ds_id for p in bundle.params]
    graphs = {}
    for name in bundle.graph_names:
        form = bundle.form(name)  # straight from a version-2 bundle's columns: no FX graph, no networkx view
        # A constant (get_attr) counts as compute, as in the networkx view.
        roles = Counter(KIND_NAMES[COMPUTE if k == CONSTANT else k] for k in form.kind)
        compute = comm = 0.0
        unprofiled = 0
        for k, time in zip(form.kind, form.device_time):
            if k in (PLACEHOLDER, OUTPUT):
                continue
            if time is None:
                unprofiled += 1
                continue
            if k in COMM_KINDS:
                comm += time
            elif k in (COMPUTE, CONSTANT):
                compute += time
        graphs[name] = {
            "graph_id": bundle.graph_ids.get(name),
            "nodes": len(form),
            "roles": {role.value: roles.get(role.value, 0) for role in Role},
            "compute_ms": compute,
            "comm_ms": comm,
            "unprofiled": unprofiled,
            "plan": plan_counts(bundle.plans.get(name), ds_ids),
        }
    params = [{"name": p.name, "ds_id": p.ds_id, "shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch."),
               "bytes": p.nbytes} for p in bundle.params]
    saved = saved_memory.from_provenance(bundle.provenance)
    return {
        "graphs": graphs,
        "params": params,
        "param_bytes": sum(p["bytes"] for p in params),
        "inputs": [{"name": i.name, "shape": list(i.shape), "dtype": str(i.dtype).removeprefix("torch."),
                    "stored": i.value is not None} for i in bundle.inputs],
        "provenance": bundle.provenance,
        "activation_memory": saved.to_json() if saved is not None else None,
    }
