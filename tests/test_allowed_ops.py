"""The list of ops a bundle may call (dcsched/bundle/allowed_ops.txt): side-effect free by the installed torch's
schemas, made as tools/allowed_ops.py makes it, and holding every op that real captured models use."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dcsched
from dcsched.bundle import op_allowlist
from dcsched.bundle.op_allowlist import (DENIED, DERIVED_NAMESPACES, ZERO3_OPS, allowed_ops, list_torch_version,
                                         registered_overloads, resolve, schema_refusal)

import real_models
from bundles import linear_bundle

ROOT = Path(__file__).resolve().parents[1]
SAME_TORCH = list_torch_version() == torch.__version__
STORED = sorted([*ROOT.glob("sample_graphs/*.pt"), *ROOT.glob("tests/golden/bundles/*.pt")])


def _derived() -> list[str]:
    return sorted(name for name in allowed_ops() if name.split(".")[0] in DERIVED_NAMESPACES)


def test_every_listed_op_is_side_effect_free_by_this_torchs_schema():
    registered = set(registered_overloads())
    present = [name for name in _derived() if name in registered]
    if SAME_TORCH:
        assert present == _derived(), "the list names ops this torch does not have"
    assert len(present) > 1000
    for name in present:
        op = resolve(name)
        schema = op._schema
        assert not schema.is_mutable, name
        assert not any(a.alias_info is not None and a.alias_info.is_write
                       for a in [*schema.arguments, *schema.returns]), name
        assert name.rpartition(".")[0] not in DENIED and schema.returns, name
        assert not {"inplace", "inplace_view", "out", "maybe_aliasing_or_mutating"} & \
            {str(tag).rpartition(".")[2] for tag in op.tags}, name
        assert schema_refusal(op) is None, name


def test_the_list_holds_the_zero3_ops_and_nothing_outside_its_namespaces():
    assert set(ZERO3_OPS) <= allowed_ops()
    assert {name.split(".")[0] for name in allowed_ops()} == {"aten", "prims", "dcsched", "dc"}
    assert "aten.from_file.default" not in allowed_ops() and "aten._print.default" not in allowed_ops()


@pytest.mark.skipif(not SAME_TORCH, reason=f"the list was made from torch {list_torch_version()}")
def test_the_list_is_what_the_tool_makes_from_this_torch():
    assert sorted(allowed_ops()) == sorted(op_allowlist.derive())


@pytest.mark.parametrize("op, words", [
    ("aten.add_.Tensor", "writes to its input in place"),
    ("aten.native_batch_norm.default", "op 'aten.native_batch_norm.default' is not allowed: it updates its "
                                       "running-statistics inputs in place"),
    ("aten._print.default", "op 'aten._print.default' is not allowed: it prints to standard output"),
])
def test_an_op_with_side_effects_is_refused_even_if_listed(tmp_path, monkeypatch, op, words):
    """A list made from another torch is checked against this torch's schemas (and the rules) at load."""
    monkeypatch.setattr(op_allowlist, "allowed_ops", lambda: frozenset({*ZERO3_OPS, "aten.relu.default",
                                                                       "aten.sum.default", "aten.mm.default", op}))
    bundle = linear_bundle()
    next(n for n in bundle.forward.nodes if n.name == "mm_0").target = resolve(op)
    path = dcsched.save(bundle, tmp_path / "b.pt")
    with pytest.raises(dcsched.BundleError, match=words):
        dcsched.load(path)


@pytest.mark.parametrize("path", STORED, ids=lambda p: p.name)
def test_stored_captures_load_and_use_only_listed_ops(path):
    used = real_models.ops_of(dcsched.load(path))
    assert {name for name in used if not name.startswith("operator.")} <= allowed_ops()


@pytest.mark.slow
@pytest.mark.parametrize("label", sorted(real_models.EXAMPLES))
def test_captured_example_models_use_only_listed_ops(label):
    used = real_models.ops_of(real_models.capture_example(label))
    assert {name for name in used if not name.startswith("operator.")} <= allowed_ops()


@pytest.mark.slow
@pytest.mark.parametrize("name", real_models.HF_MODELS)
def test_captured_hugging_face_models_use_only_listed_ops(name):
    pytest.importorskip("transformers")
    used = real_models.ops_of(real_models.capture_hf(name))
    assert {name for name in used if not name.startswith("operator.")} <= allowed_ops()
