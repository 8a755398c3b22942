"""``overlap-plan``'s step 5 with block boundaries moved: a cut's fixed points may leave a backward's last reduce
bucket too long to hide behind its end; moving the boundary keeps the collectives and shortens the step."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dcsched.budget import Budget
from dcsched.graph.form import GraphForm
from dcsched.schedulers.overlap_plan import scheduler as overlap_plan_module
from dcsched.schedulers import run_step
from dcsched.schedulers.fsdp.scheduler import kept_root, step_blocks
from dcsched.schedulers.overlap.scheduler import Overlap
from dcsched.schedulers.overlap_plan.candidates import GraphOrders, GraphPlanner
from dcsched.schedulers.overlap_plan.refine import refine
from dcsched.sim.collectives import DEFAULT_LATENCY_MS
from dcsched.synthetic import moe_graph

from test_overlap_plan import _measure
from test_plan_coalesce import _forms

EPS = 1e-9


def _unshifted(monkeypatch) -> None:
    """The planner as it was before boundaries moved: the refined plan alone, never the polished one."""
    monkeypatch.setattr(overlap_plan_module, "refine", lambda *args, **kwargs: refine(*args, **kwargs)[:1])


def _moe4() -> dict[str, GraphForm]:
    return {kind: GraphForm(moe_graph(0, kind=kind, n_layers=4)) for kind in ("forward", "backward")}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(["layered", "moe"]), layers=st.integers(1, 3), seed=st.integers(0, 5),
       graph=st.sampled_from(["forward", "backward"]), fraction=st.sampled_from([1.1, 1.5, math.inf]))
def test_a_shifted_candidate_is_the_same_collectives_bucketed_again(family, layers, seed, graph, fraction):
    """Every candidate :meth:`GraphPlanner.shifted` offers moves one boundary between the last reduce blocks:
    the same members in as many blocks of each kind, a valid order, and no more collectives than before."""
    forms = _forms(family, layers, seed)
    form = forms[graph]
    budget = fraction * Overlap(form).min_budget("all") if math.isfinite(fraction) else math.inf
    planner = GraphPlanner(GraphOrders(form, DEFAULT_LATENCY_MS, "all"), step_blocks(forms)[graph], budget, graph)
    candidates = planner.fitting(budget, frozenset())
    for candidate in (c for c in candidates if c.groups is not None):
        for trial in planner.shifted(candidate, frozenset()):
            form.check_order([form.names[v] for v in trial.order])
            assert trial.collectives <= candidate.collectives
            for which in (0, 1):
                before, after = candidate.groups[which], trial.groups[which]
                assert len(after) == len(before) and all(after)
                assert sorted(m for b in after for m in b) == sorted(m for b in before for m in b)
            assert trial.groups[0] == candidate.groups[0] and trial.groups[1] != candidate.groups[1]
            # one boundary moved, among the last two: the blocks before them as they were
            assert trial.groups[1][:-3] == candidate.groups[1][:-3]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(["layered", "moe"]), layers=st.integers(1, 3), seed=st.integers(0, 5),
       fraction=st.sampled_from([1.1, 1.3, 2.0, math.inf]))
@example(family="moe", layers=3, seed=0, fraction=math.inf)  # polished: 473.287 ms against 474.833
@example(family="moe", layers=4, seed=1, fraction=2.0)  # the polished plan alone: 327.260 against 326.829
def test_moving_boundaries_never_lengthens_the_plan(family, layers, seed, fraction):
    """The plan with boundaries moved is no slower than the plan without them, at no more collectives than
    ``fsdp``'s wherever that plan fits (what is shorter before replication need not be after it, so both go on
    to step 6 and the shorter final plan is kept)."""
    forms = _forms(family, layers, seed)
    smallest = max(Overlap(form).min_budget("all") for form in forms.values())
    budget = Budget(math.ceil(fraction * smallest), "all") if math.isfinite(fraction) else None
    shifted = _measure(forms, DEFAULT_LATENCY_MS, "overlap-plan", budget)
    with pytest.MonkeyPatch.context() as patch:
        _unshifted(patch)
        plain = _measure(forms, DEFAULT_LATENCY_MS, "overlap-plan", budget)
    fsdp = _measure(forms, DEFAULT_LATENCY_MS, "fsdp", None)
    assert shifted[0] <= plain[0] + EPS
    if budget is None or fsdp[1] <= budget.bytes:
        assert shifted[2] <= fsdp[2]


def test_at_overlaps_peak_moe4s_plan_is_no_slower_than_overlap(monkeypatch):
    """Given exactly ``overlap``'s peak on the 4-layer MoE step, the cut's fixed points left the backward's last
    reduce bucket 30 gradients long and 4.8 ms exposed at its end (663.518 ms in all, against ``overlap``'s
    657.554); polished, the bucket hides, a merge frees a collective for a cut, step 6 replicates the forward's
    first bucket, and the step is 657.318 ms within ``fsdp``'s 12 collectives and the budget."""
    forms = _moe4()
    overlap_step, overlap_peak, _ = _measure(forms, DEFAULT_LATENCY_MS, "overlap", None)
    budget = Budget(overlap_peak, "all")
    step, peak, collectives = _measure(forms, DEFAULT_LATENCY_MS, "overlap-plan", budget)
    with monkeypatch.context() as patch:
        _unshifted(patch)
        plain_step = _measure(forms, DEFAULT_LATENCY_MS, "overlap-plan", budget)[0]
    assert step < plain_step - 5.0  # 657.318 against 663.518
    assert step <= overlap_step + EPS
    assert peak <= overlap_peak and collectives <= _measure(forms, DEFAULT_LATENCY_MS, "fsdp", None)[2]


def test_replicated_heads_figures_are_the_plans(monkeypatch):
    """Step 6 hands back the figures it measured (step and collectives, replication included), which step 7
    and the choice between refinements compare: they are what the finished plan simulates to."""
    forms = _moe4()
    budget = Budget(_measure(forms, DEFAULT_LATENCY_MS, "overlap", None)[1], "all")
    seen = []
    original = overlap_plan_module.replicated_head

    def recording(*args, **kwargs):
        replicated, figures = original(*args, **kwargs)
        seen.append((replicated, figures))
        return replicated, figures

    monkeypatch.setattr(overlap_plan_module, "replicated_head", recording)
    step, _peak, collectives = _measure(forms, DEFAULT_LATENCY_MS, "overlap-plan", budget)
    plans = run_step("overlap-plan", forms, budget=budget, comm_latency_ms=DEFAULT_LATENCY_MS)
    replicated = {ds for ds, where in plans["forward"].residency.items() if where == "replicated"}
    assert replicated  # the forward's first pieces, here
    assert (step, collectives) in [(pytest.approx(f[0], abs=1e-9), f[1]) for r, f in seen if r == replicated]
    assert kept_root(forms, step_blocks(forms)) == frozenset()  # no root: one unit layout, one choice
