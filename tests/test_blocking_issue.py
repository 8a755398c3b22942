"""A blocking collective on the critical path: the simulator adds its time to the step where the run issues it
blocking (``CollectiveIssue.async_gather`` / ``async_reduce`` False), and hides it behind the compute where the
run issues it asynchronously; :data:`~dcsched.collective_issue.SIMULATOR` keeps its own model."""

from __future__ import annotations

import torch
import torch.fx
from hypothesis import given, settings, strategies as st

from dcsched.collective_issue import FSDP2_ON_GLOO, GLOO, PROCESS_GROUP, SIMULATOR, CollectiveIssue
from dcsched.graph.form import ALLGATHER
from dcsched.runtime import ops
from dcsched.sim.simulate import compile_view
from dcsched.synthetic import layered_stack, random_graph

ASYNC = CollectiveIssue(async_gather=True, async_reduce=True)
GATHERS_BLOCK = CollectiveIssue(async_gather=False, async_reduce=True)


def _gather_beside_compute() -> torch.fx.Graph:
    """An all-gather (2 ms) issued before a compute node that does not read it (3 ms), then a reader (1 ms)."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["tensor_size"] = 16
    w = g.placeholder("w")
    w.meta["tensor_size"] = 25
    ag = g.call_function(ops.allgather_param, (w, 0, 0))
    ag.meta.update(device_time=2.0, tensor_size=100)
    other = g.create_node("call_function", torch.ops.aten.relu.default, (x,), name="other")
    other.meta.update(device_time=3.0, tensor_size=16)
    wt = g.call_function(ops.wait_allgather, (ag, 0, 0))
    wt.meta.update(device_time=0.0, tensor_size=100)
    y = g.create_node("call_function", torch.ops.aten.add.Tensor, (wt, other), name="reader")
    y.meta.update(device_time=1.0, tensor_size=100)
    r = g.call_function(ops.release_param, (y, 0, 0, 1))
    r.meta.update(device_time=0.0, tensor_size=100)
    g.output((r,))
    return g


def test_a_blocking_all_gather_adds_its_time_and_an_asynchronous_one_hides_behind_the_compute():
    compiled = compile_view(_gather_beside_compute())
    hidden = compiled.simulate(None, issue=ASYNC)
    blocking = compiled.simulate(None, issue=GATHERS_BLOCK)
    assert hidden.step_ms == 4.0  # the gather (0-2 ms) runs beside `other` (0-3 ms); the reader 3-4 ms
    assert blocking.step_ms == 6.0  # the host waits in the gather (0-2 ms), then `other` 2-5, the reader 5-6
    # the simulator's default and a run whose reduce-scatters alone block (there are none) keep it hidden
    assert compiled.simulate(None).step_ms == compiled.simulate(None, issue=SIMULATOR).step_ms == 4.0
    assert compiled.simulate(None, issue=CollectiveIssue(async_reduce=False)).step_ms == 4.0
    # unpriced, the blocking flags change the memory alone (the simulator's model before a run's)
    assert compiled.simulate(None, issue=CollectiveIssue(async_gather=False, blocking_in_step=False)).step_ms == 4.0
    # the planner's timeline reads the same, by argument or by the graph's own timing
    order = list(compiled.topo)
    assert compiled.timeline_figures(order, issue=GATHERS_BLOCK) == (6.0, 1)
    compiled.timing = GATHERS_BLOCK
    assert compiled.timeline_figures(order) == (6.0, 1)
    assert compiled.timeline_figures(order, issue=SIMULATOR) == (4.0, 1)


def test_the_runtime_ways_price_what_blocks_and_the_simulator_does_not():
    assert not SIMULATOR.blocks_step and not GLOO.blocks_step and not PROCESS_GROUP.blocks_step
    assert FSDP2_ON_GLOO.blocks_step
    assert CollectiveIssue(async_reduce=False).blocks_step  # a run's blocking reduce-scatters, priced


def test_blocking_reduce_scatters_lengthen_a_backward_by_their_exposed_time():
    backward = compile_view(layered_stack(3).backward)
    overlapped = backward.simulate(None, issue=ASYNC).step_ms
    serial = backward.simulate(None, issue=CollectiveIssue(async_gather=True, async_reduce=False)).step_ms
    assert serial > overlapped
    everything = backward.simulate(None, issue=CollectiveIssue(async_gather=False, async_reduce=False)).step_ms
    assert abs(everything - (backward.compute_ms + backward.comm_ms)) < 1e-9  # nothing overlaps at all


_ISSUES = st.sampled_from([CollectiveIssue(async_gather=g, async_reduce=r, staging=s)
                           for g in (True, False) for r in (True, False) for s in (True, False)])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 30), st.sampled_from(["forward", "backward"]), _ISSUES, st.integers(0, 4))
def test_blocking_never_makes_the_step_shorter_than_asynchronous(seed, kind, issue, bucket_every):
    """Whatever the graph, buckets and way of issuing: priced blocking is never faster than the same collectives
    asynchronous, and never faster than :data:`SIMULATOR`'s model of them; the planner's timeline agrees with the
    simulation."""
    compiled = compile_view(random_graph(seed, kind=kind))
    order = list(compiled.topo)
    gathers = [i for i in order if compiled.kind[i] == ALLGATHER]
    buckets = [gathers[k:k + 2] for k in range(0, len(gathers) - 1, bucket_every + 2)] if bucket_every else []
    buckets = [b for b in buckets if _issuable(compiled, b, order)]
    priced = compiled.simulate(order, buckets=buckets, issue=issue).step_ms
    free = compiled.simulate(order, buckets=buckets, issue=CollectiveIssue(async_gather=True, async_reduce=True,
                                                                           staging=issue.staging)).step_ms
    unpriced = compiled.simulate(order, buckets=buckets, issue=SIMULATOR).step_ms
    assert priced >= free - 1e-9 and priced >= unpriced - 1e-9
    if issue.blocks_step:
        bound = sum(compiled.duration[i] for i in order if not compiled.is_comm[i])
        assert priced >= bound - 1e-9
    assert abs(compiled.timeline_figures(order, buckets=buckets, issue=issue)[0] - priced) < 1e-9


def _issuable(compiled, bucket, order) -> bool:
    try:
        compiled.bucket_indices([bucket], order)
    except Exception:  # noqa: BLE001 (a bucket whose member's input runs after its first member)
        return False
    return True


def test_overlap_plan_planning_for_blocking_collectives_sees_what_they_cost():
    """``overlap-plan`` with ``blocking`` times every candidate with its collectives on the critical path: its
    plan is no slower, issued blocking, than the plan made for asynchronous collectives, and its figures are
    the blocking simulation's."""
    from pathlib import Path

    import dcsched
    from dcsched.schedulers import run_step
    from dcsched.sim.collectives import latency_from_provenance
    from dcsched.sim.plans import simulate_plan

    bundle = dcsched.load(Path(__file__).resolve().parent.parent / "sample_graphs" / "gpt.pt")
    latency = latency_from_provenance(bundle.provenance)
    forms = {name: bundle.form(name) for name in bundle.graph_names}
    blocking = CollectiveIssue(async_gather=False, async_reduce=False)

    def step(plans, issue) -> float:
        return sum(simulate_plan(compile_view(forms[name], comm_latency_ms=latency), plans[name], name,
                                 issue=issue).step_ms for name in forms)

    for_async = run_step("overlap-plan", forms, comm_latency_ms=latency)
    for_blocking = run_step("overlap-plan", forms, comm_latency_ms=latency, blocking=True)
    assert step(for_blocking, blocking) <= step(for_async, blocking) + 1e-9
    assert step(for_async, blocking) > step(for_async, ASYNC)  # blocking costs this step something
