"""dcsched.graph.fxbuild: the linking route and the public-API route rebuild identical FX graphs (hypothesis)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.fx
from hypothesis import given, settings, strategies as st

from dcsched.errors import GraphError
from dcsched.graph.fxbuild import linking_supported, rebuild
from dcsched.graph.nxview import to_networkx
from dcsched.synthetic.stacking import stack_copies
from dcsched.synthetic import layered_stack

from strategies import arbitrary_dags, random_topological_order, zero3_graphs

aten = torch.ops.aten
#: Names a graph built afterwards asks for: taken ones, numbered ones past gaps, fresh ones.
LATER_NAMES = ("c1", "c", "ag", "ag_7", "relu", "p0", "p", "add", "getitem", "x_3", "input", "sum")


def _structure(arg):
    return torch.fx.node.map_arg(arg, lambda n: ("node", n.name))


def fingerprint(graph: torch.fx.Graph) -> dict:
    """Everything a rebuilt graph holds, node references by name (so two graphs compare)."""
    namespace = graph._graph_namespace
    return {
        # First: generating code sets node attributes, which re-inserts the nodes into this table.
        "table": {key: [n.name for n in nodes] for key, nodes in graph._find_nodes_lookup_table.table.items() if nodes},
        "nodes": [(n.name, n.op, n.target, _structure(n.args), _structure(n.kwargs), n.type, n.meta,
                   [u.name for u in n.users], n._erased) for n in graph.nodes],
        "reverse": [n.name for n in reversed(graph.nodes)],
        "len": len(graph.nodes),
        "code": graph.python_code("self").src,
        "used": namespace._used_names,
        "obj_to_name": {node.name: name for node, name in namespace._obj_to_name.items()},
        "base_count": namespace._base_count,
        "sort_keys": [n < m for n, m in zip(graph.nodes, list(graph.nodes)[1:])],
    }


def _after_more_nodes(graph: torch.fx.Graph) -> list[str]:
    """The names the graph gives nodes created after the rebuild (its namespace state at work)."""
    x = next(iter(graph.nodes))
    with graph.inserting_before(None):
        return [graph.create_node("call_function", aten.relu.default, (x,), name=name).name for name in LATER_NAMES]


def assert_same_rebuild(graph: torch.fx.Graph, order: list[str]) -> None:
    linked, created = rebuild(graph, order, link=True), rebuild(graph, order, link=False)
    linked.lint()
    assert fingerprint(linked) == fingerprint(created)
    assert [n.name for n in linked.nodes] == order
    by_name = {n.name: n for n in graph.nodes}
    for node in linked.nodes:  # a shallow copy of meta, not the source's dict
        assert node.meta == by_name[node.name].meta and node.meta is not by_name[node.name].meta
    assert _after_more_nodes(linked) == _after_more_nodes(created)
    assert fingerprint(linked) == fingerprint(created)
    found = [[n.name for n in g.find_nodes(op="call_function", target=aten.relu.default)] for g in (linked, created)]
    assert found[0] == found[1]


def _shuffled(graph: torch.fx.Graph, seed: int) -> list[str]:
    return random_topological_order(to_networkx(graph), random.Random(seed))


def test_linking_is_supported_by_this_torch():
    assert linking_supported(torch.fx.Graph())


@settings(max_examples=60, deadline=None)
@given(graph=st.one_of(arbitrary_dags(), arbitrary_dags(random_ops=True), zero3_graphs), seed=st.integers(0, 10**6))
def test_both_routes_give_identical_graphs(graph, seed):
    assert_same_rebuild(graph, [n.name for n in graph.nodes])
    assert_same_rebuild(graph, _shuffled(graph, seed))


def test_identical_on_stacks_and_numbered_names():
    graph = stack_copies(layered_stack(2).backward, 3)  # names with _c1, _c2 suffixes, gaps in numbers
    assert_same_rebuild(graph, _shuffled(graph, 0))
    g = torch.fx.Graph()
    x = g.placeholder("x_10")
    y = g.create_node("call_function", aten.relu.default, (x,), name="relu_3")
    z = g.create_node("call_function", aten.add.Tensor, (y, x), {"alpha": 2}, name="relu")
    w = g.create_node("call_function", aten.add.Tensor, (z,), {"other": y}, name="relu_01")
    g.output((w,))
    assert_same_rebuild(g, ["x_10", "relu_3", "relu", "relu_01", "output"])


def test_reader_before_its_input_is_a_graph_error_on_both_routes():
    graph = layered_stack(1).forward
    names = [n.name for n in graph.nodes]
    for link in (True, False):
        with pytest.raises(GraphError, match="before"):
            rebuild(graph, names[::-1], link=link)
        with pytest.raises(GraphError, match="names"):
            rebuild(graph, names[:-1], link=link)


@pytest.mark.parametrize("name", ["input", "sum", "class", "torch"])
def test_a_name_fx_would_change_is_refused_as_on_the_public_route(name):
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.create_node("call_function", aten.relu.default, (x,), name="y")
    g.output((y,))
    y.name = name  # only direct assignment gets such a name into a graph
    for link in (None, False):
        with pytest.raises(GraphError, match="keep its name"):
            rebuild(g, ["x", name, "output"], link=link)


def test_falls_back_to_the_public_api_without_the_expected_internals(monkeypatch):
    graph = stack_copies(layered_stack(1).forward, 2)
    order = _shuffled(graph, 1)
    expected = fingerprint(rebuild(graph, order, link=True))
    original_init = torch.fx.Graph.__init__

    def init_with_other_insert_point(self, *args, **kwargs):  # a torch whose graphs insert differently
        original_init(self, *args, **kwargs)
        root = self._root
        self._insert = lambda node: root.prepend(node)

    monkeypatch.setattr(torch.fx.Graph, "__init__", init_with_other_insert_point)
    assert not linking_supported(torch.fx.Graph())
    with pytest.raises(RuntimeError, match="internals"):
        rebuild(graph, order, link=True)
    assert fingerprint(rebuild(graph, order)) == expected
