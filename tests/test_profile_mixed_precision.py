"""``dcsched profile --master-dtype / --reduce-dtype``: a bf16 script planned as FSDP2 runs it under
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` over fp32 master weights."""

from __future__ import annotations

import textwrap

import pytest
import torch

import dcsched
from dcsched.cli import run
from dcsched.graph.roles import Role, role_of
from dcsched.sim.step_memory import step_memory

SCRIPT = """
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    model = model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters())
    compiled = torch.compile(model)
    compiled(torch.randn(8, 64, dtype=torch.bfloat16)).float().square().mean().backward()
    optimizer.step()
"""
PROFILE = ["--meta", "--cost-model", "analytic", "--gpu", "h100", "--world-size", "2", "--no-progress"]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    script = root / "mlp.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = {}
    for how, extra in (("plain", []), ("mixed", ["--master-dtype", "fp32", "--reduce-dtype", "fp32"])):
        assert run(["profile", str(script), "-o", str(root / f"{how}.pt"), *PROFILE, *extra]) == 0
        out[how] = dcsched.load(root / f"{how}.pt")
    return out


def _reduces(bundle) -> list:
    return [node for node in bundle.backward.nodes if role_of(node) is Role.REDUCE]


def test_the_shards_are_fp32_the_gathers_bf16_the_reduces_fp32(bundles):
    plain, mixed = bundles["plain"], bundles["mixed"]
    assert {p.dtype for p in plain.params} == {torch.bfloat16} and {p.dtype for p in mixed.params} == {torch.float32}
    assert mixed.provenance["mixed_precision"] == {"master_dtype": "float32", "param_dtype": "bfloat16",
                                                   "reduce_dtype": "float32"}
    gathers = {name: [n.meta["tensor_size"] for n in b.forward.nodes if role_of(n) is Role.ALLGATHER]
               for name, b in bundles.items()}
    assert gathers["mixed"] == gathers["plain"]  # gathered in bf16 as captured
    assert [n.meta["tensor_size"] for n in _reduces(mixed)] == [2 * n.meta["tensor_size"] for n in _reduces(plain)]
    casts = [n for n in mixed.backward.nodes if "convert_element_type" in str(n.target)
             and any(role_of(user) is Role.REDUCE for user in n.users)]
    assert len(casts) == len(_reduces(mixed)) == 4  # each bf16 gradient cast to fp32 before its reduce


def test_the_whole_step_counts_fp32_shards_and_states(bundles):
    plain, mixed = (step_memory(bundles[name], gpu=True) for name in ("plain", "mixed"))
    assert plain.optimizer == mixed.optimizer == "adamw"  # the script's, recorded
    assert mixed.phases["optimizer"] > plain.phases["optimizer"]
    shards = sum(p.numel for p in bundles["mixed"].params) * 4 // 2  # fp32, 2 ranks
    assert mixed.parts["parameter_shards"] == shards == 2 * plain.parts["parameter_shards"]
    assert mixed.parts["optimizer_states"] == 2 * shards == 2 * plain.parts["optimizer_states"]


@pytest.mark.parametrize("options, words", [
    (["--reduce-dtype", "fp32"], "--reduce-dtype needs --master-dtype"),
    (["--master-dtype", "fp9"], "unknown dtype 'fp9'"),
    (["--master-dtype", "fp32", "--cost-model", "measured"], "--master-dtype changes the shards' dtype"),
])
def test_a_bad_policy_is_one_line_and_exit_2_before_running(tmp_path, capsys, options, words):
    script = tmp_path / "touch.py"
    marker = tmp_path / "ran"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    assert run(["profile", str(script), "-o", str(tmp_path / "g.pt"), "--no-progress", *options]) == 2
    err = capsys.readouterr().err
    assert words in err and err.strip().count("\n") == 0, err
    assert not marker.exists() and not (tmp_path / "g.pt").exists()
