"""Training with dcsched on one GPU: losses, memory, NCCL's asynchronous collectives (skipped without CUDA)."""

from __future__ import annotations

import datetime

import pytest
import torch

import train_runs as runs

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ALGOS = ("none", "fast-free", "overlap")
STEPS, BATCH = 10, 4


def _within(memory: dict, share: float = 0.05) -> None:
    for graph, (measured, simulated) in memory.items():
        assert abs(measured - simulated) <= share * simulated, (graph, measured, simulated)


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_one_gpu_every_schedule_trains_identically_and_as_eager_does(name):
    results = {algo: runs.train_dcsched(name, algo, STEPS, BATCH, device="cuda") for algo in ALGOS}
    losses = {algo: result["losses"] for algo, result in results.items()}
    assert losses["none"] == losses["fast-free"] == losses["overlap"]  # bit for bit
    eager = runs.train_eager(name, STEPS, BATCH, device="cuda")
    assert torch.allclose(torch.tensor(losses["none"]), torch.tensor(eager), rtol=1e-5, atol=0)
    for result in results.values():
        _within(result["memory"])  # live tensor bytes on the GPU against the simulator


def test_nccl_collectives_on_their_streams_train_as_the_local_runtime_does():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_nccl_available():
        pytest.skip("needs NCCL")
    local = runs.train_dcsched("gpt", "overlap", STEPS, BATCH, device="cuda")
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{runs.free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60), device_id=device)
    try:
        # All-gathers waited at their wait nodes, reduce-scatters asynchronous until the backward's end.
        nccl = runs.train_dcsched("gpt", "overlap", STEPS, BATCH, device="cuda")
    finally:
        dist.destroy_process_group()
    assert torch.allclose(torch.tensor(nccl["losses"]), torch.tensor(local["losses"]), rtol=1e-6, atol=0)
    _within(nccl["memory"])


def test_one_gpu_inductor_compute_trains_as_eager_does():
    inductor = runs.train_dcsched("gpt", "overlap", STEPS, BATCH, device="cuda", compute="inductor")
    eager = runs.train_eager("gpt", STEPS, BATCH, device="cuda")
    assert torch.allclose(torch.tensor(inductor["losses"]), torch.tensor(eager), rtol=1e-5, atol=0)
