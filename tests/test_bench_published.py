"""``benchmarks/bench_published.py``'s memory figure: the bf16 capture under the published run's mixed-precision
policy, fp32 master shards (the benchmark itself plans an 8B model and is not run here)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import dcsched
from dcsched import replay
from dcsched.costmodels.options import ProfileOptions
from dcsched.profile.measure import profile_bundle
from dcsched.sim.step_memory import step_memory

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_published  # noqa: E402

PROFILE = ProfileOptions(cost_model="analytic", gpu="h100", world_size=2, progress=False)


def _profiled():
    return profile_bundle(replay.example_bundle(), PROFILE)


def _bf16_capture():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)).to(torch.bfloat16)
    return dcsched.capture(model, (torch.randn(4, 32, dtype=torch.bfloat16),), loss_fn=lambda out: out.float().sum())


def test_the_runs_policy_makes_fp32_master_shards_once():
    plain = profile_bundle(_bf16_capture(), PROFILE)
    mixed = profile_bundle(bench_published.under_the_runs_policy(_bf16_capture()), PROFILE)
    assert {p.dtype for p in mixed.params} == {torch.float32}
    assert bench_published.under_the_runs_policy(mixed) is mixed  # a bundle that records the policy is kept
    assert {p.dtype for p in mixed.params} == {torch.float32}
    before, after = (step_memory(b, "adamw", gpu=True, plans={}) for b in (plain, mixed))
    # the update holds shards, gradients, two moments and one foreach temporary per parameter, all in the
    # shard's dtype: all of it doubles
    assert after.phases["optimizer"] == 2 * before.phases["optimizer"]
    assert after.cuda is not None and after.cuda.reserved_bytes >= after.cuda.allocated_bytes >= after.peak_bytes


def test_each_algorithm_is_costed_under_its_own_plans():
    from dcsched.report.compare import compare_bundle

    bundle = _profiled()
    figures = bench_published.plan(bundle, ("fsdp", "overlap-plan"), 0.0)
    comparison = compare_bundle(bundle, ("fsdp", "overlap-plan"))
    for algo, row in figures.items():
        plans = {name: graph.plans[algo] for name, graph in comparison.graphs.items()}
        expected = step_memory(bundle, "adamw", gpu=True, plans=plans)
        assert sum(row["peak_parts"].values()) == row["live_bytes"] == expected.peak_bytes
        assert row["peak_bytes"] == expected.cuda.reserved_bytes >= row["allocated_bytes"] >= row["live_bytes"]
