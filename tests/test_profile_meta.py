"""``dcsched profile --meta``: a Hugging Face model planned from shapes on the meta device, beside its real capture.

What holds, for small models built from a config (a 2-layer Llama with eager and with SDPA attention, a
2-layer Mixtral, a 2-layer BERT): the same forward and backward graphs node for node (the same ops in the same
order, the same arguments by position, the same output shapes and dtypes), the same analytic time for every
node (exactly equal, not within a tolerance), the same parameter table, inputs of the same shapes and dtypes
(no values), the same ZeRO-3 collectives per parameter, the world size recorded; the bundle says it is
planned and replay refuses it in one line. Under ``--meta`` the script's tensors are traced as the CPU's (see
docs/profile.md), so the model's device-dependent choices (SDPA's CPU flash kernel, Mixtral's ``histc``
dtype) and the decompositions are the real run's.
"""

from __future__ import annotations

import textwrap
from collections import Counter

import pytest
import torch

import dcsched
from dcsched.cli import run
from dcsched.graph.roles import Role, role_of

pytest.importorskip("transformers")

SCRIPT = """
    import torch
    from transformers import {config}, {model}
    config = {config}(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      vocab_size=128, max_position_embeddings=32, attn_implementation={attention!r}, {extra})
    model = {model}(config){cast}
    optimizer = torch.optim.AdamW(model.parameters())
    compiled = torch.compile(model)
    ids = torch.randint(0, 128, (2, 16))
    compiled(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
"""
LLAMA = {"config": "LlamaConfig", "model": "LlamaForCausalLM", "extra": "num_key_value_heads=2, use_cache=False",
         "cast": ""}
MODELS = {
    "llama-eager": {**LLAMA, "attention": "eager"},
    "llama-sdpa": {**LLAMA, "attention": "sdpa"},
    # MoE routing; its auxiliary loss picks histc's dtype by device in Python, before any tracing. In bf16, as
    # planned (benchmarks/bench_profile.py): its experts are then aten._grouped_mm (in float32 transformers
    # routes them through its own op, transformers.grouped_mm_fallback, which a bundle does not hold).
    "mixtral": {"config": "MixtralConfig", "model": "MixtralForCausalLM", "attention": "eager",
                "extra": "num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, use_cache=False",
                "cast": ".to(torch.bfloat16)"},
    # SDPA on the CPU's flash kernel, dropout, a masked-LM head tied to the embedding.
    "bert": {"config": "BertConfig", "model": "BertForMaskedLM", "attention": "sdpa", "extra": "", "cast": ""},
}
PROFILE = ["--cost-model", "analytic", "--gpu", "h100", "--world-size", "64", "--no-progress"]


def _profile(root, name: str) -> dict:
    script = root / f"{name}.py"
    script.write_text(textwrap.dedent(SCRIPT.format(**MODELS[name])))
    for how, extra in (("real", []), ("meta", ["--meta"])):
        assert run(["profile", str(script), "-o", str(root / f"{name}-{how}.pt"), "--force", *PROFILE,
                    *extra]) == 0
    return {how: dcsched.load(root / f"{name}-{how}.pt") for how in ("real", "meta")}


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """``profiled(name)``: the model's real and planned bundles, profiled once per module."""
    root = tmp_path_factory.mktemp("meta")
    done: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in done:
            done[name] = _profile(root, name)
        return done[name]

    return get


@pytest.fixture(scope="module")
def bundles(profiled):
    return profiled("llama-eager")


def _nodes(graph) -> list[tuple]:
    """Each node as (op, target, args, kwargs, output shape and dtype), other nodes named by position."""
    index = {node: i for i, node in enumerate(graph.nodes)}

    def by_position(value):
        if isinstance(value, torch.fx.Node):
            return ("node", index[value])
        if isinstance(value, (list, tuple)):
            return type(value)(by_position(v) for v in value)
        if isinstance(value, dict):
            return {k: by_position(v) for k, v in value.items()}
        return value

    return [(node.op, str(node.target), by_position(node.args), by_position(node.kwargs), node.meta.get("out"))
            for node in graph.nodes]


def _collectives(bundle) -> Counter:
    return Counter((graph, role_of(node).value, node.meta.get("ds_id")) for graph, g in bundle.graphs.items()
                   for node in g.nodes if role_of(node) in (Role.ALLGATHER, Role.REDUCE))


@pytest.mark.parametrize("name", [
    "llama-eager",
    "mixtral",
    pytest.param("llama-sdpa", marks=pytest.mark.slow),
    pytest.param("bert", marks=pytest.mark.slow),
])
def test_a_planned_bundle_has_the_real_ones_graphs_node_for_node_and_figures_exactly(profiled, name):
    real, meta = profiled(name)["real"], profiled(name)["meta"]
    for graph in ("forward", "backward"):
        real_nodes, meta_nodes = _nodes(real.graphs[graph]), _nodes(meta.graphs[graph])
        assert len(meta_nodes) == len(real_nodes), graph
        differ = [(i, r, m) for i, (r, m) in enumerate(zip(real_nodes, meta_nodes)) if r != m]
        assert not differ, f"{graph}: first differing node {differ[0]}"
        assert all(node[4] is not None for node in real_nodes if node[0] == "call_function"), graph
        times = [[n.meta["device_time"] for n in b.graphs[graph].nodes] for b in (real, meta)]
        assert times[1] == times[0], graph  # exactly: the same shapes priced by the same model
        assert any(times[0]), graph
    assert meta.forward_placeholders == real.forward_placeholders
    assert meta.backward_placeholders == real.backward_placeholders
    assert meta.num_user_outputs == real.num_user_outputs


def test_a_planned_capture_makes_the_cpus_choices(profiled):
    """What the meta device got wrong before: the loss's gradient, the model's own device test."""
    backward = {str(n.target) for n in profiled("llama-eager")["meta"].graphs["backward"].nodes}
    assert "aten.nll_loss_backward.default" in backward  # lost when AOT autograd traced meta tensors
    mixtral = profiled("mixtral")["meta"].graphs["forward"]
    histc = [n for n in mixtral.nodes if str(n.target) == "aten.histc.default"]
    assert histc and all(n.meta["out"]["dtype"] == "float32" for n in histc)  # the CPU's dtype, not int32


@pytest.mark.slow
def test_a_planned_capture_takes_the_cpus_attention_kernel(profiled):
    forward = {str(n.target) for n in profiled("llama-sdpa")["meta"].graphs["forward"].nodes}
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in forward  # not SDPA's math path


def test_a_planned_bundle_has_the_real_ones_parameters_inputs_and_collectives(bundles):
    real, meta = bundles["real"], bundles["meta"]
    assert [(p.name, p.shape, p.dtype) for p in meta.params] == [(p.name, p.shape, p.dtype) for p in real.params]
    assert [(i.name, i.shape, i.dtype) for i in meta.inputs] == [(i.name, i.shape, i.dtype) for i in real.inputs]
    assert all(i.value is None and i.low is None for i in meta.inputs)  # shapes only
    assert _collectives(meta) == _collectives(real)
    for name in ("forward", "backward"):
        times = [sum(n.meta["device_time"] for n in b.graphs[name].nodes if role_of(n) is Role.COMPUTE)
                 for b in (real, meta)]
        assert times[1] == times[0], name
    assert meta.provenance["planned"] is True and meta.provenance["world_size"] == 64
    assert "planned" not in real.provenance


def test_a_planned_bundle_schedules_and_refuses_replay_in_one_line(bundles, tmp_path, capsys):
    path = dcsched.save(bundles["meta"], tmp_path / "planned.pt")
    assert run(["schedule", str(path), "--algo", "fast-free", "-o", str(tmp_path / "ff.pt")]) == 0
    said = " ".join(capsys.readouterr().err.split())
    assert "planned, not measured: the figures are the analytic cost model's for NVIDIA H100 SXM5 80GB at world " \
           "size 64, from shapes alone" in said, said
    assert run(["replay", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "planned without data (dcsched profile --meta)" in err, err


def test_meta_with_the_measured_cost_model_is_refused_before_running(tmp_path, capsys):
    script = tmp_path / "touch.py"
    marker = tmp_path / "ran"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    assert run(["profile", str(script), "-o", str(tmp_path / "g.pt"), "--meta"]) == 2
    assert "--meta captures shapes without data" in capsys.readouterr().err
    assert not marker.exists()
