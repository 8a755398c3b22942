"""Training with dcsched over 2 and 3 gloo ranks on the CPU: losses, memory, sharding.

One spawn per world size runs every configuration (compiling dominates the
time; the steps take milliseconds). Skipped where gloo is missing.
"""

from __future__ import annotations

import pytest
import torch

import train_runs as runs

from gloo import GLOO_MARKS, dist, mp  # noqa: F401

pytestmark = GLOO_MARKS

ALGOS = ("none", "fast-free", "overlap")
STEPS = 20
BATCH = 4


def _spawn(tmp_path, world_size: int, plan: list[tuple]) -> list[dict]:
    mp.spawn(runs.spawned_losses, args=(world_size, runs.free_port(), str(tmp_path), plan), nprocs=world_size,
             join=True)
    return [torch.load(tmp_path / f"losses{rank}.pt", weights_only=True) for rank in range(world_size)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    plan = [(f"{name}-{algo}", name, algo, STEPS, BATCH, {}) for name in ("gpt", "llama") for algo in ALGOS]
    plan.append(("convnet-bn-overlap", "convnet-bn", "overlap", STEPS, BATCH, {}))
    return _spawn(tmp_path_factory.mktemp("train2"), 2, plan)


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_every_schedule_trains_bit_identically_and_as_eager_does(two_ranks, name):
    losses = {algo: two_ranks[0][f"{name}-{algo}"]["losses"] for algo in ALGOS}
    assert losses["none"] == losses["fast-free"] == losses["overlap"]  # bit for bit
    assert two_ranks[1][f"{name}-none"]["losses"] == losses["none"]  # every rank reports the same mean
    eager = runs.train_eager(name, STEPS, BATCH)
    assert len(eager) == STEPS
    assert torch.allclose(torch.tensor(losses["none"]), torch.tensor(eager), rtol=1e-5, atol=0)
    assert losses["none"][-1] != losses["none"][0]  # it trained


def test_batchnorm_convnet_trains_as_eager_over_the_same_split(two_ranks):
    # BatchNorm normalises over each rank's own slice, so eager averages the two slices' losses.
    losses = two_ranks[0]["convnet-bn-overlap"]["losses"]
    eager = runs.train_eager("convnet-bn", STEPS, BATCH, split=2)
    assert torch.allclose(torch.tensor(losses), torch.tensor(eager), rtol=1e-5, atol=0)


def test_per_rank_peak_memory_matches_the_simulator(two_ranks):
    for rank in range(2):
        for label, result in two_ranks[rank].items():
            for graph, (measured, simulated) in result["memory"].items():
                assert abs(measured - simulated) <= 0.05 * simulated, (rank, label, graph, measured, simulated)


def test_three_ranks_with_parameters_that_do_not_divide(tmp_path):
    # d_model 32 and vocab 64 divide by neither 3 nor each other: LayerNorm weights (32) pad to 33.
    results = _spawn(tmp_path, 3, [("gpt", "gpt", "fast-free", 6, 6, {})])
    eager = runs.train_eager("gpt", 6, 6)
    for rank in range(3):
        assert torch.allclose(torch.tensor(results[rank]["gpt"]["losses"]), torch.tensor(eager), rtol=1e-5, atol=0)
