"""dcsched.graph.lastuse follows DeepSpeed's get_last_uses (golden data recorded from 0.19.8) and reads kwargs."""

from __future__ import annotations

import pytest
import torch
import torch.fx

from dcsched.runtime import ops
from oracle import last_uses, last_uses_by_user
from dcsched.graph.nxview import to_networkx
from golden_corpus import build, records

aten = torch.ops.aten
RECORDS = records()


@pytest.mark.parametrize("record", RECORDS[::7], ids=[r["id"] for r in RECORDS[::7]])
def test_matches_deepspeed_get_last_uses(record):
    graph = build(record["graph"])
    names = [n.name for n in graph.nodes]
    expected = {names[v]: names[u] for v, u in record["last_uses"]}
    assert last_uses(to_networkx(graph)) == expected


def _graph():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.placeholder("y")
    return g, x, y


def _call(g, target, args, name, kwargs=None):
    return g.create_node("call_function", target, args, kwargs or {}, name=name)


def test_plain_reader_is_the_last_use():
    g, x, y = _graph()
    a = _call(g, aten.relu.default, (x,), "a")
    b = _call(g, aten.add.Tensor, (a, x), "b")
    g.output((b,))
    found = last_uses(to_networkx(g))
    assert found["x"] == "b" and found["a"] == "b" and found["b"] == "output"
    assert "y" not in found  # nobody reads y


def test_reading_through_a_view_extends_life_to_the_views_last_use():
    g, x, _ = _graph()
    v = _call(g, aten.t.default, (x,), "v")           # aliasing
    a = _call(g, aten.relu.default, (x,), "a")
    b = _call(g, aten.relu.default, (v,), "b")        # x is read last through v, here
    g.output((a, b))
    found = last_uses(to_networkx(g))
    assert found["x"] == "b" and found["v"] == "b"
    assert last_uses_by_user(to_networkx(g))["b"] == ["v", "x"]


def test_wait_aliases_but_release_does_not():
    g, x, _ = _graph()
    ag = _call(g, ops.allgather_param, (x, 0, 7), "ag")
    w = _call(g, ops.wait_allgather, (ag, 0, 7), "w")
    use = _call(g, aten.relu.default, (w,), "use")
    rel = _call(g, ops.release_param, (use, 0, 7, 1), "rel")
    out = _call(g, aten.neg.default, (rel,), "out")
    g.output((out,))
    found = last_uses(to_networkx(g))
    assert found["ag"] == "use"       # the gathered buffer's last use is the use through the wait
    assert found["use"] == "rel" and found["rel"] == "out"


def test_kwargs_readers_count():
    g, x, y = _graph()
    a = _call(g, aten.add.Tensor, (x,), "a", kwargs={"other": y})
    g.output((a,))
    assert last_uses(to_networkx(g))["y"] == "a"
