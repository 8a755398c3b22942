"""The waits-first pass: a wait before the all-gathers issued just before it, the same step with no more memory."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from dcsched.bundle.core import load

from dcsched.graph.form import ALLGATHER, WAIT, GraphForm
from dcsched.schedulers import run, run_step
from dcsched.schedulers.fsdp.scheduler import bucketed, just_in_time, step_blocks
from dcsched.schedulers.fsdp.waits_first import waits_first
from dcsched.sim.simulate import CompiledGraph
from dcsched.synthetic import layered_stack, moe_graph, random_graph

EPS = 1e-9
ROOT = Path(__file__).resolve().parent.parent


def _prefetch_before_waits(form: GraphForm, rng: random.Random) -> list[int]:
    """A just-in-time order with some all-gathers moved to just before the wait of the gather before them:
    the shape the pass undoes."""
    order = just_in_time(form, list(form.topo))
    gathers = [v for v in order if form.kind[v] == ALLGATHER]
    for earlier, later in zip(gathers, gathers[1:]):
        if rng.random() < 0.5:
            continue
        wait = next((w for w in form.succs[earlier] if form.kind[w] == WAIT), None)
        if wait is None or not all(order.index(p) < order.index(wait) for p in form.preds[later]):
            continue
        order.remove(later)
        order.insert(order.index(wait), later)
    return order


def _check(form: GraphForm, order: list[int], buckets=()) -> None:
    moved = waits_first(form, order, buckets)
    assert sorted(moved) == sorted(order)
    form.check_order(form.order_names(moved))
    compiled = CompiledGraph(form)
    names = [b for b in ([form.names[m] for m in members] for members in buckets)]
    before = compiled.simulate(form.order_names(order), buckets=names or None)
    after = compiled.simulate(form.order_names(moved), buckets=names or None)
    assert abs(after.step_ms - before.step_ms) <= EPS * max(1.0, before.step_ms)
    assert after.peak_bytes <= before.peak_bytes
    assert after.gathered_peak_bytes <= before.gathered_peak_bytes
    assert waits_first(form, moved, buckets) == moved  # nothing left to move


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), kind=st.sampled_from(["forward", "backward"]), n_params=st.integers(1, 8))
def test_same_step_no_more_memory_on_random_graphs(seed, kind, n_params):
    form = GraphForm(random_graph(seed, kind=kind, n_params=n_params))
    _check(form, _prefetch_before_waits(form, random.Random(seed)))


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10**6), kind=st.sampled_from(["forward", "backward"]))
def test_same_step_no_more_memory_on_moe_graphs(seed, kind):
    form = GraphForm(moe_graph(seed, kind=kind, n_layers=2))
    _check(form, _prefetch_before_waits(form, random.Random(seed)))


def test_scheduler_orders_keep_their_step():
    """Orders of the per-parameter schedulers (no buckets), passed through: the same step, no more memory."""
    pair = layered_stack(2)
    for graph in (pair.forward, pair.backward):
        form = GraphForm(graph)
        for algo in ("overlap", "fast-free", "simple-prefetch"):
            plan = run(algo, form)
            _check(form, [form.index[name] for name in plan.order])


def test_fsdp_prefetch_waits_for_the_block_before():
    """fsdp's buckets, one block ahead: each bucket is issued once the block before it
    has waited (FSDP2 issues a prefetch from the block's own pre-forward / pre-backward, after its unshard)."""
    pair = layered_stack(4)
    forms = {"forward": GraphForm(pair.forward), "backward": GraphForm(pair.backward)}
    found = step_blocks(forms)
    for name, form in forms.items():
        blocks = found[name].gathers
        order, buckets = bucketed(form, just_in_time(form, list(form.topo)), blocks, found[name].reduces, ahead=1)
        _check(form, order, buckets)
        pos = {v: p for p, v in enumerate(order)}
        waits = [min(pos[w] for m in group for w in form.succs[m] if form.kind[w] == WAIT) for group in blocks]
        issues = [min(pos[m] for m in group) for group in blocks]
        assert all(issues[k + 1] > waits[k] for k in range(len(blocks) - 1)), name


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_planned_orders_never_prefetch_beside_a_wait(name):
    """fsdp's and overlap-plan's final orders are the pass's fixed points: no wait stands after an all-gather
    issued later with nothing between them. (Each graph planned alone as well: a step's backward leaves its
    kept parameters' all-gathers, which issue nothing, out of its buckets, so the plan no longer says which
    bucket they stood in.)"""
    bundle = load(ROOT / "sample_graphs" / f"{name}.pt")
    forms = {graph: GraphForm(bundle.form(graph)) for graph in bundle.graph_names}
    for algo in ("fsdp", "overlap-plan"):
        planned = [("step", graph, plan) for graph, plan in run_step(algo, forms).items() if graph == "forward"]
        planned += [("alone", graph, run(algo, form)) for graph, form in forms.items()]
        for how, graph, plan in planned:
            form = forms[graph]
            order = [form.index[node] for node in plan.order]
            buckets = [[form.index[node] for node in b.members] for b in plan.buckets if b.kind == "allgather"]
            assert waits_first(form, order, buckets) == order, (algo, how, graph)
