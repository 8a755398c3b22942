"""The activation memory a captured step saves for its backward, against the same step without checkpointing.

A tiny model of two checkpointed blocks, each ``Linear(8, 16) -> relu -> Linear(16, 8)`` (no bias) on a
4 x 8 float32 batch, its loss the output's sum, counted by hand:

* without checkpointing the forward saves, per block, the relu's output (4 x 16 floats, 256 bytes: the
  second matmul's weight gradient and the relu's own backward read it) and, for the second block, its
  input (the first block's output, 4 x 8 floats, 128 bytes: the second block's first weight gradient reads
  it; the first block's input is the batch, a forward input, not counted): 2 * 256 + 128 = 640 bytes;
* with both blocks checkpointed it saves only the boundary between them (128 bytes): each block is
  recomputed from its input.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import given, strategies as st
import torch._functorch.config  # noqa: F401  (torch._functorch.config.patch below)
from torch.utils.checkpoint import checkpoint

import dcsched
from dcsched.bundle import core as bundle_io
from dcsched.bundle.saved_memory import MAX_BYTES, SAVED_KEY, WITHOUT_KEY, SavedActivations, from_provenance
from dcsched.cli import run
from dcsched.errors import BundleError
from dcsched.profile import saved_activations

BATCH, WIDTH, HIDDEN, FLOAT = 4, 8, 16, 4
RELU_OUT = BATCH * HIDDEN * FLOAT
BLOCK_OUT = BATCH * WIDTH * FLOAT


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, HIDDEN, bias=False)
        self.down = torch.nn.Linear(HIDDEN, WIDTH, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class TwoBlocks(torch.nn.Module):
    def __init__(self, checkpointed: bool):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.checkpointed = checkpointed

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return x.sum()


def _capture(checkpointed: bool) -> bundle_io.Bundle:
    torch.manual_seed(0)
    return dcsched.capture(TwoBlocks(checkpointed), [torch.randn(BATCH, WIDTH)])


@pytest.fixture(scope="module")
def captured():
    return {checkpointed: _capture(checkpointed) for checkpointed in (False, True)}


def test_full_checkpointing_saves_the_block_boundary_only(captured):
    saved = from_provenance(captured[True].provenance)
    assert saved == SavedActivations(BLOCK_OUT, 2 * RELU_OUT + BLOCK_OUT)
    assert saved.saved_bytes < saved.without_checkpointing
    assert saved.reduction == pytest.approx(1 - 128 / 640)
    assert saved.describe().endswith("(-80.0%)")


def test_the_unchecked_figure_is_what_the_step_captured_without_checkpointing_saves(captured):
    plain = from_provenance(captured[False].provenance)
    assert plain == SavedActivations(2 * RELU_OUT + BLOCK_OUT)  # no checkpointing: no second figure
    assert WITHOUT_KEY not in captured[False].provenance
    assert "no saving" in plain.describe()
    assert from_provenance(captured[True].provenance).without_checkpointing == plain.saved_bytes


def test_an_activation_memory_budget_is_checkpointing_too():
    with torch._functorch.config.patch(activation_memory_budget=0.0):
        budgeted = from_provenance(_capture(False).provenance)
    assert budgeted.without_checkpointing == 2 * RELU_OUT + BLOCK_OUT  # the step's, budget lifted
    assert budgeted.saved_bytes < budgeted.without_checkpointing


def test_the_figures_survive_saving_scheduling_and_the_reports(captured, tmp_path, capsys):
    from dcsched.costmodels.options import ProfileOptions
    from dcsched.profile.measure import profile_bundle
    path = tmp_path / "step.pt"
    options = ProfileOptions(cost_model="analytic", gpu="h100", progress=False)
    bundle_io.save(profile_bundle(captured[True], options), path)
    assert bundle_io.load(path).provenance[SAVED_KEY] == BLOCK_OUT
    assert run(["show", str(path), "--no-params"]) == 0
    assert "activation memory saved for backward: 128 B (checkpointed) vs 640 B without (-80.0%)" in \
        _words(capsys.readouterr().out)
    assert run(["schedule", str(path), "--algo", "fast-free", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["activation_memory"] == {"saved_bytes": 128, "without_checkpointing_bytes": 640,
                                           "reduction": pytest.approx(0.8)}
    assert bundle_io.load(tmp_path / "step.fast-free.pt").provenance[WITHOUT_KEY] == 640
    assert run(["schedule", str(tmp_path / "step.fast-free.pt"), "--algo", "fsdp", "-o",
                str(tmp_path / "again.pt")]) == 0
    assert "128 B (checkpointed) vs 640 B without" in _words(capsys.readouterr().out)


def test_the_copy_without_checkpointing_leaves_the_joint_graph_as_it_was():
    from torch.utils.checkpoint import CheckpointPolicy
    from dcsched.profile.checkpointing import PARAM_VIEWS_REGION
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    view = graph.call_function(torch.ops.aten.t.default, (x,))
    view.meta.update(recompute=CheckpointPolicy.MUST_RECOMPUTE, ac_graph_id=PARAM_VIEWS_REGION)
    relu = graph.call_function(torch.ops.aten.relu.default, (view,))
    relu.meta.update(recompute=CheckpointPolicy.PREFER_RECOMPUTE, ac_graph_id=3)
    graph.output((relu,))
    joint = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert saved_activations.has_checkpointed_regions(joint.graph)
    copy = saved_activations.without_checkpointing(joint)
    assert not saved_activations.has_checkpointed_regions(copy.graph)
    _, copied_view, copied_relu, _ = copy.graph.nodes
    assert copied_view.meta == {"recompute": CheckpointPolicy.MUST_RECOMPUTE, "ac_graph_id": PARAM_VIEWS_REGION}
    assert copied_relu.meta == {"ac_graph_id": saved_activations.DEFAULT_REGION}
    assert relu.meta == {"recompute": CheckpointPolicy.PREFER_RECOMPUTE, "ac_graph_id": 3}  # the original's


@given(saved=st.integers(0, MAX_BYTES), without=st.one_of(st.none(), st.integers(0, MAX_BYTES)))
def test_figures_round_trip_through_the_provenance(saved, without):
    figures = SavedActivations(saved, without)
    assert from_provenance(figures.provenance()) == figures
    reduction = figures.reduction
    assert reduction is None if without is None else reduction <= 1.0


@pytest.mark.parametrize("value", [-1, MAX_BYTES + 1, True, 1.5, "640", [640]])
def test_a_figure_out_of_bounds_stops_the_load_with_one_line(tmp_path, value, capsys):
    bundle = _bundle_with({SAVED_KEY: 10, WITHOUT_KEY: value})
    path = tmp_path / "bad.pt"
    bundle_io.save(bundle, path)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(BundleError, match=f"{WITHOUT_KEY} .* is not a byte count"):
        bundle_io.load(path)
    assert run(["schedule", str(path), "--algo", "fast-free"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a byte count" in err, err
    assert sorted(os.listdir(tmp_path)) == before


def _words(text: str) -> str:
    """``text`` with the terminal's line wrapping undone."""
    return " ".join(text.split())


def _bundle_with(provenance: dict) -> bundle_io.Bundle:
    from dcsched.replay import example_bundle
    bundle = example_bundle()
    bundle.provenance = {**bundle.provenance, **provenance}
    return bundle


def test_the_train_report_says_what_each_module_saves(capsys):
    from dcsched.cli.train import render
    from dcsched.train.script import TrainResult
    saved = SavedActivations(BLOCK_OUT, 2 * RELU_OUT + BLOCK_OUT).to_json()
    result = TrainResult("step.py", "fsdp", 0, 1, 0, ["TwoBlocks"], [], [1.0, 0.5],
                         activation_memory={"TwoBlocks": saved})
    assert result.to_json()["activation_memory"] == {"TwoBlocks": saved}
    render(result)
    assert "TwoBlocks: activation memory saved for backward: 128 B (checkpointed) vs 640 B without (-80.0%)" \
        in _words(capsys.readouterr().out)
    assert "activation_memory" not in TrainResult("step.py", "fsdp", 0, 1, 0, [], [], None).to_json()
