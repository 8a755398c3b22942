"""One plan on every rank: multi-rank training with dcsched's default cost model, each rank timing its own nodes.

The ranks' measured times are skewed on purpose (every node's time scaled by a factor in [0.1, 10] drawn with
the rank as the seed), so an order that depended on one rank's times would differ between ranks and pair one
rank's gathers with another's parameters. The figures are agreed before scheduling (dcsched.runtime.consensus), so
every algorithm runs one order on every rank and trains as single-process eager does.
"""

from __future__ import annotations

import pytest
import torch

import train_runs as runs

from gloo import GLOO_MARKS

pytestmark = GLOO_MARKS

ALGOS = ("none", "fast-free", "overlap", "simple-prefetch")
MODELS = ("gpt", "llama")
STEPS = 6


@pytest.fixture(scope="module")
def two_skewed_ranks(tmp_path_factory):
    plan = [(f"{name}-{algo}", name, algo, STEPS, 4, {"cost_model": "measured"})
            for name in MODELS for algo in ALGOS]
    plan += [(f"convnet-bn-{algo}", "convnet-bn", algo, STEPS, 4, {"cost_model": "measured"})
             for algo in ("fast-free", "overlap")]
    # Rank 1 builds another model: every rank must stop with one line naming it, before any step's collective.
    plan.append(("mismatch", "gpt", "fast-free", 2, 4, {"cost_model": "measured", "per_rank": {1: {"d_model": 16}}}))
    plan.append(("after-mismatch", "gpt", "overlap", STEPS, 4, {"cost_model": "measured"}))
    return runs.spawn(tmp_path_factory.mktemp("one-plan") / "out", 2, plan, skew=True)


@pytest.mark.parametrize("name", MODELS)
def test_every_algorithm_trains_as_eager_with_each_rank_timing_its_own_nodes(two_skewed_ranks, name):
    eager = torch.tensor(runs.train_eager(name, STEPS, 4))
    reference = two_skewed_ranks[0][f"{name}-none"]["losses"]
    for algo in ALGOS:
        label = f"{name}-{algo}"
        losses = [two_skewed_ranks[rank][label]["losses"] for rank in range(2)]
        assert losses[0] == losses[1] == reference, label  # bit for bit, every rank, every order
        assert torch.allclose(torch.tensor(losses[0]), eager, rtol=1e-5, atol=0), (label, losses[0], eager)


def test_a_batchnorm_convnet_trains_as_eager_over_the_same_split(two_skewed_ranks):
    # BatchNorm normalises over each rank's own slice, so eager averages the two slices' losses.
    eager = torch.tensor(runs.train_eager("convnet-bn", STEPS, 4, split=2))
    for algo in ("fast-free", "overlap"):
        losses = [two_skewed_ranks[rank][f"convnet-bn-{algo}"]["losses"] for rank in range(2)]
        assert losses[0] == losses[1]
        assert torch.allclose(torch.tensor(losses[0]), eager, rtol=1e-5, atol=0), algo


@pytest.mark.parametrize("name", MODELS)
def test_every_rank_runs_the_same_order(two_skewed_ranks, name):
    for algo in ALGOS:
        plans = [two_skewed_ranks[rank][f"{name}-{algo}"]["plan"] for rank in range(2)]
        assert plans[0] == plans[1], (name, algo)


def test_without_agreement_the_skewed_ranks_would_order_differently(monkeypatch):
    # What the agreement prevents: each rank's own skewed times give another order (so the tests above
    # would see a disagreement as wrong losses or a gloo abort, as they did before dcsched.runtime.consensus).
    import dcsched
    from dcsched.costmodels.measured import Timer
    from dcsched.costmodels.options import ProfileOptions
    from dcsched.profile.measure import profile_bundle
    bundle = dcsched.load("sample_graphs/gpt.pt")
    orders = []
    for rank in range(2):
        monkeypatch.setattr(Timer, "time", Timer.time)  # undone after the test; skewed anew per rank
        runs.skew_measured_times(rank)
        own = profile_bundle(bundle, ProfileOptions(cost_model="measured", iters=1, warmup=0, progress=False))
        budget = {"overlap": {"memory_budget": float("inf")}}
        orders.append({(algo, graph): runs.order_digest(dcsched.schedule(own.graphs[graph], algo,
                                                                          **budget.get(algo, {})))
                       for algo in ALGOS[1:] for graph in ("forward", "backward")})
    assert any(orders[0][key] != orders[1][key] for key in orders[0]), orders


def test_ranks_that_compiled_different_models_stop_with_one_line_naming_the_rank(two_skewed_ranks):
    for rank in range(2):
        message = two_skewed_ranks[rank]["mismatch"]["error"]
        assert "\n" not in message
        assert message.startswith("rank 1 compiled a different "), message
        assert "from rank 0" in message
    # Nothing was left half-done: the next compile on the same process group trains as before.
    assert two_skewed_ranks[0]["after-mismatch"]["losses"] == two_skewed_ranks[0]["gpt-none"]["losses"]


def test_three_ranks_with_an_uneven_parameter_and_the_default_cost_model(tmp_path):
    # d_model 32 and vocab 64 do not divide by 3 (LayerNorm weights pad to 33); batch 6 splits in three.
    plan = [(algo, "gpt", algo, 4, 6, {"cost_model": "measured"}) for algo in ("fast-free", "overlap")]
    results = runs.spawn(tmp_path, 3, plan, skew=True)
    eager = torch.tensor(runs.train_eager("gpt", 4, 6))
    for algo in ("fast-free", "overlap"):
        assert results[0][algo]["plan"] == results[1][algo]["plan"] == results[2][algo]["plan"]
        for rank in range(3):
            assert torch.allclose(torch.tensor(results[rank][algo]["losses"]), eager, rtol=1e-5, atol=0), algo


def _profile_main(rank: int, world_size: int, port: int, out_dir: str) -> None:
    from dcsched import replay
    from dcsched.runtime.distributed import shutdown
    from dcsched.costmodels.options import ProfileOptions
    from dcsched.profile.measure import profile_bundle
    runs.init_gloo(rank, world_size, port)
    runs.skew_measured_times(rank)
    try:
        profiled = profile_bundle(replay.example_bundle(), ProfileOptions(iters=1, warmup=0, progress=False))
        torch.save({name: [node.meta["device_time"] for node in graph.nodes]
                    for name, graph in profiled.graphs.items()}, f"{out_dir}/rank{rank}.pt")
    finally:
        shutdown()


def test_a_profile_under_a_process_group_gives_every_rank_the_same_figures(tmp_path):
    import torch.multiprocessing as mp
    mp.spawn(_profile_main, args=(2, runs.free_port(), str(tmp_path)), nprocs=2, join=True)
    figures = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert figures[0] == figures[1]
    assert any(ms > 0 for ms in figures[0]["forward"])


def _lone_state_dict_main(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Rank 0 alone asks for the full state dict mid-training (as a rank-0-only save does)."""
    import dcsched
    import dcsched.train.full_state as full_state
    from dcsched.runtime.distributed import shutdown
    runs.init_gloo(rank, world_size, port)
    full_state.STATE_DICT_WAIT_S = 3.0
    try:
        model, _ = runs.model_of("gpt")
        dcsched.shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=runs.LR)
        compiled = torch.compile(model, backend=dcsched.backend(algo="fast-free"), dynamic=False)
        losses, error = [], None
        for step, inputs in enumerate(runs.global_batches("gpt", 4, 4)):
            loss = compiled(*runs.local_slice(inputs, rank, world_size))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(runs.mean_over_ranks(loss))
            if step == 1 and rank == 0:
                try:
                    model.state_dict()
                except dcsched.DcschedError as exc:
                    error = str(exc)
        torch.save({"losses": losses, "error": error}, f"{out_dir}/rank{rank}.pt")
    finally:
        shutdown()


def test_a_state_dict_asked_on_one_rank_alone_is_one_error_and_training_goes_on(tmp_path):
    # Its gathers run on a group of their own: they cannot pair with the next step's collectives.
    import torch.multiprocessing as mp
    mp.spawn(_lone_state_dict_main, args=(2, runs.free_port(), str(tmp_path)), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert results[0]["error"].startswith("GPT.state_dict() gathers the full weights from every rank, and not "
                                          "every rank called it within 3 s")
    assert results[0]["losses"] == results[1]["losses"]
    eager = torch.tensor(runs.train_eager("gpt", 4, 4))
    assert torch.allclose(torch.tensor(results[0]["losses"]), eager, rtol=1e-5, atol=0)
