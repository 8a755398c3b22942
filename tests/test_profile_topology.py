"""One topology per profile: the world size a profile's figures are for, where it comes from, what provenance says.

Under a process group the world size is the group's (a ``--world-size`` that differs is refused in one line);
a cost model that runs nothing models the collectives at that size and says so, recording the latency its
figures include; in one process the options' world size (default 8) is modelled.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dcsched
from dcsched import costmodels
from dcsched.costmodels.formulas import comm_time_ms
from dcsched.costmodels.options import DEFAULT_WORLD_SIZE, ProfileOptions
from dcsched.costmodels.topology import resolve_topology
from dcsched.errors import OptionError
from dcsched.graph.roles import Role, role_of
from dcsched.graph.specs import node_bytes, sharded_bytes
from dcsched.profile.capture import capture_step
from dcsched.profile.measure import profile_bundle, profile_topology
from dcsched.sim.collectives import DEFAULT_LATENCY_MS, latency_from_provenance
from gloo import on_gloo_ranks
from train_runs import free_port

ROOT = Path(__file__).resolve().parents[1]
H100 = costmodels.interconnect("h100", 2)
ANALYTIC = ProfileOptions(cost_model="analytic", gpu="h100", progress=False)
TINY_GPT = ["--layers", "1", "--d-model", "16", "--vocab", "32", "--seq", "4", "--batch", "1"]


@pytest.fixture(scope="module")
def mlp():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return capture_step(model, [torch.randn(3, 16)], lambda out: out.sum()).bundle


def collectives(bundle):
    return [node for graph in bundle.graphs.values() for node in graph.nodes
            if role_of(node) in (Role.ALLGATHER, Role.REDUCE)]


def assert_modelled_at(bundle, world_size: int, latency_us: float, bandwidth_gbps: float) -> None:
    """Every all-gather and reduce-scatter costs the model's figure at ``world_size`` ranks, not at another."""
    found = collectives(bundle)
    assert found
    for node in found:
        at = comm_time_ms(node_bytes(node), world_size=world_size, bandwidth_gbps=bandwidth_gbps,
                          latency_us=latency_us)
        assert node.meta["device_time"] == pytest.approx(at, rel=1e-12), node.name
        assert node.meta["time_source"] == "modelled"
        if role_of(node) is Role.REDUCE:
            assert node.meta["tensor_size"] == sharded_bytes(node, world_size)
    eight = [comm_time_ms(node_bytes(n), world_size=8, bandwidth_gbps=bandwidth_gbps, latency_us=latency_us)
             for n in found]
    if world_size != 8:
        assert [n.meta["device_time"] for n in found] != pytest.approx(eight)


# ---------------------------------------------------------------------------
# One process
# ---------------------------------------------------------------------------

def test_without_a_process_group_the_default_world_size_is_modelled_and_said(mlp):
    bundle = profile_bundle(mlp, ANALYTIC)
    link = costmodels.interconnect("h100", DEFAULT_WORLD_SIZE)
    assert_modelled_at(bundle, DEFAULT_WORLD_SIZE, link.latency_us, link.bandwidth_gbps)
    prov = bundle.provenance
    assert (prov["world_size"], prov["ranks_per_node"]) == (8, 8)
    assert prov["comm_time"] == ("modelled (analytic cost model, one process): h100, world size 8, 1 node: latency "
                                 "15 us + bytes*(W-1)/W at 360 GB/s (h100, 1 node: NVLink 4 / NVSwitch)")
    assert (prov["comm_latency_ms"], prov["comm_bandwidth_GBps"], prov["comm_link"]) == \
        (0.015, 360.0, link.name)
    assert latency_from_provenance(prov) == 0.015 != DEFAULT_LATENCY_MS


def test_a_measured_profile_alone_models_its_collectives_at_the_given_size(mlp):
    options = ProfileOptions(iters=1, warmup=0, device="cpu", world_size=3, progress=False)
    bundle = profile_bundle(mlp, options)
    gloo = costmodels.interconnect("cpu", 3)
    assert_modelled_at(bundle, 3, gloo.latency_us, gloo.bandwidth_gbps)
    assert bundle.provenance["comm_time"].startswith("modelled (measured cost model, one process): cpu, world "
                                                     "size 3, 1 node: latency 100 us")
    assert bundle.provenance["comm_latency_ms"] == 0.1


def test_a_process_group_of_one_rank_models_the_size_asked_for(mlp, tmp_path):
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        topology = profile_topology(dataclasses.replace(ANALYTIC, world_size=4))
        bundle = profile_bundle(mlp, dataclasses.replace(ANALYTIC, world_size=4))
    finally:
        dist.destroy_process_group()
    assert (topology.world_size, topology.process_group) == (4, False)
    assert bundle.provenance["world_size"] == 4 and "world size 4, 1 node" in bundle.provenance["comm_time"]


def test_a_groups_topology_passed_down_prices_collectives_at_its_size(mlp):
    """What training's compile and ``dcsched profile`` under torchrun hand the profile: the group's topology."""
    topology = profile_topology(ANALYTIC, group_size=2)
    assert (topology.world_size, topology.process_group, topology.link) == (2, True, H100)
    bundle = profile_bundle(mlp, ANALYTIC, topology=topology)
    assert_modelled_at(bundle, 2, H100.latency_us, H100.bandwidth_gbps)
    prov = bundle.provenance
    assert prov["world_size"] == 2 and prov["comm_latency_ms"] == 0.015
    assert prov["comm_time"].startswith("modelled (analytic cost model, the process group's collectives not run): "
                                        "h100, world size 2, 1 node: latency 15 us")


def test_a_world_size_the_group_does_not_have_is_refused_from_python(mlp):
    with pytest.raises(OptionError) as raised:
        profile_topology(dataclasses.replace(ANALYTIC, world_size=8), group_size=2)
    message = str(raised.value)
    assert "\n" not in message and "is 8" in message and "has 2 ranks" in message and "launch 8 ranks" in message
    assert raised.value.option == "world_size"


def test_ranks_per_node_come_from_the_launch(mlp, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    across = profile_topology(ANALYTIC, group_size=16)  # 4 nodes of 4 ranks: InfiniBand
    assert (across.ranks_per_node, across.nodes, across.link) == (4, 4, costmodels.interconnect("h100", 16, 4))
    alone = profile_topology(dataclasses.replace(ANALYTIC, world_size=16))  # one process: boards of 8
    assert (alone.ranks_per_node, alone.nodes) == (8, 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    assert profile_topology(ANALYTIC, group_size=2).ranks_per_node == 2


@settings(max_examples=60, deadline=None)
@given(group=st.integers(1, 64), asked=st.one_of(st.none(), st.integers(1, 64)), local=st.one_of(
    st.none(), st.integers(1, 16)))
def test_the_world_size_is_the_groups_or_the_one_asked_for(group, asked, local):
    options = dataclasses.replace(ANALYTIC, world_size=asked)
    model = costmodels.build(options)
    if group > 1 and asked is not None and asked != group:
        with pytest.raises(OptionError, match=f"is {asked} but this run's process group has {group} ranks"):
            resolve_topology(options, model, group_size=group, local_size=local)
        return
    topology = resolve_topology(options, model, group_size=group, local_size=local)
    assert topology.world_size == (group if group > 1 else asked or DEFAULT_WORLD_SIZE)
    assert topology.process_group == (group > 1)
    assert topology.link == costmodels.interconnect("h100", topology.world_size, topology.ranks_per_node)


# ---------------------------------------------------------------------------
# Two ranks: ``dcsched profile`` launched as torchrun launches it
# ---------------------------------------------------------------------------

def _two_ranks(args: list[str], cwd: Path) -> list[subprocess.CompletedProcess]:
    """``python -m dcsched profile ARGS`` as ranks 0 and 1 of one gloo group (torchrun's environment)."""
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    procs = [subprocess.Popen([sys.executable, "-m", "dcsched", "profile", *args], cwd=cwd, text=True,
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in (0, 1)]
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


@on_gloo_ranks
@pytest.mark.slow
def test_two_ranks_profile_analytically_at_the_groups_size(tmp_path):
    out = tmp_path / "two.pt"
    ranks = _two_ranks([str(ROOT / "examples" / "gpt.py"), "-o", str(out), "--cost-model", "analytic", "--gpu",
                        "h100", "--no-progress", "--", *TINY_GPT], ROOT)
    assert [r.returncode for r in ranks] == [0, 0], ranks[0].stderr[-2000:] + ranks[1].stderr[-2000:]
    bundle = dcsched.load(out)
    assert_modelled_at(bundle, 2, H100.latency_us, H100.bandwidth_gbps)
    prov = bundle.provenance
    assert (prov["world_size"], prov["ranks_per_node"]) == (2, 2)
    assert prov["comm_time"].startswith("modelled (analytic cost model, the process group's collectives not run): "
                                        "h100, world size 2, 1 node: latency 15 us")
    assert (prov["comm_latency_ms"], prov["comm_bandwidth_GBps"], prov["comm_link"]) == (0.015, 360.0, H100.name)
    # the simulator charges a bucket the latency the figures include, not its default
    assert latency_from_provenance(prov) == 0.015 != DEFAULT_LATENCY_MS
    assert "world size 2, collectives 15 us + bytes at 360 GB/s" in " ".join(ranks[0].stdout.split())


@on_gloo_ranks
@pytest.mark.slow
def test_a_world_size_the_group_does_not_have_is_refused_in_one_line(tmp_path):
    marker = tmp_path / "untouched"
    marker.write_text("")
    out = tmp_path / "never.pt"
    ranks = _two_ranks([str(ROOT / "examples" / "gpt.py"), "-o", str(out), "--cost-model", "analytic", "--gpu",
                        "h100", "--world-size", "8", "--no-progress", "--", *TINY_GPT], tmp_path)
    for rank in ranks:
        assert rank.returncode == 2, rank.stderr[-2000:]
        lines = rank.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in rank.stderr, rank.stderr[-2000:]
        assert "--world-size is 8" in lines[0] and "process group has 2 ranks" in lines[0]
        assert "leave --world-size out" in lines[0] and "launch 8 ranks" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["untouched"] and not out.exists()
