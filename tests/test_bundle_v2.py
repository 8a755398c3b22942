"""Version-2 bundles (one safetensors file, graphs as columns): round trip bit for bit, the same refusals as
version 1 for hostile files, version 1 still loading, ``dcsched convert``, and the columns' GraphForm."""

from __future__ import annotations

import json
import os
import random
import struct
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import dcsched
from dcsched.bundle import core as bundle_io
from dcsched.bundle import fileio
from dcsched.bundle.graph_encoding import MAX_BYTES, MAX_NODE_MS, encode_graph
from dcsched.bundle.columns import GraphColumns
from dcsched.bundle.summary import summarize
from dcsched.cli import run
from dcsched.errors import BundleError
from dcsched.graph.form import FIELDS, GraphForm
from dcsched.graph.nxview import to_networkx
from dcsched.graph.roles import Role, ds_id_of, role_of
from dcsched.plan import RESIDENCIES, Bucket, Plan

from bundles import linear_bundle
from strategies import arbitrary_dags, zero3_graphs
from bundles import save_v1

ROOT = Path(__file__).resolve().parent.parent
GOLDEN_V1 = sorted((ROOT / "tests" / "golden" / "bundles").glob("*.pt"))


def _encoded(graph) -> str:
    """A graph's nodes (names, ops, targets, args, kwargs, kept meta) as text that tells 1 from 1.0."""
    return json.dumps(encode_graph(graph))


def _same_form(a: GraphForm, b: GraphForm) -> None:
    for field in FIELDS:
        assert getattr(a, field) == getattr(b, field), field


# ---------------------------------------------------------------------------
# Round trip
# ---------------------------------------------------------------------------

def test_v2_is_one_safetensors_file_and_loads_columns(tmp_path):
    path = dcsched.save(linear_bundle(3), tmp_path / "graph.pt")
    data = path.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    assert header["__metadata__"] == {"dcsched-bundle": str(bundle_io.BUNDLE_VERSION)}
    assert b"pickle" not in data and not data.startswith((b"PK", b"\x80"))
    loaded = dcsched.load(path)
    assert isinstance(loaded.__dict__["_graph_forward"], GraphColumns), "FX is built only when asked for"
    _same_form(loaded.form("forward"), GraphForm(linear_bundle(3).forward))
    assert isinstance(loaded.__dict__["_graph_forward"], GraphColumns)
    assert _encoded(loaded.forward) == _encoded(linear_bundle(3).forward)


def test_tables_that_grow_with_the_model_are_limited_per_entry(tmp_path):
    """A placeholder per parameter: 50,000 entries hold more than 100,000 values together, none alone."""
    doc, tensors = fileio.document_and_tensors(linear_bundle())
    doc["backward_placeholders"] = [{"kind": "saved", "index": i} for i in range(50_000)]
    path = tmp_path / "big.pt"
    path.write_bytes(fileio.encode(doc, tensors))
    assert len(dcsched.load(path).backward_placeholders) == 50_000
    doc["backward_placeholders"][7] = {"kind": _deep(40)}
    path.write_bytes(fileio.encode(doc, tensors))
    with pytest.raises(BundleError, match="backward_placeholders: arguments nest deeper than 32"):
        dcsched.load(path)


def test_non_finite_float_arguments_round_trip(tmp_path):
    """JSON has no inf or nan; an attention mask's -inf is stored tagged and comes back a float."""
    bundle = linear_bundle()
    graph = bundle.forward
    relu = next(n for n in graph.nodes if n.name == "relu_0")
    with graph.inserting_after(relu):
        masked = graph.create_node("call_function", torch.ops.aten.masked_fill.Scalar, (relu, relu, float("-inf")),
                                   name="masked")
    with graph.inserting_after(masked):
        clamped = graph.create_node("call_function", torch.ops.aten.clamp.default, (masked,),
                                    {"min": float("nan"), "max": float("inf")}, name="clamped")
    clamped.meta.update(device_time=0.1, tensor_size=8)
    masked.meta.update(device_time=0.1, tensor_size=8)
    loaded = dcsched.load(dcsched.save(bundle, tmp_path / "inf.pt"))
    node = next(n for n in loaded.forward.nodes if n.name == "masked")
    assert node.args[2] == float("-inf") and isinstance(node.args[2], float)
    kwargs = next(n for n in loaded.forward.nodes if n.name == "clamped").kwargs
    assert kwargs["max"] == float("inf") and kwargs["min"] != kwargs["min"]


@pytest.mark.parametrize("path", [ROOT / "sample_graphs" / f"{n}.pt" for n in ("gpt", "llama", "convnet")],
                         ids=lambda p: p.stem)
def test_sample_forms_and_summaries_from_columns_match_fx(path):
    bundle = dcsched.load(path)
    for name in bundle.graph_names:
        graph = bundle.graphs[name]
        _same_form(bundle.form(name), GraphForm(graph))
        _same_form(bundle.form(name), GraphForm(to_networkx(graph)))
    from_fx = bundle.with_graphs(**bundle.graphs)
    from_fx.__dict__.update({f"_graph_{n}": g for n, g in bundle.graphs.items()})
    assert summarize(bundle) == summarize(from_fx)


_FLOATS = st.floats(min_value=0.0, max_value=MAX_NODE_MS, allow_nan=False, allow_infinity=False)
_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**62, 2**62) | _FLOATS | _TEXT,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
                     max_leaves=8)
_DTYPES = [torch.float32, torch.int64, torch.bfloat16, torch.bool, torch.float64, torch.int32]


_COMM_ROLES = (Role.ALLGATHER, Role.WAIT, Role.RELEASE, Role.REDUCE)


def _with_graph_id(graph, graph_id: int):
    """``graph`` with every ZeRO-3 op's graph_id argument set to ``graph_id``."""
    for node in graph.nodes:
        if role_of(node) in _COMM_ROLES:
            node.args = (node.args[0], graph_id, *node.args[2:])
    return graph


def _gathered(graphs) -> set[int]:
    """The ds_ids the ZeRO-3 ops of ``graphs`` name."""
    return {ds_id_of(node) for graph in graphs for node in graph.nodes if role_of(node) in _COMM_ROLES}


@st.composite
def random_bundles(draw):
    """A bundle with random graphs, figures (floats, integers, missing), inputs, constants and provenance."""
    graphs = {"forward": _with_graph_id(draw(zero3_graphs | arbitrary_dags(random_ops=True)), 0)}
    if draw(st.booleans()):
        graphs["backward"] = _with_graph_id(draw(zero3_graphs), 1)  # a loader refuses ops of another graph's id
    for graph in graphs.values():
        for node in graph.nodes:
            node.meta.pop("val", None)
            choice = draw(st.sampled_from(["float", "int", "none", "keep"]))
            if choice == "float":
                node.meta["device_time"] = draw(_FLOATS)
            elif choice == "int":
                node.meta["device_time"] = draw(st.integers(0, 10**6))
            elif choice == "none":
                node.meta.pop("device_time", None)
            if draw(st.booleans()):
                node.meta["tensor_size"] = draw(st.integers(0, MAX_BYTES))
            if draw(st.booleans()):
                node.meta["time_source"] = draw(st.sampled_from(["analytic", "measured"]))
                node.meta["out"] = {"shape": draw(st.lists(st.integers(0, 64), max_size=3)),
                                    "dtype": draw(st.sampled_from(["float32", "bfloat16", "int64"]))}
    inputs = []
    for k in range(draw(st.integers(0, 3))):
        dtype = draw(st.sampled_from(_DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
        value = None
        if draw(st.booleans()):
            value = (torch.randn(shape, generator=torch.Generator().manual_seed(k)) * 100).to(dtype)
        low = draw(st.none() | st.floats(-1e9, 0, allow_nan=False))
        inputs.append(bundle_io.InputInfo(f"in{k}", shape, dtype, value, low, None if low is None else low + 1))
    constants = {f"c{k}": torch.full((k + 1,), float(k)) for k in range(draw(st.integers(0, 2)))}
    bundle = bundle_io.Bundle(
        forward=graphs["forward"], backward=graphs.get("backward"),
        # Every parameter the graphs gather or reduce (a loader refuses an op naming none), and some more.
        params=[bundle_io.ParamInfo(f"p.{i}", tuple(draw(st.lists(st.integers(0, 9), max_size=3))),
                                    draw(st.sampled_from([torch.float32, torch.bfloat16])), i)
                for i in sorted(_gathered(graphs.values()) | set(range(draw(st.integers(0, 4)))))],
        inputs=inputs,
        forward_placeholders=[{"kind": "input", "index": 0}] if inputs else [],
        backward_placeholders=[{"kind": "saved", "index": 1}] if "backward" in graphs else [],
        num_user_outputs=draw(st.integers(1, 3)),
        graph_ids={"forward": 0, "backward": 1},
        constants=constants,
        provenance=draw(st.dictionaries(_TEXT, _JSON, max_size=4)))
    bundle.plans = draw(random_plans(bundle))
    return bundle


@st.composite
def random_plans(draw, bundle):
    """Plans for some of ``bundle``'s graphs: random buckets of its all-gathers and reduces (each node in at
    most one, members in any order) and one residency over parameters of its table."""
    params = [p.ds_id for p in bundle.params]
    residency = {d: draw(st.sampled_from(RESIDENCIES)) for d in draw(st.lists(st.sampled_from(params), unique=True))
                 } if params else {}
    plans = {}
    for name, graph in bundle.graphs.items():
        if not draw(st.booleans()):
            continue
        buckets = []
        for role, kind in ((Role.ALLGATHER, "allgather"), (Role.REDUCE, "reduce")):
            nodes = draw(st.permutations([n for n in graph.nodes if role_of(n) is role]))
            while nodes:
                size = draw(st.integers(1, len(nodes)))
                members, nodes = nodes[:size], nodes[size:]
                if draw(st.booleans()):  # some nodes in no bucket
                    buckets.append(Bucket(kind, [n.name for n in members], [ds_id_of(n) for n in members]))
        order = [n.name for n in graph.nodes] if draw(st.booleans()) else []
        plans[name] = Plan(order, draw(st.permutations(buckets)), residency)
    return plans


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(bundle=random_bundles())
def test_random_bundles_round_trip_bit_for_bit(tmp_path_factory, bundle):
    tmp = tmp_path_factory.mktemp("rt")
    first = dcsched.save(bundle, tmp / "a.pt").read_bytes()
    loaded = dcsched.load(tmp / "a.pt")
    # Saved again from the columns, untouched: the same bytes.
    assert dcsched.save(loaded, tmp / "b.pt").read_bytes() == first
    # The FX graphs built from the columns: node for node the originals, figures to the bit (1 is not 1.0).
    for name in bundle.graph_names:
        assert _encoded(loaded.graphs[name]) == _encoded(bundle.graphs[name])
        _same_form(loaded.form(name), GraphForm(bundle.graphs[name]))
    # The plans, in the graphs' own order.
    assert loaded.plans == {name: plan.with_order(n.name for n in bundle.graphs[name].nodes)
                            for name, plan in bundle.plans.items()}
    # Saved from those FX graphs (with_graphs drops the replaced graphs' plans): the same bytes again.
    rebuilt = loaded.with_graphs(**loaded.graphs)
    assert rebuilt.plans == {}
    rebuilt.plans = dict(loaded.plans)
    assert dcsched.save(rebuilt, tmp / "c.pt").read_bytes() == first
    assert loaded.params == bundle.params
    assert loaded.provenance == bundle.provenance
    assert loaded.forward_placeholders == bundle.forward_placeholders
    assert loaded.num_user_outputs == bundle.num_user_outputs
    assert list(loaded.constants) == list(bundle.constants)
    assert all(torch.equal(loaded.constants[k], bundle.constants[k]) for k in bundle.constants)
    for a, b in zip(loaded.inputs, bundle.inputs, strict=True):
        assert (a.name, a.shape, a.dtype, a.low, a.high) == (b.name, b.shape, b.dtype, b.low, b.high)
        assert (a.value is None) == (b.value is None)
        if a.value is not None:
            assert a.value.dtype == b.value.dtype and torch.equal(a.value, b.value)


def test_reordered_bundle_permutes_columns_like_fx(tmp_path):
    """``schedule`` on a version-2 bundle permutes the columns; the result is what rebuilding FX gives."""
    path = ROOT / "sample_graphs" / "llama.pt"
    bundle = dcsched.load(path)
    orders = {name: [n.name for n in dcsched.schedule(bundle.graphs[name], "fast-free").nodes]
              for name in bundle.graph_names}
    fresh = dcsched.load(path)
    permuted = fresh.reordered(orders)
    assert all(isinstance(permuted.__dict__[f"_graph_{n}"], GraphColumns) for n in fresh.graph_names)
    by_fx = bundle.reordered(orders)  # an FX-holding bundle: to_fx
    # Saved straight from the permuted columns (no FX graph built): the bytes encoding the reordered FX graphs gives
    unbuilt = dcsched.load(path).reordered(orders)
    assert dcsched.save(unbuilt, tmp_path / "c.pt").read_bytes() == dcsched.save(by_fx, tmp_path / "f.pt").read_bytes()
    for name in bundle.graph_names:
        assert _encoded(permuted.graphs[name]) == _encoded(by_fx.graphs[name])
        _same_form(permuted.form(name), GraphForm(by_fx.graphs[name]))
    dcsched.save(permuted, tmp_path / "p.pt")
    assert _encoded(dcsched.load(tmp_path / "p.pt").forward) == _encoded(by_fx.forward)


# ---------------------------------------------------------------------------
# Version 1 still loads; dcsched convert
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("path", GOLDEN_V1, ids=lambda p: p.stem)
def test_version_1_bundles_still_load(path):
    assert path.read_bytes()[:2] == b"PK", "the golden bundles stay version-1 torch files"
    bundle = dcsched.load(path)
    for name in bundle.graph_names:
        _same_form(bundle.form(name), GraphForm(bundle.graphs[name]))


def test_convert_rewrites_v1_in_the_current_version(tmp_path, capsys):
    source = tmp_path / "old.pt"
    save_v1(linear_bundle(3), source)
    out = tmp_path / "new.pt"
    assert run(["convert", str(source), str(out)]) == 0
    assert fileio.is_v2(out.read_bytes()[:16])  # a safetensors file
    assert f'"dcsched-bundle":"{bundle_io.BUNDLE_VERSION}"'.encode() in out.read_bytes()[:4096]
    assert "bundle version 3" in capsys.readouterr().err
    old, new = dcsched.load(source), dcsched.load(out)
    assert _encoded(new.forward) == _encoded(old.forward) and new.params == old.params
    before = out.read_bytes()
    assert run(["convert", str(source), str(out)]) == 2
    assert "exists already" in capsys.readouterr().err and out.read_bytes() == before
    assert run(["convert", str(source), str(source)]) == 2  # its own input: only with --force
    assert run(["convert", str(source), str(source), "--force"]) == 0
    assert fileio.is_v2(source.read_bytes()[:16])
    assert sorted(os.listdir(tmp_path)) == ["new.pt", "old.pt"]


def test_convert_of_a_bad_file_writes_nothing(tmp_path, capsys):
    bad = tmp_path / "bad.pt"
    data = bundle_io.to_data(linear_bundle())
    data["graphs"]["forward"]["nodes"][0]["target"] = "x=__import__('os')"
    torch.save(data, bad)
    assert run(["convert", str(bad), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a plain identifier" in err
    assert sorted(os.listdir(tmp_path)) == ["bad.pt"]


# ---------------------------------------------------------------------------
# Hostile version-2 files
# ---------------------------------------------------------------------------

def _raw():
    """A good bundle's document and tensors, to edit."""
    return fileio.document_and_tensors(linear_bundle())


def _names(tensors, edit, graph="forward"):
    key = f"graph.{graph}.names"
    names = bytes(tensors[key].numpy()).decode().split("\0")
    edit(names)
    tensors[key] = torch.frombuffer(bytearray("\0".join(names).encode()), dtype=torch.uint8)


def _first_call_string(doc):
    strings = doc["graphs"]["forward"]["strings"]
    return strings.index("aten.mm.default")


def _set(tensors, column, index, value, graph="forward"):
    tensors[f"graph.{graph}.{column}"] = tensors[f"graph.{graph}.{column}"].clone()
    tensors[f"graph.{graph}.{column}"][index] = value


def _node(doc, tensors, name):
    names = bytes(tensors["graph.forward.names"].numpy()).decode().split("\0")
    return names.index(name)


def _deep(levels):
    nested = 1
    for _ in range(levels):
        nested = [nested]
    return nested


def _template_of(doc, tensors, name):
    return doc["graphs"]["forward"]["templates"][int(tensors["graph.forward.args"][_node(doc, tensors, name)])]


def _own_template(doc, tensors, name, template):
    """Give node ``name`` a template of its own."""
    doc["graphs"]["forward"]["templates"].append(template)
    _set(tensors, "args", _node(doc, tensors, name), len(doc["graphs"]["forward"]["templates"]) - 1)


def _edit_strings(doc, old, new):
    strings = doc["graphs"]["forward"]["strings"]
    strings[strings.index(old)] = new


def _shared_template(doc, tensors, nodes=2000, values=104_000):
    """``nodes`` nodes before the output, all calling with one template of ``values`` float literals (stored once:
    about 0.5 MB; 2 * 10^8 values once every node's arguments are built)."""
    g, p = doc["graphs"]["forward"], "graph.forward."
    out = g["nodes"] - 1
    g["templates"].append([{"$tuple": [[0.5] * values]}, {"$dict": []}])
    g["strings"].append("aten.zeros.default")
    _names(tensors, lambda names: names.__setitem__(slice(out, out), [f"blowup_{i}" for i in range(nodes)]))
    for column, value in (("op", 1), ("target", len(g["strings"]) - 1), ("args", len(g["templates"]) - 1),
                          ("meta", 0), ("device_time", 0.0), ("tensor_size", 0), ("figures", 0)):
        c = tensors[p + column]
        tensors[p + column] = torch.cat([c[:out], torch.full((nodes,), value, dtype=c.dtype), c[out:]])
    for column in ("input_offsets", "int_offsets"):  # the new nodes read no node and no integer
        c = tensors[p + column]
        tensors[p + column] = torch.cat([c[:out + 1], torch.full((nodes,), int(c[out]), dtype=c.dtype), c[out + 1:]])
    g["nodes"] += nodes


#: (case, edit of (doc, tensors), words in the message). ``MARKER`` stands for a file a payload would create.
HOSTILE_V2 = [
    ("one template shared by 2000 nodes", _shared_template,
     "its nodes' arguments hold 208012147 values in all, more than the 228960 allowed for 2015 nodes"),
    ("node name expression", lambda d, t: _names(t, lambda n: n.__setitem__(3, "x=(__import__('os').system("
                                                                             "'touch MARKER'),1)[1]")),
     "is not a plain identifier"),
    ("node name builtin", lambda d, t: _names(t, lambda n: n.__setitem__(3, "print")), "not a valid FX node name"),
    ("node name not ascii", lambda d, t: _names(t, lambda n: n.__setitem__(3, "\u00c0")), "not a valid FX node name"),
    ("names not utf-8", lambda d, t: t.update({"graph.forward.names": torch.tensor([0xff, 0xfe], dtype=torch.uint8)}),
     "node names are not UTF-8"),
    ("placeholder target expression", lambda d, t: _edit_strings(d, "primals_1", "__import__('os').system('MARKER')"),
     "is not a plain identifier"),
    ("op outside the allow-list", lambda d, t: _edit_strings(d, "aten.mm.default", "os.system"),
     "op 'os.system' is not allowed"),
    ("builtins eval", lambda d, t: _edit_strings(d, "aten.mm.default", "builtins.eval"),
     "op 'builtins.eval' is not allowed"),
    ("dunder op", lambda d, t: _edit_strings(d, "aten.mm.default", "aten.__class__.__init__"), "is not an op name"),
    ("in-place copy_", lambda d, t: _edit_strings(d, "aten.mm.default", "aten.copy_.default"),
     "writes to its input in place"),
    ("unknown op", lambda d, t: _edit_strings(d, "aten.mm.default", "aten.definitely_not_an_op.default"),
     "unknown op 'aten.definitely_not_an_op.default'"),
    ("dangling reference", lambda d, t: _set(t, "inputs", 3, 10**6), "refers to node #1000000, which is not in"),
    ("negative reference", lambda d, t: _set(t, "inputs", 3, -1), "refers to node #-1"),
    ("cycle", lambda d, t: _set(t, "inputs", int(t["graph.forward.input_offsets"][_node(d, t, "mm_0")]),
                                _node(d, t, "relu_0")), "has a cycle"),
    ("inputs miscounted", lambda d, t: _set(t, "input_offsets", 4, int(t["graph.forward.input_offsets"][4]) + 1),
     "inputs"),
    ("target index out of range", lambda d, t: _set(t, "target", 2, 10**6), "target #1000000 is not in"),
    ("template index out of range", lambda d, t: _set(t, "args", 2, -3), "argument template #-3"),
    ("node kind out of range", lambda d, t: _set(t, "op", 2, 9), "node kind #9"),
    ("nan device_time", lambda d, t: _set(t, "device_time", 5, float("nan")), "device_time is nan, not a finite"),
    ("infinite device_time", lambda d, t: _set(t, "device_time", 5, float("inf")), "device_time is inf"),
    ("negative device_time", lambda d, t: _set(t, "device_time", 5, -1.0), "device_time is negative"),
    ("year-long device_time", lambda d, t: _set(t, "device_time", 5, 3.2e10), "over the largest believable"),
    ("huge tensor_size", lambda d, t: _set(t, "tensor_size", 5, 2**62), "tensor_size is 4.61169e+18, over"),
    ("negative tensor_size", lambda d, t: _set(t, "tensor_size", 5, -64), "tensor_size is negative"),
    ("unknown figure flags", lambda d, t: _set(t, "figures", 5, 64), "unknown figure flags"),
    ("all-gather id negative",
     lambda d, t: _set(t, "ints", int(t["graph.forward.int_offsets"][_node(d, t, "allgather_ds_param_primals_1_0")])
                       + 1, -7), "allgather_param's id is negative (-7)"),
    ("all-gather id 'zero'", lambda d, t: _own_template(d, t, "allgather_ds_param_primals_1_0", [
        {"$tuple": [{"$node": 0}, {"$int": 0}, "zero", {"$int": 1}]}, {"$dict": []}]),
     "allgather_param's id is 'zero', not an integer"),
    ("layout by attribute", lambda d, t: _template_of(d, t, "mm_0").__setitem__(1, {"$dict": [["layout", {
        "$layout": "_C"}]]}), "unknown layout '_C'"),
    ("deep arguments", lambda d, t: _template_of(d, t, "mm_0").__setitem__(1, {"$dict": [["x", _deep(40)]]}),
     "arguments nest deeper than 32 levels"),
    ("wide arguments", lambda d, t: _template_of(d, t, "mm_0").__setitem__(1, {"$dict": [["x", [0] * 100_100]]}),
     "arguments hold more than 100030 values"),  # 100,000 + 2 per node (15)
    ("unknown tag", lambda d, t: _template_of(d, t, "mm_0").__setitem__(1, {"$eval": "1+1"}),
     "unknown argument tag '$eval'"),
    ("float by expression", lambda d, t: _template_of(d, t, "mm_0").__setitem__(1, {"$dict": [["x", {
        "$float": "__import__('os')"}]]}), "malformed float"),
    ("device by expression", lambda d, t: _template_of(d, t, "mm_0").__setitem__(1, {"$dict": [["device", {
        "$device": "__import__('os')"}]]}), "malformed arguments"),
    ("meta with other keys", lambda d, t: d["graphs"]["forward"]["metas"].__setitem__(0, {"val": 1}),
     "holds other keys"),
    ("output shape negative", lambda d, t: d["graphs"]["forward"]["metas"].append(
        {"out": {"shape": [-1], "dtype": "float32"}}) or _set(t, "meta", 5, len(d["graphs"]["forward"]["metas"]) - 1),
     "output shape [-1] is not a list of non-negative integers"),
    ("column of another dtype", lambda d, t: t.update({"graph.forward.op": t["graph.forward.op"].to(torch.int64)}),
     "column 'op' is torch.int64"),
    ("column too short", lambda d, t: t.update({"graph.forward.target": t["graph.forward.target"][:-1]}),
     "column 'target' holds"),
    ("missing column", lambda d, t: t.pop("graph.forward.figures"), "no 'graph.forward.figures' column"),
    ("graph of another name", lambda d, t: d["graphs"].update(__init__=d["graphs"]["forward"]),
     "is neither 'forward' nor 'backward'"),
    ("no forward graph", lambda d, t: d["graphs"].pop("forward"), "bundle has no forward graph"),
    ("constant named forward", lambda d, t: (d.update(constants=["forward"]),
                                             t.update({"constant.forward": torch.zeros(1)})),
     "constant name 'forward' would replace"),
    ("constant without tensor", lambda d, t: d.update(constants=["c"]), "constant 'c' has no tensor"),
    ("dtype by attribute", lambda d, t: d["params"][0].update(dtype="_C"), "unknown dtype '_C'"),
    ("deep provenance", lambda d, t: d["provenance"].update(x=_deep(40)), "the bundle's provenance"),
    ("input low above high", lambda d, t: d["inputs"].append({"name": "ids", "shape": [2], "dtype": "int64",
                                                             "value": False, "low": 5, "high": 1}),
     "its range [5, 1] is empty"),
    ("input value missing", lambda d, t: t.pop("input.0"), "its stored value is missing"),
    ("huge parameter", lambda d, t: d["params"][0].update(shape=[10**12, 10**12]), "holds 4e+24 bytes"),
    ("document version 4", lambda d, t: d.update(version=4), "not a dcsched graph bundle"),
    ("document version true", lambda d, t: d.update(version=True), "not a dcsched graph bundle"),
]


def _write(path: Path, doc, tensors, marker: Path) -> None:
    text = json.dumps(doc).replace("MARKER", str(marker))
    path.write_bytes(fileio.encode(json.loads(text), tensors))


def _hostile_v2(tmp_path, kind):
    edit, words = next((edit, words) for case, edit, words in HOSTILE_V2 if case == kind)
    doc, tensors = _raw()
    edit(doc, tensors)
    marker = tmp_path / "pwned"
    path = tmp_path / "hostile.pt"
    _write(path, doc, tensors, marker)
    return path, words, marker


def _one_line(code, capsys, words):
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert words in " ".join(err.split()), err


@pytest.mark.parametrize("kind", [case for case, _edit, _words in HOSTILE_V2])
def test_hostile_v2_bundles_refused_at_load(tmp_path, kind):
    path, words, marker = _hostile_v2(tmp_path, kind)
    with pytest.raises(BundleError) as info:
        dcsched.load(path)
    assert words in str(info.value) and str(path) in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize("kind", [case for case, _edit, _words in HOSTILE_V2])
@pytest.mark.parametrize("command", [["show"], ["schedule", "--algo", "fast-free"], ["replay"]])
def test_hostile_v2_bundles_run_no_code_and_stop_with_one_line(tmp_path, kind, command, capsys):
    path, words, marker = _hostile_v2(tmp_path, kind)
    before = sorted(os.listdir(tmp_path))
    _one_line(run([command[0], str(path), *command[1:]]), capsys, words)
    assert sorted(os.listdir(tmp_path)) == before and not marker.exists()


def test_shared_template_blow_up_refused_fast_by_every_command(tmp_path, capsys):
    path, words, _marker = _hostile_v2(tmp_path, "one template shared by 2000 nodes")
    assert path.stat().st_size < 600_000
    for command in (["show"], ["schedule", "--algo", "none"], ["convert", str(tmp_path / "out.pt")], ["replay"]):
        start = time.monotonic()
        _one_line(run([command[0], str(path), *command[1:]]), capsys, words)
        assert time.monotonic() - start < 10, command
    assert sorted(os.listdir(tmp_path)) == ["hostile.pt"]


def test_a_shared_template_within_the_allowance_loads(tmp_path):
    doc, tensors = _raw()
    _shared_template(doc, tensors, nodes=20, values=1000)
    path = tmp_path / "fine.pt"
    path.write_bytes(fileio.encode(doc, tensors))
    assert len(dcsched.load(path).forward.nodes) == 35


def _file_cases(tmp_path) -> dict[str, tuple[Path, str]]:
    good = dcsched.save(linear_bundle(), tmp_path / "good.pt").read_bytes()
    size = struct.unpack("<Q", good[:8])[0]
    cases = {
        "truncated": (good[: len(good) // 2], "truncated or corrupt"),
        "truncated header": (good[: 8 + size // 2], "truncated or corrupt"),
        "random after a header length": (good[:8] + b"{" + random.Random(0).randbytes(4096),
                                         "truncated or corrupt"),
        "oversized header length": (struct.pack("<Q", 10**15) + good[8:], "not a dcsched bundle"),
        "header of the wrong length": (struct.pack("<Q", size + 7) + good[8:], "truncated or corrupt"),
        "newer version": (good.replace(b'"dcsched-bundle":"3"', b'"dcsched-bundle":"4"'), "newer dcsched"),
        "version text": (good.replace(b'"dcsched-bundle":"3"', b'"dcsched-bundle":"x"'),
                         "bundle version 'x' is not a version number"),
        "other safetensors file": (_safetensors({"weight": torch.zeros(2)}), "not a dcsched graph bundle"),
        "document not json": (_safetensors({"bundle.json": torch.tensor(list(b"{nope"), dtype=torch.uint8)},
                                           {"dcsched-bundle": "2"}), "its JSON document does not parse"),
        "document nested 100000 deep": (_safetensors({"bundle.json": torch.tensor(list(b"[" * 100_000),
                                                                                  dtype=torch.uint8)},
                                                     {"dcsched-bundle": "2"}), "nests deeper"),
    }
    return cases


def _safetensors(tensors, metadata=None) -> bytes:
    from safetensors.torch import save
    return save(tensors, metadata=metadata)


FILE_CASES = ["truncated", "truncated header", "random after a header length", "oversized header length",
              "header of the wrong length", "newer version", "version text", "other safetensors file",
              "document not json", "document nested 100000 deep"]


@pytest.mark.parametrize("kind", FILE_CASES)
def test_bad_v2_files_one_line_exit_2(tmp_path, kind, capsys):
    data, words = _file_cases(tmp_path)[kind]
    path = tmp_path / "bad.pt"
    path.write_bytes(data)
    with pytest.raises(BundleError) as info:
        dcsched.load(path)
    assert words in str(info.value), str(info.value)
    before = sorted(os.listdir(tmp_path))
    for command in (["show"], ["schedule", "--algo", "none"], ["replay"]):
        _one_line(run([command[0], str(path), *command[1:]]), capsys, words)
    assert sorted(os.listdir(tmp_path)) == before


_EXPRESSIONS = st.sampled_from([
    "__import__('os').system('touch MARKER')", "x=(__import__('os').system('touch MARKER'),1)[1]",
    "exec('open(\"MARKER\",\"w\")')", "__class__", "__init__", "forward", "lambda: 0", "os.system",
    "aten.__class__.__init__", "aten.copy_.default", "aten.add_.Tensor", "aten.mm.__call__", "builtins.eval",
    "dcsched.__dict__", "operator.attrgetter", "import", "None", "1+1", "print", "getattr",
])


@st.composite
def _hostile_v2_edit(draw):
    """One hostile change to a version-2 file: a name, a string, a template, a column value."""
    where = draw(st.sampled_from(["node name", "string", "template", "column", "constant name"]))
    text = draw(st.one_of(_EXPRESSIONS, st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)))
    column = draw(st.sampled_from(["op", "target", "args", "meta", "inputs", "input_offsets", "ints",
                                   "int_offsets", "figures", "tensor_size", "device_time"]))
    value = draw(st.integers(-2**31, 2**31 - 1))
    index = draw(st.integers(0, 10))
    depth = draw(st.integers(0, 80))

    def edit(doc, tensors):
        graph = doc["graphs"]["forward"]
        if where == "node name":
            _names(tensors, lambda n: n.__setitem__(index % len(n), text))
        elif where == "string":
            graph["strings"][index % len(graph["strings"])] = text
        elif where == "template":
            graph["templates"][index % len(graph["templates"])] = [{"$tuple": [text]}, {"$dict": [["x", _deep(depth)]]}]
        elif where == "constant name":
            doc["constants"] = [text]
            tensors[f"constant.{text}"] = torch.zeros(1)
        else:
            key = f"graph.forward.{column}"
            tensor = tensors[key].clone()
            if len(tensor):
                stored = value
                if not tensor.dtype.is_floating_point:  # any value the column's type can hold (uint8: 0..255)
                    info = torch.iinfo(tensor.dtype)
                    stored = (value - info.min) % (info.max - info.min + 1) + info.min
                tensor[index % len(tensor)] = stored
            tensors[key] = tensor
    return edit


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edit=_hostile_v2_edit(), command=st.sampled_from([["show"], ["schedule", "--algo", "list"], ["replay"]]))
def test_generated_hostile_v2_bundles_never_run_code_nor_hang(tmp_path_factory, edit, command):
    import contextlib
    import io
    tmp_path = tmp_path_factory.mktemp("hostile")
    marker = tmp_path / "pwned"
    doc, tensors = _raw()
    edit(doc, tensors)
    path = tmp_path / "hostile.pt"
    _write(path, doc, tensors, marker)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = run([command[0], str(path), *command[1:], *(["-o", str(tmp_path / "out.pt")]
                                                           if command[0] == "schedule" else [])])
    assert not marker.exists(), "a stored name or target ran code"
    assert code in (0, 2)
    if code == 2:
        lines = err.getvalue().strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err.getvalue(), err.getvalue()
