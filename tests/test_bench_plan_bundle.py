"""``benchmarks/bench_plan.py --bundle``: one timed row per algorithm on a bundle's step."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("bench_plan", ROOT / "benchmarks" / "bench_plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_bundle_gets_one_timed_row_per_algorithm(capsys):
    bench = _bench()
    path = str(ROOT / "sample_graphs" / "gpt.pt")
    rows = bench.time_bundle(path, ["fsdp", "overlap-plan"], "unlimited")
    assert [r["algo"] for r in rows] == ["fsdp", "overlap-plan"]
    for row in rows:
        assert row["nodes"] > 0 and row["sched_s"] >= 0 and row["sched_cpu_s"] >= 0 and row["step_ms"] > 0
    # the planner issues fewer collectives than fsdp's per-block buckets and is no slower, simulated
    assert rows[1]["collectives"] <= rows[0]["collectives"] and rows[1]["step_ms"] <= rows[0]["step_ms"] + 1e-9
    bench.main(["--bundle", path, "--algos", "fsdp", "--budget", "unlimited"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["bundle", "nodes", "algorithm"] and out[1].split()[:3][2] == "fsdp"
