"""How many collectives a run issues under a communication plan: what the runtime's counters are held to."""

from __future__ import annotations

from typing import Mapping

import torch.fx

from dcsched.graph.roles import Role, comm_ids, role_of
from dcsched.runtime.commplan import CommPlan


def planned_collectives(graphs: Mapping[str, torch.fx.Graph], plan: CommPlan) -> int:
    """How many collectives one run of ``graphs`` (graph name -> graph) issues under ``plan`` at world size > 1.

    Every all-gather and every reduce alone, less ``len(bucket) - 1`` per
    bucket, less the backward's all-gathers of kept parameters (they reuse the
    forward's buffer), less every all-gather of a replicated parameter (it is
    whole on every rank; its reduce is an all-reduce, one collective still).
    The graph_id of each graph is read from its ops.

    Examples
    --------
    >>> from dcsched import replay
    >>> from dcsched.runtime.commplan import EMPTY, CommPlan, GraphComm
    >>> bundle = replay.example_bundle()
    >>> planned_collectives(bundle.graphs, EMPTY)
    7
    >>> planned_collectives(bundle.graphs, CommPlan({0: GraphComm(allgather=((0, 1, 2),))}, frozenset({2}), 0))
    4
    >>> planned_collectives(bundle.graphs, CommPlan(replicated=frozenset({2})))  # its two gathers go
    5
    """
    total = 0
    for graph in graphs.values():
        for node in graph.nodes:
            role = role_of(node)
            if role is Role.REDUCE:
                total += 1
            elif role is Role.ALLGATHER:
                graph_id, ds_id = comm_ids(node)
                if ds_id in plan.replicated:
                    continue
                if graph_id == plan.forward_graph_id or ds_id not in plan.kept:
                    total += 1
    for comm in plan.graphs.values():
        total -= sum(len(bucket) - 1 for bucket in comm.allgather + comm.reduce)
    return total
