"""Large ZeRO-3 graphs with captured shapes: copies of a captured graph chained one after another.

:func:`stack_copies` turns a captured, profiled graph (a bundle's forward or
backward graph: real ops, sizes and times) into one ``copies`` times as
large, for benchmarks at 10^5 nodes with real shapes. Each copy is the whole
graph with its own parameters (every parameter shard and every ZeRO-3 op of
copy ``k`` gets its own ``ds_id``), so the stack gathers ``copies`` times as
many parameters, like a model that many times as deep. The copies share the
graph's other inputs (the batch, saved activations), and copy ``k`` starts
only after copy ``k - 1``: its first compute node that reads no parameter
also reads the previous copy's last compute node (an extra argument in
kwargs, ``after``), so the copies run in sequence as layers do.

The stacked graph is for scheduling and simulation (the extra argument makes
it unrunnable); it follows DeepCompile's insertion rules as the captured
graph does.

>>> import dcsched
>>> from dcsched.synthetic import layered_stack
>>> g = layered_stack(1).forward
>>> big = stack_copies(g, 3)
>>> gathers = lambda graph: sum(1 for n in graph.nodes if dcsched.role_of(n) is dcsched.Role.ALLGATHER)
>>> gathers(big) == 3 * gathers(g)
True
>>> dcsched.simulate(dcsched.schedule(big, "fast-free")).step_ms > 2 * dcsched.simulate(g).step_ms
True
"""

from __future__ import annotations

import torch.fx

from dcsched.graph.roles import COMM_ROLES, Role, ds_id_of, role_of


def stack_copies(graph: torch.fx.Graph, copies: int) -> torch.fx.Graph:
    """``copies`` chained copies of ``graph`` in one graph (see the module docstring); ``graph`` is unchanged."""
    if copies < 1:
        raise ValueError(f"copies must be at least 1, not {copies}")
    nodes = list(graph.nodes)
    shards = {n for n in nodes if n.op == "placeholder" and any(role_of(u) is Role.ALLGATHER for u in n.users)}
    ids = [d for d in (ds_id_of(n) for n in nodes) if d is not None]
    stride = max(ids, default=-1) + 1
    stacked = torch.fx.Graph()
    shared: dict[torch.fx.Node, torch.fx.Node] = {}
    own: list[dict[torch.fx.Node, torch.fx.Node]] = [{} for _ in range(copies)]
    # All placeholders first (the graph's signature): the shared inputs, then each copy's shards.
    for node in nodes:
        if node.op == "placeholder" and node not in shards:
            shared[node] = _copy_placeholder(stacked, node, node.name)
    for k in range(copies):
        for node in nodes:
            if node in shards:
                own[k][node] = _copy_placeholder(stacked, node, f"{node.name}_c{k}" if k else node.name)
    outputs: list = []
    previous_tail = None
    for k in range(copies):
        env = {**shared, **own[k]}
        chained = previous_tail is None
        tail = None
        for node in nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                outputs.extend(torch.fx.node.map_arg(node.args[0], env.__getitem__))
                continue
            args = torch.fx.node.map_arg(node.args, env.__getitem__)
            kwargs = dict(torch.fx.node.map_arg(node.kwargs, env.__getitem__))
            role = role_of(node)
            if role in COMM_ROLES:  # (value, graph_id, ds_id, ...): this copy's own parameter
                if len(args) > 2:
                    args = (*args[:2], args[2] + k * stride, *args[3:])
                else:
                    kwargs["id"] = kwargs["id"] + k * stride
            elif not chained and node.op == "call_function" and not any(p in shards for p in node.all_input_nodes):
                kwargs["after"] = previous_tail  # start this copy after the previous one
                chained = True
            new = stacked.create_node(node.op, node.target, args, kwargs, name=f"{node.name}_c{k}" if k else node.name)
            new.meta.update(node.meta)
            env[node] = new
            if role is Role.COMPUTE and node.op == "call_function":
                tail = new
        previous_tail = tail if tail is not None else previous_tail
    stacked.output(tuple(outputs))
    return stacked


def _copy_placeholder(graph: torch.fx.Graph, node: torch.fx.Node, name: str) -> torch.fx.Node:
    new = graph.placeholder(name)
    new.meta.update(node.meta)
    return new
