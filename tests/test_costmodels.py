"""Cost models as registered objects: analytic, calibrated (analytic x factors from a file), measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dcsched
from dcsched import costmodels
from dcsched import replay as rp
from dcsched.cli import run as cli
from dcsched.costmodels import Calibration, fit_calibration, load_calibration, op_kind
from dcsched.errors import DcschedError
from dcsched.costmodels.options import ProfileOptions
from dcsched.profile.measure import profile_bundle
from dcsched.graph.roles import Role, role_of
from dcsched.costmodels.formulas import GPUS, comm_time_ms
from dcsched.graph.specs import node_bytes
from dcsched.report.compare import compare_bundle
from dcsched.sim.collectives import DEFAULT_LATENCY_MS, latency_from_provenance
from dcsched.sim.simulate import compile_view

ROOT = Path(__file__).resolve().parent.parent
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
    ("not json", "calibration is not valid JSON"),
    ("[" * 100_000, "calibration nests deeper than 64 levels"),
    ('{"format": "other"}', "not a dcsched calibration file"),
    ('{"format": "dcsched-calibration", "version": 9}', "version 9"),
    ('{"format": "dcsched-calibration", "version": "\u0661"}', "calibration version '\u0661' is not a version"),
    ('{"format": "dcsched-calibration", "version": "01"}', "calibration version '01' is not a version number"),
    ('{"format": "dcsched-calibration", "version": true}', "calibration version 'True' is not a version number"),
    ('{"format": "dcsched-calibration", "version": 1, "gpu": "h100", "default": 1, "samples": {"a": "x"}}',
     "sample counts must be whole numbers"),
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
    for _name, node in compute_nodes(measured):
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


# ---------------------------------------------------------------------------
# Collective costs: the interconnect table, overrides, provenance (issue #32)
# ---------------------------------------------------------------------------

def gathers(bundle):
    """(graph name, all-gather node) of every all-gather."""
    return [(name, n) for name, g in bundle.graphs.items() for n in g.nodes if role_of(n) is Role.ALLGATHER]


def test_the_table_has_a_row_for_every_gpu_and_the_cpu_and_names_its_sources():
    assert set(costmodels.INTERCONNECTS) == set(GPUS) | {"cpu"}
    for within, across in costmodels.INTERCONNECTS.values():
        assert within.source and within.latency_us > 0 and within.bandwidth_gbps > 0
        if across is not None:  # the network is narrower than NVLink, and slower to start
            assert across.source and across.bandwidth_gbps < within.bandwidth_gbps
            assert across.latency_us >= within.latency_us and across.per_doubling_us > 0
    link = costmodels.interconnect("h100", 8)
    assert (link.latency_us, link.bandwidth_gbps) == (15.0, 360.0) and "NVLink" in link.name
    # Latency grows with log2 of the nodes: 2 nodes pay one doubling, 16 nodes four.
    assert costmodels.interconnect("h100", 16).latency_us == 25.0
    assert costmodels.interconnect("h100", 128).latency_us == 55.0
    assert costmodels.interconnect("h100", 9).name.startswith("h100, 2 nodes: InfiniBand")
    assert costmodels.interconnect("cpu", 1) == costmodels.interconnect("cpu", 512)
    with pytest.raises(DcschedError, match="gpu names no interconnect 'v100'"):
        costmodels.interconnect("v100", 8)
    with pytest.raises(DcschedError, match="world_size must be at least 1"):
        costmodels.interconnect("h100", 0)


def test_the_table_reaches_device_time_and_more_nodes_make_a_slower_gather(mlp):
    one_node = profile_bundle(mlp, ProfileOptions(cost_model="analytic", gpu="a100", world_size=8, progress=False))
    four_nodes = profile_bundle(mlp, ProfileOptions(cost_model="analytic", gpu="a100", world_size=32,
                                                    progress=False))
    within, across = costmodels.interconnect("a100", 8), costmodels.interconnect("a100", 32)
    pairs = list(zip(gathers(one_node), gathers(four_nodes)))
    assert pairs
    for (_, near), (_, far) in pairs:
        assert node_bytes(near) == node_bytes(far)  # the same full parameter
        assert near.meta["device_time"] == pytest.approx(comm_time_ms(
            node_bytes(near), world_size=8, bandwidth_gbps=within.bandwidth_gbps, latency_us=within.latency_us))
        assert far.meta["device_time"] == pytest.approx(comm_time_ms(
            node_bytes(far), world_size=32, bandwidth_gbps=across.bandwidth_gbps, latency_us=across.latency_us))
        assert far.meta["device_time"] > near.meta["device_time"]
    # The h200 and the h100 share a row's figures; the a100's NVLink is slower.
    h100 = profile_bundle(mlp, ANALYTIC)
    assert all(a.meta["device_time"] > h.meta["device_time"] for (_, a), (_, h) in zip(gathers(one_node),
                                                                                       gathers(h100)))


def test_a_given_latency_or_bandwidth_overrides_the_table(mlp, analytic):
    given = profile_bundle(mlp, ProfileOptions(cost_model="analytic", gpu="h100", latency_us=3.0, progress=False))
    bandwidth = costmodels.interconnect("h100", 8).bandwidth_gbps
    for (_, node), (_, base) in zip(gathers(given), gathers(analytic)):
        assert node.meta["device_time"] == pytest.approx(node_bytes(node) * 7 / 8 / (bandwidth * 1e9) * 1e3 + 0.003)
        assert node.meta["device_time"] == pytest.approx(base.meta["device_time"] - 0.015 + 0.003)
    prov = given.provenance
    assert prov["comm_latency_ms"] == 0.003 and prov["comm_bandwidth_GBps"] == bandwidth
    assert prov["comm_link"] == "given latency; bandwidth from h100, 1 node: NVLink 4 / NVSwitch"
    both = profile_bundle(mlp, ProfileOptions(cost_model="analytic", gpu="h100", latency_us=0, bandwidth_gbps=1,
                                              progress=False))
    assert (both.provenance["comm_latency_ms"], both.provenance["comm_bandwidth_GBps"]) == (0.0, 1.0)
    assert both.provenance["comm_link"] == "given"
    for bad in (ProfileOptions(latency_us=-1.0), ProfileOptions(latency_us=float("nan"))):
        with pytest.raises(DcschedError, match="latency_us must not be negative"):
            bad.check()


def test_provenance_records_the_figures_once_under_the_new_keys(analytic):
    prov = analytic.provenance
    link = costmodels.interconnect("h100", 8)
    assert (prov["comm_latency_ms"], prov["comm_bandwidth_GBps"], prov["comm_link"]) == \
        (link.latency_us / 1e3, link.bandwidth_gbps, link.name)
    assert "latency_us" not in prov and "bandwidth_GBps" not in prov
    assert {k for k in prov if "latency" in k or "bandwidth" in k or k.startswith("comm_")} == \
        {"comm_latency_ms", "comm_bandwidth_GBps", "comm_link", "comm_time"}


def test_a_cpu_profile_without_a_gpu_takes_the_gloo_row(mlp):
    measured = profile_bundle(mlp, ProfileOptions(iters=1, warmup=0, device="cpu", world_size=4, progress=False))
    gloo = costmodels.interconnect("cpu", 4)
    assert measured.provenance["comm_latency_ms"] == gloo.latency_us / 1e3 == 0.1
    assert measured.provenance["comm_link"] == gloo.name == "cpu: gloo over TCP"
    # With a GPU named, its row: the measured model prices the collectives for the target.
    targeted = profile_bundle(mlp, ProfileOptions(iters=1, warmup=0, device="cpu", gpu="h200", progress=False))
    assert targeted.provenance["comm_link"] == costmodels.interconnect("h200", 8).name


def test_old_provenance_keys_still_give_the_latency():
    sample = dcsched.load(ROOT / "sample_graphs" / "gpt.pt")
    assert "comm_latency_ms" not in sample.provenance or sample.provenance["comm_latency_ms"] is None
    assert sample.provenance["latency_us"] == 20.0
    assert latency_from_provenance(sample.provenance) == DEFAULT_LATENCY_MS == 0.02
    assert latency_from_provenance({"latency_us": 7.5, "bandwidth_GBps": 100.0}) == 0.0075
    # Measured collectives record no figure: the old default, as before.
    assert latency_from_provenance({"comm_latency_ms": None, "comm_link": None}) == 0.02


def test_a_bucket_pays_the_latency_the_bundle_was_profiled_with(mlp):
    bundle = profile_bundle(mlp, ProfileOptions(cost_model="analytic", gpu="h100", world_size=64, progress=False))
    latency = costmodels.interconnect("h100", 64).latency_us / 1e3
    assert latency_from_provenance(bundle.provenance) == pytest.approx(latency) and latency != 0.02
    comparison = compare_bundle(bundle, ["none"])
    assert all(cmp.compiled.comm_latency_ms == pytest.approx(latency) for cmp in comparison.graphs.values())
    name, members = next((name, [n.name for _, n in group]) for name in bundle.graph_names
                         if len(group := [g for g in gathers(bundle) if g[0] == name]) >= 2)
    compiled = compile_view(bundle.form(name), comm_latency_ms=latency_from_provenance(bundle.provenance))
    order = list(compiled.names)
    plain = compiled.simulate(order)
    fused = compiled.simulate(order, buckets=[members])
    assert fused.collectives == plain.collectives - (len(members) - 1)
    assert fused.comm_ms == pytest.approx(plain.comm_ms - (len(members) - 1) * latency)



def test_a_measured_profile_on_a_gpu_takes_its_kind_by_name(monkeypatch):
    from dcsched.costmodels import measured
    model = measured.MeasuredCostModel(torch.device("cuda"), iters=1, warmup=0)  # nothing runs: names only
    options = ProfileOptions(world_size=16, progress=False)
    monkeypatch.setattr(measured, "describe_device", lambda device: "cuda:0 (NVIDIA H100 80GB HBM3)")
    assert model.comm_link(options, 16) == costmodels.interconnect("h100", 16)
    monkeypatch.setattr(measured, "describe_device", lambda device: "cuda:0 (NVIDIA L4)")
    link = model.comm_link(options, 16)
    assert link.latency_us == costmodels.interconnect("a100", 16).latency_us
    assert link.name.endswith("(cuda:0 (NVIDIA L4) is not in the table: taken as a100)")
    # A named GPU wins over the device's name.
    assert model.comm_link(ProfileOptions(gpu="h200"), 16) == costmodels.interconnect("h200", 16)
