"""Running a communication plan (issue #32): bucketed collectives and kept parameters compute what the plain run does.

The layout of a bucket is checked by hand at world sizes 2 and 3 (parameters that do not divide); the runtime on
2 gloo ranks replays the example bundle under several plans, and trains the GPT example with FSDP's buckets:
results bit-identical to the unbucketed run, the collectives issued per step the plan's count, kept parameters
alive from the forward to the backward and freed after.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import train_runs as runs
from dcsched import replay as rp
from dcsched.collective_issue import CollectiveIssue
from dcsched.errors import DcschedError
from dcsched.graph.roles import Role, comm_ids, role_of
from dcsched.plan import Bucket, Plan
from dcsched.runtime import ops
from dcsched.runtime.buckets import offsets, pack_gradient, unpack_gathered
from comm_counts import planned_collectives
from dcsched.runtime.commplan import EMPTY, comm_plan
from dcsched.runtime.distributed import padded_numel, shard_of
from dcsched.runtime.step import build_step, installed, make_state, run_backward, run_forward

from gloo import mp, on_gloo_ranks

GRAPH_IDS = {"forward": 0, "backward": 1}


# ---------------------------------------------------------------------------
# The layout, by hand
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [2, 3])
def test_bucketed_all_gather_layout_gives_each_full_parameter(world_size):
    numels = [7, 12, 5, 1]  # 7, 5 and 1 pad at W=2 and W=3 (12 pads at neither)
    fulls = [torch.arange(n, dtype=torch.float32) + 100 * k for k, n in enumerate(numels)]
    sizes = [padded_numel(n, world_size) // world_size for n in numels]
    # all_gather_into_tensor: rank r's input (its shards, concatenated) is row r of the output
    output = torch.cat([torch.cat([shard_of(full, rank, world_size) for full in fulls])
                        for rank in range(world_size)])
    for full, offset, size in zip(fulls, offsets(sizes), sizes):
        padded = torch.empty(size * world_size)
        unpack_gathered(output, world_size, offset, size, padded.view(world_size, size))
        assert torch.equal(padded[:full.numel()], full) and not padded[full.numel():].any()


@pytest.mark.parametrize("world_size", [2, 3])
def test_bucketed_reduce_scatter_layout_gives_each_rank_its_shards(world_size):
    numels = [7, 12, 5, 1]
    sizes = [padded_numel(n, world_size) // world_size for n in numels]
    generator = torch.Generator().manual_seed(0)
    grads = [[torch.randn(n, generator=generator) for n in numels] for _rank in range(world_size)]
    inputs = []
    for rank in range(world_size):
        flat = torch.full((world_size * sum(sizes),), float("nan"))  # every element must be written
        for grad, offset, size in zip(grads[rank], offsets(sizes), sizes):
            pack_gradient(grad, flat.view(world_size, -1)[:, offset:offset + size])
        inputs.append(flat)
    for rank in range(world_size):
        # reduce_scatter_tensor (SUM): rank r receives the sum over ranks of row r of every input
        received = sum(flat.view(world_size, -1)[rank] for flat in inputs)
        for member, (offset, size) in enumerate(zip(offsets(sizes), sizes)):
            alone = sum(shard_of(grads[q][member], rank, world_size) for q in range(world_size))
            assert torch.equal(received[offset:offset + size], alone), (rank, member)


# ---------------------------------------------------------------------------
# The plan the runtime reads
# ---------------------------------------------------------------------------

def _plan(graph, gathers=(), reduces=(), residency=None) -> Plan:
    """A plan for ``graph`` in its own order, buckets given by ds_id."""
    names = {}
    for node in graph.nodes:
        if role_of(node) in (Role.ALLGATHER, Role.REDUCE):
            names[(role_of(node), comm_ids(node)[1])] = node.name
    buckets = [Bucket("allgather", [names[(Role.ALLGATHER, d)] for d in ids], ids) for ids in gathers]
    buckets += [Bucket("reduce", [names[(Role.REDUCE, d)] for d in ids], ids) for ids in reduces]
    return Plan([n.name for n in graph.nodes], buckets, residency or {})


def example_plans(bundle) -> dict[str, dict]:
    """The plans the distributed tests run on the example bundle (3 forward gathers, 1 backward, 3 reduces).

    The forward gathers ds_ids 0, 1, 2; the backward gathers 2 and reduces 2, 0, 1 in that order.
    """
    forward, backward = bundle.forward, bundle.backward
    return {
        "none": {},
        "buckets": {"forward": _plan(forward, gathers=[(0, 1, 2)]),
                    "backward": _plan(backward, reduces=[(2, 0, 1)])},
        "kept": {"forward": _plan(forward, residency={2: "kept"})},
        # members out of execution order; ds_id 0 kept but never gathered by the backward (freed at its end)
        "both": {"forward": _plan(forward, gathers=[(1, 0)], residency={2: "kept", 0: "kept"}),
                 "backward": _plan(backward, gathers=[(2,)], reduces=[(0, 2)])},
    }


def test_comm_plan_reads_buckets_and_kept():
    bundle = rp.example_bundle()
    plans = example_plans(bundle)
    assert comm_plan(plans["none"], GRAPH_IDS) is EMPTY
    both = comm_plan(plans["both"], GRAPH_IDS)
    assert both.allgather_buckets(0) == ((1, 0),) and both.allgather_buckets(1) == ()  # a single member: alone
    assert both.reduce_buckets(1) == ((0, 2),) and both.kept == {0, 2} and both.forward_graph_id == 0
    # a kept parameter in a backward bucket is left out of it: the backward reuses the forward's buffer
    skipped = comm_plan({"forward": _plan(bundle.forward, residency={2: "kept"}),
                         "backward": Plan(("a",), [Bucket("allgather", ["x", "y", "z"], [2, 0, 1])])}, GRAPH_IDS)
    assert skipped.allgather_buckets(1) == ((0, 1),)
    counts = {label: planned_collectives(bundle.graphs, comm_plan(p, GRAPH_IDS)) for label, p in plans.items()}
    assert counts == {"none": 7, "buckets": 3, "kept": 6, "both": 4}
    # replicated parameters: tests/test_runtime_replicated.py
    with pytest.raises(DcschedError, match="two allgather buckets"):
        comm_plan({"forward": _plan(bundle.forward, gathers=[(0, 1), (1, 2)])}, GRAPH_IDS)
    with pytest.raises(DcschedError, match="no graph_id"):
        comm_plan({"forward": _plan(bundle.forward)}, {"backward": 1})


def test_one_process_holds_kept_parameters_from_forward_to_backward():
    bundle = rp.example_bundle()
    expected = rp.replay(bundle, iters=0).results
    kept = dataclasses.replace(bundle, plans=example_plans(bundle)["both"])
    assert rp.compare(expected, rp.replay(kept, iters=0).results).exact
    runtime = ops.Zero3Runtime()
    runtime.set_plan(comm_plan(kept.plans, GRAPH_IDS))
    step, state = build_step(kept), make_state(kept)
    with installed(runtime):
        outputs = run_forward(step, list(state.forward_args))
        held = dict(runtime.held)
        assert sorted(held) == [0, 2] and all(t.untyped_storage().nbytes() > 0 for t in held.values())
        run_backward(step, outputs)
        assert runtime.held == {} and all(t.untyped_storage().nbytes() == 0 for t in held.values())
        # an evaluation forward (no backward) holds them until the next forward starts
        run_forward(step, list(state.forward_args))
        first = dict(runtime.held)
        run_forward(step, list(state.forward_args))
        assert all(t.untyped_storage().nbytes() == 0 for t in first.values()) and sorted(runtime.held) == [0, 2]
    assert sum(runtime.issued.values()) == 0


# ---------------------------------------------------------------------------
# Replay on gloo ranks
# ---------------------------------------------------------------------------

def _replay_ranks(rank: int, world_size: int, port: int, out_dir: str, labels: list[str]) -> None:
    from dcsched.runtime.distributed import shutdown
    from dcsched.runtime.select import runtime_for

    runs.init_gloo(rank, world_size, port)
    try:
        bundle = rp.example_bundle()
        out = {}
        # "both" again with reduce-scatters waited where issued, with no limit on those in flight, and with the
        # all-gathers waited where issued (training's choice on gloo under a budget their copies do not fit)
        variants = [(label, label, {}) for label in labels] + [
            ("both-sync", "both", {"issue": CollectiveIssue(async_reduce=False)}),
            ("both-unbounded", "both", {"reduces_in_flight": None}),
            ("both-blocking", "both", {"issue": CollectiveIssue(async_gather=False, async_reduce=False)}),
            ("both-pergraph", "both", {"issues": {0: CollectiveIssue(async_gather=False, async_reduce=True),
                                                  1: CollectiveIssue(async_gather=True, async_reduce=False)}})]
        for label, plan_label, settings in variants:
            planned = dataclasses.replace(bundle, plans=example_plans(bundle)[plan_label])
            runtime = runtime_for(bundle.params, flat_shards=False, plans=planned.plans, graph_ids=GRAPH_IDS)
            for name, value in settings.items():
                setattr(runtime, name, value)
            results = rp.replay(planned, runtime=runtime, iters=0).results
            # kept parameters: alive between the forward and the backward, freed after
            step, state = build_step(planned), make_state(planned, shard=runtime.shard)
            with installed(runtime):
                outputs = run_forward(step, list(state.forward_args))
                held = {d: t.untyped_storage().nbytes() for d, t in runtime.held.items()}
                grads = run_backward(step, outputs)
                after = len(runtime.held)
            out[label] = {"results": results, "issued": sum(runtime.issued.values()), "held": held,
                          "held_after": after, "grads": [g for g in grads if g is not None]}
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        shutdown()


@on_gloo_ranks
def test_replay_under_every_plan_is_bit_identical_and_issues_the_planned_collectives(tmp_path):
    # Two ranks: fc1.bias (7) and fc2.weight (21) pad; the layout at 3 ranks is checked by hand above.
    world_size, labels = 2, ["none", "buckets", "kept", "both"]
    mp.spawn(_replay_ranks, args=(world_size, runs.free_port(), str(tmp_path), labels), nprocs=world_size,
             join=True)
    bundle = rp.example_bundle()
    plans = example_plans(bundle)
    sizes = {p.ds_id: p.numel * 4 for p in bundle.params}
    for rank in range(world_size):
        data = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        plain = data["none"]
        for label in [*labels, "both-sync", "both-unbounded", "both-blocking", "both-pergraph"]:
            run, plan = data[label], comm_plan(plans[label.split("-")[0]], GRAPH_IDS)
            assert rp.compare(plain["results"], run["results"]).exact, (rank, label)
            assert all(torch.equal(a, b) for a, b in zip(plain["grads"], run["grads"])), (rank, label)
            assert run["issued"] == planned_collectives(bundle.graphs, plan), (rank, label)
            kept = plan.kept
            # a kept parameter's whole gathered buffer (padded) lives from the forward to the backward
            assert sorted(run["held"]) == sorted(kept) and run["held_after"] == 0
            for ds_id, nbytes in run["held"].items():
                assert sizes[ds_id] <= nbytes <= padded_numel(sizes[ds_id] // 4, world_size) * 4
        assert data["none"]["issued"] == 7


def _in_place_ranks(rank: int, world_size: int, port: int, out_dir: str) -> None:
    from dcsched.runtime.distributed import DistributedZero3Runtime, shutdown

    runs.init_gloo(rank, world_size, port)
    try:
        bundle = rp.example_bundle()
        runtime = DistributedZero3Runtime(bundle.params)
        runtime.set_plan(comm_plan({"forward": _plan(bundle.forward, gathers=[(0, 1)])}, GRAPH_IDS))
        fulls = {p.ds_id: torch.arange(p.numel, dtype=torch.float32).reshape(p.shape) + 1000 * p.ds_id
                 for p in bundle.params if p.ds_id in (0, 1)}
        shards = {ds_id: runtime.shard(full) for ds_id, full in fulls.items()}
        runtime.begin_graph(0, {ds_id: (shard, None) for ds_id, shard in shards.items()})
        first = runtime.allgather(shards[0], 0, 0, None)
        bucket = runtime.pending[(0, 0)]
        # the runtime's own tensors with bytes (a member's buffer has none until the copy-out)
        storages = {t.untyped_storage().data_ptr() for t in runtime.buffers() if t.untyped_storage().nbytes()}
        output = bucket.output.untyped_storage()
        out = {"input_is_a_row": bucket.source.untyped_storage().data_ptr() == output.data_ptr()
               and bucket.source.data_ptr() == bucket.output.data_ptr() + rank * bucket.source.nbytes,
               "storages": len(storages), "output_bytes": output.nbytes()}
        second = runtime.allgather(shards[1], 0, 1, None)
        runtime.wait(first, 0, 0)
        out["transient"] = runtime.transient_bytes()
        runtime.wait(second, 0, 1)
        out["equal"] = torch.equal(first, fulls[0]) and torch.equal(second, fulls[1])
        runtime.end_graph(0)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        shutdown()


@on_gloo_ranks
def test_a_bucket_gathers_in_place(tmp_path):
    """As FSDP2 gathers: this rank's shards are copied into its own row of the flat output, the collective's
    input, so a bucket in flight holds one flat tensor (a flat input of its own, as before, held the shards'
    bytes again from the issue to the wait); the members still come out whole."""
    world_size = 2
    mp.spawn(_in_place_ranks, args=(world_size, runs.free_port(), str(tmp_path)), nprocs=world_size, join=True)
    for rank in range(world_size):
        out = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert out["input_is_a_row"] and out["equal"], (rank, out)
        assert out["storages"] == 1 and out["transient"] == out["output_bytes"], (rank, out)


# ---------------------------------------------------------------------------
# Training the GPT example with FSDP's buckets
# ---------------------------------------------------------------------------

def unkept_fsdp_plans(bundle) -> dict:
    """FSDP's buckets for each graph planned alone: nothing kept (the step's plan keeps the root)."""
    from dcsched.graph.form import GraphForm
    from dcsched.schedulers.fsdp.scheduler import fsdp

    return {name: fsdp({name: GraphForm(graph)})[name] for name, graph in bundle.graphs.items()}


def _train_ranks(rank: int, world_size: int, port: int, out_dir: str) -> None:
    import dcsched
    from dcsched.runtime.distributed import shutdown

    runs.init_gloo(rank, world_size, port)
    try:
        torch._dynamo.reset()
        model, _ = runs.model_of("gpt", n_layers=2)  # two blocks: the root (embeddings, head) stands apart
        dcsched.shard(model)
        initial = [p.detach().clone() for p in model.parameters()]
        backend = dcsched.backend(algo="fsdp", cost_model="analytic", gpu="h100")
        compiled = torch.compile(model, backend=backend, dynamic=False)
        # the step's plan (the root kept) ScheduledProgram got from the bundle, reduce-scatters asynchronous
        out = {"fsdp-kept-async": _train_gpt(compiled, model, rank, world_size, backend, async_reduce=True)}
        program = backend.programs[0]
        out["wired"] = sorted(program.runtime.plan.kept) == sorted(program.bundle.plans["forward"].residency)
        # The same compiled step under other plans: the runtime reads its plan at every op.
        for label, plans in (("none", {}), ("fsdp", unkept_fsdp_plans(program.bundle))):
            with torch.no_grad():
                for param, value in zip(model.parameters(), initial):
                    param.copy_(value)
            program.runtime.set_plan(comm_plan(plans, program.bundle.graph_ids))
            out[label] = _train_gpt(compiled, model, rank, world_size, backend, async_reduce=False)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        shutdown()


def _train_gpt(compiled, model, rank: int, world_size: int, backend, async_reduce: bool) -> dict:
    """Three SGD steps of the GPT example; the first step's gradient shards and kept buffers.

    ``async_reduce``: the runtime's default issue's (training's default is True, ``PROCESS_GROUP``).
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=runs.LR)
    result: dict = {"losses": []}
    for step, inputs in enumerate(runs.global_batches("gpt", 3, 4)):
        loss = compiled(*runs.local_slice(inputs, rank, world_size))
        runtime = backend.programs[0].runtime  # made by the first call
        runtime.issue = dataclasses.replace(runtime.issue, async_reduce=async_reduce)
        if step == 0:
            result["held"] = {d: t.untyped_storage().nbytes() for d, t in runtime.held.items()}
        loss.backward()
        if step == 0:
            result["grads"] = [p.grad.clone() for p in model.parameters()]
            result["held_after"] = len(runtime.held)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        result["losses"].append(loss.detach().clone())
    program = backend.programs[0]
    result.update(issued=sum(program.runtime.issued.values()), kept=sorted(program.runtime.plan.kept),
                  planned=planned_collectives(program.bundle.graphs, program.runtime.plan),
                  plain=planned_collectives(program.bundle.graphs, EMPTY),
                  buckets=len(program.runtime.plan.graphs), async_reduce=program.runtime.issue.async_reduce)
    return result


@on_gloo_ranks
def test_training_with_fsdp_buckets_and_kept_parameters_is_bit_identical(tmp_path):
    mp.spawn(_train_ranks, args=(2, runs.free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        data = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert data["wired"]  # ScheduledProgram's runtime runs the scheduled bundle's plans
        plain = data["none"]
        assert plain["issued"] == plain["planned"] == plain["plain"] and plain["held"] == {}
        for label in ("fsdp", "fsdp-kept-async"):
            run = data[label]
            assert all(torch.equal(a, b) for a, b in zip(plain["losses"], run["losses"])), (rank, label)
            assert all(torch.equal(a, b) for a, b in zip(plain["grads"], run["grads"])), (rank, label)
            assert run["buckets"] == 2  # the forward's and the backward's
            assert run["issued"] == run["planned"] < plain["issued"], (rank, label, run["issued"], run["planned"])
        kept = data["fsdp-kept-async"]
        assert kept["async_reduce"] and not data["fsdp"]["async_reduce"]
        assert kept["kept"] and sorted(kept["held"]) == kept["kept"] and kept["held_after"] == 0
        assert all(nbytes > 0 for nbytes in kept["held"].values())  # alive from the forward to the backward
        assert kept["issued"] < data["fsdp"]["issued"]
