"""overlap-plan's trials made from their current candidate (splice.py, sim/resume.py) are the trials made
whole: the same order, buckets and figures to the bit, whatever blocks a refinement changes."""

from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from dcsched.budget import Budget
from dcsched.graph.form import GraphForm
from dcsched.schedulers import run_step
from dcsched.schedulers.fast_free.scheduler import fast_free_indices
from dcsched.schedulers.fsdp.bucketing import bucketed, placement
from dcsched.schedulers.fsdp.scheduler import step_blocks
from dcsched.schedulers.overlap_plan import candidates as plan_candidates
from dcsched.schedulers.overlap_plan.splice import full, spliced
from dcsched.sim.resume import MARK_EVERY, resumed_clocks
from dcsched.sim.simulate import CompiledGraph
from dcsched.synthetic import layered_stack, moe_graph, random_graph
from dcsched.synthetic.fanin import fanin_graph


def _graph(family: str, seed: int, kind: str):
    if family == "random":
        return random_graph(seed, kind=kind, n_params=2 + seed % 9)
    if family == "moe":
        return moe_graph(seed % 4, kind=kind)
    if family == "fanin":
        return fanin_graph(3 + seed % 20, kind=kind)
    stack = layered_stack(1 + seed % 5, tied=bool(seed % 2))
    return stack.forward if kind == "forward" else stack.backward


def _moved(rng: random.Random, groups: tuple) -> tuple:
    """``groups`` with one refinement-like change: neighbouring blocks merged, a block cut, or the boundary
    between two neighbours moved (each kind of block: all-gathers, reduces)."""
    which = rng.choice([w for w in (0, 1) if groups[w]] or [0])
    blocks = [list(b) for b in groups[which]]
    if not blocks:
        return groups
    k = rng.randrange(len(blocks))
    move = rng.choice(("merge", "cut", "shift"))
    if move == "merge" and k + 1 < len(blocks):
        blocks[k:k + 2] = [blocks[k] + blocks[k + 1]]
    elif move == "cut" and len(blocks[k]) > 1:
        cut = rng.randrange(1, len(blocks[k]))
        blocks[k:k + 1] = [blocks[k][:cut], blocks[k][cut:]]
    elif k + 1 < len(blocks) and len(blocks[k]) + len(blocks[k + 1]) > 2:
        joined = blocks[k] + blocks[k + 1]
        cut = rng.randrange(1, len(joined))
        blocks[k:k + 2] = [joined[:cut], joined[cut:]]
    return (blocks, groups[1]) if which == 0 else (groups[0], blocks)


@settings(max_examples=40, deadline=None)
@given(family=st.sampled_from(["random", "moe", "stack", "fanin"]), seed=st.integers(0, 10**6),
       kind=st.sampled_from(["forward", "backward"]), ahead=st.integers(0, 2), fast=st.booleans(),
       held_share=st.floats(0.0, 1.0), moves=st.integers(1, 12))
def test_a_splice_is_the_order_made_whole(family, seed, kind, ahead, fast, held_share, moves):
    form = GraphForm(_graph(family, seed, kind))
    compiled = CompiledGraph(form, assume_zero=True, comm_latency_ms=0.05)
    base = fast_free_indices(form) if fast else list(form.topo)
    placed = placement(form, base)
    blocks = step_blocks({"graph": form})["graph"]
    rng = random.Random(seed)
    ids = sorted({form.ds_id[m] for group in blocks.gathers for m in group})
    held = frozenset(rng.sample(ids, int(held_share * len(ids)))) if kind == "backward" else frozenset()
    groups = (blocks.gathers, blocks.reduces)
    known: dict = {}
    current = full(form, compiled, placed, base, groups, ahead, held, known)
    for _ in range(moves):
        groups = _moved(rng, groups)
        made = spliced(current, form, compiled, placed, groups, known)
        whole = full(form, compiled, placed, base, groups, ahead, held)
        order, buckets = bucketed(form, base, *groups, ahead=ahead, placed=placed)
        assert (whole.order, whole.buckets) == (order, buckets)
        figures = compiled.timeline_figures(order, buckets=buckets, held=held, check=False)
        assert (whole.clocks.step, whole.fused.collectives) == figures
        if made is None:  # the output ends not both orders: made whole instead (never in these graphs)
            continue
        assert (made.raw, made.spread, made.order, made.buckets) == (whole.raw, whole.spread, order, buckets)
        assert (made.clocks.step, made.fused.collectives) == figures
        assert made.clocks.done == whole.clocks.done
        assert (made.clocks.compute, made.clocks.comm) == (whole.clocks.compute, whole.clocks.comm)
        assert (made.fused.lead, made.fused.time) == (whole.fused.lead, whole.fused.time)
        current = made


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), kind=st.sampled_from(["forward", "backward"]))
def test_clocks_resumed_anywhere_are_the_clocks(seed, kind):
    form = GraphForm(random_graph(seed, kind=kind, n_params=2 + seed % 9))
    compiled = CompiledGraph(form, assume_zero=True)
    blocks = step_blocks({"graph": form})["graph"]
    order, buckets = bucketed(form, list(form.topo), blocks.gathers, blocks.reduces, ahead=1)
    fused = compiled._fused(buckets)
    whole = resumed_clocks(compiled, order, fused)
    assert whole.step == compiled._fused_timeline(order, False, fused)[0]
    assert len(whole.compute) == -(-len(order) // MARK_EVERY)
    for start in range(0, len(order), 7):
        again = resumed_clocks(compiled, order, fused, whole, start=start, end=start + 1, buckets=buckets)
        assert (again.step, again.done, again.compute) == (whole.step, whole.done, whole.compute)


def _plans(forms, budget):
    plans = run_step("overlap-plan", forms, budget=budget)
    return {name: (plan.order, [(b.kind, b.members) for b in plan.buckets], sorted(plan.residency.items()))
            for name, plan in plans.items()}


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10**6), moe=st.booleans(), unlimited=st.booleans())
def test_plans_with_trials_made_whole_are_the_same(seed, moe, unlimited):
    make = (lambda kind: moe_graph(seed % 4, kind=kind)) if moe else \
        (lambda kind: random_graph(seed, kind=kind, n_params=2 + seed % 9))
    forms = {kind: GraphForm(make(kind)) for kind in ("forward", "backward")}
    budget = Budget.unlimited() if unlimited else None
    spliced_plans = _plans(forms, budget)
    planner = plan_candidates.GraphPlanner
    original = planner.rebucketed

    def whole(self, source, base, groups, role, ahead, parent=None):  # no parent: every trial made whole
        return original(self, source, base, groups, role, ahead)

    planner.rebucketed = whole  # type: ignore[method-assign]
    try:
        whole_plans = _plans({kind: GraphForm(make(kind)) for kind in ("forward", "backward")}, budget)
    finally:
        planner.rebucketed = original  # type: ignore[method-assign]
    assert spliced_plans == whole_plans
