"""Training with dcsched over 2 and 3 gloo ranks on the CPU: losses, memory, sharding.

The 2-rank tests read one spawn that runs every configuration (``two_rank_training`` in conftest.py, shared
with the checkpoint test; compiling dominates the time, the steps take milliseconds). Skipped where gloo is
missing.
"""

from __future__ import annotations

import pytest
import torch

import train_runs as runs

from gloo import GLOO_MARKS

pytestmark = GLOO_MARKS

ALGOS = ("none", "fast-free", "overlap", "overlap-plan")
STEPS = 20
BATCH = 4


@pytest.fixture(scope="module")
def two_ranks(two_rank_training):
    return two_rank_training["ranks"]


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_every_schedule_trains_bit_identically_and_as_eager_does(two_ranks, name):
    losses = {algo: two_ranks[0][f"{name}-{algo}"]["losses"] for algo in ALGOS}
    # bit for bit: orders, buckets and kept parameters change when bytes move, not what is computed
    assert losses["none"] == losses["fast-free"] == losses["overlap"] == losses["overlap-plan"]
    assert two_ranks[1][f"{name}-none"]["losses"] == losses["none"]  # every rank reports the same mean
    eager = runs.train_eager(name, STEPS, BATCH)
    assert len(eager) == STEPS
    assert torch.allclose(torch.tensor(losses["none"]), torch.tensor(eager), rtol=1e-5, atol=0)
    assert losses["none"][-1] != losses["none"][0]  # it trained


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_the_planner_issues_the_collectives_it_plans(two_ranks, name):
    for rank in range(2):
        planned, plain = two_ranks[rank][f"{name}-overlap-plan"], two_ranks[rank][f"{name}-overlap"]
        counts = planned["collectives"]
        assert counts["buckets"] > 0  # a plan, not only an order
        assert counts["issued"] == counts["planned"] < plain["collectives"]["issued"]
        assert plain["collectives"]["issued"] == plain["collectives"]["planned"]


def test_batchnorm_convnet_trains_as_eager_over_the_same_split(two_ranks):
    # BatchNorm normalises over each rank's own slice, so eager averages the two slices' losses.
    losses = two_ranks[0]["convnet-bn-overlap"]["losses"]
    eager = runs.train_eager("convnet-bn", STEPS, BATCH, split=2)
    assert torch.allclose(torch.tensor(losses), torch.tensor(eager), rtol=1e-5, atol=0)


def test_inductor_compute_with_real_collectives_trains_as_eager_does(two_ranks):
    # Two ranks: the ZeRO-3 ops stay in inductor's code as calls on the gloo runtime, in the schedule's order.
    losses = two_ranks[0]["gpt-overlap-inductor"]["losses"]
    assert two_ranks[1]["gpt-overlap-inductor"]["losses"] == losses
    eager = runs.train_eager("gpt", STEPS, BATCH)
    assert torch.allclose(torch.tensor(losses), torch.tensor(eager), rtol=1e-5, atol=0)
    assert torch.allclose(torch.tensor(losses), torch.tensor(two_ranks[0]["gpt-overlap"]["losses"]), rtol=1e-5, atol=0)


def test_per_rank_peak_memory_matches_the_simulator(two_ranks):
    for rank in range(2):
        for label, result in two_ranks[rank].items():
            if result["memory"] is None:  # inductor's buffers are not tracked
                continue
            for graph, (measured, simulated) in result["memory"].items():
                assert abs(measured - simulated) <= 0.05 * simulated, (rank, label, graph, measured, simulated)


def test_overlap_under_a_memory_budget_stays_within_it_in_real_training(two_ranks):
    for rank in range(2):
        budgeted, unlimited = two_ranks[rank]["gpt-overlap-budget"], two_ranks[rank]["gpt-overlap"]
        assert budgeted["losses"] == two_ranks[0]["gpt-none"]["losses"]  # the budget changes the order only
        for graph, (measured, simulated) in budgeted["memory"].items():
            assert abs(measured - simulated) <= 0.05 * simulated, (rank, graph, measured, simulated)
            assert max(measured, simulated) <= runs.OVERLAP_BUDGET, (rank, graph, measured, simulated)
        # The budget binds: unlimited overlap gathers ahead past it in the backward.
        assert unlimited["memory"]["backward"][1] > runs.OVERLAP_BUDGET >= budgeted["memory"]["backward"][1]
        # Reduce-scatters asynchronous without a budget (under it: where the simulator, run so, fits them in).
        assert unlimited["collectives"]["async_reduce"]


def test_three_ranks_with_parameters_that_do_not_divide(tmp_path):
    # d_model 32 and vocab 64 divide by neither 3 nor each other: LayerNorm weights (32) pad to 33.
    results = runs.spawn(tmp_path, 3, [("gpt", "gpt", "fast-free", 6, 6, {})])
    eager = runs.train_eager("gpt", 6, 6)
    for rank in range(3):
        assert torch.allclose(torch.tensor(results[rank]["gpt"]["losses"]), torch.tensor(eager), rtol=1e-5, atol=0)
