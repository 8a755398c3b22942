"""The whole step's memory (:mod:`dcsched.sim.step_memory`): its parts add up to its peak, a hand-computed case,
the caching-allocator model, the optimizer record and ``--optimizer``, the reports; and (slow, two gloo ranks)
the simulated whole-step peak against the measured per-rank one (:mod:`step_memory_runs`)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

import dcsched
from dcsched.bundle.optimizer import KNOWN, OptimizerError, from_provenance, named, of_torch
from dcsched.collective_issue import GLOO, PROCESS_GROUP, SIMULATOR
from dcsched.plan import Plan
from dcsched.sim.allocator import MiB, cuda_footprint, round_size
from dcsched.sim.plans import simulate_plan
from dcsched.sim.simulate import compile_view
from dcsched.sim.step_memory import KINDS, graph_peak, step_memory

SAMPLES = ("gpt", "llama", "convnet")


def _plans(graph, algo: str, name: str) -> Plan:
    from dcsched.graph.form import GraphForm
    from dcsched.schedulers.fsdp.scheduler import fsdp
    return fsdp({name: GraphForm(graph)})[name] if algo == "fsdp" else Plan(())


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), kind=st.sampled_from(["forward", "backward"]),
       algo=st.sampled_from(["none", "fsdp"]), issue=st.sampled_from([SIMULATOR, PROCESS_GROUP, GLOO]),
       residency=st.sampled_from([None, "kept", "replicated"]))
def test_a_graphs_parts_add_up_to_its_simulated_peak(seed, kind, algo, issue, residency):
    import dataclasses

    from dcsched.synthetic.random_dag import random_graph
    graph = random_graph(seed, kind=kind)
    plan = _plans(graph, algo, kind)
    if residency is not None:  # every other parameter
        from dcsched.graph.form import GraphForm
        ids = sorted({d for d in GraphForm(graph).ds_id if d is not None and d >= 0})
        assert ids
        plan = dataclasses.replace(plan, residency={d: residency for d in ids[::2]})
    compiled = compile_view(graph)
    at = graph_peak(compiled, plan, kind, issue=issue)
    assert at.peak_bytes == simulate_plan(compiled, plan, kind, issue=issue).peak_bytes
    assert sum(at.parts.values()) == at.peak_bytes
    assert all(value >= 0 for value in at.parts.values()), at.parts


@pytest.mark.parametrize("sample", SAMPLES)
@pytest.mark.parametrize("optimizer", sorted(KNOWN))
def test_the_whole_steps_parts_add_up_to_its_peak(sample, optimizer):
    bundle = dcsched.load(f"sample_graphs/{sample}.pt")
    memory = step_memory(bundle, optimizer)
    assert list(memory.parts) == list(KINDS)
    assert sum(memory.parts.values()) == memory.peak_bytes == max(memory.phases.values())
    assert all(value >= 0 for value in memory.parts.values())
    assert memory.peak_bytes == memory.phases[memory.phase]


def test_the_graph_phases_are_the_simulators_figures_plus_the_optimizers_states(monkeypatch):
    from dcsched.sim import saved_storage
    from dcsched.sim.bundle_figures import simulated_figures
    bundle = dcsched.load("sample_graphs/gpt.pt")
    figures, _ = simulated_figures(bundle)
    shards = sum(math.prod(p.shape) for p in bundle.params) * 4 // 8  # fp32, 8 ranks (sizes divide evenly)
    plain, adamw = step_memory(bundle, "none"), step_memory(bundle, "adamw")
    assert plain.phases["forward"] == figures["forward_peak_bytes"]
    # saved tensors sharing a storage count it once here, each its recorded size in the graph's own figures
    assert plain.phases["backward"] < figures["backward_peak_bytes"] + figures["held_across_bytes"]
    with monkeypatch.context() as patch:
        patch.setattr(saved_storage, "saved_storage_bytes", lambda bundle: {})
        patch.setattr(saved_storage, "saved_forward_roots", lambda bundle: frozenset())
        assert step_memory(bundle, "none").phases["backward"] == \
            figures["backward_peak_bytes"] + figures["held_across_bytes"]
    assert plain.parts["parameter_shards"] == shards  # every shard, across the backward too
    assert adamw.phases["backward"] - plain.phases["backward"] == 2 * shards  # two fp32 moments, on the GPU
    assert adamw.parts["optimizer_states"] == 2 * shards
    assert adamw.cuda is not None and adamw.cuda.reserved_bytes >= adamw.cuda.allocated_bytes >= adamw.peak_bytes


def test_a_hand_computed_step():
    # Linear(4, 2) on one rank: weight 32 B, bias 8 B; AdamW on the CPU
    bundle = dcsched.profile_bundle(
        dcsched.capture(torch.nn.Linear(4, 2), (torch.randn(3, 4),), loss_fn=lambda out: out.sum()),
        dcsched.ProfileOptions(cost_model="analytic", gpu="h100", world_size=1))
    memory = step_memory(bundle, "adamw", gpu=False)
    update = memory.phases["optimizer"]
    # shards 40 + gradients 40 + two moments 80 + two step scalars 8 + the update's temporaries: the weight's two
    # (32 each), more than the bias's two (8 each) with the weight's last still bound (32)
    assert update == 40 + 40 + 80 + 8 + 2 * 32
    from dcsched.sim.step_memory import _temporaries
    assert _temporaries(named("adamw"), [8, 32, 32, 4], gpu=False) == [32, 32, 32]  # the neighbours' largest
    assert _temporaries(named("adamw"), [8, 32, 32, 4], gpu=True) == [8, 32, 32, 4]  # _foreach_sqrt: one list
    plain = step_memory(bundle, "sgd", gpu=False)
    assert plain.phases["optimizer"] == 40 + 40
    assert memory.phases["forward"] - plain.phases["forward"] == 80 + 8


class _GroupedQueryAttention(torch.nn.Module):
    """One key-value head repeated to two query heads (an expand the backward saves), the attention's output
    saved twice (for its own backward and, viewed, for the output projection's)."""

    def __init__(self):
        super().__init__()
        self.wq, self.wo = (torch.nn.Parameter(torch.randn(16, 16) / 4) for _ in range(2))
        self.wk, self.wv = (torch.nn.Parameter(torch.randn(16, 8) / 4) for _ in range(2))

    def forward(self, x):
        b, s, _ = x.shape
        q = (x @ self.wq).view(b, s, 2, 8).transpose(1, 2)
        k, v = ((x @ w).view(b, 1, s, 8).unsqueeze(2).expand(b, 1, 2, s, 8).reshape(b, 2, s, 8)
                for w in (self.wk, self.wv))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return (o.transpose(1, 2).reshape(b, s, 16) @ self.wo).sum()


def test_saved_tensors_count_their_storage_once(monkeypatch):
    from dcsched.sim import saved_storage
    from dcsched.sim.saved_storage import saved_storage_bytes
    bundle = dcsched.profile_bundle(dcsched.capture(_GroupedQueryAttention(), (torch.randn(2, 4, 16),)),
                                    dcsched.ProfileOptions(cost_model="analytic", gpu="h100", world_size=1))
    recorded = {node.name: node.meta["tensor_size"] for node in bundle.backward.nodes if node.op == "placeholder"}
    counted = saved_storage_bytes(bundle)
    # the saved expanded keys and values: 512 B recorded (2 heads), 256 B held (the one head's storage)
    expanded = [name for name, nbytes in counted.items() if nbytes == recorded[name] // 2]
    assert len(expanded) == 2 and all(recorded[name] == 512 for name in expanded)
    # the attention's output saved twice: one of the two carries it, the other counts 0
    assert sorted(counted.values()) == [0, 256, 256]
    memory = step_memory(bundle, "sgd")
    assert sum(memory.parts.values()) == memory.peak_bytes
    monkeypatch.setattr(saved_storage, "saved_storage_bytes", lambda bundle: {})
    as_recorded = step_memory(bundle, "sgd")
    assert 0 < as_recorded.phases["backward"] - memory.phases["backward"] <= 2 * 256 + 256


def test_the_caching_allocator_rounds_blocks_and_packs_segments():
    assert round_size(1) == 512 and round_size(1025) == 1536
    small = cuda_footprint([100] * 5000)  # 5000 blocks of 512 B: 2.44 MiB, two 2 MiB segments
    assert small.allocated_bytes == 5000 * 512 and small.reserved_bytes == 4 * MiB
    assert cuda_footprint([11 * MiB + 1]).reserved_bytes == 12 * MiB  # its own segment, 2 MiB multiples
    assert cuda_footprint([2 * MiB]).reserved_bytes == 20 * MiB  # a 20 MiB large-pool segment


def test_optimizers_are_named_from_torch_and_recorded_in_bounds():
    p = torch.nn.Parameter(torch.ones(3))
    assert of_torch(torch.optim.Adam([p], amsgrad=True)).state_tensors == 3
    assert of_torch(torch.optim.SGD([p], lr=0.1)).state_tensors == 0
    assert of_torch(torch.optim.LBFGS([p])) is None
    assert from_provenance({"optimizer": named("adamw").provenance()}) == named("adamw")
    for bad in ({"name": "x", "state_tensors": 99}, ["adamw"], {"name": "x", "state_tensors": 1, "code": "x"}):
        with pytest.raises(OptimizerError):
            from_provenance({"optimizer": bad})


def test_a_profiled_script_records_its_optimizer():
    from pathlib import Path
    gpt = Path(dcsched.__file__).parent.parent / "examples" / "gpt.py"
    bundle = dcsched.capture_script(gpt, ["--layers", "1", "--d-model", "32", "--heads", "2", "--vocab", "64",
                                          "--seq", "8", "--batch", "2", "--steps", "1"])
    assert bundle.provenance["optimizer"]["name"] == "adamw"


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "dcsched", *args], capture_output=True, text=True, cwd=cwd)


def test_show_and_schedule_carry_the_breakdown(tmp_path):
    from pathlib import Path
    sample = str(Path("sample_graphs/llama.pt").resolve())
    shown = _cli("show", sample, "--json", "--optimizer", "adamw", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    memory = json.loads(shown.stdout)["step_memory"]
    assert sum(memory["parts"].values()) == memory["peak_bytes"] and memory["optimizer"] == "adamw"
    done = _cli("schedule", sample, "--algo", "fast-free", "-o", str(tmp_path / "out.pt"), "--json",
                "--optimizer", "sgd-momentum", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    step = json.loads(done.stdout)["step_memory"]
    assert set(step) == {"before", "fast-free"} and step["fast-free"]["parts"]["optimizer_states"] > 0
    table = _cli("schedule", sample, "--algo", "fast-free", "-o", str(tmp_path / "t.pt"), cwd=tmp_path)
    assert "Whole-step memory per rank" in table.stdout and "optimizer states" in table.stdout


@pytest.mark.parametrize("command", ["show", "schedule"])
def test_an_unknown_optimizer_is_one_line_and_exit_2(tmp_path, command):
    from pathlib import Path
    done = _cli(command, str(Path("sample_graphs/gpt.pt").resolve()), "--optimizer", "lamb", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0
    assert "unknown optimizer 'lamb': one of adadelta" in done.stderr
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------
# Two gloo ranks: simulated against measured
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    pytest.importorskip("transformers")  # the Hugging Face Llama
    import step_memory_runs
    return step_memory_runs.spawn(tmp_path_factory.mktemp("step_memory"), 2)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("run", [f"{model}-{precision}" for model in ("gpt", "llama", "hf-llama")
                                 for precision in ("fp32", "bf16")])
def test_the_whole_step_peak_is_the_measured_one_within_5_percent(two_ranks, run):
    for rank in range(2):
        result = two_ranks[rank][run]
        measured, simulated = result["measured"], result["simulated"]
        assert abs(measured - simulated) <= 0.05 * measured, (rank, run, result)
        assert result["optimizer_states"] > 0


@pytest.mark.parametrize("record", [{"name": "adamw", "state_tensors": 10**9}, "adamw",
                                    {"name": "x", "state_tensors": 1, "__reduce__": "os.system"}])
def test_a_bundle_with_a_bad_optimizer_record_is_refused_in_one_line(tmp_path, record):
    from dcsched.bundle import core as bundle_io
    bundle = dcsched.load("sample_graphs/convnet.pt")
    bundle.provenance["optimizer"] = record
    path = tmp_path / "bad.pt"
    bundle_io.save(bundle, path)
    before = sorted(tmp_path.iterdir())
    done = _cli("show", str(path), "--json", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "optimizer" in done.stderr and sorted(tmp_path.iterdir()) == before
