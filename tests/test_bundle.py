"""The bundle file: round trip, and every kind of bad input refused with one line and exit code 2."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import random
import threading
import time
import warnings
import zipfile

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import dcsched
from dcsched.bundle import core as bundle_io
from dcsched.bundle.op_allowlist import allowed_ops, registered_overloads, resolve
from dcsched.cli import run
from dcsched.outputs import write_atomic
from dcsched.errors import BundleError, DcschedError

from bundles import linear_bundle

aten = torch.ops.aten


def _nodes(graph):
    return [(n.name, n.op, str(n.target), str(n.args), str(n.kwargs)) for n in graph.nodes]


def test_round_trip_node_for_node(tmp_path):
    original = linear_bundle(3)
    path = dcsched.save(original, tmp_path / "graph.pt")
    loaded = dcsched.load(path)
    assert _nodes(loaded.forward) == _nodes(original.forward)
    assert [n.meta.get("device_time") for n in loaded.forward.nodes] == \
        [n.meta.get("device_time") for n in original.forward.nodes]
    assert loaded.params == original.params
    assert torch.equal(loaded.inputs[0].value, original.inputs[0].value)
    assert loaded.forward_placeholders == original.forward_placeholders
    assert loaded.provenance == original.provenance
    loaded.forward.lint()


def test_save_is_atomic_and_keeps_existing_file_on_failure(tmp_path):
    path = tmp_path / "graph.pt"
    path.write_bytes(b"precious")

    def broken(handle):
        handle.write(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(DcschedError, match=r"cannot be written \(is the disk full\? disk full\)"):
        write_atomic(path, broken)  # torch.save on a full disk raises a RuntimeError
    assert path.read_bytes() == b"precious"
    assert os.listdir(tmp_path) == ["graph.pt"]


def test_save_refuses_to_overwrite_when_asked(tmp_path):
    path = dcsched.save(linear_bundle(), tmp_path / "graph.pt")
    with pytest.raises(BundleError, match="exists already"):
        dcsched.save(linear_bundle(), path, overwrite=False)


def test_dc_namespace_graphs_load(tmp_path):
    data = bundle_io.to_data(linear_bundle())
    for node in data["graphs"]["forward"]["nodes"]:
        if node["op"] == "call_function" and node["target"].startswith("dcsched."):
            node["target"] = "dc." + node["target"].removeprefix("dcsched.")
    torch.save(data, tmp_path / "dc.pt")
    graph = dcsched.load(tmp_path / "dc.pt").forward
    targets = {str(n.target) for n in graph.nodes if n.op == "call_function"}
    assert "dc.allgather_param.default" in targets
    assert dcsched.to_networkx(graph).nodes["allgather_ds_param_primals_1_0"]["role"] == "allgather"


class _Payload:
    """Unpickling this would run code: it must never happen."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _bad_files(tmp_path):
    """name -> (path, expected words in the message)."""
    good = tmp_path / "good.pt"
    dcsched.save(linear_bundle(), good)
    files = {}

    marker = tmp_path / "pwned"
    payload = tmp_path / "payload.pt"
    torch.save({"format": "dcsched-bundle", "version": 1, "x": _Payload(marker)}, payload)
    files["code payload"] = (payload, "refused")

    raw_pickle = tmp_path / "raw.pkl"
    raw_pickle.write_bytes(pickle.dumps(_Payload(marker)))
    files["raw pickle payload"] = (raw_pickle, "not a dcsched bundle")

    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    files["truncated"] = (truncated, "truncated or corrupt")

    text = tmp_path / "notes.pt"
    text.write_text("these are not the graphs you are looking for\n")
    files["text file"] = (text, "not a dcsched bundle")

    noise = tmp_path / "noise.pt"
    noise.write_bytes(bytes(random.Random(0).getrandbits(8) for _ in range(4096)))
    files["random bytes"] = (noise, "not a dcsched bundle (neither a safetensors file, a torch file nor a pickle)")

    shadow = tmp_path / "shadow"
    shadow.write_text("root:$6$salt$hash:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n")
    files["password file"] = (shadow, "not a dcsched bundle (neither a safetensors file, a torch file nor a pickle)")

    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    files["empty file"] = (empty, "not a dcsched bundle (the file is empty)")

    protocol_4 = tmp_path / "dict.pkl"
    protocol_4.write_bytes(pickle.dumps({"format": "dcsched-bundle"}, protocol=4))
    files["protocol-4 pickle"] = (protocol_4, "not a dcsched bundle")

    other = tmp_path / "weights.pt"
    torch.save({"weight": torch.zeros(2)}, other)
    files["other torch file"] = (other, "not a dcsched graph bundle")

    data = bundle_io.to_data(linear_bundle())
    data["version"] = bundle_io.BUNDLE_VERSION + 1
    newer = tmp_path / "newer.pt"
    torch.save(data, newer)
    files["newer version"] = (newer, "newer dcsched")

    def edited(name, edit):
        data = bundle_io.to_data(linear_bundle())
        edit(data["graphs"]["forward"]["nodes"])
        path = tmp_path / f"{name}.pt"
        torch.save(data, path)
        return path

    def dangle(nodes):
        nodes[-2]["args"] = {"$tuple": [{"$node": "ghost"}]}

    def cycle(nodes):
        by_name = {n["name"]: n for n in nodes}
        by_name["mm_0"]["args"] = {"$tuple": [{"$node": "relu_0"}, {"$node": "wait_allgather_ds_param__primals_1_0"}]}

    def unknown(nodes):
        nodes[-2]["target"] = "aten.definitely_not_an_op.default"

    def forbidden(nodes):
        nodes[-2]["target"] = "os.system"

    files["dangling reference"] = (edited("dangling", dangle), "refers to 'ghost'")
    files["cycle"] = (edited("cycle", cycle), "cycle")
    files["unknown op"] = (edited("unknown", unknown), "unknown op 'aten.definitely_not_an_op.default'")
    files["disallowed target"] = (edited("forbidden", forbidden), "op 'os.system' is not allowed")

    def figure(key, value):
        def edit(nodes):
            next(n for n in nodes if n["name"] == "mm_0")["meta"][key] = value
        return edit

    for name, key, value, words in FIGURES:
        files[name] = (edited(name.replace(" ", "_"), figure(key, value)), f"node mm_0: {key} {words}")

    for name, shape, words in SHAPES:
        data = bundle_io.to_data(linear_bundle())
        data["params"][0]["shape"] = shape
        path = tmp_path / f"{name.replace(' ', '_')}.pt"
        torch.save(data, path)
        files[name] = (path, f"parameter 'layers.0.weight': shape {words}")
    return files, marker


#: Figures no measurement gives: (case, meta key, value, words in the message).
FIGURES = [
    ("infinite device_time", "device_time", float("inf"), "is inf, not a finite number"),
    ("nan device_time", "device_time", float("nan"), "is nan, not a finite number"),
    ("negative device_time", "device_time", -1.0, "is negative"),
    ("year-long device_time", "device_time", 3.2e10, "is 3.2e+10, over the largest believable"),
    ("huge tensor_size", "tensor_size", 1e30, "is 1e+30, over the largest believable"),
    ("infinite tensor_size", "tensor_size", float("inf"), "is inf, not a finite number"),
    ("text tensor_size", "tensor_size", "64", "is '64', not a number"),
]
#: Parameter shapes no model has: (case, shape, words in the message).
SHAPES = [
    ("huge shape", [10**12, 10**12], "[1000000000000, 1000000000000] holds 4e+24 bytes"),
    ("negative shape", [4, -4], "[4, -4] has a negative dimension"),
    ("float shape", [1e12, 1e12], "[1000000000000.0, 1000000000000.0] is not a list of integers"),
]


BAD = ["code payload", "raw pickle payload", "truncated", "text file", "random bytes", "password file", "empty file",
       "protocol-4 pickle", "other torch file", "newer version",
       "dangling reference", "cycle", "unknown op", "disallowed target",
       *(case[0] for case in FIGURES), *(case[0] for case in SHAPES)]
NUMBERS = [*(case[0] for case in FIGURES), *(case[0] for case in SHAPES)]


def _first_call(data):
    return next(n for n in data["graphs"]["forward"]["nodes"] if n["op"] == "call_function"
                and not n["target"].startswith("dcsched."))


def _first_of(data, op):
    return next(n for n in data["graphs"]["forward"]["nodes"] if n["target"] == f"dcsched.{op}.default")


def _self_similar(levels: int = 60) -> list:
    nested = [1]
    for _ in range(levels):
        nested = [nested, nested]  # 2**60 values when walked; pickle stores each level once
    return nested


def _sharing(nodes: int, values: list) -> list:
    """``nodes`` call nodes whose arguments are one list (pickle stores it once)."""
    return [{"name": f"blowup_{i}", "op": "call_function", "target": "aten.zeros.default",
             "args": {"$tuple": [values]}, "kwargs": {"$dict": []}, "meta": {}} for i in range(nodes)]


def _insert_before_output(nodes: list, extra: list) -> None:
    nodes[len(nodes) - 1:len(nodes) - 1] = extra


#: Bundles built to run code, hang or crash a command: (case, edit of the plain data, words in the message).
#: ``MARKER`` in an edit stands for a file the payload would create.
HOSTILE = [
    ("placeholder target expression",
     lambda d: d["graphs"]["forward"]["nodes"][0].update(target="x=(__import__('os').system('touch MARKER'),p)[1]"),
     "is not a plain identifier"),
    ("get_attr target expression",
     lambda d: d["graphs"]["forward"]["nodes"].insert(1, {"name": "c", "op": "get_attr", "args": {"$tuple": []},
                                                          "kwargs": {"$dict": []}, "meta": {},
                                                          "target": "__import__('os').system('touch MARKER')"}),
     "get_attr target part"),
    ("dunder op", lambda d: _first_call(d).update(target="aten.__class__.__init__"), "is not an op name"),
    ("attribute walk to a module", lambda d: _first_call(d).update(target="aten.mm.__call__"), "is not an op name"),
    ("layout by attribute", lambda d: _first_call(d).update(kwargs={"$dict": [["layout", {"$layout": "_C"}]]}),
     "unknown layout '_C'"),
    ("memory format by attribute",
     lambda d: _first_call(d).update(kwargs={"$dict": [["memory_format", {"$memory_format": "os"}]]}),
     "unknown memory format 'os'"),
    ("dtype by attribute", lambda d: d["params"][0].update(dtype="_C"), "unknown dtype '_C'"),
    ("in-place copy_", lambda d: _first_call(d).update(target="aten.copy_.default"), "writes to its input in place"),
    ("in-place set_", lambda d: _first_call(d).update(target="aten.set_.source_Tensor"), "writes to its input"),
    ("self-similar kwargs", lambda d: _first_call(d).update(kwargs={"$dict": [["x", _self_similar()]]}),
     "arguments nest deeper than 32 levels"),
    ("self-similar provenance", lambda d: d["provenance"].update(x=_self_similar()), "the bundle's provenance"),
    ("saved activation bytes negative", lambda d: d["provenance"].update(saved_for_backward_bytes=-1),
     "saved_for_backward_bytes '-1' is not a byte count"),
    ("unchecked activation bytes alone",
     lambda d: d["provenance"].update(saved_for_backward_bytes_without_checkpointing=8),
     "has saved_for_backward_bytes_without_checkpointing but no saved_for_backward_bytes"),
    ("constant named forward", lambda d: d.update(constants={"forward": torch.zeros(1)}),
     "constant name 'forward' would replace"),
    ("constant named __class__", lambda d: d.update(constants={"__class__": torch.zeros(1)}),
     "is not a plain identifier"),
    ("string constant", lambda d: d.update(constants={"c": "hello"}), "constant 'c' is a str, not a tensor"),
    ("version True", lambda d: d.update(version=True), "bundle version True is not a version number"),
    ("version -5", lambda d: d.update(version=-5), "bundle version -5 is not a version number"),
    ("all-gather id 'zero'", lambda d: _first_of(d, "allgather_param")["args"]["$tuple"].__setitem__(2, "zero"),
     "allgather_param's id is 'zero', not an integer"),
    ("all-gather with one argument",
     lambda d: _first_of(d, "allgather_param").update(args={"$tuple": _first_of(d, "allgather_param")["args"]
                                                             ["$tuple"][:1]}),
     "allgather_param has no graph_id argument"),
    ("2000 nodes sharing one argument list",
     lambda d: _insert_before_output(d["graphs"]["forward"]["nodes"], _sharing(2000, [0.5] * 90_000)),
     "its nodes' arguments hold more than the"),
    ("output shape nan", lambda d: _first_call(d)["meta"].update(out={"shape": [float("nan")], "dtype": "float32"}),
     "output shape [nan] is not a list of non-negative integers"),
    ("from_file creating a file",
     lambda d: _first_call(d).update(target="aten.from_file.default", args={"$tuple": ["MARKER", True, 4096]},
                                     kwargs={"$dict": [["dtype", {"$dtype": "uint8"}]]}),
     "op 'aten.from_file.default' is not allowed: it maps a file into a tensor"),
    ("_print to stdout",
     lambda d: _first_call(d).update(target="aten._print.default", kwargs={"$dict": []},
                                     args={"$tuple": ["dcsched: error: everything is fine\x1b[2J"]}),
     "op 'aten._print.default' is not allowed: it prints to standard output"),
]
#: Input tables no capture writes: (case, input fields, words).
INPUTS = [
    ("input low above high", {"low": 5, "high": 1}, "its range [5, 1] is empty"),
    ("input low nan", {"low": float("nan")}, "range bound nan is not a finite number"),
    ("input value not a tensor", {"value": [1, 2]}, "its stored value is a list, not a tensor"),
]
HOSTILE += [(case, lambda d, fields=fields: d["inputs"].append({"name": "ids", "shape": [2], "dtype": "int64",
                                                                 "value": None, "low": None, "high": None,
                                                                 **fields}), words)
            for case, fields, words in INPUTS]


def _hostile(tmp_path, kind) -> tuple[Path, str, Path]:
    """The hostile bundle ``kind`` (from the linear example), the words its error names, the marker file."""
    edit, words = next((edit, words) for case, edit, words in HOSTILE if case == kind)
    marker = tmp_path / "pwned"
    data = bundle_io.to_data(linear_bundle())
    edit(data)
    path = tmp_path / "hostile.pt"
    torch.save(_with_marker(data, str(marker)), path)
    return path, words, marker


def _with_marker(value, marker: str):
    if isinstance(value, str):
        return value.replace("MARKER", marker)
    if isinstance(value, dict):
        return {k: _with_marker(v, marker) for k, v in value.items()}
    if isinstance(value, list) and value and value[0] is not value[-1]:  # leave self-similar lists as they are
        return [_with_marker(v, marker) for v in value]
    return value


@pytest.mark.parametrize("kind", [case for case, _edit, _words in HOSTILE])
@pytest.mark.parametrize("command", [["show"], ["schedule", "--algo", "fast-free"], ["replay"]])
def test_hostile_bundles_run_no_code_and_stop_with_one_line(tmp_path, kind, command, capsys):
    path, words, marker = _hostile(tmp_path, kind)
    before = sorted(os.listdir(tmp_path))
    assert run([command[0], str(path), *command[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert words in " ".join(err.split()), err
    assert sorted(os.listdir(tmp_path)) == before and not marker.exists()


@pytest.mark.parametrize("kind", BAD)
def test_bad_bundle_raises_bundle_error(tmp_path, kind):
    files, marker = _bad_files(tmp_path)
    path, words = files[kind]
    with pytest.raises(BundleError) as info:
        dcsched.load(path)
    assert words in str(info.value)
    assert str(path) in str(info.value)
    assert not marker.exists(), "loading ran code from the file"


@pytest.mark.parametrize("kind", BAD)
def test_bad_bundle_cli_one_line_exit_2(tmp_path, kind, capsys):
    files, marker = _bad_files(tmp_path)
    path, words = files[kind]
    before = sorted(os.listdir(tmp_path))
    assert run(["show", str(path)]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err and words in " ".join(err.split())
    assert sorted(os.listdir(tmp_path)) == before
    assert not marker.exists()


@pytest.mark.parametrize("kind", NUMBERS)
@pytest.mark.parametrize("command", [["show"], ["schedule", "--algo", "none"], ["replay"]])
def test_absurd_figures_refused_by_every_command(tmp_path, kind, command, capsys):
    files, _ = _bad_files(tmp_path)
    path, words = files[kind]
    before = sorted(os.listdir(tmp_path))
    assert run([command[0], str(path), *command[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert words in " ".join(err.split()), err
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("kind", ["raw pickle payload", "protocol-4 pickle"])
def test_foreign_pickle_gives_no_warning(tmp_path, kind):
    files, _ = _bad_files(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(BundleError, match="not a dcsched bundle"):
            dcsched.load(files[kind][0])
    assert [str(w.message) for w in caught] == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file_one_line(tmp_path, capsys):
    path = dcsched.save(linear_bundle(), tmp_path / "locked.pt")
    path.chmod(0)
    assert run(["show", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot be read (Permission denied)" in err, err


def test_missing_file(tmp_path, capsys):
    assert run(["show", str(tmp_path / "nope.pt")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_zip_of_other_content_is_rejected(tmp_path):
    path = tmp_path / "archive.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("hello.txt", "hi")
    with pytest.raises(BundleError):
        dcsched.load(path)


#: Python that would run if a stored name or target reached generated code or an attribute walk.
_EXPRESSIONS = st.sampled_from([
    "__import__('os').system('touch MARKER')", "x=(__import__('os').system('touch MARKER'),1)[1]",
    "exec('open(\"MARKER\",\"w\")')", "__class__", "__init__", "forward", "a.__class__.__base__", "lambda: 0",
    "os.system", "aten.__class__.__init__", "aten.copy_.default", "aten.add_.Tensor", "aten.set_.source_Tensor",
    "aten.mm.__call__", "builtins.eval", "dcsched.__dict__", "operator.attrgetter", "import", "None", "1+1",
])
_TEXT = st.one_of(_EXPRESSIONS, st.text(min_size=0, max_size=20))


@st.composite
def _hostile_edit(draw):
    """One hostile change to a bundle's plain data: a name, a target, a constant name or deep arguments."""
    where = draw(st.sampled_from(["node name", "placeholder target", "get_attr target", "op target",
                                  "constant name", "nesting", "layout"]))
    text = draw(_TEXT)
    depth = draw(st.integers(min_value=0, max_value=80))

    def edit(data):
        nodes = data["graphs"]["forward"]["nodes"]
        call = next(n for n in nodes if n["op"] == "call_function" and not n["target"].startswith("dcsched."))
        if where == "node name":
            nodes[-2]["name"] = text
        elif where == "placeholder target":
            nodes[0]["target"] = text
        elif where == "get_attr target":
            nodes.insert(1, {"name": "c", "op": "get_attr", "target": text, "args": {"$tuple": []},
                             "kwargs": {"$dict": []}, "meta": {}})
        elif where == "op target":
            call["target"] = text
        elif where == "constant name":
            data["constants"] = {text: torch.zeros(1)}
        elif where == "layout":
            call["kwargs"] = {"$dict": [["layout", {"$layout": text}]]}
        else:
            call["kwargs"] = {"$dict": [["x", _self_similar(depth)]]}
    return edit


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edit=_hostile_edit(), command=st.sampled_from([["show"], ["schedule", "--algo", "list"], ["replay"]]))
def test_generated_hostile_bundles_never_run_code_nor_hang(tmp_path_factory, edit, command):
    tmp_path = tmp_path_factory.mktemp("hostile")
    marker = tmp_path / "pwned"
    data = bundle_io.to_data(linear_bundle())
    edit(data)
    path = tmp_path / "hostile.pt"
    torch.save(_with_marker(data, str(marker)), path)
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = run([command[0], str(path), *command[1:], *(["-o", str(tmp_path / "out.pt")]
                                                           if command[0] == "schedule" else [])])
    assert not marker.exists(), "a stored name or target ran code"
    assert code in (0, 2)
    if code == 2:
        lines = err.getvalue().strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err.getvalue(), err.getvalue()


# ---------------------------------------------------------------------------
# Ops with side effects: refused by name at load, by every command, in every format
# ---------------------------------------------------------------------------

def _calling(path: Path, op, args=None, kwargs=None, version: int = 3) -> Path:
    """The linear bundle with its first matrix product replaced by ``op(*args, **kwargs)`` (``args`` None: the
    product's two tensors), saved as ``version``."""
    bundle = linear_bundle()
    node = next(n for n in bundle.forward.nodes if n.name == "mm_0")
    node.target = op
    if args is not None:
        node.args, node.kwargs = tuple(args), dict(kwargs or {})
    if version == 1:
        torch.save(bundle_io.to_data(bundle), path)
        return path
    return dcsched.save(bundle, path)


def _commands(path: Path, out: Path) -> list[list[str]]:
    """Every command that reads a bundle, writing (where it writes) to ``out``."""
    return [["show", str(path)], ["schedule", str(path), "--algo", "fast-free", "-o", str(out)],
            ["convert", str(path), str(out)], ["replay", str(path), "--json"]]


def _refused(argv: list[str], name: str) -> None:
    """``argv`` exits 2 with one line refusing op ``name`` and prints nothing on stdout (``--json`` stays JSON)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run(argv)
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err.getvalue(), err.getvalue()
    assert f"op '{name}' is not allowed" in lines[0], lines[0]
    assert out.getvalue() == "", out.getvalue()


@pytest.mark.parametrize("version", [1, 3])
def test_from_file_and_print_refused_by_every_command(tmp_path, version):
    marker = tmp_path / "pwned"
    cases = [(aten.from_file.default, [str(marker), True, 4096], {"dtype": torch.uint8}),
             (aten._print.default, ["dcsched: error: everything is fine\x1b[2J"], {})]
    for i, (op, args, kwargs) in enumerate(cases):
        path = _calling(tmp_path / f"hostile{i}.pt", op, args, kwargs, version)
        before = sorted(os.listdir(tmp_path))
        for argv in _commands(path, tmp_path / "out.pt"):
            _refused(argv, f"aten.{op._opname}.default")
        assert sorted(os.listdir(tmp_path)) == before and not marker.exists()


@pytest.mark.parametrize("version", [1, 3])
def test_from_file_leaves_an_existing_file_as_it_was(tmp_path, version):
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"keep me")
    before = victim.stat()
    path = _calling(tmp_path / "hostile.pt", aten.from_file.default, [str(victim), True, 1 << 20],
                    {"dtype": torch.uint8}, version)
    for argv in _commands(path, tmp_path / "out.pt"):
        _refused(argv, "aten.from_file.default")
    after = victim.stat()
    assert victim.read_bytes() == b"keep me" and (after.st_size, after.st_mtime_ns) == (7, before.st_mtime_ns)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes")
def test_from_file_never_opens_a_fifo(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    path = _calling(tmp_path / "hostile.pt", aten.from_file.default, [str(fifo), True, 4096], {"dtype": torch.uint8})
    readers, done = [], threading.Event()

    def watch():
        # A reader blocked opening the pipe would hang the test: open its other end, which lets it through,
        # and record that it was opened. ENXIO: nobody has it open for reading.
        while not done.wait(0.01):
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                readers.append(time.monotonic())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start = time.monotonic()
    try:
        for argv in _commands(path, tmp_path / "out.pt"):
            _refused(argv, "aten.from_file.default")
    finally:
        done.set()
        watcher.join()
    assert readers == [], "a command opened the named pipe"
    assert time.monotonic() - start < 60


#: Every aten and prims overload torch registers.
_TORCH_OPS = registered_overloads()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(_TORCH_OPS), version=st.sampled_from([1, 3]),
       command=st.sampled_from([["show"], ["replay", "--json"]]))
def test_any_torch_op_off_the_list_is_refused_by_name(tmp_path_factory, name, version, command):
    tmp_path = tmp_path_factory.mktemp("ops")
    path = _calling(tmp_path / "op.pt", resolve(name), version=version)
    before = sorted(os.listdir(tmp_path))
    if name in allowed_ops():
        with contextlib.redirect_stdout(io.StringIO()):
            assert run(["show", str(path)]) == 0  # it loads; running it on two 4x4 matrices may fail
    elif name.split(".")[1].startswith("__"):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            assert run([command[0], str(path), *command[1:]]) == 2
        assert f"'{name}' is not an op name" in err.getvalue() and len(err.getvalue().strip().splitlines()) == 1
    else:
        _refused([command[0], str(path), *command[1:]], name)
    assert sorted(os.listdir(tmp_path)) == before
