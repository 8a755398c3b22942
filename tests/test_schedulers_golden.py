"""Differential tests: dcsched's fast-free and simple-prefetch give DeepSpeed 0.19.8's orders.

The orders were recorded from DeepSpeed 0.19.8 itself (no memory budget) by
``tools/record_golden.py``; this suite does not need DeepSpeed.
"""

from __future__ import annotations

import pytest

from dcsched.nxview import check_order, to_networkx
from dcsched.schedulers import get
from dcsched.synthetic import graph_digest
from golden_corpus import build, records

ALGOS = ("fast-free", "simple-prefetch")
RECORDS = records()


def test_corpus_covers_every_kind_of_graph():
    sources = {(r["graph"]["source"], r["graph"]["kind"]) for r in RECORDS}
    assert {("random", "forward"), ("random", "backward"), ("layered", "forward"), ("layered", "backward"),
            ("bundle", "forward"), ("bundle", "backward")} <= sources
    compared = [r for r in RECORDS if all(r[a].get("valid") for a in ALGOS)]
    assert len(compared) >= 250
    assert max(r["nodes"] for r in compared) >= 400


@pytest.mark.parametrize("record", RECORDS, ids=[r["id"] for r in RECORDS])
def test_matches_deepspeed(record):
    graph = build(record["graph"])
    assert graph_digest(graph) == record["digest"], "the corpus graph changed since recording: re-record"
    view = to_networkx(graph)
    names = [n.name for n in graph.nodes]
    for algo in ALGOS:
        ours = get(algo)(view)
        check_order(view, ours)
        golden = record[algo]
        if golden.get("valid"):
            assert ours == [names[i] for i in golden["order"]], algo
        # Otherwise DeepSpeed failed or gave an invalid order (a dependency only
        # kwargs carry): there is nothing to match, and ours is still valid.


def test_deepspeed_fails_where_only_kwargs_carry_a_dependency():
    kwarg_graphs = [r for r in RECORDS if r["graph"].get("kwargs_deps")]
    assert any("error" in r["fast-free"] or not r["fast-free"]["valid"] for r in kwarg_graphs)
