"""The table of collective kinds: a new kind is one row plus its runtime kernel and its cost.

A test-only kind (an all-reduce of a gradient, bucketed with the reduce-scatters) is registered in
:mod:`dcsched.collectives` for one test at a time; the bundle checks, the simulator, a scheduler and the
runtime take a graph running it with no other change, and taking it out of the table takes its op out of
torch's registry.
"""

from __future__ import annotations

import pytest
import torch

import dcsched
from dcsched import collectives, replay
from dcsched.bundle.checks import check_comm_arguments, comm_ints
from dcsched.costmodels.base import modelled_comm_time
from dcsched.costmodels.topology import Topology
from dcsched.costmodels.interconnects import Link
from dcsched.errors import BundleError
from dcsched.graph.form import REDUCE, GraphForm
from dcsched.graph.roles import Role, collective_of, role_of
from dcsched.plan import Bucket, Plan
from dcsched.reorder import plan as schedule_plan
from dcsched.runtime import ops
from dcsched.runtime.step import build_step, installed, make_state, run_step
from dcsched.sim.simulate import simulate

#: The node of the example bundle's backward that the test kind replaces (fc2's gradient reduce).
SWAPPED = "reduce_ds_param_fc2_weight"
CALLS: list[tuple[int, int]] = []


def _allreduce(runtime, grad, graph_id, ds_id):
    """An all-reduce of the whole gradient: in one process, the gradient itself (in its reduce dtype)."""
    CALLS.append((graph_id, ds_id))
    return runtime.in_reduce_dtype(grad, ds_id).clone()


def _allreduce_fake(runtime, grad, graph_id, ds_id):
    return torch.empty_like(grad)


def _allreduce_cost(nbytes, world_size, bandwidth_gbps, latency_us):
    """A ring all-reduce: twice a reduce-scatter's traffic, one latency per half."""
    return 2 * (nbytes * (world_size - 1) / world_size / (bandwidth_gbps * 1e9) * 1e3 + latency_us * 1e-3)


ALLREDUCE = collectives.CollectiveKind(
    "allreduce", "allreduce_grad", "allreduce_grad(Tensor a, int graph_id, int id) -> Tensor", ("graph_id", "id"),
    role="reduce", bucket="reduce", kernel=_allreduce, fake=_allreduce_fake, cost=_allreduce_cost)


@pytest.fixture
def allreduce():
    CALLS.clear()
    with collectives.registered(ALLREDUCE) as kind:
        yield kind
    assert collectives.find(ALLREDUCE.op) is None


def _with_allreduce(bundle):
    """``bundle`` with its node :data:`SWAPPED` running the test kind's op."""
    node = next(n for n in bundle.backward.nodes if n.name == SWAPPED)
    node.target = torch.ops.dcsched.allreduce_grad.default
    return bundle


def test_a_registered_kind_is_an_op_with_its_role_bucket_and_arguments(allreduce):
    assert str(torch.ops.dcsched.allreduce_grad.default._schema) == \
        "dcsched::allreduce_grad(Tensor a, int graph_id, int id) -> Tensor"
    node = next(n for n in _with_allreduce(replay.example_bundle()).backward.nodes if n.name == SWAPPED)
    assert role_of(node) is Role.REDUCE and collective_of(node) is allreduce
    assert collectives.bucket_ops("reduce") == ("reduce_grad", "allreduce_grad")
    assert comm_ints("allreduce_grad") == ("graph_id", "id")
    with pytest.raises(ValueError, match=r"allreduce_grad's id is negative \(-1\)"):
        check_comm_arguments("allreduce_grad", ("grad", 0, -1), {}, "node r")


def test_a_bundle_with_the_kind_round_trips_with_a_bucket_of_it(allreduce, tmp_path):
    bundle = _with_allreduce(replay.example_bundle())
    reduces = [n.name for n in bundle.backward.nodes if role_of(n) is Role.REDUCE]
    ds_ids = [n.args[2] for n in bundle.backward.nodes if n.name in reduces]
    bundle.plans["backward"] = Plan((), [Bucket("reduce", reduces, ds_ids)])
    path = dcsched.save(bundle, tmp_path / "allreduce.pt")
    loaded = dcsched.load(path)
    swapped = next(n for n in loaded.backward.nodes if n.name == SWAPPED)
    assert swapped.target is torch.ops.dcsched.allreduce_grad.default
    assert [b.members for b in loaded.plans["backward"].buckets] == [tuple(reduces)]
    assert dcsched.save(loaded, tmp_path / "again.pt").read_bytes() == path.read_bytes()
    # A bucket kind that fuses no such op is refused, naming the ops it fuses.
    bundle.plans["backward"] = Plan((), [Bucket("allgather", [SWAPPED], [2])])
    with pytest.raises(BundleError, match="is no allgather_param"):
        dcsched.save(bundle, tmp_path / "wrong.pt")


def test_the_simulator_and_a_scheduler_take_the_kind_as_a_reduce(allreduce):
    plain = replay.example_bundle()
    swapped = _with_allreduce(replay.example_bundle())
    form = GraphForm(swapped.backward)
    assert form.kind[form.index[SWAPPED]] == REDUCE
    assert simulate(swapped.backward) == simulate(plain.backward)
    for algo in ("fsdp", "fast-free", "overlap-plan"):
        chosen, reference = schedule_plan(swapped.backward, algo), schedule_plan(plain.backward, algo)
        assert chosen == reference and SWAPPED in chosen.order
    fsdp = schedule_plan(swapped.backward, "fsdp")  # fuses the all-reduce with the reduce-scatters
    assert [b.kind for b in fsdp.buckets if SWAPPED in b.members] == ["reduce"]
    fused = simulate(swapped.backward, fsdp.order, buckets=fsdp.buckets)
    assert fused == simulate(plain.backward, fsdp.order, buckets=fsdp.buckets)
    assert fused.collectives == simulate(swapped.backward, fsdp.order).collectives - 2


def test_the_kind_is_priced_by_its_cost(allreduce):
    node = next(n for n in _with_allreduce(replay.example_bundle()).backward.nodes if n.name == SWAPPED)
    link = Link(latency_us=10.0, bandwidth_gbps=100.0, source="test", name="given")
    topology = Topology(world_size=8, ranks_per_node=8, device_kind="h100", link=link, process_group=False)
    nbytes = 4 * node.meta["out"]["shape"][0] * (node.meta["out"]["shape"][1] if len(node.meta["out"]["shape"]) > 1
                                                  else 1)
    assert modelled_comm_time(node, topology) == pytest.approx(_allreduce_cost(nbytes, 8, 100.0, 10.0))


def test_the_runtime_runs_the_kind_by_its_kernel(allreduce):
    plain = replay.example_bundle()
    with installed(ops.Zero3Runtime()):
        expected = run_step(build_step(plain, "cpu"), make_state(plain, seed=0))
    swapped = _with_allreduce(replay.example_bundle())
    with installed(ops.Zero3Runtime()):
        results = run_step(build_step(swapped, "cpu"), make_state(swapped, seed=0))
    assert CALLS == [(1, 2)]
    assert list(results) == list(expected)
    for name in expected:
        torch.testing.assert_close(results[name], expected[name], rtol=0, atol=0)


def test_taking_the_kind_out_takes_its_op_out(tmp_path):
    with collectives.registered(ALLREDUCE):
        path = dcsched.save(_with_allreduce(replay.example_bundle()), tmp_path / "allreduce.pt")
    assert collectives.find("allreduce_grad") is None and "allreduce_grad" not in collectives.bucket_ops("reduce")
    with pytest.raises(RuntimeError, match="does not exist"):
        torch._C._dispatch_has_kernel_for_dispatch_key("dcsched::allreduce_grad", "CPU")
    with pytest.raises(BundleError, match="allreduce_grad") as refused:
        _ = dcsched.load(path).backward
    assert "\n" not in str(refused.value)
    with collectives.registered(ALLREDUCE):  # registered again: the same file loads
        assert SWAPPED in [n.name for n in dcsched.load(path).backward.nodes]


@pytest.mark.parametrize("change, message", [
    ({"name": "All Reduce"}, "not a lower-case identifier"),
    ({"op": "__import__"}, "not a lower-case identifier"),
    ({"schema": "other(Tensor a, int graph_id, int id) -> Tensor"}, "does not define allreduce_grad"),
    ({"ints": ("id",)}, "not graph_id, id"),
    ({"role": "broadcast"}, "unknown role"),
    ({"bucket": "allgather", "role": "wait"}, "not a bucket kind of its role"),
    ({"ints": ("graph_id", "id", "n_users")}, "only a release, takes n_users"),
    ({"op": "reduce_grad", "schema": "reduce_grad(Tensor a, int graph_id, int id) -> Tensor"}, "in the table"),
])
def test_a_faulty_row_is_refused_and_the_table_is_unchanged(change, message):
    import dataclasses
    before = collectives.kinds()
    with pytest.raises(ValueError, match=message):
        collectives.register(dataclasses.replace(ALLREDUCE, **change))
    assert collectives.kinds() == before


def test_a_built_in_kind_cannot_be_taken_out():
    with pytest.raises(ValueError, match="built-in"):
        collectives.unregister("reduce_grad")
    assert collectives.find("reduce_grad").role == "reduce"
