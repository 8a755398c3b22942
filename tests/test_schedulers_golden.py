"""Differential tests: dcsched's fast-free, simple-prefetch and deepcompile give DeepSpeed 0.19.8's orders.

The orders were recorded from DeepSpeed 0.19.8 itself by ``tools/record_golden.py``
(fast-free and simple-prefetch with no memory budget; the prefetch pass of
``deepcompile`` at several budgets); this suite does not need DeepSpeed.
"""

from __future__ import annotations

import pytest

from dcsched.graph.form import output_last
from dcsched.graph.nxview import check_order, to_networkx
from dcsched.synthetic import graph_digest
from dcsched.schedulers.deepcompile import DeepCompile
from scheduling import scheduled
from golden_corpus import build, prefetch_records, records

ALGOS = ("fast-free", "simple-prefetch")
RECORDS = records()
PREFETCH = prefetch_records()


def test_corpus_covers_every_kind_of_graph():
    sources = {(r["graph"]["source"], r["graph"]["kind"]) for r in RECORDS}
    assert {("random", "forward"), ("random", "backward"), ("layered", "forward"), ("layered", "backward"),
            ("bundle", "forward"), ("bundle", "backward")} <= sources
    compared = [r for r in RECORDS if all(r[a].get("valid") for a in ALGOS)]
    assert len(compared) >= 250
    assert max(r["nodes"] for r in compared) >= 400


def _recorded_graph(record) -> tuple:
    """The view of a record's graph and its node names, after checking it is the graph recorded."""
    graph = build(record["graph"])
    assert graph_digest(graph) == record["digest"], "the corpus graph changed since recording: re-record"
    return to_networkx(graph), [n.name for n in graph.nodes]


@pytest.mark.parametrize("record", RECORDS, ids=[r["id"] for r in RECORDS])
def test_matches_deepspeed(record):
    view, names = _recorded_graph(record)
    for algo in ALGOS:
        ours = scheduled(algo, view)
        check_order(view, ours)
        golden = record[algo]
        if golden.get("valid"):
            # DeepSpeed may place the output before a chain nothing reads (its code then returns before the
            # chain runs); dcsched keeps every other node in DeepSpeed's place and the output last.
            assert ours == output_last(view, [names[i] for i in golden["order"]]), algo
        # Otherwise DeepSpeed failed or gave an invalid order (a dependency only
        # kwargs carry): there is nothing to match, and ours is still valid.


def _output_index(record) -> int:
    return next(i for i, node in enumerate(build(record["graph"]).nodes) if node.op == "output")


def test_deepspeed_returns_early_on_graphs_with_chains_nothing_reads():
    # Why the comparison above moves the output last: some of DeepSpeed's own orders put it before such chains.
    early = [(r["id"], algo) for r in RECORDS for algo in ALGOS
             if r[algo].get("valid") and r[algo]["order"][-1] != _output_index(r)]
    assert early and all(record_id.startswith("source=random") for record_id, _ in early), early


def test_deepspeed_fails_where_only_kwargs_carry_a_dependency():
    kwarg_graphs = [r for r in RECORDS if r["graph"].get("kwargs_deps")]
    assert any("error" in r["fast-free"] or not r["fast-free"]["valid"] for r in kwarg_graphs)


def test_prefetch_corpus_exercises_memory_and_fusion():
    runs = [run for r in PREFETCH for run in r["runs"]]
    assert len(PREFETCH) >= 250 and all("plan" in run for run in runs)
    fused = [run for run in runs if any(isinstance(x, list) and len(x) > 1 for x in run["plan"])]
    # The tight budgets hold prefetches back: some plan issues a group after the first compute node.
    held = [run for run in runs if any(isinstance(x, list) for x in run["plan"][len(run["plan"]) // 3:])]
    assert len(fused) >= len(runs) // 2 and len(held) >= 100


@pytest.mark.parametrize("record", PREFETCH, ids=[r["id"] for r in PREFETCH])
def test_deepcompile_matches_deepspeeds_prefetch_pass(record):
    view, names = _recorded_graph(record)
    pipeline = DeepCompile(view)
    for run in record["runs"]:
        plan = pipeline.plan(run["budget"])
        golden = [tuple(names[i] for i in x) if isinstance(x, list) else names[x] for x in run["plan"]]
        assert plan.deepspeed == golden, run["budget"]
        check_order(view, plan.order)
        # dcsched's form: every other node keeps DeepSpeed's place, each group's members run back to back.
        moved = {g for group in plan.groups for g in group}
        assert [v for v in plan.order if v not in moved] == \
            [x for x in plan.deepspeed if not isinstance(x, tuple) and x not in moved]
        at = {v: i for i, v in enumerate(plan.order)}
        assert all(at[group[-1]] - at[group[0]] == len(group) - 1 for group in plan.groups)
