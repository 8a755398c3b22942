"""Chained copies of a captured graph (dcsched.synthetic.stacking): a valid ZeRO-3 graph that schedules and
simulates."""

from __future__ import annotations

from pathlib import Path

import networkx as nx
import pytest

import dcsched
from dcsched.graph.nxview import check_order, to_networkx
from dcsched.graph.roles import Role, ds_id_of, role_of
from dcsched.synthetic.stacking import stack_copies

SAMPLE = Path(__file__).resolve().parent.parent / "sample_graphs" / "llama.pt"


@pytest.fixture(scope="module")
def llama():
    return dcsched.load(SAMPLE)


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_three_chained_copies_of_the_captured_llama_schedule_and_simulate(llama, kind):
    graph = getattr(llama, kind)
    before = [n.name for n in graph.nodes]
    stacked = stack_copies(graph, 3)
    assert [n.name for n in graph.nodes] == before  # the captured graph is unchanged
    stacked.lint()
    gathers = [n for n in stacked.nodes if role_of(n) is Role.ALLGATHER]
    original = [n for n in graph.nodes if role_of(n) is Role.ALLGATHER]
    assert len(gathers) == 3 * len(original)
    assert len({ds_id_of(n) for n in gathers}) == 3 * len({ds_id_of(n) for n in original})
    view = to_networkx(stacked)
    # The copies run in sequence: copy k starts after copy k-1's last compute node.
    chained = [n for n in stacked.nodes if "after" in n.kwargs]
    assert [n.name.rsplit("_c", 1)[-1] for n in chained] == ["1", "2"]
    assert chained[0].kwargs["after"].name in before and chained[1].kwargs["after"].name.endswith("_c1")
    assert nx.has_path(view, chained[0].kwargs["after"].name, chained[1].name)
    one = dcsched.simulate(graph, assume_zero=True)
    three = dcsched.simulate(stacked, assume_zero=True)
    assert three.compute_ms == pytest.approx(3 * one.compute_ms)
    assert three.comm_ms == pytest.approx(3 * one.comm_ms)
    for algo, options in (("fast-free", {}), ("simple-prefetch", {}), ("overlap", {"memory_budget": float("inf")})):
        order = [n.name for n in dcsched.schedule(stacked, algo, **options).nodes]
        check_order(view, order)
        assert dcsched.simulate(stacked, order, assume_zero=True).step_ms >= three.tight_lower_bound_ms - 1e-9
