"""The fast schedulers equal their literal oracles, including on graphs too large for DeepSpeed's code."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcsched.bundle.core import load as load_bundle
from dcsched.graph.nxview import to_networkx
from dcsched.synthetic.stacking import stack_copies
from dcsched.synthetic import layered_stack, moe_graph, random_graph
from scheduling import scheduled

import oracle  # tests/oracle.py: the literal, slow statements of the rules

SAMPLES = Path(__file__).resolve().parent.parent / "sample_graphs"
ORACLES = {"fast-free": oracle.output_last_of(oracle.fast_free_oracle),
           "simple-prefetch": oracle.output_last_of(oracle.simple_prefetch_oracle),
           "list": oracle.output_last_of(oracle.list_oracle)}


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_random_graphs(seed, kind):
    view = to_networkx(random_graph(5000 + seed, kind=kind, kwargs_deps=seed % 2 == 0))
    for algo, literal in ORACLES.items():
        assert scheduled(algo, view) == literal(view), algo


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_large_random_graph(kind):
    view = to_networkx(random_graph(77, kind=kind, n_params=250, n_ops=900, kwargs_deps=True))
    assert view.number_of_nodes() > 1500
    for algo in ("fast-free", "simple-prefetch"):
        assert scheduled(algo, view) == ORACLES[algo](view), algo


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_deep_layered_stack(kind):
    # Deeper than DeepSpeed's recursive DFS allows at the default recursion limit.
    view = to_networkx(getattr(layered_stack(24), kind))
    assert view.number_of_nodes() > 2000
    for algo in ("fast-free", "simple-prefetch"):
        assert scheduled(algo, view) == ORACLES[algo](view), algo


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_moe_graphs(seed, kind):
    # Many parallel same-size experts: the count-1 candidates that lose round after round, and their ties.
    view = to_networkx(moe_graph(seed, kind=kind))
    for algo in ("fast-free", "simple-prefetch"):
        assert scheduled(algo, view) == ORACLES[algo](view), algo


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_stacked_captured_copies(kind):
    # Each copy's inputs-only branches (embedding, rotary tables) wait beside the other copies' rounds.
    graph = getattr(load_bundle(SAMPLES / "llama.pt"), kind)
    view = to_networkx(stack_copies(graph, 3))
    assert scheduled("fast-free", view) == ORACLES["fast-free"](view)
