"""benchmarks/gpu_check.py's dry run on the CPU: it produces its JSON, table and a calibration profile loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dcsched import replay as rp
from dcsched.costmodels.options import ProfileOptions
from dcsched.profile.measure import profile_bundle
from dcsched.schedulers import available

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_tiny_dry_run_writes_results_and_loadable_factors(tmp_path):
    out = tmp_path / "check"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--tiny",
                           "--models", "gpt", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((out / "gpu_check.json").read_text())
    (graph,) = result["graphs"]
    assert [row["algo"] for row in graph["rows"]] == available()
    for row in graph["rows"]:
        assert row["equal"] is True
        assert row["measured"]["step_ms"] > 0 and row["measured"]["peak_bytes"] > 0
        assert row["simulated"]["step_ms"] > 0 and row["simulated"]["peak_bytes"] > 0
    table = (out / "gpu_check.md").read_text()
    assert all(f"| gpt | {algo} |" in table for algo in available()) and "Spearman" in table
    assert result["calibration"]["factors"]["aten.mm"] > 0
    bundle = profile_bundle(rp.example_bundle(), ProfileOptions(cost_model="analytic", calibration=out /
                                                                "calibration.json", progress=False))
    assert bundle.provenance["cost_model"] == "calibrated" and bundle.provenance["gpu"].startswith("NVIDIA H100")
