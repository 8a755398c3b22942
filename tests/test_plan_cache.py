"""overlap-plan's caches change no plan: bucketed orders kept or evicted, a placement given or computed, the
waits-first pass against its literal statement, fast-free run once for both orders that start from it."""

from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from dcsched.budget import Budget
from dcsched.graph.form import ALLGATHER, WAIT, GraphForm
from dcsched.schedulers import run_step
from dcsched.schedulers.overlap_plan import candidates as plan_candidates
from dcsched.schedulers.fast_free.scheduler import fast_free
from dcsched.schedulers.overlap.scheduler import Overlap
from dcsched.schedulers.fsdp.scheduler import bucketed, just_in_time, placement, step_blocks
from dcsched.schedulers.overlap_plan.candidates import GraphOrders
from dcsched.schedulers.fsdp.waits_first import waits_first
from dcsched.synthetic import moe_graph, random_graph
from dcsched.synthetic.fanin import fanin_graph


def _literal_waits_first(form: GraphForm, order: list[int], buckets) -> list[int]:
    """The pass as its docstring states it, node by node: each wait placed before the all-gathers directly
    before it that were issued after its own collective (its own bucket's members stay before it)."""
    bucket_of = {m: k for k, members in enumerate(buckets) for m in members}
    result: list[int] = []
    run: list[int] = []  # the all-gathers directly before the node being placed, not yet placed
    for v in order:
        if form.kind[v] == ALLGATHER:
            run.append(v)
            continue
        own = next((p for p in form.preds[v] if form.kind[p] == ALLGATHER), None)
        if own is None or not run or form.kind[v] != WAIT:  # not a wait on an all-gather: everything before stays
            keep = len(run)
        elif own in run:
            keep = run.index(own) + 1
            while keep < len(run) and own in bucket_of and bucket_of.get(run[keep]) == bucket_of[own]:
                keep += 1
        else:
            keep = 0
        result.extend(run[:keep])
        result.append(v)
        run = run[keep:] if form.kind[v] == WAIT else []
    return result + run


def _plans(forms, budget):
    plans = run_step("overlap-plan", forms, budget=budget)
    return {name: (plan.order, [(b.kind, b.members) for b in plan.buckets], sorted(plan.residency.items()))
            for name, plan in plans.items()}


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10**6), n_params=st.integers(2, 8), unlimited=st.booleans())
def test_evicting_every_bucketed_order_changes_no_plan(seed, n_params, unlimited):
    forms = {kind: GraphForm(random_graph(seed, kind=kind, n_params=n_params)) for kind in ("forward", "backward")}
    budget = Budget.unlimited() if unlimited else None
    cached = _plans(forms, budget)
    kept, plan_candidates.BUCKETED_KEPT = plan_candidates.BUCKETED_KEPT, 0  # only the latest one kept
    try:
        assert _plans(forms, budget) == cached
    finally:
        plan_candidates.BUCKETED_KEPT = kept


def test_a_cached_bucketing_is_the_bucketing():
    form = GraphForm(moe_graph(1, kind="backward"))
    blocks = step_blocks({"graph": form})["graph"]
    orders = GraphOrders(form, 0.05, "all")
    base = just_in_time(form, list(form.topo))
    for ahead in (0, 1, 2):
        fresh = bucketed(form, base, blocks.gathers, blocks.reduces, ahead=ahead)
        first = orders.bucketed(base, (blocks.gathers, blocks.reduces), ahead, frozenset())
        again = orders.bucketed(base, (blocks.gathers, blocks.reduces), ahead, frozenset())  # from the cache
        assert first[:2] == again[:2] == fresh
        assert first[2] == again[2] == orders.compiled.timeline_figures(fresh[0], buckets=fresh[1], check=False)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), n_params=st.integers(1, 12), fanin=st.booleans(), ahead=st.integers(0, 2))
def test_bucketing_and_waits_first_match_their_statements(seed, n_params, fanin, ahead):
    kind = random.Random(seed).choice(["forward", "backward"])
    graph = fanin_graph(n_params, kind=kind, seed=seed) if fanin else random_graph(seed, kind=kind,
                                                                                   n_params=n_params)
    form = GraphForm(graph)
    blocks = step_blocks({"graph": form})["graph"]
    rng = random.Random(seed)
    base = list(form.topo)
    for order in (base, just_in_time(form, base)):
        given_placement = bucketed(form, order, blocks.gathers, blocks.reduces, ahead=ahead,
                                   placed=placement(form, order))
        assert given_placement == bucketed(form, order, blocks.gathers, blocks.reduces, ahead=ahead)
        buckets = [members for members in given_placement[1] if form.kind[members[0]] == ALLGATHER]
        shuffled = [b for b in buckets if rng.random() < 0.5]
        for bucket_list in (buckets, shuffled, []):
            assert waits_first(form, order, bucket_list) == _literal_waits_first(form, order, bucket_list)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), n_params=st.integers(1, 10), fanin=st.booleans(), backward=st.booleans())
def test_fast_free_computed_once_is_both_orders_fast_free(seed, n_params, fanin, backward):
    """The ``fast-free`` base and ``overlap``'s first skeleton come from one run of fast-free: the same
    orders as each computed on its own."""
    kind = "backward" if backward else "forward"
    graph = fanin_graph(n_params, kind=kind, seed=seed) if fanin else random_graph(seed, kind=kind,
                                                                                   n_params=n_params)
    form = GraphForm(graph)
    orders = GraphOrders(form, 0.05, "all")
    assert orders.fixed_bases()["fast-free"] == [form.index[n] for n in fast_free(form).order]
    alone, handed = Overlap(form), Overlap(form, fast_free_order=orders.fast_free())
    assert [p.fast_free_order for p in handed.planners] == [p.fast_free_order for p in alone.planners]
    for budget in (float("inf"), handed.min_budget("all")):
        assert handed.order(budget, "all") == alone.order(budget, "all")


def test_a_plan_simulated_from_its_lists_is_the_cached_one():
    """:meth:`GraphOrders.figures` keys a plan given as lists as :meth:`GraphOrders.bucketed` keys it: the
    second asks no new simulation."""
    form = GraphForm(moe_graph(2, kind="backward"))
    blocks = step_blocks({"graph": form})["graph"]
    orders = GraphOrders(form, 0.05, "all")
    base = just_in_time(form, list(form.topo))
    held = frozenset(blocks.gathers[0][:1])
    order, buckets, figures, _parts = orders.bucketed(base, (blocks.gathers, blocks.reduces), 1, held)
    assert len(orders._figures) == 1
    assert orders.figures(order, buckets, held) == figures
    assert orders.figures(order, buckets, frozenset()) == orders.compiled.timeline_figures(order, buckets=buckets,
                                                                                         check=False)
    assert len(orders._figures) == 2
