"""Capture: AOT graphs with ZeRO-3 ops compute what eager PyTorch computes, placed as DeepCompile places them."""

from __future__ import annotations

import operator
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.fx

import dcsched
from dcsched.bundle.graph_encoding import encode_graph
from dcsched.runtime import ops
from dcsched.profile.capture import CaptureError, capture_script_step, capture_step
from dcsched.cli import run
from dcsched.examples import build
from dcsched.graph.roles import Role, is_aliasing, role_of
from bundles import column_nodes

ROOT = Path(__file__).resolve().parents[1]

TINY = {
    "gpt": dict(n_layers=2, d_model=32, n_heads=4, vocab=64, seq=8, batch=2),
    "convnet": dict(n_layers=2, width=8, image=8, batch=2),
    "llama": dict(n_layers=2, d_model=32, n_heads=4, vocab=64, seq=8, batch=2),
    "vit": dict(n_layers=2, d_model=32, n_heads=4, image=16, patch=8, batch=2),
}


@pytest.fixture(scope="module", params=sorted(TINY))
def captured(request):
    model, inputs, loss_fn = build(request.param, **TINY[request.param])
    return request.param, model, inputs, loss_fn, capture_step(model, inputs, loss_fn)


def _graph_module(graph: torch.fx.Graph, constants: dict) -> torch.fx.GraphModule:
    root = torch.nn.Module()
    for name, value in constants.items():
        setattr(root, name, value)
    return torch.fx.GraphModule(root, graph)


def _run_bundle(bundle, params, inputs):
    """Forward then backward, executed as FX graph modules (never re-traced)."""
    fw_args = []
    for kind in bundle.forward_placeholders:
        fw_args.append(params[kind["ds_id"]].detach().clone() if kind["kind"] == "param"
                       else inputs[kind["index"]].clone())
    forward_out = _graph_module(bundle.forward, bundle.constants)(*fw_args)
    bw_args = []
    for kind in bundle.backward_placeholders:
        if kind["kind"] == "saved":
            bw_args.append(forward_out[kind["index"]])
        else:
            bw_args.append(torch.ones_like(forward_out[kind["index"]]))
    backward_out = _graph_module(bundle.backward, bundle.constants)(*bw_args)
    return forward_out, backward_out


def test_graphs_compute_eager_loss_and_gradients(captured):
    name, model, inputs, loss_fn, cap = captured
    bundle = cap.bundle
    ops.set_runtime(ops.Zero3Runtime())
    forward_out, backward_out = _run_bundle(bundle, cap.params, cap.inputs)

    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(*inputs))
    loss.backward()
    torch.testing.assert_close(forward_out[0], loss.detach(), rtol=1e-5, atol=1e-6)
    named = dict(model.named_parameters())
    checked = 0
    for i, kind in enumerate(bundle.forward_placeholders):
        if kind["kind"] != "param":
            assert backward_out[i] is None or not bundle.inputs[kind["index"]].dtype.is_floating_point
            continue
        param = bundle.params[kind["ds_id"]]
        torch.testing.assert_close(backward_out[i], named[param.name].grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, param=param: f"{name} gradient of {param.name}: {m}")
        checked += 1
    assert checked == len(bundle.params) == len([p for p in model.parameters() if p.requires_grad])
    assert not ops.RUNTIME.gathered, "every gathered buffer is released by the end of each graph"


def test_ds_ids_follow_named_parameters(captured):
    _, model, _, _, cap = captured
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert [p.name for p in cap.bundle.params] == names
    assert [p.ds_id for p in cap.bundle.params] == list(range(len(names)))
    assert sorted(k["ds_id"] for k in cap.bundle.forward_placeholders if k["kind"] == "param") == list(
        range(len(names)))


def _check_gather_and_releases(graph: torch.fx.Graph, graph_id: int, param_names: dict[str, int]) -> set[int]:
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    first_other = next(i for i, n in enumerate(nodes) if n.op != "placeholder")
    assert all(n.op != "placeholder" for n in nodes[first_other:]), "placeholders come first"
    gathered = set()
    for node in nodes:
        if role_of(node) is not Role.ALLGATHER:
            continue
        placeholder, gid, ds_id = node.args
        assert gid == graph_id and placeholder.op == "placeholder" and param_names[placeholder.name] == ds_id
        assert set(node.kwargs) == {"dtype"} and isinstance(node.kwargs["dtype"], torch.dtype)
        assert node.name == f"allgather_ds_param_{placeholder.name}_{ds_id}"
        wait = nodes[position[node] + 1]
        assert role_of(wait) is Role.WAIT and wait.args == (node, graph_id, ds_id)
        assert wait.name == f"wait_allgather_ds_param__{placeholder.name}_{ds_id}"
        assert list(node.users) == [wait]
        releases = [n for n in nodes if role_of(n) is Role.RELEASE and n.args[2] == ds_id]
        assert releases, f"{placeholder.name} is gathered but never released"
        for release in releases:
            use, gid, rid, n_users = release.args
            while role_of(use) in (Role.RELEASE, Role.REDUCE):  # ops inserted after one use form a chain
                use = use.args[0]
            assert (gid, rid, n_users) == (graph_id, ds_id, len(releases))
            assert release.name == f"release_ds_param_{placeholder.name}_{use.name}_{ds_id}" or re.fullmatch(
                rf"release_ds_param_{placeholder.name}_{re.escape(use.name)}_{ds_id}_\d+", release.name)
            assert position[release] > position[use]
        gathered.add(ds_id)
        # Nothing reads the gathered value, directly or through views, after its last release.
        last_release = max(position[r] for r in releases)
        frontier, seen = [wait], set()
        while frontier:
            value = frontier.pop()
            for reader in value.users:
                if reader.op == "output":
                    pytest.fail(f"graph output reads the gathered {placeholder.name} through {value.name}")
                if role_of(reader) is Role.RELEASE:
                    continue
                assert position[reader] < last_release, f"{reader.name} reads gathered {placeholder.name} late"
                if is_aliasing(reader) and reader not in seen:
                    seen.add(reader)
                    frontier.append(reader)
    return gathered


def test_zero3_ops_as_deepcompile_inserts_them(captured):
    _, _, _, _, cap = captured
    bundle = cap.bundle
    fw_placeholders = [n for n in bundle.forward.nodes if n.op == "placeholder"]
    param_names = {n.name: k["ds_id"] for n, k in zip(fw_placeholders, bundle.forward_placeholders)
                   if k["kind"] == "param"}
    gathered_fw = _check_gather_and_releases(bundle.forward, 0, param_names)
    assert gathered_fw == set(range(len(bundle.params))), "every parameter is gathered in the forward"
    _check_gather_and_releases(bundle.backward, 1, param_names)

    output = next(n for n in bundle.backward.nodes if n.op == "output")
    reduces = [n for n in bundle.backward.nodes if role_of(n) is Role.REDUCE]
    assert len(reduces) == len(bundle.params)
    by_ds_id = {n.args[2]: n for n in reduces}
    for i, kind in enumerate(bundle.forward_placeholders):
        if kind["kind"] == "param":
            reduce = by_ds_id[kind["ds_id"]]
            read = output.args[0][i]
            while role_of(read) is Role.RELEASE:  # a gradient that also used a parameter is released first
                read = read.args[0]
            assert read is reduce and reduce.args[1] == 1
            assert reduce.name == f"reduce_ds_param_{fw_placeholders[i].name}"
    # The forward saves shards, never gathered copies, for the backward.
    saved = [v for v in next(n for n in bundle.forward.nodes if n.op == "output").args[0] if v is not None]
    assert not any(role_of(v) in (Role.ALLGATHER, Role.WAIT) for v in saved)


def test_placeholder_conventions(captured):
    _, _, inputs, _, cap = captured
    bundle = cap.bundle
    assert bundle.num_user_outputs == 1
    # Step inputs: the batch plus buffers (Llama's rotary tables), in graph order.
    assert [i.shape for i in bundle.inputs] == [tuple(t.shape) for t in cap.inputs]
    assert len(bundle.inputs) >= len(inputs)
    forward_outputs = next(n for n in bundle.forward.nodes if n.op == "output").args[0]
    kinds = Counter(k["kind"] for k in bundle.backward_placeholders)
    assert kinds["tangent"] == 1
    for kind in bundle.backward_placeholders:
        if kind["kind"] == "saved":
            assert bundle.num_user_outputs <= kind["index"] < len(forward_outputs)
        else:
            assert kind["index"] == 0


def test_bundle_round_trips_node_for_node(captured, tmp_path):
    _, _, _, _, cap = captured
    path = tmp_path / "graph.pt"
    dcsched.save(cap.bundle, path)
    loaded = dcsched.load(path)
    for name in ("forward", "backward"):
        assert encode_graph(loaded.graphs[name]) == encode_graph(cap.bundle.graphs[name])
    assert loaded.forward_placeholders == cap.bundle.forward_placeholders
    assert loaded.backward_placeholders == cap.bundle.backward_placeholders


def test_python_api_returns_a_bundle():
    model, inputs, loss_fn = build("gpt", **TINY["gpt"])
    bundle = dcsched.capture(model, inputs, loss_fn=loss_fn)
    assert isinstance(bundle, dcsched.Bundle)
    assert bundle.inputs[0].value is not None and bundle.inputs[0].high < 64  # small: kept; token ids < vocab
    assert all(p.grad is None for p in model.parameters()), "capture leaves .grad alone"


class _BatchNormNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, images, labels):
        features = torch.relu(self.bn(self.conv(images))).mean((2, 3))
        return torch.nn.functional.cross_entropy(self.fc(features), labels)


def test_mutated_buffers_follow_the_loss_and_gradients_match():
    torch.manual_seed(0)
    model = _BatchNormNet()
    inputs = (torch.randn(2, 3, 8, 8), torch.tensor([0, 1]))
    stats = model.bn.running_mean.clone()
    cap = capture_step(model, inputs)
    assert torch.equal(model.bn.running_mean, stats), "capture leaves BatchNorm statistics alone"
    bundle = cap.bundle
    assert [i.name for i in bundle.inputs] == ["images", "bn.num_batches_tracked", "bn.running_mean",
                                               "bn.running_var", "labels"]
    assert bundle.num_user_outputs == 4  # the loss, then the three updated buffers
    assert [k for k in bundle.backward_placeholders if k["kind"] == "tangent"] == [{"kind": "tangent", "index": 0}]
    ops.set_runtime(ops.Zero3Runtime())
    forward_out, backward_out = _run_bundle(bundle, cap.params, cap.inputs)
    loss = model(*inputs)
    loss.backward()
    torch.testing.assert_close(forward_out[0], loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(forward_out[2], model.bn.running_mean, rtol=1e-5, atol=1e-6)
    named = dict(model.named_parameters())
    for i, kind in enumerate(bundle.forward_placeholders):
        if kind["kind"] == "param":
            name = bundle.params[kind["ds_id"]].name
            torch.testing.assert_close(backward_out[i], named[name].grad, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# Scripts and the CLI
# ---------------------------------------------------------------------------

GPT_ARGS = ["--layers", "1", "--d-model", "32", "--vocab", "64", "--seq", "8", "--batch", "2", "--steps", "50"]


def test_profile_cli_writes_a_bundle_that_loads_node_for_node(tmp_path, capsys):
    out = tmp_path / "gpt.pt"
    code = run(["profile", str(ROOT / "examples" / "gpt.py"), "-o", str(out), "--cost-model", "analytic",
                "--gpu", "h100", "--no-progress", "--", *GPT_ARGS])
    assert code == 0
    assert "step 1" not in capsys.readouterr().out, "the script stops after its first step"
    loaded = dcsched.load(out)
    stored = {name: column_nodes(loaded.columns(name)) for name in ("forward", "backward")}  # as the file holds them
    for name in ("forward", "backward"):
        assert encode_graph(loaded.graphs[name]) == stored[name]
        for node in loaded.graphs[name].nodes:
            assert node.meta["device_time"] >= 0 and node.meta["tensor_size"] >= 0
            assert node.op == "output" or "out" in node.meta
    assert loaded.provenance["cost_model"] == "analytic" and loaded.provenance["world_size"] == 8

    # Never overwritten without --force; nothing changes on refusal.
    before = out.read_bytes()
    assert run(["profile", str(ROOT / "examples" / "gpt.py"), "-o", str(out), "--no-progress"]) == 2
    assert out.read_bytes() == before
    assert "exists" in capsys.readouterr().err


def _script(tmp_path, text: str) -> Path:
    path = tmp_path / "train.py"
    path.write_text(text)
    return path


def test_graph_break_is_an_error_naming_where(tmp_path):
    path = _script(tmp_path, (
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        y = self.fc(x)\n"
        "        torch._dynamo.graph_break()\n"
        "        return y.sum()\n"
        "net = torch.compile(Net())\n"
        "net(torch.randn(2, 4)).backward()\n"))
    with pytest.raises(CaptureError, match=r"graph break in Net at .*train\.py:8"):
        capture_script_step(path)


def test_script_without_torch_compile_says_how_to_fix(tmp_path, capsys):
    path = _script(tmp_path, "import torch\nm = torch.nn.Linear(4, 4)\nm(torch.randn(2, 4)).sum().backward()\n")
    with pytest.raises(CaptureError, match=r"never calls torch.compile.*torch\.compile\(model\)"):
        capture_script_step(path)
    out = tmp_path / "g.pt"
    assert run(["profile", str(path), "-o", str(out), "--no-progress"]) == 2
    assert not out.exists()
    err = capsys.readouterr().err
    assert "never calls torch.compile" in err and "Traceback" not in err


def test_a_script_that_ends_with_os_exit_is_reported_not_silent(tmp_path, capsys):
    # os._exit skips every handler: dcsched turns the script's own call into an ordinary end of the script.
    path = _script(tmp_path, "import os, torch\nm = torch.nn.Linear(4, 4)\nos._exit(0)\n")
    out = tmp_path / "g.pt"
    assert run(["profile", str(path), "-o", str(out), "--no-progress"]) == 2
    assert not out.exists()
    err = capsys.readouterr().err
    assert "never calls torch.compile" in err and "Traceback" not in err


TWO_MODULES = (
    "import torch\n"
    "class Small(torch.nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.fc = torch.nn.Linear(4, 4)\n"
    "    def forward(self, x):\n"
    "        return self.fc(x)\n"
    "class Big(torch.nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.a, self.b = torch.nn.Linear(4, 16), torch.nn.Linear(16, 4)\n"
    "    def forward(self, x):\n"
    "        return self.b(torch.relu(self.a(x))).pow(2).mean()\n"
    "small, big = torch.compile(Small()), torch.compile(Big())\n"
    "for step in range(3):\n"
    "    big(small(torch.randn(2, 4))).backward()\n"
    "    print('step', step)\n")


def test_largest_compiled_module_or_the_named_one(tmp_path, capsys):
    path = _script(tmp_path, TWO_MODULES)
    assert capture_script_step(path).module_name == "Big"
    small = capture_script_step(path, module="Small")
    assert small.module_name == "Small" and [p.name for p in small.bundle.params] == ["fc.weight", "fc.bias"]
    assert small.bundle.num_user_outputs == 1 and small.bundle.backward_placeholders[-1]["kind"] == "tangent"
    with pytest.raises(CaptureError, match="no module named 'Huge'.*Big, Small"):
        capture_script_step(path, module="Huge")


# ---------------------------------------------------------------------------
# Golden: DeepSpeed 0.19.8's own insertion pass on a hand-built graph
# ---------------------------------------------------------------------------
# The expected lists below were recorded by running DeepSpeed 0.19.8's
# ``add_gather_and_release`` / ``add_gather_and_reduce`` (deepspeed/compile/passes/zero3_compile.py)
# on the graphs ``_tricky_graphs`` builds, with parameters primals_1..4 as ds_ids 0..3, forward
# graph id 0 and backward graph id 1. Recording needs DeepSpeed; this test does not.

aten, prims = torch.ops.aten, torch.ops.prims


def _call(g, target, args, name, val, kwargs=None):
    n = g.create_node("call_function", target, args, kwargs or {}, name=name)
    n.meta["val"] = val
    return n

def _tricky_graphs():
    """A forward and a backward graph with the cases DeepCompile's insertion treats specially.

    Forward: a weight read through a view chain (t -> mm), a parameter read twice by one
    tuple-returning op (native_layer_norm weight and bias = same param), a parameter whose only
    reader is a narrowing cast (folded into the all-gather), a tied weight read by two ops, two
    parameters released after one shared use.
    Backward: the weight's gradient is a getitem of an op that also reads the weight.
    """
    e = torch.empty
    g = torch.fx.Graph()
    w, b, c, tied, x = (g.placeholder(n) for n in ("primals_1", "primals_2", "primals_3", "primals_4", "primals_5"))
    for node, val in ((w, e(4, 4)), (b, e(4)), (c, e(4, 4)), (tied, e(8, 4)), (x, e(2, 4))):
        node.meta["val"] = val
    t = _call(g, aten.t.default, (w,), "t", e(4, 4))
    addmm = _call(g, aten.addmm.default, (b, x, t), "addmm", e(2, 4))
    ln = _call(g, aten.native_layer_norm.default, (addmm, [4], b, b, 1e-5), "native_layer_norm",
               (e(2, 4), e(2, 1), e(2, 1)))
    g0 = _call(g, operator.getitem, (ln, 0), "getitem", e(2, 4))
    g1 = _call(g, operator.getitem, (ln, 1), "getitem_1", e(2, 1))
    cast = _call(g, prims.convert_element_type.default, (c, torch.bfloat16), "convert_element_type",
                 e(4, 4, dtype=torch.bfloat16))
    xb = _call(g, prims.convert_element_type.default, (g0, torch.bfloat16), "convert_element_type_1",
               e(2, 4, dtype=torch.bfloat16))
    _call(g, aten.mm.default, (xb, cast), "mm", e(2, 4, dtype=torch.bfloat16))
    tt = _call(g, aten.t.default, (tied,), "t_1", e(4, 8))
    mm2 = _call(g, aten.mm.default, (g0, tt), "mm_1", e(2, 8))
    vw = _call(g, aten.view.default, (tied, [32]), "view", e(32))
    s = _call(g, aten.sum.default, (vw,), "sum_1", e(()))
    out = _call(g, aten.add.Tensor, (mm2, s), "add", e(2, 8))
    loss = _call(g, aten.sum.default, (out,), "sum_2", e(()))
    g.output((loss, w, b, tied, addmm, g0, g1))

    bw = torch.fx.Graph()
    w2, b2, tied2, addmm2, g02, g12, tan = (bw.placeholder(n) for n in (
        "primals_1", "primals_2", "primals_4", "addmm", "getitem", "getitem_1", "tangents_1"))
    for node, val in ((w2, e(4, 4)), (b2, e(4)), (tied2, e(8, 4)), (addmm2, e(2, 4)), (g02, e(2, 4)),
                      (g12, e(2, 1)), (tan, e(()))):
        node.meta["val"] = val
    ex = _call(bw, aten.expand.default, (tan, [2, 8]), "expand", e(2, 8))
    mmb = _call(bw, aten.mm.default, (ex, tied2), "mm_2", e(2, 4))
    tg = _call(bw, aten.t.default, (ex,), "t_2", e(8, 2))
    gt = _call(bw, aten.mm.default, (tg, g02), "mm_3", e(8, 4))
    nlb = _call(bw, aten.native_layer_norm_backward.default,
                (mmb, addmm2, [4], g12, g12, b2, b2, [True, True, True]), "native_layer_norm_backward",
                (e(2, 4), e(4), e(4)))
    gx = _call(bw, operator.getitem, (nlb, 0), "getitem_2", e(2, 4))
    gb = _call(bw, operator.getitem, (nlb, 1), "getitem_3", e(4))
    tw = _call(bw, aten.t.default, (w2,), "t_3", e(4, 4))
    gin = _call(bw, aten.mm.default, (gx, tw), "mm_4", e(2, 4))
    gw = _call(bw, aten.mm.default, (gx, gin), "mm_5", e(4, 4))
    bw.output((gw, gb, None, gt, gin))
    return g, bw


FORWARD_DS = [('primals_1', '()', '{}'),
 ('primals_2', '()', '{}'),
 ('primals_3', '()', '{}'),
 ('primals_4', '()', '{}'),
 ('primals_5', '()', '{}'),
 ('allgather_ds_param_primals_1_0', "('primals_1', 0, 0)", "{'dtype': torch.float32}"),
 ('wait_allgather_ds_param__primals_1_0', "('allgather_ds_param_primals_1_0', 0, 0)", '{}'),
 ('allgather_ds_param_primals_2_1', "('primals_2', 0, 1)", "{'dtype': torch.float32}"),
 ('wait_allgather_ds_param__primals_2_1', "('allgather_ds_param_primals_2_1', 0, 1)", '{}'),
 ('allgather_ds_param_primals_3_2', "('primals_3', 0, 2)", "{'dtype': torch.bfloat16}"),
 ('wait_allgather_ds_param__primals_3_2', "('allgather_ds_param_primals_3_2', 0, 2)", '{}'),
 ('allgather_ds_param_primals_4_3', "('primals_4', 0, 3)", "{'dtype': torch.float32}"),
 ('wait_allgather_ds_param__primals_4_3', "('allgather_ds_param_primals_4_3', 0, 3)", '{}'),
 ('t', "('wait_allgather_ds_param__primals_1_0',)", '{}'),
 ('addmm', "('wait_allgather_ds_param__primals_2_1', 'primals_5', 't')", '{}'),
 ('release_ds_param_primals_2_addmm_1', "('addmm', 0, 1, 3)", '{}'),
 ('release_ds_param_primals_1_addmm_0', "('release_ds_param_primals_2_addmm_1', 0, 0, 1)", '{}'),
 ('native_layer_norm',
  "('release_ds_param_primals_1_addmm_0', [4], 'wait_allgather_ds_param__primals_2_1', 'wait_allgather_ds_param__primals_2_1', 1e-05)",
  '{}'),
 ('getitem', "('native_layer_norm', 0)", '{}'),
 ('release_ds_param_primals_2_getitem_2', "('getitem', 0, 1, 3)", '{}'),
 ('release_ds_param_primals_2_getitem_1', "('release_ds_param_primals_2_getitem_2', 0, 1, 3)", '{}'),
 ('getitem_1', "('native_layer_norm', 1)", '{}'),
 ('convert_element_type_1', "('release_ds_param_primals_2_getitem_1', torch.bfloat16)", '{}'),
 ('mm', "('convert_element_type_1', 'wait_allgather_ds_param__primals_3_2')", '{}'),
 ('release_ds_param_primals_3_mm_2', "('mm', 0, 2, 1)", '{}'),
 ('t_1', "('wait_allgather_ds_param__primals_4_3',)", '{}'),
 ('mm_1', "('release_ds_param_primals_2_getitem_1', 't_1')", '{}'),
 ('release_ds_param_primals_4_mm_1_3', "('mm_1', 0, 3, 2)", '{}'),
 ('view', "('wait_allgather_ds_param__primals_4_3', [32])", '{}'),
 ('sum_1', "('view',)", '{}'),
 ('release_ds_param_primals_4_sum_1_3', "('sum_1', 0, 3, 2)", '{}'),
 ('add', "('release_ds_param_primals_4_mm_1_3', 'release_ds_param_primals_4_sum_1_3')", '{}'),
 ('sum_2', "('add',)", '{}'),
 ('output',
  "(('sum_2', 'primals_1', 'primals_2', 'primals_4', 'release_ds_param_primals_1_addmm_0', 'release_ds_param_primals_2_getitem_1', 'getitem_1'),)",
  '{}')]

BACKWARD_DS = [('primals_1', '()', '{}'),
 ('primals_2', '()', '{}'),
 ('primals_4', '()', '{}'),
 ('addmm', '()', '{}'),
 ('getitem', '()', '{}'),
 ('getitem_1', '()', '{}'),
 ('tangents_1', '()', '{}'),
 ('allgather_ds_param_primals_1_0', "('primals_1', 1, 0)", "{'dtype': torch.float32}"),
 ('wait_allgather_ds_param__primals_1_0', "('allgather_ds_param_primals_1_0', 1, 0)", '{}'),
 ('allgather_ds_param_primals_2_1', "('primals_2', 1, 1)", "{'dtype': torch.float32}"),
 ('wait_allgather_ds_param__primals_2_1', "('allgather_ds_param_primals_2_1', 1, 1)", '{}'),
 ('allgather_ds_param_primals_4_3', "('primals_4', 1, 3)", "{'dtype': torch.float32}"),
 ('wait_allgather_ds_param__primals_4_3', "('allgather_ds_param_primals_4_3', 1, 3)", '{}'),
 ('expand', "('tangents_1', [2, 8])", '{}'),
 ('mm_2', "('expand', 'wait_allgather_ds_param__primals_4_3')", '{}'),
 ('release_ds_param_primals_4_mm_2_3', "('mm_2', 1, 3, 1)", '{}'),
 ('t_2', "('expand',)", '{}'),
 ('mm_3', "('t_2', 'getitem')", '{}'),
 ('reduce_ds_param_primals_4', "('mm_3', 1, 3)", '{}'),
 ('native_layer_norm_backward',
  "('release_ds_param_primals_4_mm_2_3', 'addmm', [4], 'getitem_1', 'getitem_1', 'wait_allgather_ds_param__primals_2_1', "
  "'wait_allgather_ds_param__primals_2_1', [True, True, True])",
  '{}'),
 ('getitem_2', "('native_layer_norm_backward', 0)", '{}'),
 ('release_ds_param_primals_2_getitem_2_2', "('getitem_2', 1, 1, 2)", '{}'),
 ('release_ds_param_primals_2_getitem_2_1', "('release_ds_param_primals_2_getitem_2_2', 1, 1, 2)", '{}'),
 ('getitem_3', "('native_layer_norm_backward', 1)", '{}'),
 ('reduce_ds_param_primals_2', "('getitem_3', 1, 1)", '{}'),
 ('t_3', "('wait_allgather_ds_param__primals_1_0',)", '{}'),
 ('mm_4', "('release_ds_param_primals_2_getitem_2_1', 't_3')", '{}'),
 ('release_ds_param_primals_1_mm_4_0', "('mm_4', 1, 0, 1)", '{}'),
 ('mm_5', "('release_ds_param_primals_2_getitem_2_1', 'release_ds_param_primals_1_mm_4_0')", '{}'),
 ('reduce_ds_param_primals_1', "('mm_5', 1, 0)", '{}'),
 ('output',
  "(('reduce_ds_param_primals_1', 'reduce_ds_param_primals_2', None, 'reduce_ds_param_primals_4', 'release_ds_param_primals_1_mm_4_0'),)",
  '{}')]


def _describe(graph):
    return [(n.name, repr(torch.fx.node.map_arg(n.args, lambda x: x.name)), repr(dict(n.kwargs))) for n in graph.nodes]


def test_insertion_matches_deepspeed_on_tricky_cases():
    from dcsched.profile import zero3
    forward, backward = _tricky_graphs()
    params = [zero3.ParamNode(f"primals_{i + 1}", i, torch.float32) for i in range(4)]
    assert _describe(zero3.insert_forward(forward, params, 0)) == FORWARD_DS
    grad_index = {"primals_1": 0, "primals_2": 1, "primals_3": 2, "primals_4": 3}
    assert _describe(zero3.insert_backward(backward, params, grad_index, 1)) == BACKWARD_DS


def test_evaluation_before_training_is_skipped(tmp_path):
    path = _script(tmp_path, (
        "import torch\n"
        "net = torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)))\n"
        "with torch.no_grad():\n"
        "    print('eval', net(torch.randn(2, 4)).sum().item())\n"
        "net(torch.randn(2, 4)).sum().backward()\n"))
    captured = capture_script_step(path)
    assert captured.module_name == "Sequential" and captured.bundle.backward is not None
    assert [p.name for p in captured.bundle.params] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    # The module's output is not a scalar here: its tangent has the output's shape.
    (tangent,) = [n for n in captured.bundle.backward.nodes if n.name.startswith("tangents")]
    assert tuple(tangent.meta["val"].shape) == (2, 1)


def test_module_that_never_trains_is_an_error(tmp_path):
    path = _script(tmp_path, (
        "import torch\n"
        "net = torch.compile(torch.nn.Linear(4, 1))\n"
        "with torch.no_grad():\n"
        "    net(torch.randn(2, 4))\n"))
    with pytest.raises(CaptureError, match="Linear .*no_grad"):
        capture_script_step(path)


def test_vit_script_profiles_to_a_bundle_with_every_parameter(tmp_path):
    out = tmp_path / "vit.pt"
    args = ["--layers", "1", "--d-model", "16", "--heads", "2", "--image", "16", "--patch", "8", "--batch", "2"]
    assert run(["profile", str(ROOT / "examples" / "vit.py"), "-o", str(out), "--cost-model", "analytic",
                "--gpu", "h100", "--no-progress", "--", *args]) == 0
    bundle = dcsched.load(out)
    names = {p.name for p in bundle.params}
    # patch embedding (weight, bias), class token, positions, one block (12), final norm (2), head (2)
    assert len(names) == 2 + 1 + 1 + 12 + 2 + 2
    assert {"patch_embed.weight", "cls", "pos", "head.weight"} <= names
    pos = next(p for p in bundle.params if p.name == "pos")
    assert tuple(pos.shape) == (1, (16 // 8) ** 2 + 1, 16)


def test_vit_trains():
    model, inputs, loss_fn = build("vit", **TINY["vit"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        loss = loss_fn(model(*inputs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match="multiple of the patch"):
        build("vit", image=30, patch=8)
