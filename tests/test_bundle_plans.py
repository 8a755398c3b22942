"""Bundle version 3: the communication plans (buckets per graph, the step's residency) saved, loaded and
checked; version 2 still loading with none; copies; ``show``; ``schedule`` writing the scheduler's plans;
the ranks' plan fingerprints."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import dcsched
from dcsched import replay
from dcsched.bundle import fileio
from dcsched.bundle.summary import summarize
from dcsched.cli import run
from dcsched.errors import BundleError, GraphError
from dcsched.plan import Bucket, Plan
from dcsched.report.compare import compare_bundle
from dcsched.runtime.consensus import plan_fingerprints
from dcsched.sim.simulate import compile_view

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = [ROOT / "sample_graphs" / f"{n}.pt" for n in ("gpt", "llama", "convnet")]

FORWARD_GATHERS = ("allgather_ds_param_primals_1_0", "allgather_ds_param_primals_2_1", "allgather_ds_param_primals_3_2")
BACKWARD_REDUCES = ("reduce_ds_param_fc2_weight", "reduce_ds_param_fc1_weight", "reduce_ds_param_fc1_bias")


def planned_bundle(residency=None):
    """The replay example (forward and backward, 3 parameters) with a plan per graph.

    The backward's bucket is structurally sound, what a loader checks; the simulator would refuse to issue it
    in the stored order (fc1's gradients are computed after fc2's reduce), which is its own check to make.
    """
    bundle = replay.example_bundle()
    residency = {0: "kept", 2: "replicated"} if residency is None else residency
    plans = {
        "forward": Plan((), [Bucket("allgather", FORWARD_GATHERS[:2], [0, 1]),
                             Bucket("allgather", FORWARD_GATHERS[2:], [2])], residency),
        "backward": Plan((), [Bucket("reduce", BACKWARD_REDUCES, [2, 0, 1])], residency),
    }
    return bundle.reordered({}, plans=plans)


def _header(path: Path) -> dict:
    data = path.read_bytes()
    return json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])


# ---------------------------------------------------------------------------
# Round trip, versions
# ---------------------------------------------------------------------------

def test_plans_round_trip_as_version_3(tmp_path):
    bundle = planned_bundle()
    path = dcsched.save(bundle, tmp_path / "p.pt")
    assert _header(path)["__metadata__"] == {"dcsched-bundle": "3"}
    doc, _ = fileio.read_raw(path)
    assert doc["version"] == 3
    assert doc["plans"]["backward"] == {"buckets": [{"kind": "reduce", "members": [12, 18, 20], "ds_ids": [2, 0, 1]}]}
    assert doc["residency"] == {"0": "kept", "2": "replicated"}
    loaded = dcsched.load(path)
    for name in ("forward", "backward"):
        names = tuple(n.name for n in bundle.graphs[name].nodes)
        assert loaded.plans[name] == bundle.plans[name] == bundle.plans[name].with_order(names)
    assert dcsched.save(loaded, tmp_path / "again.pt").read_bytes() == path.read_bytes()


def test_a_bundle_without_plans_stores_none(tmp_path):
    path = dcsched.save(replay.example_bundle(), tmp_path / "g.pt")
    doc, _ = fileio.read_raw(path)
    assert (doc["plans"], doc["residency"]) == ({}, {})
    assert dcsched.load(path).plans == {}


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_version_2_files_still_load_with_empty_plans(path):
    assert _header(path)["__metadata__"] == {"dcsched-bundle": "2"}, "the samples stay version-2 files"
    assert dcsched.load(path).plans == {}


def test_a_version_2_document_ignores_version_3_keys(tmp_path):
    """A version-2 file is read by version 2's schema: plans, even well-formed ones, are no part of it."""
    doc, tensors = fileio.document_and_tensors(planned_bundle())
    doc["version"] = 2
    path = tmp_path / "v2.pt"
    path.write_bytes(fileio.encode(doc, tensors, version=2))
    loaded = dcsched.load(path)
    assert loaded.plans == {} and [p.name for p in loaded.params] == ["fc1.weight", "fc1.bias", "fc2.weight"]


def test_convert_writes_version_3_and_keeps_plans(tmp_path):
    source = dcsched.save(planned_bundle(), tmp_path / "in.pt")
    assert run(["convert", str(source), str(tmp_path / "out.pt")]) == 0
    assert _header(tmp_path / "out.pt")["__metadata__"] == {"dcsched-bundle": "3"}
    assert dcsched.load(tmp_path / "out.pt").plans == dcsched.load(source).plans


# ---------------------------------------------------------------------------
# Copies
# ---------------------------------------------------------------------------

def test_with_graphs_drops_the_replaced_graphs_plan():
    bundle = planned_bundle()
    copy = bundle.with_graphs(forward=bundle.forward)
    assert set(copy.plans) == {"backward"} and set(bundle.plans) == {"forward", "backward"}


@pytest.mark.parametrize("stored", ["fx", "columns"])
def test_reordered_keeps_plans_in_the_new_order_and_sets_given_ones(tmp_path, stored):
    bundle = planned_bundle()
    if stored == "columns":
        bundle = dcsched.load(dcsched.save(bundle, tmp_path / "p.pt"))
    names = [n.name for n in bundle.forward.nodes]
    order = dcsched.schedule(bundle.forward, "fast-free")
    new = [n.name for n in order.nodes]
    assert new != names
    moved = bundle.reordered({"forward": new})
    assert moved.plans["forward"].order == tuple(new)
    assert moved.plans["forward"].buckets == bundle.plans["forward"].buckets
    assert moved.plans["backward"] == bundle.plans["backward"]
    replaced = bundle.reordered({"forward": new}, plans={"forward": Plan(new)})
    assert replaced.plans["forward"] == Plan(new) and replaced.plans["backward"] == bundle.plans["backward"]
    with pytest.raises(ValueError, match="another order than the graph's"):
        bundle.reordered({"forward": new}, plans={"forward": Plan(names)})
    with pytest.raises(ValueError, match="a plan given for graph 'sideways', which the bundle lacks"):
        bundle.reordered({}, plans={"sideways": Plan(())})
    loaded = dcsched.load(dcsched.save(moved, tmp_path / "m.pt"))
    assert loaded.plans == moved.plans


# ---------------------------------------------------------------------------
# Plans a loader refuses (and save refuses to write)
# ---------------------------------------------------------------------------

def _bucket(doc, graph="forward", k=0):
    return doc["plans"][graph]["buckets"][k]


#: (case, edit of the document, words in the message)
HOSTILE_PLANS = [
    ("plans not a table", lambda d: d.update(plans=[1]), "plans are not a table by graph name"),
    ("plan of an absent graph", lambda d: d["plans"].update(sideways={"buckets": []}),
     "a plan for graph 'sideways', which it lacks"),
    ("plan of another shape", lambda d: d["plans"].update(forward=[]), "is not a table of buckets"),
    ("residency per graph", lambda d: d["plans"]["forward"].update(residency={"1": "kept"}),
     "the residency is the step's, stored once"),
    ("buckets not a list", lambda d: d["plans"]["forward"].update(buckets={"0": 1}), "its buckets are not a list"),
    ("bucket of other keys", lambda d: _bucket(d).update(code="exec"), "bucket #0 is not a table of kind"),
    ("unknown kind", lambda d: _bucket(d).update(kind="broadcast"), "of unknown kind 'broadcast'"),
    ("kind not text", lambda d: _bucket(d).update(kind=["allgather"]), "of unknown kind"),
    ("member by name", lambda d: _bucket(d).update(members=["allgather_ds_param_primals_1_0", 6]),
     "members are not a list of integers"),
    ("member true", lambda d: _bucket(d).update(members=[True, 6]), "members are not a list of integers"),
    ("member float", lambda d: _bucket(d).update(members=[4.0, 6]), "members are not a list of integers"),
    ("member beyond the graph", lambda d: _bucket(d).update(members=[4, 10**6]),
     "member #1000000 is not a node of the graph"),
    ("member beyond int64", lambda d: _bucket(d).update(members=[4, 2**70]), "is not a node of the graph"),
    ("negative member", lambda d: _bucket(d).update(members=[-1, 6]), "member #-1 is not a node"),
    ("negative ds_id", lambda d: _bucket(d).update(ds_ids=[0, -1]), "ds_id -1 is not a parameter id"),
    ("ds_ids miscounted", lambda d: _bucket(d).update(ds_ids=[0]), "has 2 members and 1 ds_ids"),
    ("empty bucket", lambda d: _bucket(d).update(members=[], ds_ids=[]), "has 0 members"),
    ("member a compute node", lambda d: _bucket(d).update(members=[4, 10]),
     "bucket #0 (allgather): node t is no allgather_param"),
    ("member a wait", lambda d: _bucket(d).update(members=[4, 5]), "node wait_allgather_ds_param__primals_1_0 is "
                                                                    "no allgather_param"),
    ("all-gather in a reduce bucket", lambda d: _bucket(d, "backward").update(members=[1, 18, 20]),
     "bucket #0 (reduce): node allgather_ds_param_primals_3_2 is no reduce_grad"),
    ("reduce in an all-gather bucket", lambda d: _bucket(d).update(kind="reduce"),
     "node allgather_ds_param_primals_1_0 is no reduce_grad"),
    ("ds_id not the node's", lambda d: _bucket(d).update(ds_ids=[0, 2]),
     "node allgather_ds_param_primals_2_1 has ds_id 1, the bucket says 2"),
    ("node in two buckets", lambda d: _bucket(d, k=1).update(members=[6], ds_ids=[1]),
     "node allgather_ds_param_primals_2_1 is in two buckets"),
    ("node twice in a bucket", lambda d: _bucket(d).update(members=[4, 4], ds_ids=[0, 0]),
     "node allgather_ds_param_primals_1_0 is in two buckets"),
    ("residency not a table", lambda d: d.update(residency=["kept"]), "residency is not a table"),
    ("residency unknown", lambda d: d["residency"].update({"1": "swapped"}), "residency 'swapped' is unknown"),
    ("residency of no parameter", lambda d: d["residency"].update({"9": "kept"}),
     "names parameter 9, which is not in the parameter table"),
    ("residency key not a number", lambda d: d["residency"].update({"__import__('os')": "kept"}), "is not a ds_id"),
    ("residency key padded", lambda d: d["residency"].update({"01": "kept"}), "'01' is not a ds_id"),
    ("residency without plans", lambda d: d.update(plans={}), "holds a residency but no plan"),
    ("document version 2 under header 3", lambda d: d.update(version=2), "its document says version 2, its header 3"),
]


def _hostile(tmp_path, kind) -> tuple[Path, str]:
    edit, words = next((edit, words) for case, edit, words in HOSTILE_PLANS if case == kind)
    doc, tensors = fileio.document_and_tensors(planned_bundle())
    edit(doc)
    path = tmp_path / "hostile.pt"
    path.write_bytes(fileio.encode(doc, tensors))
    return path, words


@pytest.mark.parametrize("kind", [case for case, _edit, _words in HOSTILE_PLANS])
def test_hostile_plans_refused_at_load(tmp_path, kind):
    path, words = _hostile(tmp_path, kind)
    with pytest.raises(BundleError) as info:
        dcsched.load(path)
    message = str(info.value)
    assert words in message and str(path) in message and len(message.splitlines()) == 1, message


@pytest.mark.parametrize("kind", ["member a compute node", "node in two buckets", "residency of no parameter",
                                  "bucket of other keys"])
@pytest.mark.parametrize("command", [["show"], ["schedule", "--algo", "deepcompile"], ["replay"], ["convert"]])
def test_hostile_plans_stop_every_command_with_one_line(tmp_path, kind, command, capsys):
    path, words = _hostile(tmp_path, kind)
    before = sorted(os.listdir(tmp_path))
    extra = [str(tmp_path / "out.pt")] if command[0] == "convert" else []
    assert run([command[0], str(path), *command[1:], *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and words in " ".join(err.split()), err
    assert sorted(os.listdir(tmp_path)) == before


def _kept(plans):
    """The residency the planned bundle's plans share (a changed plan keeps it, to fail on what it changes)."""
    return plans["backward"].residency


#: (case, change to a planned bundle's plans, words): plans :func:`dcsched.save` refuses to write.
UNSTORABLE = [
    ("unknown member", lambda p: p.update(forward=Plan((), [Bucket("allgather", ["nope"], [0])], _kept(p))),
     "member 'nope' is not a node of the graph"),
    ("member of another kind", lambda p: p.update(forward=Plan((), [Bucket("reduce", ["t"], [0])], _kept(p))),
     "node t is no reduce_grad"),
    ("residencies differ", lambda p: p.update(backward=Plan((), residency={1: "kept"})), "differ in residency"),
    ("residency of no parameter", lambda p: p.update(forward=Plan((), residency={7: "kept"}),
                                                     backward=Plan((), residency={7: "kept"})),
     "names parameter 7, which is not in the parameter table"),
    ("another order", lambda p: p.update(forward=Plan(("x",), residency=_kept(p))),
     "orders the nodes otherwise than the graph"),
    ("plan of no graph", lambda p: p.update(sideways=Plan(())), "a plan for graph 'sideways'"),
    ("not a plan", lambda p: p.update(forward=["allgather"]), "not a dcsched.plan.Plan"),
]


@pytest.mark.parametrize("kind", [case for case, _edit, _words in UNSTORABLE])
def test_save_refuses_plans_a_loader_would_refuse(tmp_path, kind):
    edit, words = next((edit, words) for case, edit, words in UNSTORABLE if case == kind)
    bundle = planned_bundle()
    edit(bundle.plans)
    with pytest.raises(BundleError, match="cannot be stored") as info:
        dcsched.save(bundle, tmp_path / "out.pt")
    assert words in str(info.value)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------
# show, schedule, fingerprints
# ---------------------------------------------------------------------------

def test_show_counts_buckets_members_and_residency(tmp_path, capsys):
    path = dcsched.save(planned_bundle(), tmp_path / "p.pt")
    assert run(["show", str(path), "--json"]) == 0
    graphs = json.loads(capsys.readouterr().out)["graphs"]
    assert graphs["forward"]["plan"] == {"buckets": 2, "members": 3,
                                         "residency": {"sharded": 1, "kept": 1, "replicated": 1}}
    assert graphs["backward"]["plan"]["buckets"] == 1 and graphs["backward"]["plan"]["members"] == 3
    assert run(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Communication plans" in out and "replicated" in out
    plain = summarize(replay.example_bundle())["graphs"]["forward"]["plan"]
    assert plain == {"buckets": 0, "members": 0, "residency": {"sharded": 3, "kept": 0, "replicated": 0}}


@pytest.mark.parametrize("algo", ["deepcompile", "fsdp"])
def test_schedule_writes_the_schedulers_plans(tmp_path, algo):
    source = SAMPLES[1]  # llama: fsdp finds its blocks, deepcompile fuses its gathers
    out = tmp_path / "out.pt"
    assert run(["schedule", str(source), "--algo", algo, "-o", str(out)]) == 0
    comparison = compare_bundle(dcsched.load(source), [algo])
    loaded = dcsched.load(out)
    assert set(loaded.plans) == {"forward", "backward"}
    for name, plan in loaded.plans.items():
        assert plan == comparison.graphs[name].plans[algo]
        assert plan.order == tuple(loaded.form(name).names)
    assert any(plan.buckets for plan in loaded.plans.values()), "the scheduler's buckets reach the file"
    assert run(["show", str(out), "--json"]) == 0


def test_plan_fingerprints_tell_buckets_apart():
    """Two ranks with the same order but different buckets run different collectives."""
    bundle = planned_bundle()
    other = bundle.reordered({}, plans={"forward": Plan((), [Bucket("allgather", FORWARD_GATHERS, [0, 1, 2])],
                                                        bundle.plans["forward"].residency)})
    mine, theirs = plan_fingerprints(bundle), plan_fingerprints(other)
    assert mine["forward plan"] != theirs["forward plan"]
    assert mine["backward plan"] == theirs["backward plan"] and mine["forward graph"] == theirs["forward graph"]
    assert plan_fingerprints(planned_bundle()) == mine
    assert plan_fingerprints(planned_bundle(residency={})) != mine
    # No plan and an empty one run alike.
    plain = replay.example_bundle()
    assert plan_fingerprints(plain) == plan_fingerprints(plain.reordered({}, plans={"forward": Plan(())}))


_SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.text(max_size=6)
            | st.floats(allow_nan=False, allow_infinity=False))
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


@st.composite
def _plan_edits(draw):
    """One arbitrary value written somewhere in a planned bundle's plans or residency."""
    where = draw(st.sampled_from(["plans", "graph plan", "buckets", "bucket", "kind", "members", "member",
                                  "ds_ids", "residency", "residency key", "residency value"]))
    value = draw(_JSON | st.integers(0, 25))
    text = draw(st.text(max_size=8))

    def edit(doc):
        bucket = doc["plans"]["forward"]["buckets"][0]
        if where == "plans":
            doc["plans"] = value
        elif where == "graph plan":
            doc["plans"]["backward"] = value
        elif where == "buckets":
            doc["plans"]["forward"]["buckets"] = value
        elif where == "bucket":
            doc["plans"]["forward"]["buckets"][1] = value
        elif where in ("kind", "members", "ds_ids"):
            bucket[where] = value
        elif where == "member":
            bucket["members"][0] = value
        elif where == "residency":
            doc["residency"] = value
        elif where == "residency key":
            doc["residency"][text] = "kept"
        else:
            doc["residency"]["0"] = value
    return edit


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edit=_plan_edits())
def test_generated_hostile_plans_load_or_fail_in_one_line(tmp_path_factory, edit):
    doc, tensors = fileio.document_and_tensors(planned_bundle())
    edit(doc)
    path = tmp_path_factory.mktemp("plans") / "hostile.pt"
    path.write_bytes(fileio.encode(doc, tensors))
    try:
        loaded = dcsched.load(path)
    except BundleError as exc:
        assert len(str(exc).splitlines()) == 1, str(exc)
        return
    for name, plan in loaded.plans.items():  # what loads is a plan the simulator can read
        compiled = compile_view(loaded.form(name))
        try:
            compiled.bucket_indices(plan.buckets, list(range(len(plan.order))))
        except GraphError as exc:  # whether the stored order can issue a bucket is the simulator's to say
            assert "is issued before" in str(exc), str(exc)
