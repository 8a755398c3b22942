"""Sharded replay over 2 gloo ranks on the CPU equals the single-process replay.

Ranks talk over 127.0.0.1 only, on a free port. Skipped where torch.distributed or
gloo is missing.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

import dcsched
from dcsched import replay as rp

from gloo import GLOO_MARKS, dist, mp  # noqa: F401

pytestmark = GLOO_MARKS

WORLD_SIZE = 2


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, out_dir: str) -> None:
    from dcsched.runtime.distributed import DistributedZero3Runtime, shutdown

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        bundle = rp.example_bundle()
        late = bundle.with_graphs(forward=rp.latest_first(bundle.forward), backward=rp.latest_first(bundle.backward))
        sharded = rp.replay(bundle, runtime=DistributedZero3Runtime(bundle.params), iters=1, warmup=0)
        sharded_late = rp.replay(late, runtime=DistributedZero3Runtime(bundle.params), iters=0)
        torch.save({"results": sharded.results, "late": sharded_late.results,
                    "resident": sharded.measurement.resident_bytes, "peak": sharded.measurement.peak_bytes},
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        shutdown()


def test_two_gloo_ranks_shard_and_reduce_exactly_like_one_process(tmp_path):
    from dcsched.runtime.distributed import padded_numel, shard_of

    mp.spawn(_rank_main, args=(WORLD_SIZE, free_port(), str(tmp_path)), nprocs=WORLD_SIZE, join=True)

    bundle = rp.example_bundle()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = rp.replay(bundle, iters=0).results
    finally:
        torch.set_num_threads(threads)
    sizes = {f"grad {p.name}": p.numel for p in bundle.params}
    for rank in range(WORLD_SIZE):
        data = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert list(data["results"]) == list(single)
        assert torch.equal(data["results"]["loss"], single["loss"])  # every rank computes the whole loss
        for name, full in single.items():
            if name == "loss":
                continue
            shard = data["results"][name]
            # the reduced gradient is this rank's 1-D shard of the padded, averaged gradient
            assert shard.shape == (padded_numel(sizes[name], WORLD_SIZE) // WORLD_SIZE,)
            assert torch.equal(shard, shard_of(full, rank, WORLD_SIZE)), (rank, name)
        # a reordered graph, sharded, gives the very same shards
        assert rp.compare(data["results"], data["late"]).exact
        # each rank holds its shards only: fc2.weight's 21 elements pad to 22, 11 per rank
        shard_bytes = sum(padded_numel(p.numel, WORLD_SIZE) // WORLD_SIZE * 4 for p in bundle.params)
        assert data["resident"] == shard_bytes + 5 * 4 * 4
        assert data["peak"] > data["resident"]
    last = torch.load(tmp_path / f"rank{WORLD_SIZE - 1}.pt", weights_only=True)
    assert last["results"]["grad fc2.weight"][-1] == 0  # the padding element


def test_torchrun_cli_replays_sharded_and_only_rank_0_prints(tmp_path):
    bundle = rp.example_bundle()
    dcsched.save(bundle, tmp_path / "graph.pt")
    late = bundle.with_graphs(forward=rp.latest_first(bundle.forward), backward=rp.latest_first(bundle.backward))
    dcsched.save(late, tmp_path / "graph.sched.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD_SIZE),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               "-m", "dcsched", "replay", str(tmp_path / "graph.sched.pt"), "--baseline", str(tmp_path / "graph.pt"),
               "--device", "cpu", "--iters", "1", "--warmup", "0", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-8000:]
    data = json.loads(done.stdout)  # one JSON document: rank 1 printed nothing
    assert data["world_size"] == WORLD_SIZE and data["device"] == "cpu"
    assert data["results"]["exact"] and data["results"]["outputs"] == 4
    assert [o["label"] for o in data["orders"]] == ["baseline", "scheduled"]


def test_torchrun_ranks_that_load_different_bundles_stop_before_any_collective(tmp_path):
    bundle = rp.example_bundle()
    dcsched.save(bundle, tmp_path / "graph.pt")
    dcsched.save(bundle.with_graphs(forward=rp.latest_first(bundle.forward)), tmp_path / "other.pt")
    script = tmp_path / "per_rank.sh"  # rank 1 replays another order than rank 0
    script.write_text(f'if [ "$RANK" = 1 ]; then b={tmp_path / "other.pt"}; else b={tmp_path / "graph.pt"}; fi\n'
                      f'exec {sys.executable} -m dcsched replay "$b" --device cpu --iters 1 --warmup 0\n')
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD_SIZE),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--no-python", "bash", str(script)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("dcsched: error:")]
    assert lines and all(line == lines[0] for line in lines), done.stderr[-3000:]
    assert lines[0].startswith("dcsched: error: rank 1 loaded a different bundle's forward "), lines[0]
    assert "from rank 0" in lines[0] and "Traceback" not in done.stdout


def test_every_torchrun_rank_stops_past_the_bound(tmp_path):
    from test_replay_bounds import _chain

    path = dcsched.save(_chain(20, 2048, 1.0), tmp_path / "slow.pt")
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": root}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), "-m", "dcsched", "replay", str(path), "--device", "cpu",
               "--iters", "1", "--warmup", "0", "--timeout", "3"]
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=170, env=env)
    assert done.returncode != 0 and time.monotonic() - start < 120
    lines = [line for line in done.stderr.splitlines() if line.startswith("dcsched: error:")]
    assert lines and all("replay stopped: the replay ran past its bound of 3 s" in line for line in lines), \
        done.stderr[-3000:]


def _replay_all_main(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Replay every bundle in ``out_dir`` sharded over the ranks; save the results by file stem."""
    from dcsched.runtime.distributed import DistributedZero3Runtime, shutdown

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        results = {}
        for path in sorted(Path(out_dir).glob("*.pt")):
            bundle = dcsched.load(path)
            results[path.stem] = rp.replay(bundle, runtime=DistributedZero3Runtime(bundle.params), iters=0,
                                           check_memory=False).results
        torch.save(results, Path(out_dir) / f"rank{rank}.results")
    finally:
        shutdown()


def test_dropout_model_replays_bit_for_bit_on_two_gloo_ranks_under_every_scheduler(tmp_path):
    # T5 only: its encoder's and decoder's dropouts are independent, so a scheduler could swap them
    # (GPT's are chained by data; tests/test_random_ops.py replays both in one process).
    from dropout_models import captured, distinct, scheduled

    expected = []
    for name in ["t5"]:
        bundle = captured(name)
        dcsched.save(bundle, tmp_path / f"{name}.baseline.pt")
        for algo, reordered in distinct(scheduled(bundle), bundle).items():
            dcsched.save(reordered, tmp_path / f"{name}.{algo}.pt")
            expected.append((name, algo))
    mp.spawn(_replay_all_main, args=(WORLD_SIZE, free_port(), str(tmp_path)), nprocs=WORLD_SIZE, join=True)
    assert len(expected) >= 2
    for rank in range(WORLD_SIZE):
        results = torch.load(tmp_path / f"rank{rank}.results", weights_only=True)
        for name, algo in expected:
            comparison = rp.compare(results[f"{name}.baseline"], results[f"{name}.{algo}"])
            assert comparison.exact and comparison.outputs > 10, (rank, name, algo)
