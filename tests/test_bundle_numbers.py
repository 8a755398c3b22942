"""Numbers a bundle holds, checked at load in both forms (version 1's nodes, version 3's columns): ZeRO-3 op ids
naming parameters of the table, graph ids, shapes and counts within belief, versions in ASCII digits; and a
stored plan that cannot run refused by ``schedule`` and ``replay`` alike."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import json

import pytest
import torch
from hypothesis import given, strategies as st

import dcsched
from dcsched import replay
from dcsched.bundle import fileio
from dcsched.bundle.core import Bundle, ParamInfo
from dcsched.cli import run
from dcsched.errors import BundleError, GraphError
from dcsched.plan import Bucket, Plan
from dcsched.safeparse import json_depth
from bundles import save_v1

BIG = 2**70  # past 64 bits: stored literally in a version-3 template, a Python int in version 1
#: Every command that reads a bundle (convert also takes an output path).
COMMANDS = [["show"], ["schedule", "--algo", "fast-free", "--json"], ["replay"], ["convert"]]


def _set_args(bundle: Bundle, graph: str, node: str, position: int, value) -> None:
    found = next(n for n in bundle.graphs[graph].nodes if n.name == node)
    args = list(found.args)
    args[position] = value
    found.args = tuple(args)


def _set_param(bundle: Bundle, k: int, **fields) -> None:
    params = list(bundle.params)
    params[k] = ParamInfo(**{**params[k].__dict__, **fields})
    bundle.params = params


def _set_out(bundle: Bundle, node: str, shape) -> None:
    found = next(n for n in bundle.forward.nodes if n.name == node)
    found.meta["out"] = {"shape": shape, "dtype": "float32"}


def _set_graph_id(bundle: Bundle, graph: str, value) -> None:
    bundle.graph_ids = {**bundle.graph_ids, graph: value}


AG, WAIT, MM = "allgather_ds_param_primals_1_0", "wait_allgather_ds_param__primals_1_0", "mm"
RELEASE, REDUCE = "release_ds_param_primals_3_mm_2", "reduce_ds_param_fc1_weight"

#: (case, edit of the replay example's FX bundle, words in the message): the same words from either form.
NUMBERS: list[tuple[str, Callable[[Bundle], None], str]] = [
    ("all-gather id naming no parameter", lambda b: _set_args(b, "forward", AG, 2, 2**62),
     f"node {AG}: allgather_param's id 4611686018427387904 names no parameter of the bundle's table "
     "(3 parameters, ds_ids 0 to 2)"),
    ("wait id naming no parameter", lambda b: _set_args(b, "forward", WAIT, 2, 7),
     f"node {WAIT}: wait_allgather's id 7 names no parameter"),
    ("release id naming no parameter", lambda b: _set_args(b, "forward", RELEASE, 2, 3),
     f"node {RELEASE}: release_param's id 3 names no parameter"),
    ("reduce id naming no parameter", lambda b: _set_args(b, "backward", REDUCE, 2, 9),
     f"node {REDUCE}: reduce_grad's id 9 names no parameter"),
    ("all-gather graph_id 2^70", lambda b: _set_args(b, "forward", AG, 1, BIG),
     f"node {AG}: allgather_param's graph_id {BIG} is over the largest graph id (2147483647)"),
    ("all-gather graph_id of the other graph", lambda b: _set_args(b, "forward", AG, 1, 1),
     f"node {AG}: allgather_param's graph_id 1 is not its graph's (0)"),
    ("release n_users 2^40", lambda b: _set_args(b, "forward", RELEASE, 3, 2**40),
     "release_param's n_users 1099511627776 is over the largest use count"),
    ("graph_id 2^70", lambda b: _set_graph_id(b, "forward", BIG),
     f"graph 'forward': graph_id {BIG} is not a graph id (an integer from 0 to 2147483647)"),
    ("two graphs of one graph_id", lambda b: _set_graph_id(b, "backward", 0),
     "graphs 'forward' and 'backward' both have graph_id 0"),
    ("output shape [2^70, 2^70]", lambda b: _set_out(b, MM, [BIG, BIG]),
     f"node mm: output shape [{BIG}, {BIG}] has a dimension of 1.18059e+21, over the largest believable"),
    ("output shape of 2^62 bytes", lambda b: _set_out(b, MM, [2**40, 2**20]),
     "node mm: output shape [1099511627776, 1048576] holds 4.61169e+18 bytes, over the largest believable"),
    ("empty parameter of 2^70 columns", lambda b: _set_param(b, 0, shape=(0, BIG)),
     f"parameter 'fc1.weight': shape [0, {BIG}] has a dimension of 1.18059e+21"),
    ("parameter ds_id in Arabic digits", lambda b: _set_param(b, 0, ds_id="\u0663"),
     "parameter 'fc1.weight': ds_id '\u0663' is not a parameter id"),
    ("parameter ds_id 2^70", lambda b: _set_param(b, 0, ds_id=BIG),
     f"parameter 'fc1.weight': ds_id {BIG} is not a parameter id"),
    ("two parameters of one ds_id", lambda b: _set_param(b, 1, ds_id=0),
     "parameters 'fc1.weight' and 'fc1.bias' both have ds_id 0"),
    ("num_user_outputs in full-width digits", lambda b: setattr(b, "num_user_outputs", "\uff11"),
     "num_user_outputs '\uff11' is not a count"),
]


def _hostile(tmp_path: Path, kind: str, version: int) -> tuple[Path, str]:
    edit, words = next((edit, words) for case, edit, words in NUMBERS if case == kind)
    bundle = replay.example_bundle()
    edit(bundle)
    path = tmp_path / "hostile.pt"
    if version == 1:
        save_v1(bundle, path)
    else:
        path.write_bytes(fileio.encode(*fileio.document_and_tensors(bundle)))
    return path, words


def _refused_in_one_line(tmp_path: Path, path: Path, command: list[str], capsys) -> str:
    """Run ``command`` on ``path``: exit 2, one line on stderr, nothing created or changed; the line."""
    before = {p: p.read_bytes() for p in tmp_path.iterdir()}
    extra = [str(tmp_path / "out.pt")] if command[0] == "convert" else []
    assert run([command[0], str(path), *command[1:], *extra]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert captured.out == "", captured.out
    assert {p: p.read_bytes() for p in tmp_path.iterdir()} == before
    return " ".join(err.split())


@pytest.mark.parametrize("version", [1, 3])
@pytest.mark.parametrize("kind", [case for case, _edit, _words in NUMBERS])
def test_numbers_past_belief_are_refused_at_load_in_either_form(tmp_path, kind, version):
    path, words = _hostile(tmp_path, kind, version)
    with pytest.raises(BundleError) as info:
        dcsched.load(path)
    message = str(info.value)
    assert words in message and str(path) in message and len(message.splitlines()) == 1, message


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("kind", [case for case, _edit, _words in NUMBERS])
def test_numbers_past_belief_stop_every_command_with_one_line(tmp_path, kind, command, capsys):
    path, words = _hostile(tmp_path, kind, 3)
    assert words in _refused_in_one_line(tmp_path, path, command, capsys)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_a_version_1_id_naming_no_parameter_stops_every_command(tmp_path, command, capsys):
    path, words = _hostile(tmp_path, "all-gather id naming no parameter", 1)
    assert words in _refused_in_one_line(tmp_path, path, command, capsys)


def test_the_example_loads_in_either_form(tmp_path):
    """The checks refuse the cases above, not a bundle as dcsched writes it."""
    for version in (1, 3):
        path = tmp_path / f"v{version}.pt"
        bundle = replay.example_bundle()
        if version == 1:
            save_v1(bundle, path)
        else:
            dcsched.save(bundle, path)
        loaded = dcsched.load(path)
        assert loaded.graph_ids == {"forward": 0, "backward": 1}
        assert [p.ds_id for p in loaded.params] == [0, 1, 2]


# ---------------------------------------------------------------------------
# Versions: ASCII digits only
# ---------------------------------------------------------------------------

#: Header versions no dcsched writes: Unicode digits int() reads (or fails on), padding, a leading zero.
VERSIONS = ["\u00b2", "\u0663", "\uff13", "03", " 3", "3 ", "+3", "3.0", "", "1" * 40]


@pytest.mark.parametrize("version", VERSIONS, ids=ascii)
def test_header_versions_other_than_ascii_digits_are_refused(tmp_path, version, capsys):
    doc, tensors = fileio.document_and_tensors(replay.example_bundle())
    path = tmp_path / "v.pt"
    path.write_bytes(fileio.encode(doc, tensors, version=version))  # type: ignore[arg-type]
    with pytest.raises(BundleError, match="is not a version number") as info:
        dcsched.load(path)
    assert len(str(info.value).splitlines()) == 1
    for command in COMMANDS:
        assert "is not a version number (ASCII digits" in _refused_in_one_line(tmp_path, path, command, capsys)


_TRICKY = st.text(st.sampled_from('[]{}"\\/ab\u00e9\n'), max_size=6)
_DOCUMENTS = st.recursive(st.none() | st.integers() | _TRICKY,
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TRICKY, inner, max_size=3),
                          max_leaves=12)


def _depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


@given(document=_DOCUMENTS, ascii_only=st.booleans())
def test_json_depth_is_the_nesting_of_any_document(document, ascii_only):
    """Brackets, quotes and backslashes inside strings (keys too) are not nesting."""
    assert json_depth(json.dumps(document, ensure_ascii=ascii_only)) == _depth(document)


def test_a_deep_document_is_refused_before_parsing(tmp_path):
    """A document of 10^5 opening brackets: the depth is measured before the parser recurses."""
    path = tmp_path / "deep.pt"
    from safetensors.torch import save
    path.write_bytes(save({"bundle.json": torch.tensor(list(b"[" * 100_000), dtype=torch.uint8)},
                          metadata={"dcsched-bundle": "3"}))
    with pytest.raises(BundleError, match="its JSON document nests deeper than 64 levels"):
        dcsched.load(path)


# ---------------------------------------------------------------------------
# A stored plan that cannot run: schedule and replay refuse it alike
# ---------------------------------------------------------------------------

def _unrunnable_plan(tmp_path: Path) -> Path:
    """The example with the backward's first and last reduce in one bucket: sound in structure (it loads),
    but the bucket is issued at its first member, before the last one's gradient is computed."""
    bundle = replay.example_bundle()
    reduces = [n.name for n in bundle.backward.nodes if n.name.startswith("reduce_")]
    ds_ids = {"reduce_ds_param_fc2_weight": 2, "reduce_ds_param_fc1_weight": 0, "reduce_ds_param_fc1_bias": 1}
    first, last = reduces[0], reduces[-1]
    plans = {"backward": Plan((), [Bucket("reduce", [first, last], [ds_ids[first], ds_ids[last]])])}
    return dcsched.save(bundle.reordered({}, plans=plans), tmp_path / "crafted.pt")


WORDS = ("graph 'backward': its stored plan cannot run: bucket of 'reduce_ds_param_fc2_weight' is issued before "
         "its member 'reduce_ds_param_fc1_bias''s input 'sum_2' has run")


def test_schedule_and_replay_refuse_an_unrunnable_plan_in_the_same_words(tmp_path, capsys):
    path = _unrunnable_plan(tmp_path)
    assert dcsched.load(path).plans["backward"].buckets, "it loads: the check is the runner's, not the loader's"
    said = {command[0]: _refused_in_one_line(tmp_path, path, command, capsys)
            for command in (["schedule"], ["replay", "--iters", "1"])}
    assert said["schedule"] == said["replay"] == f"dcsched: error: {WORDS}"
    assert run(["show", str(path)]) == 0  # showing it runs nothing


@pytest.mark.parametrize("algo", ["deepcompile", "overlap"])
def test_a_scheduler_taking_the_default_budget_refuses_an_unrunnable_plan_in_one_line(tmp_path, capsys, algo):
    path = _unrunnable_plan(tmp_path)
    said = _refused_in_one_line(tmp_path, path, ["schedule", "--algo", algo], capsys)
    assert said == f"dcsched: error: {WORDS}"


def test_replay_orders_refuses_an_unrunnable_plan_of_either_bundle(tmp_path):
    crafted = dcsched.load(_unrunnable_plan(tmp_path))
    plain = replay.example_bundle()
    for candidate, baseline in ((crafted, None), (plain, crafted)):
        with pytest.raises(GraphError) as info:
            replay.replay_orders(candidate, baseline, iters=1, warmup=0)
        assert str(info.value) == WORDS
