"""Invariants of the schedulers on fresh random graphs (hypothesis).

Every order is a topological order of exactly the input's nodes, the rebuilt
FX graph holds exactly the input's nodes and edges (kwargs included), and the
fast schedulers agree with their literal oracles, on DeepCompile-style graphs
and on arbitrary DAGs where the ZeRO-3 ops sit anywhere.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from hypothesis import given, settings, strategies as st

from dcsched import ops
from dcsched.nxview import check_order, input_nodes, to_fx, to_networkx
from dcsched.schedulers import get, oracle
from dcsched.synthetic import random_graph

aten = torch.ops.aten
ALGOS = {"list": oracle.list_oracle, "simple-prefetch": oracle.simple_prefetch_oracle,
         "fast-free": oracle.fast_free_oracle}


def _edges(graph: torch.fx.Graph) -> set[tuple[str, str, int]]:
    return {(src.name, node.name, k) for node in graph.nodes for k, src in enumerate(input_nodes(node))}


def _check_all(graph: torch.fx.Graph) -> None:
    view = to_networkx(graph)
    for algo, literal in ALGOS.items():
        order = get(algo)(view)
        check_order(view, order)
        assert order == get(algo)(view), f"{algo} is not deterministic"
        rebuilt = to_fx(graph, order)
        rebuilt.lint()
        assert [n.name for n in rebuilt.nodes] == order
        assert _edges(rebuilt) == _edges(graph)
        assert order == literal(view), f"{algo} differs from its oracle"


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), kind=st.sampled_from(["forward", "backward"]),
       n_params=st.integers(1, 8), kwargs_deps=st.booleans(), tie_prone=st.booleans())
def test_deepcompile_style_graphs(seed, kind, n_params, kwargs_deps, tie_prone):
    _check_all(random_graph(seed, kind=kind, n_params=n_params, kwargs_deps=kwargs_deps, tie_prone=tie_prone))


@st.composite
def arbitrary_dags(draw):
    """A DAG of random compute and ZeRO-3 nodes reading random earlier nodes, some through kwargs only."""
    g = torch.fx.Graph()
    nodes = [g.placeholder(f"p{i}") for i in range(draw(st.integers(1, 4)))]
    for node in nodes:
        node.meta.update(device_time=0.0, tensor_size=draw(st.sampled_from([0, 8, 64])))
    for i in range(draw(st.integers(1, 30))):
        kind = draw(st.sampled_from(["compute", "compute", "kwarg", "ag", "wait", "release", "reduce", "tuple"]))
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


@settings(max_examples=80, deadline=None)
@given(graph=arbitrary_dags())
def test_arbitrary_dags(graph):
    _check_all(graph)
