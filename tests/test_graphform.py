"""The shared integer-indexed graph form: the same form from an FX graph and from its networkx view."""

from __future__ import annotations

import random

import networkx as nx
import pytest
from hypothesis import given, settings

from dcsched.errors import GraphError
from dcsched.graph.form import ALLGATHER, FIELDS, PLACEHOLDER, GraphForm, Kind
from dcsched.graph.nxview import to_networkx
from dcsched.synthetic import layered_stack

from strategies import arbitrary_dags


def _fields(form: GraphForm) -> dict:
    return {field: getattr(form, field) for field in FIELDS}


@settings(max_examples=40, deadline=None)
@given(arbitrary_dags(random_ops=True))
def test_the_form_of_an_fx_graph_is_the_form_of_its_view(graph):
    assert _fields(GraphForm(graph)) == _fields(GraphForm(to_networkx(graph)))


@settings(max_examples=20, deadline=None)
@given(arbitrary_dags())
def test_a_view_with_its_vertices_shuffled_gives_the_same_form(graph):
    view = to_networkx(graph)
    names = list(view.nodes)
    random.Random(0).shuffle(names)
    shuffled = nx.DiGraph()
    shuffled.graph.update(view.graph)
    for name in names:
        shuffled.add_node(name, **view.nodes[name])
    for name in view.nodes:  # inputs in reading order, as the view has them
        for source in view.pred[name]:
            shuffled.add_edge(source, name)
    assert _fields(GraphForm(shuffled)) == _fields(GraphForm(view))


def test_kinds_edges_and_shared_lists_on_a_layered_graph():
    graph = layered_stack(1).forward
    form = GraphForm(graph)
    nodes = list(graph.nodes)
    assert form.names == [n.name for n in nodes]
    assert all(isinstance(k, Kind) for k in form.kind)
    for i, node in enumerate(nodes):
        assert form.preds[i] == tuple(form.index[p.name] for p in node.all_input_nodes)
        assert sorted(form.succs[i]) == sorted(form.index[u.name] for u in node.users)
        assert (form.kind[i] == PLACEHOLDER) == (node.op == "placeholder")
    view = to_networkx(graph)
    assert [k == ALLGATHER for k in form.kind] == [view.nodes[n]["role"] == "allgather" for n in form.names]
    assert sum(k == ALLGATHER for k in form.kind) > 10
    assert form.topo == list(range(len(nodes))) and form.output == len(nodes) - 1
    copy = GraphForm(form)
    assert copy.preds is form.preds and copy.kind is form.kind


def test_a_view_out_of_topological_order_is_refused_by_the_fast_schedulers_and_a_cycle_by_all():
    view = nx.DiGraph()
    view.add_node("a", role="compute", position=0)
    view.add_node("b", role="compute", position=1)
    view.add_edge("b", "a")
    form = GraphForm(view)
    assert form.topo == [1, 0]
    with pytest.raises(GraphError, match="does not come before it"):
        form.check_input_order()
    view.add_edge("a", "b")
    with pytest.raises(GraphError, match="my graph has a cycle"):
        GraphForm(view, label="my graph")


def test_check_order_refuses_what_nxview_check_order_refuses():
    graph = layered_stack(1).forward
    form = GraphForm(graph)
    good = list(form.names)
    form.check_order(good)
    with pytest.raises(GraphError, match="before its input"):
        form.check_order(good[1:2] + good[:1] + good[2:] if form.preds[1] else list(reversed(good)))
    with pytest.raises(GraphError, match="not a permutation"):
        form.check_order(good[:-1])
    with pytest.raises(GraphError, match="not a permutation"):
        form.check_order(good[:-1] + ["nope"])


def test_random_ops_are_chained_in_the_form_of_an_fx_graph_as_in_its_view():
    import torch
    import torch.fx

    g = torch.fx.Graph()
    x = g.placeholder("x")
    a = g.create_node("call_function", torch.ops.aten.rand_like.default, (x,), name="rand0")
    b = g.create_node("call_function", torch.ops.aten.relu.default, (x,), name="relu")
    c = g.create_node("call_function", torch.ops.aten.rand_like.default, (b,), name="rand1")
    d = g.create_node("call_function", torch.ops.aten.add.Tensor, (a, c), name="add")
    g.output((d,))
    form = GraphForm(g)
    assert _fields(form) == _fields(GraphForm(to_networkx(g)))
    assert form.order_only == [(1, 3)] and form.preds[3] == (2, 1)
