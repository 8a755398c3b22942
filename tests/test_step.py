"""The one step runner (dcsched.runtime.step): the tangent convention, node-by-node hooks, chosen tensors, devices."""

from __future__ import annotations

import pytest
import torch
import torch.fx

from dcsched.runtime import ops
from dcsched import replay as rp
from dcsched.errors import GraphError
from dcsched.runtime.step import (backward_args, build_step, installed, make_state, run_backward, run_forward,
                          run_step, tangents)


@pytest.fixture(scope="module")
def mlp():
    return rp.example_bundle()


def test_tangents_are_ones_for_the_loss_and_zeros_for_other_outputs(mlp):
    loss, hidden = torch.tensor(2.0), torch.randn(5, 7)
    assert [t.item() for t in tangents(mlp, [loss, hidden])] == [1.0]  # one user output: the loss
    mlp_two = rp.example_bundle()
    mlp_two.num_user_outputs = 2
    ones, zeros = tangents(mlp_two, [loss, hidden])
    assert ones.item() == 1.0 and torch.equal(zeros, torch.zeros(5, 7))
    assert tangents(mlp_two, [loss, None])[1] is None


def test_forward_and_backward_pieces_compose_to_run_step(mlp):
    step, state = build_step(mlp), make_state(mlp, seed=4)
    with installed(ops.Zero3Runtime()):
        whole = run_step(step, state)
        outputs = run_forward(step, state.forward_args)
        loss = outputs[0]
        grads = run_backward(step, outputs)
    assert outputs == []  # emptied: the backward held the saved tensors alone
    assert torch.equal(loss, whole["loss"])
    assert torch.equal(grads[0], whole["grad fc1.weight"]) and grads[3] is None


def test_explicit_tangent_scales_the_gradients(mlp):
    step, state = build_step(mlp), make_state(mlp, seed=4)
    with installed(ops.Zero3Runtime()):
        base = run_backward(step, run_forward(step, state.forward_args))
        outputs = run_forward(step, state.forward_args)
        doubled = run_backward(step, outputs, [torch.tensor(2.0)])
    torch.testing.assert_close(doubled[0], 2 * base[0])


def test_hooked_run_sees_every_call_and_computes_the_same(mlp):
    step, state = build_step(mlp), make_state(mlp, seed=1)
    seen = []

    def on_node(graph_name, node, call):
        seen.append((graph_name, node.name))
        return call()

    with installed(ops.Zero3Runtime()):
        plain = run_step(step, state)
        hooked = run_step(step, state, on_node=on_node)
    assert list(plain) == list(hooked)
    assert all(torch.equal(plain[k], hooked[k]) for k in plain)
    calls = {name: [n.name for n in graph.nodes if n.op == "call_function"] for name, graph in mlp.graphs.items()}
    assert [n for g, n in seen if g == "forward"] == calls["forward"]
    assert [n for g, n in seen if g == "backward"] == calls["backward"]


def test_hooked_run_honours_a_placeholder_order(mlp):
    order = {"forward": [n.name for n in mlp.forward.nodes if n.op == "placeholder"]}
    reversed_forward = torch.fx.Graph()
    env = {}
    placeholders = [n for n in mlp.forward.nodes if n.op == "placeholder"]
    for node in reversed(placeholders):
        env[node] = reversed_forward.node_copy(node, lambda n: env[n])
    for node in mlp.forward.nodes:
        if node.op != "placeholder":
            env[node] = reversed_forward.node_copy(node, lambda n: env[n])
    moved = mlp.with_graphs(forward=reversed_forward)
    state = make_state(mlp, seed=2)
    with installed(ops.Zero3Runtime()):
        reference = run_step(build_step(mlp), state)
        hooked = run_step(build_step(moved, placeholder_order=order), state, on_node=lambda g, n, call: call())
    assert all(torch.equal(reference[k], hooked[k]) for k in reference)


def test_chosen_params_and_inputs_by_ds_id_and_position(mlp):
    params = {p.ds_id: torch.full(p.shape, 0.5) for p in mlp.params}
    inputs = [torch.ones(5, 4)]
    state = make_state(mlp, params=params, inputs=inputs)
    assert all(torch.equal(a, b) for a, b in zip(state.forward_args, [*params.values(), *inputs]))
    by_name = make_state(mlp, values={"fc1.weight": params[0]}, params={0: torch.zeros(7, 4)})
    assert torch.equal(by_name.forward_args[0], params[0])  # a value by name wins


def test_device_arguments_point_at_the_step_device():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    made = graph.call_function(torch.ops.aten.arange.default, (4,), {"device": torch.device("meta")})
    graph.output((graph.call_function(torch.ops.aten.add.Tensor, (x, made)),))
    bundle = rp.example_bundle()
    bundle = bundle.with_graphs(forward=graph)
    bundle.backward, bundle.forward_placeholders = None, [{"kind": "input", "index": 0}]
    step = build_step(bundle, "cpu")
    copy = next(n for n in step.forward.graph.nodes if n.name == made.name)
    assert copy.kwargs["device"] == torch.device("cpu")
    assert made.kwargs["device"] == torch.device("meta")  # the bundle's own graph is untouched
    with installed(ops.Zero3Runtime()):
        (out,) = run_forward(step, make_state(bundle).forward_args)
    assert out.device.type == "cpu" and out.shape == (5, 4)


def test_a_backward_placeholder_without_a_source_is_a_graph_error(mlp):
    broken = rp.example_bundle()
    broken.backward_placeholders = [*broken.backward_placeholders[:-1], {"kind": "tangent", "index": 3}]
    with pytest.raises(GraphError, match="refers to no forward output"):
        backward_args(broken, [torch.tensor(1.0)] * 5)
