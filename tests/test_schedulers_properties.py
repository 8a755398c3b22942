"""Invariants of the schedulers on fresh random graphs (hypothesis).

Every order is a topological order of exactly the input's nodes, the rebuilt
FX graph holds exactly the input's nodes and edges (kwargs included), and the
fast schedulers agree with their literal oracles, on DeepCompile-style graphs
and on arbitrary DAGs where the ZeRO-3 ops sit anywhere. On DAGs with random
ops (dropout, rand_like, bernoulli), every registered scheduler keeps them in
their input order.
"""

from __future__ import annotations


import torch
import torch.fx
from hypothesis import given, settings, strategies as st

from dcsched.graph.nxview import check_order, input_nodes, to_fx, to_networkx
from dcsched.graph.roles import is_random
from dcsched.schedulers import available, get  # noqa: F401
from dcsched.schedulers.overlap.scheduler import Overlap
from dcsched.synthetic import moe_graph, random_graph
from scheduling import scheduled

from strategies import arbitrary_dags, with_sink_chains
import oracle  # tests/oracle.py: the literal, slow statements of the rules

aten = torch.ops.aten
ALGOS = {"list": oracle.output_last_of(oracle.list_oracle),
         "simple-prefetch": oracle.output_last_of(oracle.simple_prefetch_oracle),
         "fast-free": oracle.output_last_of(oracle.fast_free_oracle)}


def _edges(graph: torch.fx.Graph) -> set[tuple[str, str, int]]:
    return {(src.name, node.name, k) for node in graph.nodes for k, src in enumerate(input_nodes(node))}


def _check_all(graph: torch.fx.Graph) -> None:
    view = to_networkx(graph)
    for algo, literal in ALGOS.items():
        order = scheduled(algo, view)
        check_order(view, order)
        assert order == scheduled(algo, view), f"{algo} is not deterministic"
        rebuilt = to_fx(graph, order)
        rebuilt.lint()
        assert [n.name for n in rebuilt.nodes] == order
        assert _edges(rebuilt) == _edges(graph)
        assert order == literal(view), f"{algo} differs from its oracle"
    # deepcompile: fast-free's order with all-gathers moved ahead, at any budget a valid order.
    for budget in (None, 0):  # None: no limit
        order = scheduled("deepcompile", view, memory_budget=budget)
        check_order(view, order)
        assert order == scheduled("deepcompile", view, memory_budget=budget)
        assert [v for v in order if view.nodes[v]["role"] != "allgather"] == \
            [v for v in scheduled("fast-free", view) if view.nodes[v]["role"] != "allgather"]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), kind=st.sampled_from(["forward", "backward"]),
       n_params=st.integers(1, 8), chains=st.integers(1, 3))
def test_graphs_with_chains_nothing_reads_keep_the_output_last(seed, kind, n_params, chains):
    # An all-gather, its wait, a compute node and the release before the output, none read by it: every
    # algorithm runs them before returning (check_order in _check_all demands the output last).
    graph = with_sink_chains(random_graph(seed, kind=kind, n_params=n_params), chains)
    _check_all(graph)
    view = to_networkx(graph)
    for algo in available():
        options = {"memory_budget": float("inf")} if "memory_budget" in get(algo).options else {}
        order = scheduled(algo, view, **options)
        assert view.nodes[order[-1]]["role"] == "output", algo


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), kind=st.sampled_from(["forward", "backward"]),
       n_params=st.integers(1, 8), kwargs_deps=st.booleans(), tie_prone=st.booleans())
def test_deepcompile_style_graphs(seed, kind, n_params, kwargs_deps, tie_prone):
    _check_all(random_graph(seed, kind=kind, n_params=n_params, kwargs_deps=kwargs_deps, tie_prone=tie_prone))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), kind=st.sampled_from(["forward", "backward"]), n_layers=st.integers(1, 2),
       n_experts=st.integers(2, 8), tie_prone=st.booleans())
def test_moe_graphs(seed, kind, n_layers, n_experts, tie_prone):
    _check_all(moe_graph(seed, kind=kind, n_layers=n_layers, n_experts=n_experts, tie_prone=tie_prone))


@settings(max_examples=80, deadline=None)
@given(graph=arbitrary_dags())
def test_arbitrary_dags(graph):
    _check_all(graph)


def _every_order(view):
    """Each registered scheduler's order of ``view`` (overlap at its smallest and an unlimited budget)."""
    for algo in available():
        if algo == "overlap":
            planner = Overlap(view)
            for scope in ("gathered", "all"):
                for budget in (planner.min_budget(scope), float("inf")):
                    yield f"overlap {scope} {budget}", planner.order(budget, scope)
        elif algo == "prefetch-ahead":
            for k in (0, 2):
                yield f"{algo} k={k}", scheduled(algo, view, k=k)
        else:
            yield algo, scheduled(algo, view)


@settings(max_examples=60, deadline=None)
@given(graph=arbitrary_dags(random_ops=True))
def test_random_ops_keep_their_order_under_every_scheduler(graph):
    _check_all(graph)
    view = to_networkx(graph)
    random_ops = [node.name for node in graph.nodes if is_random(node)]
    for label, order in _every_order(view):
        check_order(view, order)
        assert [name for name in order if name in set(random_ops)] == random_ops, label
