"""Cost models as registered objects: analytic, calibrated (analytic x factors from a file), measured."""

from __future__ import annotations

import json

import pytest
import torch

from dcsched import costmodels
from dcsched import replay as rp
from dcsched.cli import run as cli
from dcsched.costmodels import Calibration, fit_calibration, load_calibration, op_kind
from dcsched.errors import DcschedError
from dcsched.costmodels.options import ProfileOptions
from dcsched.profile.measure import profile_bundle
from dcsched.graph.roles import Role, role_of

ANALYTIC = ProfileOptions(cost_model="analytic", gpu="h100", progress=False)


@pytest.fixture(scope="module")
def mlp():
    return rp.example_bundle()


@pytest.fixture(scope="module")
def analytic(mlp):
    return profile_bundle(mlp, ANALYTIC)


def compute_nodes(bundle):
    return [(name, n) for name, g in bundle.graphs.items() for n in g.nodes
            if role_of(n) is Role.COMPUTE and n.op == "call_function"]


def test_registry_lists_every_model_and_builds_by_name():
    assert costmodels.available() == ["measured", "analytic", "calibrated"]
    assert isinstance(costmodels.build(ANALYTIC), costmodels.get("analytic"))
    with pytest.raises(DcschedError, match="unknown cost model 'guess'.*measured, analytic, calibrated"):
        costmodels.get("guess")


def test_calibrated_times_are_analytic_times_the_kind_factor(mlp, analytic, tmp_path):
    path = Calibration("h100", "test", {"aten.mm": 2.0}, default=3.0).save(tmp_path / "f.json")
    calibrated = profile_bundle(mlp, ProfileOptions(cost_model="calibrated", calibration=path, progress=False))
    assert calibrated.provenance["cost_model"] == "calibrated"
    assert calibrated.provenance["gpu"] == analytic.provenance["gpu"]  # the file names the GPU
    checked = 0
    for name, node in compute_nodes(calibrated):
        base = next(n for n in analytic.graphs[name].nodes if n.name == node.name)
        factor = 2.0 if op_kind(node) == "aten.mm" else 3.0
        assert node.meta["device_time"] == pytest.approx(base.meta["device_time"] * factor)
        assert node.meta["time_source"] == "calibrated"
        checked += base.meta["device_time"] > 0
    assert checked >= 5
    # Communication and sizes are the analytic profile's.
    for name, graph in calibrated.graphs.items():
        for node, base in zip(graph.nodes, analytic.graphs[name].nodes):
            assert node.meta["tensor_size"] == base.meta["tensor_size"]
            if role_of(node) is not Role.COMPUTE:
                assert node.meta["device_time"] == base.meta["device_time"]


def test_a_calibration_file_with_the_analytic_model_selects_the_calibrated_one(mlp, tmp_path):
    path = Calibration("h100", "test", {}, default=1.0).save(tmp_path / "f.json")
    options = ProfileOptions(cost_model="analytic", gpu="h100", calibration=path, progress=False)
    assert costmodels.build(options).name == "calibrated"
    with pytest.raises(DcschedError, match="takes none"):
        ProfileOptions(cost_model="measured", calibration=path).check()
    with pytest.raises(DcschedError, match="calibrated for h100, not for a100"):
        ProfileOptions(cost_model="calibrated", gpu="a100", calibration=path).check()
    with pytest.raises(DcschedError, match="needs a calibration file"):
        ProfileOptions(cost_model="calibrated").check()


@pytest.mark.parametrize("text, message", [
    ("not json", "not JSON"),
    ('{"format": "other"}', "not a dcsched calibration file"),
    ('{"format": "dcsched-calibration", "version": 9}', "version 9"),
    ('{"format": "dcsched-calibration", "version": 1, "gpu": "v100", "default": 1}', "unknown GPU"),
    ('{"format": "dcsched-calibration", "version": 1, "gpu": "h100", "default": -1, "factors": {}}', "positive"),
])
def test_malformed_calibration_files_are_one_line_errors(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(DcschedError, match=message):
        load_calibration(path)


def test_fit_takes_the_median_ratio_by_op_kind(mlp, analytic):
    measured = profile_bundle(mlp, ANALYTIC)  # a copy whose times are scaled below
    for name, node in compute_nodes(measured):
        node.meta["device_time"] *= 4.0 if op_kind(node) == "aten.mm" else 0.5
    fitted = fit_calibration([(analytic, measured)], "h100", "fake device")
    assert fitted.factor("aten.mm") == pytest.approx(4.0)
    assert fitted.factor("aten.relu") == pytest.approx(0.5)
    assert fitted.samples["aten.mm"] == sum(op_kind(n) == "aten.mm" and n.meta["device_time"] > 0
                                            for _, n in compute_nodes(measured))


def test_fit_round_trips_through_its_file(analytic, tmp_path):
    fitted = fit_calibration([(analytic, analytic)], "h100", "same")
    assert fitted.default == pytest.approx(1.0)
    assert load_calibration(fitted.save(tmp_path / "cal.json")) == fitted
    assert json.loads((tmp_path / "cal.json").read_text())["format"] == "dcsched-calibration"


def test_profile_cli_takes_a_calibration_file(tmp_path, capsys):
    bad = tmp_path / "missing.json"
    assert cli(["profile", "train.py", "-o", str(tmp_path / "g.pt"), "--cost-model", "analytic", "--gpu", "h100",
                "--calibration", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "cannot read calibration" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_measured_model_runs_the_step_on_the_cpu(mlp):
    measured = profile_bundle(mlp, ProfileOptions(iters=1, warmup=0, device="cpu", progress=False))
    assert measured.provenance["device"].startswith("cpu") and measured.provenance["iters"] == 1
    assert all(n.meta["time_source"] == "measured" for _, n in compute_nodes(measured))
    assert torch.is_tensor(rp.replay(measured, iters=0).results["loss"])
