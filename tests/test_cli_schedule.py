"""`dcsched schedule` end to end: table, outputs and naming, --algo all, --json, --trace, --plot, bad input."""

from __future__ import annotations

import builtins
import json
import subprocess
import sys

import pytest
import torch
import torch.fx

import dcsched
from dcsched.runtime import ops
from dcsched.bundle.core import Bundle, InputInfo, ParamInfo, to_data
from dcsched.cli import run
from dcsched.graph.nxview import to_networkx
from dcsched.errors import DcschedError
from dcsched.schedulers import Plan, available, get, register
from dcsched.schedulers.registry import unregister

aten = torch.ops.aten
B, H, SHARDS = 4, 8, 4  # batch, hidden, world size the shards were cut for
ACT = B * H * 4         # bytes of one activation
FULL = H * H * 4        # bytes of one gathered weight


def _node(g, target, args, name, time, size):
    node = g.create_node("call_function", target, tuple(args), {}, name=name)
    node.meta.update(device_time=time, tensor_size=size)
    return node


def mlp_bundle(layers: int = 3) -> Bundle:
    """An MLP step as DeepCompile writes it: gathers at the head of each graph, a release after each use,
    a reduce-grad after each weight gradient."""
    fwd = torch.fx.Graph()
    shards = [fwd.placeholder(f"primals_{k + 1}") for k in range(layers)]
    x = fwd.placeholder(f"primals_{layers + 1}")
    for s in shards:
        s.meta["tensor_size"] = FULL // SHARDS
    x.meta["tensor_size"] = ACT
    waits = []
    for k, s in enumerate(shards):
        ag = _node(fwd, ops.allgather_param, (s, 0, k), f"allgather_ds_param_{s.name}_{k}", 0.4, FULL)
        waits.append(_node(fwd, ops.wait_allgather, (ag, 0, k), f"wait_allgather_ds_param__{s.name}_{k}", 0.0, FULL))
    h, relus = x, []
    for k, (s, w) in enumerate(zip(shards, waits)):
        t = _node(fwd, aten.t.default, (w,), f"t_{k}", 0.001, FULL)
        mm = _node(fwd, aten.mm.default, (h, t), f"mm_{k}", 0.5, ACT)
        rel = _node(fwd, ops.release_param, (mm, 0, k, 1), f"release_ds_param_{s.name}_mm_{k}_{k}", 0.0, ACT)
        h = _node(fwd, aten.relu.default, (rel,), f"relu_{k}", 0.1, ACT)
        relus.append(h)
    loss = _node(fwd, aten.sum.default, (h,), "sum_1", 0.05, 4)
    fwd.output((loss, *shards, x, *relus))

    bwd = torch.fx.Graph()
    bshards = [bwd.placeholder(f"primals_{k + 1}") for k in range(layers)]
    bx = bwd.placeholder(f"primals_{layers + 1}")
    brelus = [bwd.placeholder(f"relu_{k}") for k in range(layers)]
    tangent = bwd.placeholder("tangents_1")
    for p in bshards:
        p.meta["tensor_size"] = FULL // SHARDS
    for p in (bx, *brelus):
        p.meta["tensor_size"] = ACT
    tangent.meta["tensor_size"] = 4
    bwaits = {}
    for k in range(1, layers):  # layer 0's weight is not needed for the input gradient
        s = bshards[k]
        ag = _node(bwd, ops.allgather_param, (s, 1, k), f"allgather_ds_param_{s.name}_{k}", 0.4, FULL)
        bwaits[k] = _node(bwd, ops.wait_allgather, (ag, 1, k), f"wait_allgather_ds_param__{s.name}_{k}", 0.0, FULL)
    grad = _node(bwd, aten.expand.default, (tangent, [B, H]), "expand", 0.01, ACT)
    reduces = [None] * layers
    for k in reversed(range(layers)):
        g_relu = _node(bwd, aten.threshold_backward.default, (grad, brelus[k], 0), f"threshold_backward_{k}", 0.1, ACT)
        t_g = _node(bwd, aten.t.default, (g_relu,), f"t_g_{k}", 0.001, ACT)
        inp = brelus[k - 1] if k else bx
        g_w = _node(bwd, aten.mm.default, (t_g, inp), f"mm_w_{k}", 0.5, FULL)
        reduces[k] = _node(bwd, ops.reduce_grad, (g_w, 1, k), f"reduce_ds_param_layers_{k}_weight", 0.4,
                           FULL // SHARDS)
        if k:
            mm = _node(bwd, aten.mm.default, (g_relu, bwaits[k]), f"mm_x_{k}", 0.5, ACT)
            grad = _node(bwd, ops.release_param, (mm, 1, k, 1), f"release_ds_param_{bshards[k].name}_mm_x_{k}_{k}",
                         0.0, ACT)
    bwd.output((*reduces, None))
    return Bundle(
        forward=fwd, backward=bwd,
        params=[ParamInfo(f"layers.{k}.weight", (H, H), torch.float32, k) for k in range(layers)],
        inputs=[InputInfo("x", (B, H), torch.float32)],
        forward_placeholders=[{"kind": "param", "ds_id": k} for k in range(layers)] + [{"kind": "input", "index": 0}],
        backward_placeholders=[{"kind": "saved", "index": 1 + i} for i in range(2 * layers + 1)]
        + [{"kind": "tangent", "index": 0}],
        provenance={"device_time": "hand-written", "tensor_size": "hand-written"},
    )


@pytest.fixture
def bundle_path(tmp_path):
    return dcsched.save(mlp_bundle(), tmp_path / "mlp.pt")


@pytest.fixture
def second_scheduler():
    """A second registered algorithm (gathers as late as possible), to show `all` takes whatever is registered."""
    name = "test-late-gathers"

    def late_gathers(form):
        # Repeatedly run the first runnable node in input order, all-gathers and waits only when nothing
        # else can run: each gather moves down to just before its first use.
        from dcsched.graph.form import ALLGATHER, WAIT
        waiting = [len(p) for p in form.preds]
        ready = {v for v, d in enumerate(waiting) if d == 0}
        order = []
        while ready:
            others = [v for v in ready if form.kind[v] not in (ALLGATHER, WAIT)]
            v = min(others or ready)  # node numbers are input positions
            ready.remove(v)
            order.append(v)
            for s in form.succs[v]:
                waiting[s] -= 1
                if waiting[s] == 0:
                    ready.add(s)
        return Plan(form.order_names(order))

    register(name, description="test only")(late_gathers)
    yield name
    unregister(name)


def files(directory):
    return sorted(p.name for p in directory.iterdir())


# ---------------------------------------------------------------------------
# Table, outputs
# ---------------------------------------------------------------------------

def test_table_and_default_output(bundle_path, capsys):
    assert run(["schedule", str(bundle_path), "--algo", "none"]) == 0
    out = capsys.readouterr().out
    for text in ("forward", "backward", "peak memory", "gathered peak", "step time", "exposed comm", "overlap",
                 "scheduler time", "lower bound", "memory over time", "before", "none"):
        assert text in out, text
    assert any(ch in out for ch in "▁▂▃▄▅▆▇█")
    written = bundle_path.with_name("mlp.none.pt")
    assert written.exists()
    assert files(bundle_path.parent) == ["mlp.none.pt", "mlp.pt"]


def test_output_has_same_nodes_and_edges_and_lints(bundle_path, second_scheduler, tmp_path):
    out = tmp_path / "out.pt"
    assert run(["schedule", str(bundle_path), "--algo", second_scheduler, "-o", str(out)]) == 0
    before, after = dcsched.load(bundle_path), dcsched.load(out)
    assert after.provenance["schedule"] == {"algorithm": second_scheduler, "input": "mlp.pt"}
    changed = False
    for name, graph in before.graphs.items():
        new = after.graphs[name]
        new.lint()
        v_old, v_new = to_networkx(graph), to_networkx(new)
        assert set(v_old.nodes) == set(v_new.nodes)
        assert set(v_old.edges) == set(v_new.edges)
        changed |= [n.name for n in graph.nodes] != [n.name for n in new.nodes]
    assert changed  # the test scheduler really reordered something
    assert not bundle_path.with_name(f"mlp.{second_scheduler}.pt").exists()


def test_never_over_the_input_unless_force(bundle_path, capsys):
    original = bundle_path.read_bytes()
    assert run(["schedule", str(bundle_path), "--algo", "none", "-o", str(bundle_path)]) == 2
    err = capsys.readouterr().err
    assert "overwrite the input" in err and "--force" in err and len(err.strip().splitlines()) == 1
    assert bundle_path.read_bytes() == original
    assert run(["schedule", str(bundle_path), "--algo", "none", "-o", str(bundle_path), "--force"]) == 0
    assert dcsched.load(bundle_path).provenance["schedule"]["algorithm"] == "none"


def budget_args():
    """`--memory-budget unlimited` when some registered scheduler takes a budget (it may require one)."""
    takes = any("memory_budget" in get(a).options for a in available())
    return ["--memory-budget", "unlimited"] if takes else []


def test_algo_all_side_by_side_one_bundle_each(bundle_path, second_scheduler, capsys, wide_console):
    assert run(["schedule", str(bundle_path), "--algo", "all", *budget_args()]) == 0
    out = capsys.readouterr().out
    for algo in available():
        assert algo in out
        assert bundle_path.with_name(f"mlp.{algo}.pt").exists()
        dcsched.load(bundle_path.with_name(f"mlp.{algo}.pt"))


@pytest.fixture
def refusing_scheduler():
    name = "test-needs-option"

    def refuse(form, *, needed=None):
        if needed is None:
            raise DcschedError("test-needs-option needs --option needed=...")
        return Plan(form.names)

    register(name, description="test only")(refuse)
    yield name
    unregister(name)


def test_algo_all_skips_a_scheduler_that_cannot_run_and_says_why(bundle_path, refusing_scheduler, capsys):
    assert run(["schedule", str(bundle_path), "--algo", "all", "--json", *budget_args()]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["skipped"] == {refusing_scheduler: "test-needs-option needs --option needed=..."}
    assert refusing_scheduler not in report["algorithms"] and refusing_scheduler not in report["outputs"]
    assert f"{refusing_scheduler}: skipped" in captured.err
    assert not bundle_path.with_name(f"mlp.{refusing_scheduler}.pt").exists()
    # Asked for by name it is an error; given its option it runs.
    assert run(["schedule", str(bundle_path), "--algo", refusing_scheduler]) == 2
    assert "needs --option" in capsys.readouterr().err
    assert run(["schedule", str(bundle_path), "--algo", refusing_scheduler, "-O", "needed=3"]) == 0
    # An option no selected scheduler takes is refused.
    assert run(["schedule", str(bundle_path), "--algo", "none", "-O", "bogus=1"]) == 2
    assert "no selected scheduler takes option 'bogus'" in capsys.readouterr().err


@pytest.mark.parametrize("options, words", [
    (["-O", "memory_budget=-5"], "--memory-budget is not a size: '-5'"),
    (["-O", "memory_budget=1000"], "--memory-budget 1000 B (1000 bytes) is too small"),  # not silently the default
    (["-O", "memory-budget=lots"], "--memory-budget is not a size: 'lots'"),
    (["-O", "budget_scope=some"], "unknown budget scope 'some'"),
    (["-O", "memory_budget=1GiB", "--memory-budget", "2GiB"], "--memory-budget given twice"),
])
def test_named_options_given_with_O_go_through_their_own_parser(bundle_path, capsys, options, words):
    assert run(["schedule", str(bundle_path), "--algo", "overlap", *options]) == 2
    err = capsys.readouterr().err.strip()
    errors = [line for line in err.splitlines() if "error" in line]  # after the progress lines, if it got there
    assert errors == [err.splitlines()[-1]] and words in errors[0] and "Traceback" not in err, err
    assert not bundle_path.with_name("mlp.overlap.pt").exists()


def test_json_schema_and_nothing_else_on_stdout(bundle_path, second_scheduler, capsys):
    assert run(["schedule", str(bundle_path), "--algo", "all", "--json", "--params", *budget_args()]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # the whole of stdout is one JSON document
    assert report["algorithms"] == available() and report["skipped"] == {}
    assert report["input"] == str(bundle_path)
    assert set(report["outputs"]) == set(available())
    assert set(report["graphs"]) == {"forward", "backward"}
    fwd = report["graphs"]["forward"]
    for key in ("nodes", "allgathers", "reduces", "compute_ms", "comm_ms", "lower_bound_ms", "tight_lower_bound_ms",
                "before", "after", "params"):
        assert key in fwd
    figure_keys = {"peak_bytes", "peak_node", "gathered_peak_bytes", "gathered_peak_node", "step_ms",
                   "compute_ms", "comm_ms", "exposed_comm_ms", "overlap_pct", "lower_bound_ms",
                   "tight_lower_bound_ms", "resident_bytes", "collectives", "scheduler_s"}
    assert set(fwd["before"]) == figure_keys and fwd["before"]["scheduler_s"] is None
    for algo in available():
        assert set(fwd["after"][algo]) == figure_keys
        assert fwd["after"][algo]["scheduler_s"] >= 0
    # `none` is the input order: same figures as before.
    assert {k: v for k, v in fwd["after"]["none"].items() if k != "scheduler_s"} == \
        {k: v for k, v in fwd["before"].items() if k != "scheduler_s"}
    # Hand check of the forward input order: 3 gathers of 256 B on top of 3 shards of 64 B + x 128 B.
    assert fwd["before"]["gathered_peak_bytes"] == 3 * FULL
    assert fwd["allgathers"] == 3 and report["graphs"]["backward"]["reduces"] == 3
    params = fwd["params"]["before"]
    assert [p["ds_id"] for p in params] == [0, 1, 2]
    assert all(p["held_ms"] > 0 and p["free_node"].startswith("release_ds_param") for p in params)
    assert "scheduling" in captured.err  # progress goes to stderr


@pytest.fixture
def wide_console():
    """Render as on a 200-column terminal (captured output is 80 columns otherwise)."""
    from dcsched.cli.app import console
    saved = console._width
    console.width = 200
    yield
    console._width = saved


def test_params_listing(bundle_path, capsys, wide_console):
    assert run(["schedule", str(bundle_path), "--algo", "none", "--params"]) == 0
    out = capsys.readouterr().out
    assert "gathered parameters" in out and "layers.2.weight" in out
    assert "allgather_ds_param_primals_1_0" in out and "release_ds_param_primals_1_mm_0_0" in out


def test_trace_is_valid_chrome_trace(bundle_path, tmp_path, capsys):
    trace = tmp_path / "trace.json"
    assert run(["schedule", str(bundle_path), "--algo", "none", "--trace", str(trace)]) == 0
    data = json.loads(trace.read_text())
    events = data["traceEvents"]
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    processes = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert processes == {"forward / before", "forward / none", "backward / before", "backward / none"}
    assert {name for _, name in threads} == {"compute", "communication"}
    complete = [e for e in events if e["ph"] == "X"]
    assert any(e["tid"] == 2 and e["name"].startswith("allgather_ds_param") for e in complete)
    assert any(e["tid"] == 2 and e["name"].startswith("reduce_ds_param") for e in complete)
    assert any(e["tid"] == 1 and e["name"].startswith("mm_") for e in complete)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
    counters = [e for e in events if e["ph"] == "C"]
    assert counters and all(e["name"] == "memory" and "all tensors" in e["args"] for e in counters)


def test_plot_png(bundle_path, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "mem.png"
    assert run(["schedule", str(bundle_path), "--algo", "none", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_one_clear_line_and_writes_nothing(bundle_path, tmp_path, monkeypatch, capsys):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    before = files(tmp_path)
    assert run(["schedule", str(bundle_path), "--algo", "none", "--plot", str(tmp_path / "mem.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "matplotlib" in err and "pip install 'dcsched[plot]'" in err
    assert files(tmp_path) == before


# ---------------------------------------------------------------------------
# Bad input: one line, exit 2, nothing written
# ---------------------------------------------------------------------------

def _write_data(path, data):
    torch.save(data, path)
    return path


def _bad(tmp_path, capsys, path, *extra):
    before = files(tmp_path)
    code = run(["schedule", str(path), "--algo", "none", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    assert files(tmp_path) == before
    return err


def test_cycle(tmp_path, capsys):
    data = to_data(mlp_bundle())
    nodes = data["graphs"]["forward"]["nodes"]
    mm0 = next(n for n in nodes if n["name"] == "mm_0")
    mm0["args"] = {"$tuple": [{"$node": "relu_1"}, {"$node": "t_0"}]}  # relu_1 depends on mm_0
    err = _bad(tmp_path, capsys, _write_data(tmp_path / "cycle.pt", data))
    assert "cycle" in err and "mm_0" in err


@pytest.mark.parametrize("key", ["device_time", "tensor_size"])
def test_missing_costs_named_and_assume_zero(tmp_path, capsys, key):
    bundle = mlp_bundle()
    for node in bundle.forward.nodes:
        if node.name in ("mm_1", "relu_2"):
            del node.meta[key]
    path = dcsched.save(bundle, tmp_path / "missing.pt")
    err = _bad(tmp_path, capsys, path)
    assert f"no {key}" in err and "mm_1" in err and "relu_2" in err and "--assume-zero" in err
    assert run(["schedule", str(path), "--algo", "none", "--assume-zero"]) == 0
    assert "counted as 0" in capsys.readouterr().err
    assert (tmp_path / "missing.none.pt").exists()


def test_negative_values(tmp_path, capsys):
    bundle = mlp_bundle()
    next(n for n in bundle.backward.nodes if n.name == "mm_w_1").meta["device_time"] = -0.5
    path = dcsched.save(bundle, tmp_path / "negative.pt")
    err = _bad(tmp_path, capsys, path, "--assume-zero")
    assert "negative" in err and "mm_w_1" in err and "backward" in err


def test_graph_without_parameters(tmp_path, capsys):
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["tensor_size"] = 16
    y = _node(g, aten.relu.default, (x,), "relu", 0.1, 16)
    g.output((y,))
    bundle = Bundle(forward=g, backward=None, params=[], inputs=[InputInfo("x", (4,), torch.float32)],
                    forward_placeholders=[{"kind": "input", "index": 0}], backward_placeholders=[])
    path = dcsched.save(bundle, tmp_path / "noparams.pt")
    err = _bad(tmp_path, capsys, path)
    assert "no parameters" in err and "forward" in err


def test_unknown_algorithm_and_missing_file(tmp_path, capsys, bundle_path):
    before = files(tmp_path)
    assert run(["schedule", str(bundle_path), "--algo", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown scheduler 'nope'" in err and len(err.strip().splitlines()) == 1
    assert run(["schedule", str(tmp_path / "absent.pt"), "--algo", "none"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert files(tmp_path) == before


def test_subprocess_json_stdout_is_pure(bundle_path):
    result = subprocess.run([sys.executable, "-m", "dcsched", "schedule", str(bundle_path), "--algo", "none",
                             "--json"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["graphs"]["backward"]["after"]["none"]["step_ms"] > 0


@pytest.mark.parametrize("budget,words", [
    ("1e400GB", "not a size: '1e400GB'"), ("nan", "not a size: 'nan'"), ("-1GB", "not a size: '-1GB'"),
    ("-inf", "not a size"), ("6 parsecs", "not a size"),
])
def test_bad_memory_budget_one_line(tmp_path, capsys, budget, words):
    path = dcsched.save(mlp_bundle(), tmp_path / "in.pt")
    before = files(tmp_path)
    assert run(["schedule", str(path), "--algo", "overlap", "--memory-budget", budget]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and "--memory-budget" in err, err
    assert words in err, err
    assert files(tmp_path) == before


@pytest.mark.parametrize("word", ["unlimited", "inf", "infinite", "INF", "none"])
def test_unlimited_budget_words_same_for_cli_and_python(tmp_path, capsys, word):
    path = dcsched.save(mlp_bundle(), tmp_path / "in.pt")
    assert run(["schedule", str(path), "--algo", "overlap", "--memory-budget", word, "-o",
                str(tmp_path / "out.pt")]) == 0
    cli_order = [n.name for n in dcsched.load(tmp_path / "out.pt").forward.nodes]
    python_order = [n.name for n in dcsched.schedule(mlp_bundle().forward, "overlap", memory_budget=word).nodes]
    assert cli_order == python_order
    assert python_order == [n.name for n in dcsched.schedule(mlp_bundle().forward, "overlap",
                                                             memory_budget=float("inf")).nodes]


@pytest.mark.parametrize("budget", ["0", "6GiB", "unlimited"])
def test_sweep_with_a_budget_is_refused_not_ignored(bundle_path, tmp_path, capsys, budget):
    before = files(tmp_path)
    assert run(["schedule", str(bundle_path), "--algo", "overlap", "--sweep", "--memory-budget", budget]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "drop --memory-budget" in err, err
    assert files(tmp_path) == before
