"""`dcsched schedule --algo overlap`: the default budget from the bundle, and `--sweep`."""

from __future__ import annotations

import json
import os

import pytest

import dcsched
from dcsched.cli import run

from bundles import linear_bundle


def _bundle(tmp_path, target_memory=None):
    bundle = linear_bundle(3)
    if target_memory is not None:
        bundle.provenance["target_memory_bytes"] = target_memory
    return dcsched.save(bundle, tmp_path / "g.pt")


def test_default_budget_is_device_memory_less_margin(tmp_path, capsys):
    path = _bundle(tmp_path, target_memory=1000)
    assert run(["schedule", str(path), "--algo", "overlap", "--json"]) == 0
    captured = capsys.readouterr()
    assert "memory budget 900 B" in " ".join(captured.err.split())
    figures = json.loads(captured.out)["graphs"]["forward"]["after"]["overlap"]
    assert figures["gathered_peak_bytes"] <= 900
    assert os.path.exists(tmp_path / "g.overlap.pt")


def test_no_recorded_device_means_no_limit_as_in_train(tmp_path, capsys):
    # One default rule for schedule, train and Python: the device's memory less 10%, else no limit.
    path = _bundle(tmp_path)
    assert run(["schedule", str(path), "--algo", "overlap"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "no target device recorded in the bundle: memory budget unlimited" in err and "Traceback" not in err
    scheduled = dcsched.load(tmp_path / "g.overlap.pt")
    unlimited = dcsched.schedule(dcsched.load(path).forward, "overlap", memory_budget="unlimited")
    assert [n.name for n in scheduled.forward.nodes] == [n.name for n in unlimited.nodes]


def test_budget_below_the_smallest_names_the_smallest(tmp_path, capsys):
    path = _bundle(tmp_path)
    # Each weight is 64 bytes: no order runs a matmul without its weight gathered.
    assert run(["schedule", str(path), "--algo", "overlap", "--memory-budget", "10", "--budget-scope",
                "gathered"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "64" in err and "budget" in err
    # The default scope counts all tensors: inputs, activations and the gathered weights.
    assert run(["schedule", str(path), "--algo", "overlap", "--memory-budget", "10"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "of all tensors (--budget-scope all)" in err
    assert not os.path.exists(tmp_path / "g.overlap.pt")


def test_sweep_prints_the_trade_off_and_writes_no_bundle(tmp_path, capsys):
    path = _bundle(tmp_path)
    assert run(["schedule", str(path), "--algo", "overlap", "--sweep", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    rows = document["graphs"]["forward"]
    budgets = [row["budget_bytes"] for row in rows]
    assert budgets[-1] is None  # unlimited last
    assert budgets[:-1] == sorted(budgets[:-1]) and budgets[0] == rows[0]["min_budget_bytes"]
    assert all(row["gathered_peak_bytes"] <= row["budget_bytes"] for row in rows[:-1])
    steps = [row["step_ms"] for row in rows]
    assert steps == sorted(steps, reverse=True)  # more memory never makes it slower
    assert sorted(os.listdir(tmp_path)) == ["g.pt"]


def test_sweep_table_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = _bundle(tmp_path)
    assert run(["schedule", str(path), "--algo", "overlap", "--sweep", "--plot", str(tmp_path / "curve.png")]) == 0
    out = capsys.readouterr().out
    assert "unlimited" in out and "(smallest)" in out
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_needs_overlap(tmp_path, capsys):
    path = _bundle(tmp_path)
    assert run(["schedule", str(path), "--algo", "fast-free", "--sweep"]) == 2
    assert "--algo overlap" in capsys.readouterr().err
