"""Hypothesis strategies and random orders shared by the property tests."""

from __future__ import annotations

import operator
import random

import torch
import networkx as nx
import torch.fx
from hypothesis import strategies as st

from dcsched.runtime import ops
from dcsched.synthetic import moe_graph, random_graph

aten = torch.ops.aten


#: Random ops for ``arbitrary_dags(random_ops=True)``: (target, extra args, returns a tuple).
RANDOM_OPS = ((aten.native_dropout.default, (0.5, True), True), (aten.rand_like.default, (), False),
              (aten.bernoulli.p, (0.5,), False))


#: DeepCompile-style graphs: random ZeRO-3-like DAGs and Mixtral-like stacks (a router and many
#: parallel same-size experts per layer), forward and backward.
zero3_graphs = st.one_of(
    st.builds(lambda seed, kind, n_params, kwargs_deps: random_graph(seed, kind=kind, n_params=n_params,
                                                                     kwargs_deps=kwargs_deps),
              st.integers(0, 10**6), st.sampled_from(["forward", "backward"]), st.integers(1, 10), st.booleans()),
    st.builds(lambda seed, kind, n_layers, n_experts, tie_prone: moe_graph(
        seed, kind=kind, n_layers=n_layers, n_experts=n_experts, tie_prone=tie_prone),
        st.integers(0, 10**6), st.sampled_from(["forward", "backward"]), st.integers(1, 2), st.integers(2, 8),
        st.booleans()))


@st.composite
def arbitrary_dags(draw, random_ops: bool = False):
    """A DAG of random compute and ZeRO-3 nodes reading random earlier nodes, some through kwargs only.

    With ``random_ops``, also ops that draw from the global generator (dropout, rand_like,
    bernoulli), on independent branches that an order could swap.
    """
    g = torch.fx.Graph()
    nodes = [g.placeholder(f"p{i}") for i in range(draw(st.integers(1, 4)))]
    for node in nodes:
        node.meta.update(device_time=0.0, tensor_size=draw(st.sampled_from([0, 8, 64])))
    kinds = ["compute", "compute", "kwarg", "ag", "wait", "release", "reduce", "tuple"] + ["random"] * 3 * random_ops
    for i in range(draw(st.integers(1, 30))):
        kind = draw(st.sampled_from(kinds))
        src = draw(st.sampled_from(nodes))
        ds_id = draw(st.integers(0, 3))
        if kind == "compute":
            other = draw(st.sampled_from(nodes))
            node = g.create_node("call_function", aten.add.Tensor, (src, other), name=f"c{i}")
        elif kind == "kwarg":
            other = draw(st.sampled_from(nodes))
            node = g.create_node("call_function", aten.add.Tensor, (src,), {"other": other}, name=f"k{i}")
        elif kind == "ag":
            node = g.create_node("call_function", ops.allgather_param, (src, 0, ds_id), name=f"ag{i}")
        elif kind == "wait":
            node = g.create_node("call_function", ops.wait_allgather, (src, 0, ds_id), name=f"w{i}")
        elif kind == "release":
            node = g.create_node("call_function", ops.release_param, (src, 0, ds_id, draw(st.integers(1, 3))),
                                 name=f"r{i}")
        elif kind == "reduce":
            node = g.create_node("call_function", ops.reduce_grad, (src, 0, ds_id), name=f"red{i}")
        elif kind == "random":
            target, extra, returns_tuple = draw(st.sampled_from(RANDOM_OPS))
            node = g.create_node("call_function", target, (src, *extra), name=f"rand{i}")
            if returns_tuple:
                node.meta.update(device_time=0.5, tensor_size=72)
                nodes.append(node)
                node = g.create_node("call_function", operator.getitem, (node, 0), name=f"gi{i}")
        else:
            tup = g.create_node("call_function", aten.split.Tensor, (src, 1), name=f"s{i}")
            tup.meta.update(device_time=draw(st.sampled_from([0.0, 0.5])), tensor_size=8)
            nodes.append(tup)
            node = g.create_node("call_function", operator.getitem, (tup, 0), name=f"gi{i}")
        node.meta.update(device_time=draw(st.sampled_from([0.0, 0.5, 1.0, 2.5])),
                         tensor_size=draw(st.sampled_from([0, 8, 64, 512])))
        nodes.append(node)
    outs = draw(st.lists(st.sampled_from(nodes), min_size=1, max_size=4))
    g.output(tuple(outs))
    return g


def random_topological_order(view: nx.DiGraph, rng: random.Random) -> list[str]:
    """A random valid order of ``view``: placeholders first in their input order, then any ready node."""
    nodes = sorted(view.nodes, key=lambda n: view.nodes[n]["position"])
    order = [n for n in nodes if view.nodes[n]["role"] == "placeholder"]
    waiting = {n: view.in_degree(n) for n in nodes}
    for n in order:
        for s in view.succ[n]:
            waiting[s] -= 1
    placed = set(order)
    ready = [n for n in nodes if waiting[n] == 0 and n not in placed]
    while ready:
        name = ready.pop(rng.randrange(len(ready)))
        order.append(name)
        for s in view.succ[name]:
            waiting[s] -= 1
            if waiting[s] == 0:
                ready.append(s)
    return order


def with_sink_chains(graph: torch.fx.Graph, count: int = 1) -> torch.fx.Graph:
    """``graph`` with ``count`` chains nothing reads before its output: all-gather, wait, a compute node, release.

    The shape the issue found orders returning early on: the output does not depend on the chain, so a greedy
    order may rank the output before it.
    """
    comm = torch.ops.dcsched
    placeholder = next(n for n in graph.nodes if n.op == "placeholder")
    output = next(n for n in graph.nodes if n.op == "output")
    for k in range(count):
        ds_id = 900 + k
        with graph.inserting_before(output):
            gathered = graph.call_function(comm.allgather_param.default, (placeholder, 0, ds_id))
            waited = graph.call_function(comm.wait_allgather.default, (gathered, 0, ds_id))
            computed = graph.call_function(torch.ops.aten.relu.default, (waited,))
            released = graph.call_function(comm.release_param.default, (computed, 0, ds_id, 1))
        for node, time, size in ((gathered, 0.5, 4096), (waited, 0.0, 4096), (computed, 1.0, 4096),
                                 (released, 0.0, 4096)):
            node.meta.update(device_time=time, tensor_size=size)
    return graph
