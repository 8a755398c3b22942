"""dcsched replay in one process: reordered graphs compute exactly what the original did,
mismatches are caught and named, memory is really measured, bad input exits 2."""

from __future__ import annotations

import functools
import json
import os
import random
from pathlib import Path

import pytest
import torch
import torch.fx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dcsched
from dcsched.sim import bundle_figures
from dcsched.runtime import ops
from dcsched import replay as rp
from dcsched.cli import run as cli
from dcsched.errors import DcschedError, GraphError, ResultMismatch
from dcsched.runtime.memtrack import LiveBytes
from dcsched.graph.nxview import to_fx, to_networkx

from strategies import random_topological_order

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_graphs"


@pytest.fixture(scope="module")
def mlp():
    return rp.example_bundle()


@pytest.fixture(scope="module")
def mlp_results(mlp):
    return rp.replay(mlp, iters=0).results


def reordered(bundle, order_fn):
    return bundle.with_graphs(**{name: order_fn(graph) for name, graph in bundle.graphs.items()})


def random_topological(graph: torch.fx.Graph, seed: int) -> torch.fx.Graph:
    """A random valid order: placeholders first as they were, then any ready node."""
    return to_fx(graph, random_topological_order(to_networkx(graph), random.Random(seed)))


# ---------------------------------------------------------------------------
# The step computes the right thing
# ---------------------------------------------------------------------------

def test_example_step_equals_eager_autograd(mlp):
    g = torch.Generator().manual_seed(3)
    values = {"fc1.weight": torch.randn(7, 4, generator=g), "fc1.bias": torch.randn(7, generator=g),
              "fc2.weight": torch.randn(3, 7, generator=g), "x": torch.randn(5, 4, generator=g)}
    results = rp.replay(mlp, iters=0, values=values).results

    w1, b1, w2 = (values[k].clone().requires_grad_() for k in ("fc1.weight", "fc1.bias", "fc2.weight"))
    loss = ((torch.relu(values["x"] @ w1.T + b1) @ w2.T) ** 2).sum()
    loss.backward()
    assert list(results) == ["loss", "grad fc1.weight", "grad fc1.bias", "grad fc2.weight"]
    torch.testing.assert_close(results["loss"], loss.detach())
    for name, param in (("fc1.weight", w1), ("fc1.bias", b1), ("fc2.weight", w2)):
        torch.testing.assert_close(results[f"grad {name}"], param.grad)


def test_same_seed_same_results_other_seed_other_results(mlp, mlp_results):
    again = rp.replay(mlp, iters=0).results
    assert rp.compare(mlp_results, again).exact
    with pytest.raises(ResultMismatch):
        rp.compare(mlp_results, rp.replay(mlp, iters=0, seed=1).results)


def test_inputs_respect_stored_values_and_bounds():
    gen = torch.Generator().manual_seed(0)
    stored = rp.make_input(dcsched.InputInfo("t", (3,), torch.int64, value=torch.tensor([4, 5, 6])), gen)
    assert stored.tolist() == [4, 5, 6]
    ids = rp.make_input(dcsched.InputInfo("ids", (200,), torch.int64, low=0, high=9), gen)
    assert ids.dtype == torch.int64 and 0 <= ids.min() and ids.max() <= 9 and len(ids.unique()) > 5
    floats = rp.make_input(dcsched.InputInfo("x", (500,), torch.float16, low=-2.0, high=3.0), gen)
    assert floats.dtype == torch.float16 and floats.min() >= -2 and floats.max() <= 3


def test_runnable_modules_keep_the_bundle_order_exactly(mlp):
    shuffled = random_topological(mlp.backward, seed=5)
    step = rp.build_step(mlp.with_graphs(backward=shuffled))
    assert [n.name for n in step.backward.graph.nodes] == [n.name for n in shuffled.nodes]
    assert step.backward.graph is not shuffled  # a copy: the bundle's graph is never touched


# ---------------------------------------------------------------------------
# Reordered graphs compute bit-identical results
# ---------------------------------------------------------------------------

def test_schedule_none_replays_bit_identical(mlp, mlp_results):
    same = reordered(mlp, lambda g: dcsched.schedule(g, "none"))
    comparison = rp.compare(mlp_results, rp.replay(same, iters=0).results)
    assert comparison.exact and comparison.outputs == 4 and comparison.max_abs_error == 0.0


def test_reverse_ish_order_replays_bit_identical(mlp, mlp_results):
    late = reordered(mlp, rp.latest_first)
    assert [n.name for n in late.backward.nodes] != [n.name for n in mlp.backward.nodes]
    assert rp.compare(mlp_results, rp.replay(late, iters=0).results).max_abs_error == 0.0


HAND_PERMUTED_BACKWARD = [
    # placeholders keep their relative order; everything else moves: the input-gradient branch
    # runs first, fc1.bias's gradient before fc1.weight's, fc2.weight's gradient last
    "primals_3", "primals_4", "relu", "mm", "tangents_1",
    "mul", "expand", "mul_1",
    "allgather_ds_param_primals_3_2", "wait_allgather_ds_param__primals_3_2",
    "mm_2", "release_ds_param_primals_3_mm_2_2", "threshold_backward",
    "sum_2", "reduce_ds_param_fc1_bias",
    "t_3", "mm_3", "reduce_ds_param_fc1_weight",
    "t_2", "mm_1", "reduce_ds_param_fc2_weight",
    "output",
]


def test_hand_permuted_order_replays_bit_identical(mlp, mlp_results):
    permuted = to_fx(mlp.backward, HAND_PERMUTED_BACKWARD)
    assert [n.name for n in permuted.nodes] != [n.name for n in mlp.backward.nodes]
    results = rp.replay(mlp.with_graphs(backward=permuted), iters=0).results
    assert rp.compare(mlp_results, results).max_abs_error == 0.0
    assert rp.compare(mlp_results, results).exact


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 10**6), st.integers(0, 10**6))
def test_any_valid_order_replays_bit_identical(mlp, mlp_results, fwd_seed, bwd_seed):
    shuffled = mlp.with_graphs(forward=random_topological(mlp.forward, fwd_seed),
                               backward=random_topological(mlp.backward, bwd_seed))
    assert rp.compare(mlp_results, rp.replay(shuffled, iters=0).results).exact


def test_placeholders_moved_by_a_scheduler_are_matched_by_name(mlp):
    nodes = list(mlp.backward.nodes)
    placeholders = [n.name for n in nodes if n.op == "placeholder"]
    swapped = [placeholders[1], placeholders[0], *placeholders[2:]]  # primals_4 before primals_3
    candidate = mlp.with_graphs(backward=to_fx(mlp.backward, swapped + [n.name for n in nodes
                                                                           if n.op != "placeholder"]))
    report = rp.replay_orders(candidate, mlp, iters=1, warmup=0)
    assert report.comparison.exact and report.comparison.max_abs_error == 0.0


# ---------------------------------------------------------------------------
# Mismatches are caught and named
# ---------------------------------------------------------------------------

def corrupt_gradient(bundle, param="fc2_weight", factor=1.5):
    """A copy whose backward scales one parameter's gradient before its reduce."""
    graph = to_fx(bundle.backward, [n.name for n in bundle.backward.nodes])
    reduce = next(n for n in graph.nodes if n.name == f"reduce_ds_param_{param}")
    with graph.inserting_before(reduce):
        scaled = graph.create_node("call_function", torch.ops.aten.mul.Tensor, (reduce.args[0], factor),
                                   name="corrupted")
    reduce.args = (scaled, *reduce.args[1:])
    return bundle.with_graphs(backward=graph)


def test_mismatch_names_the_first_differing_output(mlp, mlp_results):
    bad = rp.replay(corrupt_gradient(mlp), iters=0).results
    with pytest.raises(ResultMismatch, match=r"first differing output: grad fc2\.weight: \d+ of 21 elements"):
        rp.compare(mlp_results, bad)


def test_tolerance_mode_reports_largest_error(mlp_results):
    nudged = {k: v.clone() for k, v in mlp_results.items()}
    nudged["grad fc1.bias"] = nudged["grad fc1.bias"] + 1e-7
    with pytest.raises(ResultMismatch):
        rp.compare(mlp_results, nudged)  # bit for bit
    comparison = rp.compare(mlp_results, nudged, exact=False)
    assert comparison.worst_output == "grad fc1.bias"
    assert 0 < comparison.max_abs_error < 1e-6
    nudged["grad fc1.bias"] = nudged["grad fc1.bias"] + 1.0
    with pytest.raises(ResultMismatch, match="grad fc1.bias.*largest error 1"):
        rp.compare(mlp_results, nudged, exact=False)


def test_cli_refuses_a_baseline_with_other_nodes(mlp, tmp_path, capsys):
    dcsched.save(mlp, tmp_path / "graph.pt")
    dcsched.save(corrupt_gradient(mlp), tmp_path / "bad.pt")  # one node more
    code = cli(["replay", str(tmp_path / "bad.pt"), "--baseline", str(tmp_path / "graph.pt"), "--iters", "1"])
    assert code == 2 and "not two orders of one step" in capsys.readouterr().err


def test_cli_mismatch_exits_1_naming_the_output(mlp, tmp_path, capsys):
    # Same nodes in both bundles; the baseline scales fc2's gradient by 1.0, the other by 1.5.
    dcsched.save(corrupt_gradient(mlp, factor=1.0), tmp_path / "base.pt")
    dcsched.save(corrupt_gradient(mlp, factor=1.5), tmp_path / "sched.pt")
    code = cli(["replay", str(tmp_path / "sched.pt"), "--baseline", str(tmp_path / "base.pt"), "--iters", "1"])
    captured = capsys.readouterr()
    assert code == 1
    assert "results differ" in captured.err and "first differing output: grad fc2.weight" in captured.err
    assert "Traceback" not in captured.err and captured.out == ""


# ---------------------------------------------------------------------------
# Memory is measured, and releases free the gathered buffers
# ---------------------------------------------------------------------------

class Timeline(LiveBytes):
    """LiveBytes that also records (op name, live bytes after it) for every op."""

    def __init__(self):
        super().__init__()
        self.events = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.live
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.events.append((func.__name__, before, self.live, args))
        return out


def test_tracker_sees_gathered_buffers_freed_at_release(mlp):
    sizes = {p.ds_id: p.nbytes for p in mlp.params}
    with rp.installed(ops.Zero3Runtime()):
        step = rp.build_step(mlp)
        state = rp.make_state(mlp)
        with Timeline() as tracker:
            tracker.track(state.forward_args)
            rp.run_step(step, state)
    gathers = [e for e in tracker.events if e[0].startswith("allgather_param")]
    releases = [e for e in tracker.events if e[0].startswith("release_param")]
    assert len(gathers) == 4 and len(releases) == 4  # 3 in the forward, fc2.weight again in the backward
    for _name, before, after, args in gathers:
        assert after - before == sizes[args[2]]  # a fresh buffer of the whole parameter
    for _name, before, after, args in releases:
        assert before - after == sizes[args[2]]  # n_users = 1: this release frees the buffer


def test_peak_counts_gathered_parameters_that_are_not_released(mlp):
    class NeverRelease(ops.Zero3Runtime):
        def release(self, value, graph_id, ds_id, n_users):
            return value.view_as(value)

    freed = rp.replay(mlp, iters=1, warmup=0).measurement
    kept = rp.replay(mlp, iters=1, warmup=0, runtime=NeverRelease()).measurement
    assert freed.memory_source.startswith("live tensor storages")
    assert freed.resident_bytes == sum(p.nbytes for p in mlp.params) + 5 * 4 * 4
    assert kept.peak_bytes > freed.peak_bytes


def test_a_copy_out_before_the_tracker_watched_is_not_counted(mlp):
    """A bucket's copy-out bytes count at the op that made them; one made while no tracker watched (an
    unmeasured step's) must not land on the first op the next tracker sees."""
    class CopiedOutEarlier(ops.Zero3Runtime):
        pending = 10 ** 9

        def transient_bytes(self):
            made, self.pending = self.pending, 0
            return made

    runtime = CopiedOutEarlier()
    with rp.installed(runtime):
        step, state = rp.build_step(mlp), rp.make_state(mlp)
        with LiveBytes() as tracker:
            tracker.track(state.forward_args)
            rp.run_step(step, state)
    assert tracker.peak < 10 ** 9
    plain = rp.replay(mlp, iters=1, warmup=0).measurement
    assert tracker.peak == plain.peak_bytes


def test_measurement_figures(mlp):
    m = rp.replay(mlp, iters=3, warmup=2).measurement
    assert m.iters == 3 and m.warmup == 2 and m.timer == "perf_counter_ns"
    assert 0 < m.step_ms_min <= m.step_ms <= m.step_ms_max
    assert m.forward_ms > 0 and m.backward_ms > 0
    assert m.peak_bytes > m.resident_bytes


def test_simulated_figures_sit_next_to_measured(mlp):
    report = rp.replay_orders(reordered(mlp, rp.latest_first), mlp, iters=2, warmup=1)
    assert [o.label for o in report.orders] == ["baseline", "scheduled"]
    for order in report.orders:
        assert order.simulated is not None, order.simulator_note
        # the hand-written bundle's sizes are exact, so the model's peak is the measured one
        assert order.simulated["peak_bytes"] == order.measured.peak_bytes
        assert order.errors()["peak_bytes"] == 0.0
        assert order.errors()["step_ms"] is not None
    data = report.to_dict()
    assert data["results"]["exact"] and json.dumps(data)


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

def test_cli_reports_both_orders(mlp, tmp_path, capsys):
    dcsched.save(mlp, tmp_path / "graph.pt")
    dcsched.save(reordered(mlp, rp.latest_first), tmp_path / "graph.sched.pt")
    code = cli(["replay", str(tmp_path / "graph.sched.pt"), "--baseline", str(tmp_path / "graph.pt"),
                "--device", "cpu", "--iters", "2", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    data = json.loads(out)
    assert [o["label"] for o in data["orders"]] == ["baseline", "scheduled"]
    assert data["results"]["exact"] is True and data["results"]["outputs"] == 4
    assert all(o["measured"]["peak_bytes"] > 0 and o["simulated"]["step_ms"] > 0 for o in data["orders"])

    code = cli(["replay", str(tmp_path / "graph.sched.pt"), "--baseline", str(tmp_path / "graph.pt"), "--iters", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "results match bit for bit" in out and "peak memory, measured" in out and "simulated" in out


def _write_bundle_data(bundle, path, edit):
    data = dcsched.bundle.core.to_data(bundle)
    edit(data)
    torch.save(data, path)


def test_cli_unknown_op_exits_2(mlp, tmp_path, capsys):
    def rename_op(data):
        for node in data["graphs"]["forward"]["nodes"]:
            if node["target"] == "aten.relu.default":
                node["target"] = "aten.no_such_op_in_torch.default"
    _write_bundle_data(mlp, tmp_path / "odd.pt", rename_op)
    assert cli(["replay", str(tmp_path / "odd.pt")]) == 2
    err = capsys.readouterr().err
    assert "unknown op 'aten.no_such_op_in_torch.default'" in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cli_missing_device_exits_2(mlp, tmp_path, capsys):
    dcsched.save(mlp, tmp_path / "graph.pt")
    assert cli(["replay", str(tmp_path / "graph.pt"), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "device 'cuda' is not there" in err and len(err.strip().splitlines()) == 1


def test_cli_bad_device_name_exits_2(mlp, tmp_path, capsys):
    dcsched.save(mlp, tmp_path / "graph.pt")
    assert cli(["replay", str(tmp_path / "graph.pt"), "--device", "tpu7"]) == 2
    assert "unknown device" in capsys.readouterr().err


def test_cli_step_too_big_exits_2_before_allocating(mlp, tmp_path, capsys):
    def huge(data):
        data["inputs"][0]["shape"] = [10**7, 10**6]  # 40 TB of float32
    _write_bundle_data(mlp, tmp_path / "huge.pt", huge)
    assert cli(["replay", str(tmp_path / "huge.pt")]) == 2
    err = capsys.readouterr().err
    assert "needs at least" in err and "nothing was allocated" in err and len(err.strip().splitlines()) == 1


def test_check_fits_with_a_stated_budget(mlp):
    estimate = rp.estimate_bytes(mlp)
    assert estimate["param_shards"] == sum(p.nbytes for p in mlp.params) and estimate["saved"] > 0
    rp.check_fits(mlp, torch.device("cpu"), available=estimate["total"])
    with pytest.raises(DcschedError, match="needs at least"):
        rp.check_fits(mlp, torch.device("cpu"), available=estimate["total"] - 1)


def test_cli_baseline_of_another_step_exits_2(mlp, tmp_path, capsys):
    other = dcsched.replay.example_bundle()
    other.params[0] = dcsched.ParamInfo("fc1.weight", (7, 4), torch.float64, 0)
    dcsched.save(mlp, tmp_path / "graph.pt")
    dcsched.save(other, tmp_path / "other.pt")
    assert cli(["replay", str(tmp_path / "other.pt"), "--baseline", str(tmp_path / "graph.pt")]) == 2
    assert "different parameter tables" in capsys.readouterr().err


def test_cli_usage_errors_exit_2(mlp, tmp_path):
    dcsched.save(mlp, tmp_path / "graph.pt")
    assert cli(["replay", str(tmp_path / "graph.pt"), "--iters", "0"]) == 2
    assert cli(["replay", str(tmp_path / "missing.pt")]) == 2


def test_bundle_convention_violations_are_graph_errors(mlp):
    broken = mlp.with_graphs()
    broken.backward_placeholders = broken.backward_placeholders[:-1]
    with pytest.raises(GraphError, match="backward graph has 5 placeholders"):
        rp.build_step(broken)


# ---------------------------------------------------------------------------
# Captured models and the sample bundles
# ---------------------------------------------------------------------------

def _capture():
    from dcsched.profile.capture import capture
    return capture


def test_captured_model_replays_to_eager_gradients():
    capture = _capture()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    x = torch.randn(4, 6)
    bundle = capture(model, (x,), loss_fn=lambda out: (out ** 2).mean())
    values = {name: p.detach() for name, p in model.named_parameters()}
    values.update({info.name: x for info in bundle.inputs})
    results = rp.replay(bundle, iters=0, values=values).results
    loss = (model(x) ** 2).mean()
    loss.backward()
    torch.testing.assert_close(results["loss"], loss.detach())
    for name, p in model.named_parameters():
        torch.testing.assert_close(results[f"grad {name}"], p.grad)
    late = rp.replay(reordered(bundle, rp.latest_first), iters=0, values=values).results
    assert rp.compare(results, late).exact


@functools.lru_cache(maxsize=None)
def _captured(name):
    model, inputs, loss_fn = _tiny_model(name)
    return _capture()(model, inputs, loss_fn=loss_fn)


@pytest.mark.parametrize("name", ["gpt", "llama", "convnet"])
def test_captured_tiny_models_replay_bit_identical_in_any_order(name):
    bundle = _captured(name)
    base = rp.replay(bundle, iters=0).results
    assert torch.isfinite(base["loss"])
    shuffled = bundle.with_graphs(forward=random_topological(bundle.forward, 1),
                                  backward=random_topological(bundle.backward, 2))
    assert rp.compare(base, rp.replay(shuffled, iters=0).results).exact


def _tiny_model(name):
    from dcsched import examples as models
    tiny = {"gpt": dict(n_layers=1, d_model=16, vocab=32, seq=8, batch=2),
            "llama": dict(n_layers=1, d_model=16, vocab=32, seq=8, batch=2),
            "convnet": dict(n_layers=1, width=8, batch=2)}[name]
    return models.build(name, **tiny)


def test_tiny_captured_gpt_scheduled_fast_free_then_replayed(tmp_path, capsys):
    from dcsched import schedulers
    if "fast-free" not in schedulers.available():
        pytest.skip("fast-free scheduler not registered")
    dcsched.save(_captured("gpt"), tmp_path / "gpt.pt")
    assert cli(["schedule", str(tmp_path / "gpt.pt"), "--algo", "fast-free", "-o", str(tmp_path / "gpt.ff.pt"),
                "--assume-zero"]) == 0
    capsys.readouterr()
    code = cli(["replay", str(tmp_path / "gpt.ff.pt"), "--baseline", str(tmp_path / "gpt.pt"), "--device", "cpu",
                "--iters", "1", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["results"]["exact"] and data["results"]["outputs"] > 10


def _sample_bundles():
    return sorted(SAMPLES.glob("*.pt")) if SAMPLES.is_dir() else []


# The sample bundles are benchmark-sized (a CPU step takes seconds to minutes on a small box):
# replaying them is opt-in, DCSCHED_REPLAY_SAMPLES=1.
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("DCSCHED_REPLAY_SAMPLES") != "1",
                    reason="set DCSCHED_REPLAY_SAMPLES=1 to replay the benchmark-sized sample bundles")
@pytest.mark.parametrize("sample", _sample_bundles() or [pytest.param(None, marks=pytest.mark.skip(
    reason="no sample_graphs/*.pt"))], ids=lambda p: p.stem if p else "none")
def test_sample_bundle_scheduled_fast_free_then_replayed(sample, tmp_path, capsys):
    scheduled = tmp_path / f"{sample.stem}.sched.pt"
    assert cli(["schedule", str(sample), "--algo", "fast-free", "-o", str(scheduled)]) == 0
    capsys.readouterr()
    code = cli(["replay", str(scheduled), "--baseline", str(sample), "--device", "cpu", "--iters", "1",
                "--warmup", "0", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["results"]["exact"]
    for order in data["orders"]:
        assert order["measured"]["peak_bytes"] > 0 and order["simulated"]["peak_bytes"] > 0


def test_caveat_on_cpu_measured_costs_only(mlp, tmp_path, capsys):
    from dcsched.costmodels.options import ProfileOptions
    from dcsched.profile.measure import profile_bundle
    measured = profile_bundle(mlp, ProfileOptions(iters=1, warmup=0, device="cpu", progress=False))
    analytic = profile_bundle(mlp, ProfileOptions(cost_model="analytic", gpu="h100", progress=False))
    assert rp.timing_caveat(measured.provenance) == bundle_figures.CPU_TIMING_CAVEAT
    assert rp.timing_caveat(analytic.provenance) is None and rp.timing_caveat(mlp.provenance) is None
    for bundle, expected in ((measured, True), (analytic, False)):
        dcsched.save(bundle, tmp_path / "graph.pt")
        assert cli(["replay", str(tmp_path / "graph.pt"), "--device", "cpu", "--iters", "1", "--warmup", "0"]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert ("caveat: costs measured on the CPU" in out) is expected, out
        assert cli(["replay", str(tmp_path / "graph.pt"), "--device", "cpu", "--iters", "1", "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert (data["orders"][0]["caveat"] is not None) is expected


def _broken_mm(bundle):
    """mm_1 with its operands swapped: (4x4) @ (2x4) cannot run."""
    node = next(n for n in bundle.forward.nodes if n.name == "mm_1")
    node.args = (node.args[1], node.args[0])
    return bundle


def _ids_beyond_vocabulary(bundle):
    """An embedding lookup of token id 99 in a 4-row table (the first weight)."""
    g = bundle.forward
    ids = next(n for n in g.nodes if n.name == "primals_3")
    wait = next(n for n in g.nodes if n.name == "wait_allgather_ds_param__primals_1_0")
    mm = next(n for n in g.nodes if n.name == "mm_0")
    with g.inserting_before(mm):
        emb = g.create_node("call_function", torch.ops.aten.embedding.default, (wait, ids), {}, name="embedding")
        emb.meta.update(device_time=0.1, tensor_size=32)
    mm.args = (emb, mm.args[1])
    bundle.inputs[0] = dcsched.InputInfo("ids", (2,), torch.int64, torch.tensor([0, 99]))
    return bundle


@pytest.mark.parametrize("edit,node", [(_broken_mm, "mm_1"), (_ids_beyond_vocabulary, "embedding")])
def test_graph_that_fails_to_run_is_one_line_naming_the_node(tmp_path, capsys, edit, node):
    from bundles import linear_bundle
    path = dcsched.save(edit(linear_bundle()), tmp_path / "broken.pt")
    assert cli(["replay", str(path), "--iters", "1", "--warmup", "0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"forward graph failed to run at node {node}" in err, err
