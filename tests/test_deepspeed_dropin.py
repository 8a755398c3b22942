"""dcsched.deepspeed swaps in for DeepSpeed's schedulers on graphs with torch.ops.dc.* ops."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

import dcsched.deepspeed as dcsched_ds
from dcsched.runtime import ops
from dcsched.graph.form import output_last
from dcsched.graph.nxview import check_order, to_networkx
from dcsched.graph.roles import Role, role_of
from golden_corpus import build, records


def _golden(n_records: int = 6):
    found = [r for r in records() if r["graph"]["source"] in ("random", "layered")
             and r["fast-free"].get("valid") and r["simple-prefetch"].get("valid")]
    return found[::max(1, len(found) // n_records)][:n_records]


def _fake_deepcompile_pass():
    """DeepCompile's pass, reduced to how it calls the scheduler it imported by name."""
    module = types.SimpleNamespace()

    def fast_free_schedule(graph, available_mem, output_size, debug_log, *, scheduler_budget=None):
        raise AssertionError("DeepSpeed's own scheduler should have been swapped out")

    def add_z3_gather_release_fw(gm):
        gm.graph = module.fast_free_schedule(gm.graph, 80 * 2**30, 0, debug_log=False, scheduler_budget=None)
        return gm

    module.fast_free_schedule = fast_free_schedule
    module.add_z3_gather_release_fw = add_z3_gather_release_fw
    return module


@pytest.mark.parametrize("record", _golden(), ids=lambda r: r["id"])
def test_swap_gives_deepspeeds_order_on_a_deepspeed_graph(record, monkeypatch):
    graph = build(record["graph"], namespace="dc")  # DeepSpeed's op namespace
    assert any(n.target == torch.ops.dc.allgather_param.default for n in graph.nodes)
    names = [n.name for n in graph.nodes]
    z3 = _fake_deepcompile_pass()
    monkeypatch.setattr(z3, "fast_free_schedule", dcsched_ds.fast_free_schedule)
    gm = types.SimpleNamespace(graph=graph)
    new_graph = z3.add_z3_gather_release_fw(gm).graph

    assert [n.name for n in new_graph.nodes] == [names[i] for i in record["fast-free"]["order"]]
    # Same ops (still DeepSpeed's), same meta, and the input graph is untouched.
    old = {n.name: n for n in graph.nodes}
    for node in new_graph.nodes:
        assert node.target == old[node.name].target
        assert node.meta.get("device_time") == old[node.name].meta.get("device_time")
    assert [n.name for n in graph.nodes] == names

    prefetched = dcsched_ds.simple_prefetch(graph, 0, 0, False)
    # DeepSpeed's order, the output moved last (docs/schedulers.md: DeepSpeed may return before a chain).
    expected = output_last(to_networkx(graph), [names[i] for i in record["simple-prefetch"]["order"]])
    assert [n.name for n in prefetched.nodes] == expected


def test_list_schedule_works_where_deepspeeds_fails():
    graph = build({"source": "layered", "n_layers": 2, "kind": "forward"}, namespace="dc")
    new_graph = dcsched_ds.list_schedule(graph)
    order = [n.name for n in new_graph.nodes]
    check_order(to_networkx(graph), order)
    # The rule gathers a parameter only when nothing else can run.
    first_gather = next(i for i, n in enumerate(new_graph.nodes) if role_of(n) is Role.ALLGATHER)
    assert all(role_of(n) is Role.PLACEHOLDER for n in list(new_graph.nodes)[:first_gather])


def test_a_budget_is_reported_not_silently_dropped():
    ops.ensure_deepspeed_ops()
    graph = build({"source": "random", "seed": 3, "kind": "forward"}, namespace="dc")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcsched_ds.fast_free_schedule(graph, 0, 0, False, scheduler_budget=object())
    assert any("scheduler_budget" in str(w.message) for w in caught)
