"""Gloo's staging copies: what the simulator counts (``CollectiveIssue(staging=True)``), and that gloo makes them."""

from __future__ import annotations

import dataclasses

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

import train_runs as runs
from dcsched.collective_issue import FSDP2_ON_GLOO, SIMULATOR, CollectiveIssue
from dcsched.graph.form import ALLGATHER, REDUCE, WAIT, GraphForm
from dcsched.schedulers.fsdp.scheduler import fsdp
from dcsched.sim.plans import kept_ids, simulate_plan
from dcsched.sim.simulate import compile_view
from dcsched.synthetic import layered_stack, random_graph
from gloo import mp, on_gloo_ranks


def _staged(async_gather: bool, async_reduce: bool) -> dict:
    """Per graph of a 3-layer stack under fsdp's plan: the memory series without and with gloo's copies."""
    step = layered_stack(3)
    graphs = {"forward": step.forward, "backward": step.backward}
    plans = fsdp({name: GraphForm(graph) for name, graph in graphs.items()})
    out = {}
    for name, graph in graphs.items():
        compiled = compile_view(graph)
        runs_ = [simulate_plan(compiled, plans[name], name, detail="series",
                               issue=CollectiveIssue(async_gather=async_gather, async_reduce=async_reduce,
                                                     staging=staged)) for staged in (False, True)]
        out[name] = (compiled, plans[name], *runs_)
    return out


@pytest.mark.parametrize("async_gather", [True, False])
@pytest.mark.parametrize("async_reduce", [True, False])
def test_staging_adds_each_collectives_copy_where_the_runtime_holds_it(async_gather, async_reduce):
    for name, (compiled, plan, plain, staged) in _staged(async_gather, async_reduce).items():
        assert staged.step_ms == plain.step_ms and staged.collectives == plain.collectives
        extra = [s - p for s, p in zip(staged.memory, plain.memory)]
        idx = plain.indices
        position = {i: p for p, i in enumerate(idx)}
        expected = [0] * len(idx)
        kind = compiled.kind
        bucket_of = {m: tuple(position[compiled.index[x]] for x in b.members)
                     for b in plan.buckets for m in b.members}
        seen: set = set()
        reduce_issues = []
        held = kept_ids(plan) if name == "backward" else frozenset()  # gathered since the forward: no collective
        for p, i in enumerate(idx):
            if kind[i] == ALLGATHER and compiled.ds_id[i] in held:
                continue
            members = tuple(m for m in bucket_of.get(compiled.names[i], (p,))
                            if kind[idx[m]] != ALLGATHER or compiled.ds_id[idx[m]] not in held)
            if members in seen:
                continue
            seen.add(members)
            if kind[i] == ALLGATHER:
                first = min(members)
                wait = min(position[w] for m in members for w in compiled.succs[idx[m]] if kind[w] == WAIT)
                for q in range(first, wait if async_gather else first + 1):
                    expected[q] += sum(compiled.owned[idx[m]] for m in members)
            elif kind[i] == REDUCE:
                reduce_issues.append((max(members), sum(compiled.size[compiled.preds[idx[m]][0]] for m in members)))
        for k, (issued, nbytes) in enumerate(sorted(reduce_issues)):
            last = (sorted(reduce_issues)[k + 1][0] - 1 if k + 1 < len(reduce_issues) else len(idx) - 1) \
                if async_reduce else issued
            for q in range(issued, max(issued, last) + 1):
                expected[q] += nbytes
        assert extra == expected, name
        assert any(extra), name  # every graph here has a collective


def test_blocking_collectives_stage_no_more_than_asynchronous_ones():
    asynchronous, blocking = _staged(True, True), _staged(False, False)
    for name in asynchronous:
        staged_async, staged_blocking = asynchronous[name][3], blocking[name][3]
        assert staged_blocking.peak_bytes <= staged_async.peak_bytes


# ---------------------------------------------------------------------------
# The premise, on gloo: its collectives allocate the copies the model counts
# ---------------------------------------------------------------------------

GATHER_SHARD, REDUCE_SHARD = 3000, 5000  # floats a rank: sizes nothing else in the profile allocates


def _allocations(rank: int, world_size: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    runs.init_gloo(rank, world_size, port)
    try:
        gathered = torch.empty(GATHER_SHARD * world_size)
        shard = torch.ones(GATHER_SHARD)
        gradient = torch.ones(REDUCE_SHARD * world_size)
        reduced = torch.empty(REDUCE_SHARD)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            dist.all_gather_into_tensor(gathered, shard, async_op=True).wait()
            dist.reduce_scatter_tensor(reduced, gradient, async_op=True).wait()
        sizes, pending = [], list(prof.profiler.kineto_results.experimental_event_tree())
        while pending:
            event = pending.pop()
            pending.extend(event.children)
            if event.tag == _EventType.Allocation and event.extra_fields.alloc_size > 0:
                sizes.append(event.extra_fields.alloc_size)
        torch.save({"sizes": sizes, "gathered": gathered, "reduced": reduced}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@on_gloo_ranks
@pytest.mark.parametrize("world_size", [2])
def test_gloo_stages_an_all_gather_through_its_outputs_size_and_a_reduce_scatter_through_its_inputs(
        tmp_path, world_size):
    """If a torch release stops staging (gathering into the output, reducing in place), this fails: the
    simulator's ``staging`` model (dcsched.sim.staging) then overcounts gloo's collectives."""
    mp.spawn(_allocations, args=(world_size, runs.free_port(), str(tmp_path)), nprocs=world_size, join=True)
    for rank in range(world_size):
        data = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert torch.equal(data["gathered"], torch.ones(GATHER_SHARD * world_size))
        assert torch.equal(data["reduced"], torch.full((REDUCE_SHARD,), float(world_size)))
        assert GATHER_SHARD * world_size * 4 in data["sizes"], data["sizes"]
        assert REDUCE_SHARD * world_size * 4 in data["sizes"], data["sizes"]



# ---------------------------------------------------------------------------
# Planning with them: overlap-plan within fsdp's own peak on gloo
# ---------------------------------------------------------------------------

def _step_figures(forms, plans, *, issue: CollectiveIssue) -> tuple[float, int, int]:
    """Step ms, collectives and the largest graph peak, the collectives issued as ``issue`` says
    (``FSDP2_ON_GLOO``: every collective blocking with gloo's copies counted, the least memory the runtime
    runs a plan in on gloo)."""
    results = [simulate_plan(compile_view(form), plans[name], name, detail=False, issue=issue)
               for name, form in forms.items()]
    return sum(r.step_ms for r in results), sum(r.collectives for r in results), max(r.peak_bytes for r in results)


@pytest.mark.parametrize("layers", [2, 4])
def test_within_fsdps_own_peak_on_gloo_the_plan_is_no_slower_than_fsdp_with_no_more_collectives(layers):
    from dcsched.budget import Budget
    from dcsched.schedulers import run_step
    from dcsched.schedulers.fsdp.peak import fsdp_peak

    step = layered_stack(layers)
    forms = {"forward": GraphForm(step.forward), "backward": GraphForm(step.backward)}
    budget = fsdp_peak(forms, issue=FSDP2_ON_GLOO)
    fsdp_step, fsdp_collectives, fsdp_peak_bytes = _step_figures(forms, fsdp(forms), issue=FSDP2_ON_GLOO)
    assert fsdp_peak_bytes == budget  # fsdp's plan is what the budget names
    plans = run_step("overlap-plan", forms, budget=Budget(budget), staging=True)
    step_ms, collectives, peak = _step_figures(forms, plans, issue=FSDP2_ON_GLOO)
    assert peak <= budget and collectives <= fsdp_collectives and step_ms <= fsdp_step + 1e-9


# ---------------------------------------------------------------------------
# How collectives are issued: memory, each field where its docstring says; the step time where one blocks
# ---------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 50), backward=st.booleans(), async_gather=st.booleans(), async_reduce=st.booleans(),
       staging=st.booleans())
def test_how_collectives_are_issued_changes_memory_alone(seed, backward, async_gather, async_reduce, staging):
    """Unpriced (``blocking_in_step=False``), no way of issuing changes the step time or the collectives;
    without staging copies the all-gathers' asynchrony changes nothing; a way that adds no memory gives the
    simulator's default figures exactly; reduce-scatters in flight and staging copies only ever add bytes.
    Priced, the same way has the same memory and collectives and a step no shorter, equal where nothing blocks."""
    kind = "backward" if backward else "forward"
    graph = random_graph(seed, kind=kind)
    plan = fsdp({kind: GraphForm(graph)})[kind]
    compiled = compile_view(graph)
    issue = CollectiveIssue(async_gather=async_gather, async_reduce=async_reduce, staging=staging,
                            blocking_in_step=False)

    def run(way: CollectiveIssue):
        return simulate_plan(compiled, plan, kind, detail="series", issue=way)

    plain, result = run(SIMULATOR), run(issue)
    assert (result.step_ms, result.collectives) == (plain.step_ms, plain.collectives)
    priced = run(dataclasses.replace(issue, blocking_in_step=True))
    assert priced.memory == result.memory and priced.collectives == result.collectives
    assert priced.step_ms >= result.step_ms - 1e-9
    if async_gather and async_reduce:
        assert priced.step_ms == result.step_ms
    assert all(r >= p for r, p in zip(result.memory, plain.memory))
    if not issue.adds_memory:
        assert result.memory == plain.memory and result.peak_bytes == plain.peak_bytes
    if not staging:
        assert result.memory == run(CollectiveIssue(async_gather=not async_gather, async_reduce=async_reduce,
                                                    blocking_in_step=False)).memory
