"""A graph's first all-gathers cut into pieces that arrive as the compute needs them (``head_pieces``), and
what that buys ``overlap-plan`` where a step's start needs several cuts at once."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcsched.budget import Budget, default_budget
from dcsched.bundle.core import load
from dcsched.graph.form import ALLGATHER, REDUCE, GraphForm
from dcsched.schedulers import run_step
from dcsched.schedulers.overlap_plan.head_pieces import head_pieces, need_times
from dcsched.schedulers.overlap.scheduler import Overlap
from dcsched.sim.collectives import latency_from_provenance
from dcsched.sim.plans import simulate_plan
from dcsched.sim.simulate import CompiledGraph
from dcsched.synthetic import layered_stack
from dcsched.synthetic.stacking import stack_copies
from tests.test_overlap_plan import SAMPLES

LATENCY = 0.02


def _gathers(kind: str = "forward", seed: int = 0):
    """A one-layer stack's graph, ``overlap``'s order of it, and its all-gathers."""
    form = GraphForm(getattr(layered_stack(1, seed=seed), kind))
    order = [form.index[n] for n in Overlap(form).order(math.inf, "all")]
    return form, order, [i for i in form.topo if form.kind[i] == ALLGATHER]


def _modelled_wait(form, pieces, need, issue) -> float:
    """The wait the module's model gives ``pieces``, restated: piece p (from 1) arrives p latencies and
    every transfer up to its end after the first is issued, and is waited on where its first member is
    needed."""
    wait, sent = 0.0, issue
    for p, piece in enumerate(pieces, start=1):
        sent += sum(max(0.0, form.time[m] - LATENCY) for m in piece)
        wait = max(wait, p * LATENCY + sent - need[piece[0]])
    return wait


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 50), most=st.integers(1, 6))
def test_pieces_are_the_members_in_the_order_needed(seed, most):
    form, order, gathers = _gathers(seed=seed)
    need, issue = need_times(form, order, gathers)
    assert issue <= min(need.values())  # the first is issued before any is waited on
    found = head_pieces(form, order, gathers, most, LATENCY)
    assert sorted(found) == list(range(1, min(most, len(gathers)) + 1))
    for count, pieces in found.items():
        assert len(pieces) == count and all(pieces)
        flat = [m for piece in pieces for m in piece]
        assert sorted(flat) == sorted(gathers)
        assert [need[m] for m in flat] == sorted(need[m] for m in flat)


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_each_count_of_pieces_waits_least_by_the_model(kind):
    form, order, gathers = _gathers(kind)
    need, issue = need_times(form, order, gathers)
    ranked = sorted(gathers, key=lambda m: need[m])
    found = head_pieces(form, order, gathers, 3, LATENCY)
    for count, pieces in found.items():
        best = min(_modelled_wait(form, [ranked[a:b] for a, b in zip((0, *cuts), (*cuts, len(ranked)))], need, issue)
                   for cuts in itertools.combinations(range(1, len(ranked)), count - 1))
        assert _modelled_wait(form, pieces, need, issue) == pytest.approx(best, abs=1e-12)


@pytest.fixture(scope="module")
def stacked_llama():
    bundle = load(SAMPLES / "llama.pt")
    forms = {name: GraphForm(stack_copies(bundle.graphs[name], 8)) for name in bundle.graph_names}
    return forms, latency_from_provenance(bundle.provenance), default_budget(bundle)


def _step(forms, latency, algo, budget):
    """The step's simulated time (ms), collectives and peak (bytes) under ``algo``'s plans."""
    plans = run_step(algo, forms, budget=budget, comm_latency_ms=latency)
    results = [simulate_plan(CompiledGraph(form, comm_latency_ms=latency), plans[name], name, detail=False)
               for name, form in forms.items()]
    return (sum(r.step_ms for r in results), sum(r.collectives for r in results),
            max(r.peak_bytes for r in results))


def test_the_plan_starts_the_stacked_llama_no_later_than_overlap(stacked_llama):
    """The 8-copy Llama step waits on its first buckets: no single cut helps, several together do."""
    forms, latency, budget = stacked_llama
    plan, overlap, fsdp = (_step(forms, latency, algo, budget) for algo in ("overlap-plan", "overlap", "fsdp"))
    assert plan[0] <= overlap[0]
    assert plan[1] <= fsdp[1]


def test_at_overlaps_own_peak_merges_pay_for_the_head_cuts(stacked_llama):
    """Given exactly ``overlap``'s peak nothing can be kept, and the plain blocks take all of ``fsdp``'s
    collectives: merging blocks where that costs nothing frees the ones the forward's head needs."""
    forms, latency, budget = stacked_llama
    overlap = _step(forms, latency, "overlap", budget)
    plan = _step(forms, latency, "overlap-plan", Budget(overlap[2], "all"))
    assert plan[2] <= overlap[2] and plan[0] <= overlap[0]
    assert plan[1] <= _step(forms, latency, "fsdp", budget)[1]


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_stack_shards_and_gradients_are_the_parameters_bytes(kind):
    """A synthetic stack's shard is the parameter's bytes over 8 ranks and its gradient the parameter's
    bytes, as in a captured graph (a bucket's flat buffers hold these)."""
    form = GraphForm(getattr(layered_stack(2), kind))
    gathers = [i for i in form.topo if form.kind[i] == ALLGATHER]
    assert gathers
    for g in gathers:
        assert form.size[form.preds[g][0]] == -(-form.size[g] // 8)
    full = {form.ds_id[g]: form.size[g] for g in gathers}
    reduces = [i for i in form.topo if form.kind[i] == REDUCE]
    for r in reduces:
        if form.ds_id[r] in full:
            assert form.size[form.preds[r][0]] == full[form.ds_id[r]]
