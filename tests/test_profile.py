"""Profiling: the communication model, the analytic compute model, sizes under sharding, provenance."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dcsched
from dcsched.costmodels import formulas
from dcsched.profile.capture import capture_step
from dcsched.errors import DcschedError
from dcsched.runtime import ops
from dcsched.examples import build
from dcsched.costmodels.options import ProfileOptions
from dcsched.profile.measure import profile_bundle
from dcsched.runtime.step import build_step, installed, make_state, run_step
from dcsched.graph.roles import Role, role_of

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpt():
    model, inputs, loss_fn = build("gpt", n_layers=1, d_model=32, n_heads=4, vocab=64, seq=8, batch=2)
    return capture_step(model, inputs, loss_fn)


# ---------------------------------------------------------------------------
# Communication model
# ---------------------------------------------------------------------------

def test_comm_model_formula():
    # 1 GB over 8 ranks at 100 GB/s: 7/8 of it moves, 8.75 ms, plus 20 us latency.
    assert formulas.comm_time_ms(10**9, world_size=8, bandwidth_gbps=100, latency_us=20) == pytest.approx(8.77)
    assert formulas.comm_time_ms(10**9, world_size=1, bandwidth_gbps=100, latency_us=5) == pytest.approx(0.005)
    with pytest.raises(ValueError):
        formulas.comm_time_ms(1, world_size=0, bandwidth_gbps=1, latency_us=0)


@settings(max_examples=50, deadline=None)
@given(nbytes=st.integers(0, 10**12), world=st.integers(1, 1024), bw=st.floats(0.1, 1000), lat=st.floats(0, 1000))
def test_comm_model_matches_its_formula(nbytes, world, bw, lat):
    expected = nbytes * (world - 1) / world / (bw * 1e9) * 1e3 + lat / 1e3
    got = formulas.comm_time_ms(nbytes, world_size=world, bandwidth_gbps=bw, latency_us=lat)
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert formulas.comm_time_ms(nbytes * 2, world_size=world, bandwidth_gbps=bw, latency_us=lat) >= got


def test_comm_nodes_are_modelled_from_gathered_and_gradient_bytes(gpt):
    options = ProfileOptions(cost_model="analytic", gpu="a100", world_size=4, bandwidth_gbps=50, latency_us=10,
                             progress=False)
    bundle = profile_bundle(gpt.bundle, options)
    params = bundle.param_by_ds_id()
    seen = 0
    for graph in bundle.graphs.values():
        for node in graph.nodes:
            role = role_of(node)
            if role in (Role.ALLGATHER, Role.REDUCE):
                param = params[node.args[2]]
                expected = param.nbytes * 3 / 4 / 50e9 * 1e3 + 0.01
                assert node.meta["device_time"] == pytest.approx(expected)
                assert node.meta["time_source"] == "modelled"
                seen += 1
            elif role in (Role.WAIT, Role.RELEASE):
                assert node.meta["device_time"] == 0.0
    assert seen > len(params)


# ---------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------

def test_tensor_sizes_under_sharding(gpt):
    world = 3
    bundle = profile_bundle(gpt.bundle, ProfileOptions(cost_model="analytic", gpu="h100", world_size=world,
                                                       progress=False))
    params = bundle.param_by_ds_id()
    forward_placeholders = [n for n in bundle.forward.nodes if n.op == "placeholder"]
    for node, kind in zip(forward_placeholders, bundle.forward_placeholders):
        if kind["kind"] == "param":
            p = params[kind["ds_id"]]
            assert node.meta["tensor_size"] == math.ceil(p.numel / world) * p.dtype.itemsize
        else:
            info = bundle.inputs[kind["index"]]
            assert node.meta["tensor_size"] == math.prod(info.shape) * info.dtype.itemsize
    for graph in bundle.graphs.values():
        for node in graph.nodes:
            if role_of(node) is Role.ALLGATHER:
                p = params[node.args[2]]
                assert node.meta["tensor_size"] == p.numel * node.kwargs["dtype"].itemsize  # the full parameter
            elif role_of(node) is Role.REDUCE:
                p = params[node.args[2]]
                assert node.meta["tensor_size"] == math.ceil(p.numel / world) * p.dtype.itemsize


# ---------------------------------------------------------------------------
# Analytic compute model
# ---------------------------------------------------------------------------

def test_roofline_is_the_slower_of_compute_and_memory():
    h100 = formulas.gpu("H100")
    # Compute-bound: a bf16 4096^3 matmul, 2*4096^3 FLOPs at 989 TFLOP/s.
    assert formulas.roofline_ms(2 * 4096**3, 0, torch.bfloat16, h100) == pytest.approx(2 * 4096**3 / 989e12 * 1e3)
    # Memory-bound: 1 GB at 3.35 TB/s.
    assert formulas.roofline_ms(1e6, 1e9, torch.float32, h100) == pytest.approx(1e9 / 3.35e12 * 1e3)
    assert formulas.gpu("a100").peak_flops(torch.float32) == 19.5e12
    with pytest.raises(ValueError, match="unknown GPU"):
        formulas.gpu("v100")


def test_analytic_times_follow_flops_and_bytes(gpt):
    h100 = formulas.GPUS["h100"]
    bundle = profile_bundle(gpt.bundle, ProfileOptions(cost_model="analytic", gpu="h100", progress=False))
    mms = [n for n in bundle.forward.nodes if n.target is torch.ops.aten.mm.default]
    assert mms
    for node in mms:
        (m, k), (_, n) = node.args[0].meta["out"]["shape"] if "out" in node.args[0].meta else \
            node.args[0].meta["val"].shape, node.args[1].meta["val"].shape
        flops = 2 * m * k * n
        moved = 4 * (m * k + k * n + m * n)
        # fp32 at 80% (MAMF) of 67 TFLOP/s times the share of 132 SMs its 128x128 tiles fill; bytes at 85% of HBM.
        fill = min(1.0, math.ceil(m / 128) * math.ceil(n / 128) / 132)
        assert node.meta["device_time"] == pytest.approx(
            max(flops / (67e12 * 0.8 * fill), moved / (h100.memory_bandwidth * 0.85)) * 1e3)
        assert node.meta["time_source"] == "analytic"
    views = [n for n in bundle.forward.nodes if n.target is torch.ops.aten.view.default]
    assert views and all(n.meta["device_time"] == 0.0 for n in views)
    # Deterministic: profiling twice gives the same figures.
    again = profile_bundle(gpt.bundle, ProfileOptions(cost_model="analytic", gpu="h100", progress=False))
    assert [n.meta["device_time"] for n in again.backward.nodes] == [n.meta["device_time"]
                                                                     for n in bundle.backward.nodes]


def test_flops_of_attention_on_cpu_kernels():
    q = torch.empty(2, 4, 8, 16, device="meta")
    flops = formulas.node_flops(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q),
                                 {}, None)
    assert flops == 2 * (2 * 2 * 4 * 8 * 8 * 16)  # q@k^T and attn@v


# ---------------------------------------------------------------------------
# Measured profile (CPU) and provenance
# ---------------------------------------------------------------------------

def test_measured_profile_on_cpu_times_every_compute_node(gpt):
    options = ProfileOptions(cost_model="measured", iters=2, warmup=1, world_size=2, bandwidth_gbps=10,
                             latency_us=1, device="cpu", progress=False)
    bundle = profile_bundle(gpt.bundle, options, params=gpt.params, inputs=gpt.inputs)
    for graph in bundle.graphs.values():
        for node in graph.nodes:
            role = role_of(node)
            if role is Role.COMPUTE and node.op == "call_function":
                assert node.meta["time_source"] == "measured" and node.meta["device_time"] > 0
            elif role in (Role.ALLGATHER, Role.WAIT, Role.RELEASE, Role.REDUCE):
                assert node.meta["time_source"] == "modelled"
    prov = bundle.provenance
    assert prov["cost_model"] == "measured" and prov["device"].startswith("cpu")
    assert prov["target_memory_bytes"] is None and prov["gpu"] is None
    assert (prov["world_size"], prov["comm_bandwidth_GBps"], prov["comm_latency_ms"], prov["comm_link"]) == \
        (2, 10, 0.001, "given")
    assert prov["torch"] == str(torch.__version__) and prov["iters"] == 2 and prov["warmup"] == 1
    # The input bundle is left as it was.
    assert all("device_time" not in n.meta for n in gpt.bundle.forward.nodes)


def test_provenance_names_the_target_gpu_memory(gpt):
    analytic = profile_bundle(gpt.bundle, ProfileOptions(cost_model="analytic", gpu="h200", progress=False))
    assert analytic.provenance["target_memory_bytes"] == formulas.GPUS["h200"].memory_bytes
    assert analytic.provenance["cost_model"] == "analytic" and "not run" in analytic.provenance["device"]
    measured = profile_bundle(gpt.bundle, ProfileOptions(iters=1, warmup=0, gpu="a100", device="cpu",
                                                         progress=False))
    assert measured.provenance["target_memory_bytes"] == 80 * 1024**3


def test_profiled_bundle_still_computes_the_step(gpt):
    bundle = profile_bundle(gpt.bundle, ProfileOptions(iters=1, warmup=0, device="cpu", progress=False),
                            params=gpt.params, inputs=gpt.inputs)
    with installed(ops.Zero3Runtime()):
        profiled = run_step(build_step(bundle), make_state(bundle, params=gpt.params, inputs=gpt.inputs))
        reference = run_step(build_step(gpt.bundle), make_state(gpt.bundle, params=gpt.params, inputs=gpt.inputs))
    assert list(profiled) == list(reference) and "loss" in profiled
    for name, value in reference.items():
        torch.testing.assert_close(profiled[name], value)


@pytest.mark.parametrize("options, message", [
    (ProfileOptions(cost_model="analytic"), "needs a target GPU"),
    (ProfileOptions(cost_model="guess"), "unknown cost model"),
    (ProfileOptions(gpu="v100"), "unknown GPU"),
    (ProfileOptions(bandwidth_gbps=0), "bandwidth"),
])
def test_bad_options_are_one_line_errors(options, message):
    with pytest.raises(DcschedError, match=message):
        options.check()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_measured_profile_on_gpu_uses_the_gpu(gpt):
    bundle = profile_bundle(gpt.bundle, ProfileOptions(iters=3, warmup=1, device="cuda", progress=False))
    assert bundle.provenance["device"].startswith("cuda")
    assert bundle.provenance["target_memory_bytes"] == torch.cuda.get_device_properties(0).total_memory
    assert any(n.meta["device_time"] > 0 for n in bundle.forward.nodes if role_of(n) is Role.COMPUTE)


def test_profile_options_are_exported():
    assert dcsched.ProfileOptions is ProfileOptions and dcsched.profile_bundle is profile_bundle


@pytest.mark.distributed
@pytest.mark.slow
def test_collectives_are_measured_under_torchrun(tmp_path):
    import subprocess
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    out = tmp_path / "d.pt"
    from train_runs import free_port  # a fixed port collides with any other run of this test on the machine
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "dcsched", "profile", str(ROOT / "examples" / "gpt.py"), "-o", str(out), "--iters", "1",
           "--warmup", "0", "--no-progress", "--", "--layers", "1", "--d-model", "16", "--vocab", "32",
           "--seq", "4", "--batch", "1"]
    env = {**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    bundle = dcsched.load(out)
    assert bundle.provenance["world_size"] == 2 and bundle.provenance["comm_time"].startswith("measured")
    gathers = [n for n in bundle.forward.nodes if role_of(n) is Role.ALLGATHER]
    assert gathers and all(n.meta["time_source"] == "measured" and n.meta["device_time"] > 0 for n in gathers)
    # the latency is measured too (a bucket saves it per member), and no collective takes less
    latency = bundle.provenance["comm_latency_ms"]
    assert latency is not None and 0 < latency <= 2 * min(n.meta["device_time"] for n in gathers)
