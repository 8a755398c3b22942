"""A hand-written bundle (docs, tests, smoke runs)."""

from __future__ import annotations


import torch
import torch.fx

from dcsched.runtime import ops
from dcsched.bundle.core import Bundle, InputInfo, ParamInfo
from dcsched.runtime.step import build_step, installed, make_state, run_step


def _call(graph, op, args, name):
    return graph.create_node("call_function", op, tuple(args), name=name)


def _gather(graph, placeholder, graph_id, ds_id):
    gathered = _call(graph, ops.allgather_param, (placeholder, graph_id, ds_id),
                     f"allgather_ds_param_{placeholder.name}_{ds_id}")
    return _call(graph, ops.wait_allgather, (gathered, graph_id, ds_id),
                 f"wait_allgather_ds_param__{placeholder.name}_{ds_id}")


def _release(graph, value, placeholder, user, graph_id, ds_id, n_users=1):
    return _call(graph, ops.release_param, (value, graph_id, ds_id, n_users),
                 f"release_ds_param_{placeholder}_{user}_{ds_id}")


def example_bundle() -> Bundle:
    """A two-layer MLP training step written as ZeRO-3 graphs by hand (examples, tests, smoke runs).

    ``fc1`` (7x4 weight, 7 bias) and ``fc2`` (3x7 weight: 21 elements, so two
    ranks pad it), input ``x`` (5x4), loss = sum(fc2(relu(fc1(x)))^2). The
    ZeRO-3 ops sit where DeepCompile puts them, with its node names; node costs
    are nominal (``provenance['time_source']``).
    """
    aten = torch.ops.aten
    fwd = torch.fx.Graph()
    w1, b1, w2, x = (fwd.placeholder(n) for n in ("primals_1", "primals_2", "primals_3", "primals_4"))
    w1_full = _gather(fwd, w1, 0, 0)
    b1_full = _gather(fwd, b1, 0, 1)
    w2_full = _gather(fwd, w2, 0, 2)
    t = _call(fwd, aten.t.default, (w1_full,), "t")
    addmm = _call(fwd, aten.addmm.default, (b1_full, x, t), "addmm")
    rel_w1 = _release(fwd, addmm, "primals_1", "addmm", 0, 0)
    rel_b1 = _release(fwd, rel_w1, "primals_2", "addmm", 0, 1)
    relu = _call(fwd, aten.relu.default, (rel_b1,), "relu")
    t_1 = _call(fwd, aten.t.default, (w2_full,), "t_1")
    mm = _call(fwd, aten.mm.default, (relu, t_1), "mm")
    rel_w2 = _release(fwd, mm, "primals_3", "mm", 0, 2)
    pow_1 = _call(fwd, aten.pow.Tensor_Scalar, (rel_w2, 2), "pow_1")
    loss = _call(fwd, aten.sum.default, (pow_1,), "sum_1")
    fwd.output((loss, w2, x, relu, rel_w2))

    bwd = torch.fx.Graph()
    w2_s = bwd.placeholder("primals_3")
    w2_bwd = _gather(bwd, w2_s, 1, 2)
    x_s, relu_s, mm_s, tangent = (bwd.placeholder(n) for n in ("primals_4", "relu", "mm", "tangents_1"))
    expand = _call(bwd, aten.expand.default, (tangent, [5, 3]), "expand")
    twice = _call(bwd, aten.mul.Tensor, (mm_s, 2.0), "mul")
    d_mm = _call(bwd, aten.mul.Tensor, (expand, twice), "mul_1")
    t_2 = _call(bwd, aten.t.default, (d_mm,), "t_2")
    g_w2 = _call(bwd, aten.mm.default, (t_2, relu_s), "mm_1")
    red_w2 = _call(bwd, ops.reduce_grad, (g_w2, 1, 2), "reduce_ds_param_fc2_weight")
    mm_2 = _call(bwd, aten.mm.default, (d_mm, w2_bwd), "mm_2")
    rel_w2_b = _release(bwd, mm_2, "primals_3", "mm_2", 1, 2)
    d_relu = _call(bwd, aten.threshold_backward.default, (rel_w2_b, relu_s, 0), "threshold_backward")
    t_3 = _call(bwd, aten.t.default, (d_relu,), "t_3")
    g_w1 = _call(bwd, aten.mm.default, (t_3, x_s), "mm_3")
    red_w1 = _call(bwd, ops.reduce_grad, (g_w1, 1, 0), "reduce_ds_param_fc1_weight")
    g_b1 = _call(bwd, aten.sum.dim_IntList, (d_relu, [0]), "sum_2")
    red_b1 = _call(bwd, ops.reduce_grad, (g_b1, 1, 1), "reduce_ds_param_fc1_bias")
    bwd.output((red_w1, red_b1, red_w2, None))

    params = [ParamInfo("fc1.weight", (7, 4), torch.float32, 0), ParamInfo("fc1.bias", (7,), torch.float32, 1),
              ParamInfo("fc2.weight", (3, 7), torch.float32, 2)]
    bundle = Bundle(
        forward=fwd, backward=bwd, params=params,
        inputs=[InputInfo("x", (5, 4), torch.float32, low=-1.0, high=1.0)],
        forward_placeholders=[{"kind": "param", "ds_id": 0}, {"kind": "param", "ds_id": 1},
                              {"kind": "param", "ds_id": 2}, {"kind": "input", "index": 0}],
        backward_placeholders=[{"kind": "saved", "index": 1}, {"kind": "saved", "index": 2},
                               {"kind": "saved", "index": 3}, {"kind": "saved", "index": 4},
                               {"kind": "tangent", "index": 0}],
        num_user_outputs=1,
        provenance={"source": "dcsched.replay.example_bundle (hand-written)",
                    "time_source": "nominal: 0.01 ms per compute op, 0.005 ms per all-gather/reduce"},
    )
    _annotate(bundle)
    return bundle


def _annotate(bundle: Bundle) -> None:
    """Fill ``out``/``tensor_size`` (from one real step) and nominal ``device_time`` on every node."""
    from dcsched.graph.roles import Role, role_of

    nominal = {Role.COMPUTE: 0.01, Role.ALLGATHER: 0.005, Role.REDUCE: 0.005}
    for graph in bundle.graphs.values():
        for node in graph.nodes:
            role = role_of(node)
            if role not in (Role.PLACEHOLDER, Role.OUTPUT):
                node.meta["device_time"] = nominal.get(role, 0.0)
                node.meta["time_source"] = "nominal"
    with installed(ops.Zero3Runtime()):
        step = build_step(bundle)
        state = make_state(bundle)
        seen: dict[str, torch.Tensor] = {}
        for name, module in (("forward", step.forward), ("backward", step.backward)):
            _record_outputs(module, seen, name)
        run_step(step, state)
    for name, graph in bundle.graphs.items():
        for node in graph.nodes:
            value = seen.get(f"{name}:{node.name}")
            if isinstance(value, torch.Tensor) and node.op not in ("output",):
                node.meta["out"] = {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
                node.meta["tensor_size"] = value.numel() * value.element_size()


def _record_outputs(module: torch.fx.GraphModule, seen: dict, graph_name: str) -> None:
    """Make ``module`` store each node's value's shape in ``seen`` as it runs (an Interpreter)."""

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            value = super().run_node(node)
            if isinstance(value, torch.Tensor):
                seen[f"{graph_name}:{node.name}"] = torch.empty(value.shape, dtype=value.dtype, device="meta")
            return value

    interpreter = Recorder(module)
    module.forward = lambda args: interpreter.run(*args)
