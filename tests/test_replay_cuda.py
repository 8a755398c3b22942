"""The CUDA path of replay: CUDA events, torch.cuda.max_memory_allocated, NCCL.

Skipped without a GPU (and the NCCL tests without NCCL or, for two ranks, without two GPUs).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import torch

import dcsched
from dcsched import replay as rp
from dcsched.cli import run as cli

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def mlp():
    return rp.example_bundle()


def _late(bundle):
    return bundle.with_graphs(forward=rp.latest_first(bundle.forward), backward=rp.latest_first(bundle.backward))


def test_cuda_replay_uses_events_and_the_allocator(mlp):
    run = rp.replay(mlp, device="cuda", iters=3, warmup=1)
    m = run.measurement
    assert m.device.startswith("cuda") and m.timer == "cuda events"
    assert m.memory_source == "torch.cuda.max_memory_allocated"
    assert m.peak_bytes >= m.resident_bytes > 0
    assert 0 < m.step_ms_min <= m.step_ms <= m.step_ms_max
    cpu = rp.replay(mlp, device="cpu", iters=0).results
    comparison = rp.compare(cpu, run.results, exact=False)  # other kernels: within tolerance
    assert comparison.outputs == 4


def test_cuda_reordered_bundle_matches_and_reports_largest_error(mlp):
    report = rp.replay_orders(_late(mlp), mlp, device="cuda", iters=2, warmup=1)
    assert report.comparison is not None and not report.comparison.exact  # tolerance on a GPU by default
    assert report.comparison.max_abs_error >= 0.0
    assert all(o.measured.timer == "cuda events" for o in report.orders)


def test_cuda_cli_json(mlp, tmp_path, capsys):
    dcsched.save(mlp, tmp_path / "graph.pt")
    dcsched.save(_late(mlp), tmp_path / "graph.sched.pt")
    code = cli(["replay", str(tmp_path / "graph.sched.pt"), "--baseline", str(tmp_path / "graph.pt"),
                "--device", "cuda", "--iters", "2", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["device"].startswith("cuda")
    assert data["orders"][0]["measured"]["memory_source"] == "torch.cuda.max_memory_allocated"


def test_cuda_step_too_big_for_the_gpu_exits_2(mlp, tmp_path, capsys):
    data = dcsched.bundle.core.to_data(mlp)
    data["inputs"][0]["shape"] = [10**6, 10**6]  # 4 TB
    torch.save(data, tmp_path / "huge.pt")
    assert cli(["replay", str(tmp_path / "huge.pt"), "--device", "cuda"]) == 2
    assert "needs at least" in capsys.readouterr().err


def test_nccl_runtime_gathers_and_reduces_on_one_rank(mlp, tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("NCCL is not available")
    from dcsched.runtime.distributed import DistributedZero3Runtime

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        run = rp.replay(mlp, device="cuda", runtime=DistributedZero3Runtime(mlp.params), iters=2)
        plain = rp.replay(mlp, device="cuda", iters=0)
    finally:
        dist.destroy_process_group()
    # one rank: the shards are the whole (flattened) gradients
    for name, full in plain.results.items():
        torch.testing.assert_close(run.results[name], full.reshape(-1) if name != "loss" else full)
    assert run.measurement.timer == "cuda events"


def _nccl_rank(rank: int, world_size: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from dcsched.runtime.distributed import DistributedZero3Runtime

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        bundle = rp.example_bundle()
        run = rp.replay(bundle, device=torch.device("cuda", rank), runtime=DistributedZero3Runtime(bundle.params),
                        iters=1)
        torch.save(run.results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_nccl_ranks_equal_one_process(tmp_path):
    import socket

    import torch.multiprocessing as mp
    from dcsched.runtime.distributed import shard_of

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_nccl_rank, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    single = rp.replay(rp.example_bundle(), device="cuda", iters=0).results
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for name, full in single.items():
            expected = full if name == "loss" else shard_of(full, rank, 2)
            torch.testing.assert_close(results[name], expected)
