"""``dcsched profile --meta``: a Hugging Face model planned from shapes on the meta device, beside its real capture.

What holds (measured on a 2-layer Llama from a config, eager attention): the same parameter table, inputs of the
same shapes and dtypes (no values), the same ZeRO-3 collectives per parameter, the analytic compute time within
5%, the world size recorded; the bundle says it is planned and replay refuses it in one line. What differs
(docs/profile.md): a few nodes where AOT autograd's partitioner saves another tensor for the backward.
"""

from __future__ import annotations

import textwrap
from collections import Counter

import pytest

import dcsched
from dcsched.cli import run
from dcsched.graph.roles import Role, role_of

pytest.importorskip("transformers")

SCRIPT = """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=32, use_cache=False,
                         attn_implementation="eager")
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters())
    compiled = torch.compile(model)
    ids = torch.randint(0, 128, (2, 16))
    compiled(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
"""
PROFILE = ["--cost-model", "analytic", "--gpu", "h100", "--world-size", "64", "--no-progress"]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    root = tmp_path_factory.mktemp("meta")
    script = root / "llama.py"
    script.write_text(textwrap.dedent(SCRIPT))
    for name, extra in (("real", []), ("meta", ["--meta"])):
        assert run(["profile", str(script), "-o", str(root / f"{name}.pt"), *PROFILE, *extra]) == 0
    return {name: dcsched.load(root / f"{name}.pt") for name in ("real", "meta")}


def _collectives(bundle) -> Counter:
    return Counter((graph, role_of(node).value, node.meta.get("ds_id")) for graph, g in bundle.graphs.items()
                   for node in g.nodes if role_of(node) in (Role.ALLGATHER, Role.REDUCE))


def test_a_planned_bundle_has_the_real_ones_parameters_inputs_and_collectives(bundles):
    real, meta = bundles["real"], bundles["meta"]
    assert [(p.name, p.shape, p.dtype) for p in meta.params] == [(p.name, p.shape, p.dtype) for p in real.params]
    assert [(i.name, i.shape, i.dtype) for i in meta.inputs] == [(i.name, i.shape, i.dtype) for i in real.inputs]
    assert all(i.value is None and i.low is None for i in meta.inputs)  # shapes only
    assert _collectives(meta) == _collectives(real)
    for name in ("forward", "backward"):
        times = [sum(n.meta["device_time"] for n in b.graphs[name].nodes if role_of(n) is Role.COMPUTE)
                 for b in (real, meta)]
        assert times[1] == pytest.approx(times[0], rel=0.05), name
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
