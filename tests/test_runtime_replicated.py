"""Replicated parameters (issue #32): whole on every rank, no gather, their gradients all-reduced.

The plan the runtime reads (comm_plan) and the count of collectives are checked by hand; one process replays
replicated as kept; 2 gloo ranks replay the example bundle with replicated parameters (alone, in a reduce
bucket of their own, in a bucket mixed with sharded ones) with results bit-identical to the plain run, and
train the GPT example with its norm weights and biases replicated (``dcsched.shard(replicate_below=...)``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import train_runs as runs
from dcsched import replay as rp
from dcsched.collective_issue import CollectiveIssue
from dcsched.plan import Bucket, Plan
from dcsched.runtime import ops
from comm_counts import planned_collectives
from dcsched.runtime.commplan import EMPTY, comm_plan
from dcsched.runtime.distributed import padded_numel
from dcsched.runtime.step import build_step, installed, make_state, run_backward, run_forward

from gloo import mp
from test_runtime_buckets import GRAPH_IDS, _plan, on_gloo_ranks


def replicated_plans(bundle) -> dict[str, dict]:
    """Plans of the example bundle with replicated parameters.

    The forward gathers ds_ids 0, 1, 2; the backward gathers 2 and reduces 2, 0, 1 in that order.
    """
    forward, backward = bundle.forward, bundle.backward
    return {
        # fc1.bias (7 elements: pads at 2 ranks) replicated, every collective alone
        "alone": {"forward": _plan(forward, residency={1: "replicated"}),
                  "backward": _plan(backward, residency={1: "replicated"})},
        # a reduce bucket mixing both kinds: split into a reduce-scatter (2) and an all-reduce (0, 1); the
        # forward's gather bucket loses its replicated members; 'kept' elsewhere is overridden
        "mixed": {"forward": _plan(forward, gathers=[(0, 1, 2)], residency={0: "replicated", 1: "replicated"}),
                  "backward": _plan(backward, reduces=[(2, 0, 1)], residency={0: "kept", 1: "replicated"})},
        # everything replicated: plain data parallelism, one all-reduce for every gradient
        "all": {"forward": _plan(forward, residency={0: "replicated", 1: "replicated", 2: "replicated"}),
                "backward": _plan(backward, reduces=[(2, 0, 1)],
                                  residency={0: "replicated", 1: "replicated", 2: "replicated"})},
    }


# ---------------------------------------------------------------------------
# The plan the runtime reads
# ---------------------------------------------------------------------------

def test_comm_plan_reads_replicated_parameters_and_splits_mixed_reduce_buckets():
    bundle = rp.example_bundle()
    plans = replicated_plans(bundle)
    alone = comm_plan(plans["alone"], GRAPH_IDS)
    assert alone.replicated == {1} and alone.kept == set() and not alone.empty
    mixed = comm_plan(plans["mixed"], GRAPH_IDS)
    assert mixed.replicated == {0, 1} and mixed.kept == set()  # replicated overrides kept
    assert mixed.allgather_buckets(0) == ()  # (0, 1, 2) less the replicated: one member left, alone
    assert mixed.reduce_buckets(1) == ((0, 1),) and mixed.reduce_bucket_of(1, 2) is None
    assert comm_plan(plans["all"], GRAPH_IDS).reduce_buckets(1) == ((2, 0, 1),)
    # the example's 7 collectives (4 gathers, 3 reduces): a replicated parameter's gathers go, its reduce stays
    counts = {label: planned_collectives(bundle.graphs, comm_plan(p, GRAPH_IDS)) for label, p in plans.items()}
    assert counts == {"alone": 6, "mixed": 4, "all": 1}
    # a sharded and a replicated part of one bucket, each fused on its own
    split = comm_plan({"backward": Plan(("x",), [Bucket("reduce", list("abcd"), [4, 5, 6, 7])],
                                        residency={5: "replicated", 7: "replicated"})}, {"backward": 1})
    assert split.reduce_buckets(1) == ((4, 6), (5, 7))
    assert comm_plan({"forward": Plan(("a",))}, GRAPH_IDS) is EMPTY


def test_one_process_runs_replicated_as_kept():
    bundle = rp.example_bundle()
    expected = rp.replay(bundle, iters=0).results
    for label, plans in replicated_plans(bundle).items():
        planned = dataclasses.replace(bundle, plans=plans)
        assert rp.compare(expected, rp.replay(planned, iters=0).results).exact, label
    runtime = ops.Zero3Runtime()
    planned = dataclasses.replace(bundle, plans=replicated_plans(bundle)["mixed"])
    runtime.set_plan(comm_plan(planned.plans, GRAPH_IDS))
    step, state = build_step(planned), make_state(planned)
    with installed(runtime):
        outputs = run_forward(step, list(state.forward_args))
        assert sorted(runtime.held) == [0, 1]  # held from the forward to the backward, as kept ones are
        run_backward(step, outputs)
        assert runtime.held == {}
    assert sum(runtime.issued.values()) == 0


# ---------------------------------------------------------------------------
# Replay on gloo ranks
# ---------------------------------------------------------------------------

def _replay_ranks(rank: int, world_size: int, port: int, out_dir: str) -> None:
    from dcsched.runtime.distributed import shutdown
    from dcsched.runtime.select import runtime_for

    runs.init_gloo(rank, world_size, port)
    try:
        bundle = rp.example_bundle()
        out = {}
        variants = [("none", "none", {})] + [(label, label, {}) for label in replicated_plans(bundle)] + [
            ("mixed-sync", "mixed", {"issue": CollectiveIssue(async_reduce=False)})]
        for label, plan_label, settings in variants:
            plans = {} if plan_label == "none" else replicated_plans(bundle)[plan_label]
            planned = dataclasses.replace(bundle, plans=plans)
            runtime = runtime_for(bundle.params, flat_shards=False, plans=planned.plans, graph_ids=GRAPH_IDS)
            for name, value in settings.items():
                setattr(runtime, name, value)
            results = rp.replay(planned, runtime=runtime, iters=0).results
            out[label] = {"results": results, "issued": sum(runtime.issued.values()),
                          "all_reduces": runtime.all_reduces}
        # replay's proof of equality: the original order and plan against the replicated one, its reduce bucket
        # issued where replay (as schedule and the simulator) issues a bucket, at its first member: so the
        # order runs the reduces last, after every gradient they read
        mixed = replicated_plans(bundle)["mixed"]
        mixed["backward"] = _reduces_last(mixed["backward"], bundle.backward)
        report = rp.replay_orders(dataclasses.replace(bundle, plans=mixed), bundle, iters=1, warmup=0)
        out["proved"] = bool(report.comparison.exact)
        out["module"] = _sharded_module(rank, world_size)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        shutdown()


def _reduces_last(plan: Plan, graph) -> Plan:
    """``plan`` with its order's reduces moved to just before the output (each after every input it reads)."""
    reduces = {node.name for node in graph.nodes if node.target is ops.reduce_grad}
    rest = [name for name in plan.order if name not in reduces]
    order = rest[:-1] + [name for name in plan.order if name in reduces] + rest[-1:]
    return dataclasses.replace(plan, order=order)


def _sharded_module(rank: int, world_size: int) -> dict:
    """A Linear sharded with its bias (3 elements) replicated: shapes, state dict, load, gradient norm."""
    import dcsched
    from dcsched.runtime.distributed import shard_of

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    full = {key: value.detach().clone() for key, value in model.state_dict().items()}
    sharding = dcsched.shard(model, replicate_below=5)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    state_ok = all(torch.equal(value, full[key]) for key, value in model.state_dict().items())
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    model.load_state_dict(full)
    loaded_ok = all(torch.equal(value, full[key]) for key, value in model.state_dict().items())
    grads = {"weight": torch.arange(12.0).view(3, 4), "bias": torch.tensor([3.0, 4.0, 12.0])}
    model.weight.grad = shard_of(grads["weight"], rank, world_size)
    model.bias.grad = grads["bias"].clone()  # whole and equal on every rank, as the all-reduce leaves it
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    expected = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads.values()]))
    return {"replicated": sorted(sharding.replicated), "shapes": shapes, "state_ok": state_ok,
            "loaded_ok": loaded_ok, "norm": float(norm), "expected": float(expected)}


@on_gloo_ranks
def test_replay_with_replicated_parameters_is_bit_identical_and_all_reduces(tmp_path):
    world_size = 2
    mp.spawn(_replay_ranks, args=(world_size, runs.free_port(), str(tmp_path)), nprocs=world_size, join=True)
    bundle = rp.example_bundle()
    plans = replicated_plans(bundle)
    # all-reduces per run: one per replicated reduce, one per replicated reduce bucket
    all_reduces = {"none": 0, "alone": 1, "mixed": 1, "mixed-sync": 1, "all": 1}
    for rank in range(world_size):
        data = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        plain = data["none"]
        assert plain["issued"] == 7
        for label in ("alone", "mixed", "mixed-sync", "all"):
            run = data[label]
            assert rp.compare(plain["results"], run["results"]).exact, (rank, label)
            assert run["issued"] == planned_collectives(bundle.graphs, comm_plan(plans[label.split("-")[0]],
                                                                                 GRAPH_IDS)), (rank, label)
            assert run["all_reduces"] == all_reduces[label], (rank, label)
        assert data["proved"]
        # dcsched.shard(replicate_below=5): the bias whole on every rank; the state dict, its loading and the
        # gradient norm (the bias counted once, not once per rank) as for an unsharded module
        module = data["module"]
        assert module["replicated"] == [1] and module["shapes"] == {"weight": (6,), "bias": (3,)}, module
        assert module["state_ok"] and module["loaded_ok"], module
        assert module["norm"] == pytest.approx(module["expected"], rel=1e-6), module


# ---------------------------------------------------------------------------
# The simulator
# ---------------------------------------------------------------------------

def test_simulator_runs_replicated_parameters_resident_ungathered_and_all_reduced():
    from dcsched.graph.roles import Role, comm_ids, role_of
    from dcsched.sim.plans import simulate_plan
    from dcsched.sim.simulate import compile_view

    bundle = rp.example_bundle()
    latency = 0.001  # below the example's 0.005 ms per collective, so an all-reduce costs more than it
    sizes = {p.ds_id: p.numel * 4 for p in bundle.params}
    for graph in bundle.graphs.values():  # shards of 2 ranks, as a profile at world size 2 sizes them
        for node in graph.nodes:
            if node.op == "placeholder" and any(role_of(u) is Role.ALLGATHER for u in node.users):
                node.meta["tensor_size"] = padded_numel(node.meta["tensor_size"] // 4, 2) // 2 * 4
    for name, graph in bundle.graphs.items():
        compiled = compile_view(graph)
        compiled.comm_latency_ms = latency
        plain = compiled.simulate(None)
        run = simulate_plan(compiled, Plan((), residency={1: "replicated"}), name)
        gathers = [n for n in graph.nodes if role_of(n) is Role.ALLGATHER and comm_ids(n)[1] == 1]
        reduces = [n for n in graph.nodes if role_of(n) is Role.REDUCE and comm_ids(n)[1] == 1]
        assert run.collectives == plain.collectives - len(gathers), name
        # resident from the start (the whole parameter, in place of its shard), never freed
        shard = gathers[0].args[0].meta["tensor_size"] if gathers else 0
        assert not gathers or shard < sizes[1]
        assert run.memory[0] == plain.memory[0] + (sizes[1] - shard if gathers else 0), name
        assert run.memory[-1] - plain.memory[-1] >= (sizes[1] - shard if gathers else 0), name
        for node in reduces:  # an all-reduce: twice the reduce-scatter's bytes, one latency
            pos = run.indices.index(compiled.index[node.name]) if run.indices else \
                [n.name for n in graph.nodes].index(node.name)
            took = run.end_ms[pos] - run.start_ms[pos]
            assert took == pytest.approx(2 * node.meta["device_time"] - latency), name
    # a reduce bucket mixing both: split in two collectives, as the runtime splits it
    backward = compile_view(bundle.backward)
    names = {comm_ids(n)[1]: n.name for n in bundle.backward.nodes if role_of(n) is Role.REDUCE}
    bucket = Bucket("reduce", [names[d] for d in (2, 0, 1)], [2, 0, 1])
    # every reduce last, so the bucket (issued at its first member) has every member's gradient
    nodes = list(bundle.backward.nodes)
    order = [n.name for n in nodes if n.op != "output" and role_of(n) is not Role.REDUCE] + \
        [names[d] for d in (2, 0, 1)] + [nodes[-1].name]
    mixed = simulate_plan(backward, Plan(order, [bucket], residency={0: "replicated"}), "backward")
    assert mixed.collectives == simulate_plan(backward, Plan(order, [bucket]), "backward").collectives + 1


# ---------------------------------------------------------------------------
# Training on gloo ranks: the GPT example with its norm weights and biases replicated
# ---------------------------------------------------------------------------

#: Below every LayerNorm weight and bias and every Linear bias of train_runs' tiny GPT (32 to 128 elements),
#: above every weight (256 and more): 10 of its 16 parameters replicated.
REPLICATE_BELOW = 200
STEPS, BATCH, CLIP = 6, 4, 0.05


@pytest.fixture(scope="module")
def replicated_training(tmp_path_factory):
    """One 2-rank spawn: GPT sharded and with ``replicate_below``, under overlap (every collective alone) and
    fsdp (buckets mixing replicated and sharded members), clipped, checkpointed and resumed."""
    root = tmp_path_factory.mktemp("replicated")
    checkpoint = str(root / "replicated.ckpt")
    whole = {"replicate_below": REPLICATE_BELOW}
    plan = [("sharded", "gpt", "overlap", STEPS, BATCH, {"full_state": True}),
            ("replicated", "gpt", "overlap", STEPS, BATCH, {**whole, "full_state": True,
                                                            "save": (checkpoint, STEPS // 2)}),
            ("replicated-fsdp", "gpt", "fsdp", STEPS, BATCH, whole),
            ("sharded-clip", "gpt", "overlap", STEPS, BATCH, {"clip": CLIP}),
            ("replicated-clip", "gpt", "overlap", STEPS, BATCH, {**whole, "clip": CLIP}),
            # the replicated run's checkpoint, resumed replicated (under fsdp) and sharded
            ("resumed-replicated", "gpt", "fsdp", STEPS, BATCH, {**whole, "resume": checkpoint}),
            ("resumed-sharded", "gpt", "overlap", STEPS, BATCH, {"resume": checkpoint})]
    return runs.spawn(root / "out", 2, plan)


@on_gloo_ranks
def test_replicated_training_is_bit_identical_to_sharded_and_as_eager(replicated_training):
    eager = torch.tensor(runs.train_eager("gpt", STEPS, BATCH))
    sharded = replicated_training[0]["sharded"]
    assert sharded["collectives"]["replicated"] == 0
    for rank in range(2):
        for label in ("replicated", "replicated-fsdp"):
            run = replicated_training[rank][label]
            assert run["losses"] == sharded["losses"], (rank, label)
            assert torch.allclose(torch.tensor(run["losses"]), eager, rtol=1e-5, atol=0), (rank, label)
            counts = run["collectives"]
            assert counts["replicated"] == 10 and counts["issued"] == counts["planned"], (rank, label, counts)
            # the all-reduces happened: every step's, counted by the runtime
            assert counts["planned_all_reduces"] > 0, (rank, label)
            assert counts["all_reduces"] == STEPS * counts["planned_all_reduces"], (rank, label, counts)
        assert replicated_training[rank]["replicated"]["collectives"]["planned_all_reduces"] == 10
        # fsdp's reduce buckets hold replicated and sharded members: split, each part one collective
        assert replicated_training[rank]["replicated-fsdp"]["collectives"]["planned_all_reduces"] < 10
        # full_state: the replicated parameters in their full shape, the same weights as the sharded run's
        state, plain = replicated_training[rank]["replicated"]["state"], sharded["state"]
        assert state.keys() == plain.keys() and all(torch.equal(state[k], plain[k]) for k in plain), rank


@on_gloo_ranks
def test_replicated_training_peak_memory_matches_the_simulator(replicated_training):
    for rank in range(2):
        for label in ("replicated", "replicated-fsdp"):
            for graph, (measured, simulated) in replicated_training[rank][label]["memory"].items():
                assert abs(measured - simulated) <= 0.05 * simulated, (rank, label, graph, measured, simulated)


@on_gloo_ranks
def test_gradient_clipping_counts_each_replicated_parameter_once(replicated_training):
    for rank in range(2):
        plain, run = replicated_training[rank]["sharded-clip"], replicated_training[rank]["replicated-clip"]
        assert all(norm > CLIP for norm in plain["norms"])  # the clipping binds
        # the same norms (summed in another order: the replicated ones are not over ranks) and losses
        assert torch.allclose(torch.tensor(run["norms"]), torch.tensor(plain["norms"]), rtol=1e-5, atol=0), rank
        assert torch.allclose(torch.tensor(run["losses"]), torch.tensor(plain["losses"]), rtol=1e-5, atol=0), rank
    assert replicated_training[0]["replicated-clip"]["norms"] == replicated_training[1]["replicated-clip"]["norms"]


@on_gloo_ranks
def test_checkpoint_of_replicated_parameters_resumes_replicated_or_sharded(replicated_training):
    for rank in range(2):
        uninterrupted = replicated_training[rank]["replicated"]["losses"][STEPS // 2:]
        for label in ("resumed-replicated", "resumed-sharded"):
            assert replicated_training[rank][label]["losses"] == uninterrupted, (rank, label)
