"""``benchmarks/bench_published.py``'s memory figure: the bf16 capture's shards counted as the fp32 master
shards the published run holds (the benchmark itself plans an 8B model and is not run here)."""

from __future__ import annotations

import sys
from pathlib import Path

from dcsched import replay
from dcsched.costmodels.options import ProfileOptions
from dcsched.graph.specs import recorded_bytes
from dcsched.profile.measure import profile_bundle
from dcsched.sim.step_memory import step_memory

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_published  # noqa: E402


def _profiled():
    return profile_bundle(replay.example_bundle(),
                          ProfileOptions(cost_model="analytic", gpu="h100", world_size=2, progress=False))


def test_fp32_master_shards_double_the_shards_states_and_gradients_and_nothing_else():
    bundle = _profiled()
    before = {name: {n.name: recorded_bytes(n) for n in g.nodes} for name, g in bundle.graphs.items()}
    plain = step_memory(bundle, "adamw", gpu=True, plans={})
    widened = bench_published.predicted_peak(bundle, {})
    # the copy alone changed: the bundle's own figures are as they were
    assert {name: {n.name: recorded_bytes(n) for n in g.nodes} for name, g in bundle.graphs.items()} == before
    assert plain.parts["parameter_shards"] > 0 and plain.parts["optimizer_states"] > 0
    wide = step_memory(bench_published.with_fp32_master_shards(bundle), "adamw", gpu=True, plans={})
    assert wide == widened
    # the optimizer phase holds shards, gradients, two moments and one foreach temporary per parameter, all
    # in the shard's dtype: all of it doubles
    assert wide.phases["optimizer"] == 2 * plain.phases["optimizer"]
    if wide.phase == plain.phase and wide.phase != "optimizer":
        for kind in ("parameter_shards", "optimizer_states", "gradient_shards"):
            assert wide.parts[kind] == 2 * plain.parts[kind], kind
        for kind in ("gathered_parameters", "activations", "collective_buffers"):
            assert wide.parts[kind] == plain.parts[kind], kind
    assert widened.cuda is not None and widened.cuda.reserved_bytes >= widened.cuda.allocated_bytes \
        >= widened.peak_bytes


def test_each_algorithm_is_costed_under_its_own_plans():
    from dcsched.report.compare import compare_bundle

    bundle = _profiled()
    figures = bench_published.plan(bundle, ("fsdp", "overlap-plan"), 0.0)
    comparison = compare_bundle(bundle, ("fsdp", "overlap-plan"))
    for algo, row in figures.items():
        plans = {name: graph.plans[algo] for name, graph in comparison.graphs.items()}
        expected = step_memory(bench_published.with_fp32_master_shards(bundle), "adamw", gpu=True, plans=plans)
        assert sum(row["peak_parts"].values()) == row["live_bytes"] == expected.peak_bytes
        assert row["peak_bytes"] == expected.cuda.reserved_bytes >= row["allocated_bytes"] >= row["live_bytes"]
