"""Activation checkpointing recipes under dcsched: captured in one graph, trained with the plain losses.

Forms: ``torch.utils.checkpoint.checkpoint`` (non-reentrant and reentrant), torchtitan-style selective
checkpointing (``create_selective_checkpoint_contexts`` saving matmul and attention outputs),
``torch._functorch.config.activation_memory_budget``, and Hugging Face's ``gradient_checkpointing_enable``
(whose ``kernels`` layer wrapper writes a global inside each checkpointed layer). One process: each form
under each algorithm equals plain eager PyTorch (a Latin square of them in the quick suite, the rest marked
slow); the backward re-gathers each block's parameters to recompute it, as many collectives planned as
without checkpointing. Two gloo ranks (slow): Hugging Face Llama and the selective policy, the default
(measured) cost model; every form on two and three ranks. ``profile --meta`` of ``examples/llama.py`` under
each form captures the graphs of a real capture.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch._functorch.config

import dcsched
from dcsched.graph.roles import Role, role_of

import train_runs as runs
from gloo import on_gloo_ranks

ALGOS = ("list", "fast-free", "overlap", "overlap-plan", "fsdp")
FORMS = ("full", "reentrant", "selective", "budget")
#: Each form and each algorithm once in the quick suite.
QUICK = {("full", "overlap-plan"), ("reentrant", "fast-free"), ("selective", "fsdp"), ("budget", "overlap"),
         ("selective", "list")}
STEPS, BATCH = 3, 4
#: Two blocks, so checkpointed regions meet.
LAYERS = {"n_layers": 2}


def _form(form: str):
    """(the model's overrides, the context the run needs) of a checkpointing form."""
    if form == "budget":
        return dict(LAYERS), torch._functorch.config.patch(activation_memory_budget=0.5)
    return {**LAYERS, "checkpointing": form}, contextlib.nullcontext()


@pytest.fixture(scope="module")
def plain_losses():
    return runs.train_eager("llama", STEPS, BATCH, **LAYERS)


@pytest.mark.parametrize("form,algo", [
    pytest.param(form, algo, marks=() if (form, algo) in QUICK else pytest.mark.slow)
    for form in FORMS for algo in ALGOS])
def test_a_checkpointed_llama_trains_with_the_plain_losses(form, algo, plain_losses):
    overrides, context = _form(form)
    with context:
        result = runs.train_dcsched("llama", algo, STEPS, BATCH, **overrides)
    assert torch.allclose(torch.tensor(result["losses"]), torch.tensor(plain_losses), rtol=1e-5, atol=0)
    assert plain_losses[-1] != plain_losses[0]
    measured, simulated = result["memory"]["backward"]
    if algo in ("list", "fast-free", "overlap"):  # no buckets: the simulator's peak is what ran, to a scalar
        assert abs(measured - simulated) <= 16, (measured, simulated)


def _gathers(graph) -> list[int]:
    return sorted(int(node.args[2]) for node in graph.nodes if role_of(node) is Role.ALLGATHER)


def _captured(checkpointing: str, **config):
    from dcsched.examples import build
    model, inputs, loss_fn = build("llama", n_layers=2, d_model=32, n_heads=2, vocab=64, seq=8, batch=2,
                                   checkpointing=checkpointing, **config)
    return dcsched.capture(model, inputs, loss_fn=loss_fn)


def test_the_backward_recomputes_each_block_from_parameters_it_gathers_again():
    plain, checkpointed = _captured("none"), _captured("full")
    # Every parameter but the embedding's (its gradient needs no weight) is gathered again in the backward,
    # with and without checkpointing: recomputing a block costs no collective more.
    assert _gathers(checkpointed.backward) == _gathers(plain.backward) == list(range(1, len(plain.params)))
    # The recomputation is there: the backward holds more matmuls, the forward saves less.
    def mms(graph):
        return sum(1 for node in graph.nodes if node.target is torch.ops.aten.mm.default)
    assert mms(checkpointed.backward) > mms(plain.backward)
    assert len(checkpointed.backward_placeholders) < len(plain.backward_placeholders)


def test_selective_checkpointing_saves_the_matmuls_it_names():
    full, selective = _captured("full"), _captured("selective")
    assert sum(1 for n in selective.backward.nodes if n.target is torch.ops.aten.mm.default) < \
        sum(1 for n in full.backward.nodes if n.target is torch.ops.aten.mm.default)


def test_recomputed_attention_needs_no_generator_state_in_the_bundle():
    bundle = _captured("full")
    targets = {str(node.target) for graph in (bundle.forward, bundle.backward) for node in graph.nodes}
    assert not any("rng_state" in target for target in targets)
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in targets


@pytest.fixture(scope="module")
def plain_of():
    """``plain_of(name)``: the Hugging Face model's eager losses under gradient checkpointing, once per module."""
    pytest.importorskip("transformers")
    import hf_models
    done: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in done:
            done[name] = hf_models.train(name, STEPS, checkpointing={"use_reentrant": False})
        return done[name]

    return get


@pytest.fixture(scope="module")
def plain_hf(plain_of):
    return plain_of("llama")


@pytest.mark.parametrize("name,algo,reentrant", [
    ("llama", "overlap-plan", False), pytest.param("llama", "fsdp", True, marks=pytest.mark.slow),
    pytest.param("llama", "list", False, marks=pytest.mark.slow),
    pytest.param("llama", "fast-free", False, marks=pytest.mark.slow),
    pytest.param("llama", "overlap", True, marks=pytest.mark.slow),
    pytest.param("gpt2", "overlap-plan", False, marks=pytest.mark.slow),
    pytest.param("gpt2", "fsdp", True, marks=pytest.mark.slow)])
def test_hugging_face_gradient_checkpointing_trains_in_one_graph_with_the_plain_losses(name, algo, reentrant,
                                                                                       plain_of):
    import hf_models
    result = hf_models.train(name, STEPS, algo, checkpointing={"use_reentrant": reentrant})
    plain = plain_of(name)
    assert torch.allclose(torch.tensor(result["losses"]), torch.tensor(plain["losses"]), rtol=1e-5, atol=0)
    assert result["collectives"]["graphs"] == 1  # one graph: no checkpointed layer left to eager code
    saved, without = result["saved"]
    assert saved < without  # the layers were checkpointed: the step saves less for its backward


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    pytest.importorskip("transformers")
    plan = [(f"hf-{algo}", "hf-llama", algo, STEPS, BATCH, {"checkpointing": {"use_reentrant": False}})
            for algo in ("fast-free", "overlap-plan", "fsdp")]
    plan += [(f"selective-{algo}", "llama", algo, STEPS, BATCH,
              {**LAYERS, "checkpointing": "selective", "cost_model": "measured"})
             for algo in ("list", "overlap", "overlap-plan", "fsdp")]
    plan += [(f"none-{algo}", "llama", algo, STEPS, BATCH, {**LAYERS, "cost_model": "measured"})
             for algo in ("overlap-plan", "fsdp")]
    return runs.spawn(tmp_path_factory.mktemp("recipes2"), 2, plan)


@pytest.mark.slow
@on_gloo_ranks
def test_hugging_face_checkpointing_on_two_ranks_trains_with_the_plain_losses(two_ranks, plain_hf):
    for rank in range(2):
        for algo in ("fast-free", "overlap-plan", "fsdp"):
            result = two_ranks[rank][f"hf-{algo}"]
            assert torch.allclose(torch.tensor(result["losses"]), torch.tensor(plain_hf["losses"]), rtol=1e-5,
                                  atol=0), (rank, algo)
            counts = result["collectives"]
            assert counts["graphs"] == 1 and counts["issued"] == counts["planned"], (rank, algo, counts)


@pytest.mark.slow
@on_gloo_ranks
def test_selective_checkpointing_on_two_ranks_trains_as_eager_with_the_planned_collectives(two_ranks):
    eager = runs.train_eager("llama", STEPS, BATCH, **LAYERS)
    for rank in range(2):
        for algo in ("list", "overlap", "overlap-plan", "fsdp"):
            result = two_ranks[rank][f"selective-{algo}"]
            assert torch.allclose(torch.tensor(result["losses"]), torch.tensor(eager), rtol=1e-5, atol=0), algo
            assert result["collectives"]["issued"] == result["collectives"]["planned"], (rank, algo)
        planned = {key: two_ranks[rank][key]["collectives"]["planned"]
                   for key in ("selective-fsdp", "none-fsdp", "selective-overlap-plan")}
        # FSDP2's units are blocks: recomputation costs no collective more; overlap-plan never plans more
        assert planned["selective-fsdp"] == planned["none-fsdp"], (rank, planned)
        assert planned["selective-overlap-plan"] <= planned["selective-fsdp"], (rank, planned)


#: Every form on W gloo ranks, each once, the algorithms rotated: on 2 ranks the forms the runs above leave out,
#: on 3 (uneven shards) each form but Hugging Face's reentrant one (TorchDynamo traces it as the non-reentrant,
#: the graphs identical; trained on 1 and 2 ranks). ``hf``: Hugging Face's ``gradient_checkpointing_enable`` (the
#: Llama; ``hf-gpt2``: GPT-2).
EVERY_FORM = {2: [("full", "overlap"), ("reentrant", "fast-free"), ("budget", "overlap-plan"),
                  ("hf-reentrant", "fsdp"), ("hf-gpt2", "overlap-plan")],
              3: [("full", "fsdp"), ("reentrant", "list"), ("selective", "overlap-plan"), ("budget", "fast-free"),
                  ("hf", "overlap")]}
#: The global batch on W ranks: each rank trains an equal slice of it.
GLOBAL_BATCH = {2: BATCH, 3: 6}


def _spawned_run(form: str, algo: str, world_size: int) -> tuple:
    if form.startswith("hf"):
        model = "hf-gpt2" if form == "hf-gpt2" else "hf-llama"
        return (f"{form}-{algo}", model, algo, STEPS, 0, {"checkpointing": {"use_reentrant": form == "hf-reentrant"}})
    overrides = ({**LAYERS, "activation_memory_budget": 0.5} if form == "budget"
                 else {**LAYERS, "checkpointing": form})
    overrides["cost_model"] = "measured"  # dcsched's default, as the Hugging Face runs'
    return (f"{form}-{algo}", "llama", algo, STEPS, GLOBAL_BATCH[world_size], overrides)


@pytest.fixture(scope="module", params=sorted(EVERY_FORM), ids=lambda world_size: f"{world_size}-ranks")
def every_form(request, tmp_path_factory):
    pytest.importorskip("transformers")
    world_size = request.param
    plan = [_spawned_run(form, algo, world_size) for form, algo in EVERY_FORM[world_size]]
    return world_size, runs.spawn(tmp_path_factory.mktemp(f"every-form{world_size}"), world_size, plan)


@pytest.mark.slow
@on_gloo_ranks
def test_every_form_trains_with_the_plain_losses_on_two_and_three_ranks(every_form, plain_of):
    world_size, ranks = every_form
    eager = runs.train_eager("llama", STEPS, GLOBAL_BATCH[world_size], **LAYERS)
    for rank in range(world_size):
        for form, algo in EVERY_FORM[world_size]:
            result = ranks[rank][f"{form}-{algo}"]
            plain = plain_of("gpt2" if form == "hf-gpt2" else "llama")["losses"] if form.startswith("hf") else eager
            assert torch.allclose(torch.tensor(result["losses"]), torch.tensor(plain), rtol=1e-5, atol=0), \
                (rank, form, algo, result["losses"], plain)
            assert result["collectives"]["issued"] == result["collectives"]["planned"], (rank, form, algo)
            saved, without = result["saved"]
            assert saved < without, (rank, form, algo)  # it did checkpoint


HF_SCRIPT = '''
import sys, torch, transformers as hf
torch.manual_seed(0)
model = hf.LlamaForCausalLM(hf.LlamaConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=32,
                                           intermediate_size=64, vocab_size=64, num_key_value_heads=1,
                                           max_position_embeddings=16, use_cache=False))
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": sys.argv[1] == "reentrant"})
model.train()
run = torch.compile(model)
ids = torch.randint(1, 64, (2, 8))
run(input_ids=ids, labels=ids).loss.backward()
'''


@pytest.mark.slow
@pytest.mark.parametrize("reentrant,meta", [(False, True), (True, False), (True, True)])
def test_profile_captures_a_hugging_face_script_with_gradient_checkpointing(tmp_path, reentrant, meta):
    pytest.importorskip("transformers")
    from dcsched.profile.capture import capture_script_step
    script = tmp_path / "train.py"
    script.write_text(HF_SCRIPT)
    bundle = capture_script_step(script, ["reentrant" if reentrant else "plain"], meta=meta).bundle
    assert bundle.provenance["module"] == "LlamaForCausalLM"
    # every parameter but the embedding's gathered again in the backward, where the layers are recomputed
    assert _gathers(bundle.backward) == list(range(1, len(bundle.params)))


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "llama.py"
#: examples/llama.py at the size of the tests' Llama; the script moves its model and batches with .to(device).
EXAMPLE_ARGS = ["--layers", "2", "--d-model", "32", "--heads", "2", "--vocab", "64", "--seq", "8", "--batch", "2"]
#: examples/llama.py's arguments for each checkpointing form.
EXAMPLE_FORMS = {"full": ["--checkpointing", "full"], "reentrant": ["--checkpointing", "reentrant"],
                 "selective": ["--checkpointing", "selective"], "budget": ["--activation-memory-budget", "0.5"]}


def _signature(graph) -> list[tuple[str, str, str]]:
    return [(node.op, str(node.target), str(node.meta.get("out"))) for node in graph.nodes]


@pytest.mark.parametrize("form", [
    pytest.param(form, marks=() if form in ("full", "selective") else pytest.mark.slow) for form in EXAMPLE_FORMS])
def test_profile_meta_captures_the_example_llama_under_each_checkpointing_form_as_a_real_run(form, tmp_path, capsys):
    from dcsched.cli import run
    for how, meta in (("planned", ["--meta"]), ("real", [])):
        with torch._functorch.config.patch(activation_memory_budget=1.0):  # the script sets it for the budget form
            assert run(["profile", str(EXAMPLE), *meta, "--cost-model", "analytic", "--gpu", "h100", "--no-progress",
                        "-o", str(tmp_path / f"{how}.pt"), "--", *EXAMPLE_ARGS, *EXAMPLE_FORMS[form]]) == 0, \
                capsys.readouterr().err
    planned, real = dcsched.load(tmp_path / "planned.pt"), dcsched.load(tmp_path / "real.pt")
    assert not real.provenance.get("planned")
    assert planned.provenance["planned"]
    for graph in ("forward", "backward"):  # node for node the graphs of the run on the CPU
        assert _signature(planned.graphs[graph]) == _signature(real.graphs[graph]), graph
    # checkpointing did recompute: the step saves less than it would without, as much as the real capture says
    saved, without = (planned.provenance[key] for key in ("saved_for_backward_bytes",
                                                          "saved_for_backward_bytes_without_checkpointing"))
    assert saved < without and (saved, without) == (real.provenance["saved_for_backward_bytes"],
                                                    real.provenance["saved_for_backward_bytes_without_checkpointing"])
    # the backward gathers again every parameter whose gradient needs it (the budget's recomputation, the
    # embedding's too), as the real capture does
    assert _gathers(planned.backward) == _gathers(real.backward)
    assert set(_gathers(planned.backward)) >= set(range(1, len(planned.params)))


def test_a_script_moving_its_model_and_batches_to_a_device_keeps_them_on_meta_when_planned():
    from dcsched.profile.meta_device import CPU, planning_device
    with planning_device(CPU):
        model = torch.nn.Linear(4, 4).to("cpu").cuda().to(device=torch.device("cuda", 0), dtype=torch.bfloat16)
        batch = torch.ones(2, 4).cuda(0).to(torch.empty(1, dtype=torch.float16), non_blocking=True).cpu()
        made = torch.zeros(3)
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("meta", torch.bfloat16)}
    assert (batch.device.type, batch.dtype, made.device.type) == ("meta", torch.float16, "meta")
    assert torch.ones(1).to("meta").is_meta and not torch.ones(1).is_meta  # outside planning, moves are moves


class DropoutBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.nn.functional.dropout(torch.tanh(self.lin(x)), 0.5, True)


class CheckpointedDropout(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = DropoutBlock()

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.block, x, use_reentrant=False).square().mean()


def test_dropout_in_a_checkpointed_block_is_saved_not_replayed():
    bundle = dcsched.capture(CheckpointedDropout(), [torch.randn(4, 8)])
    targets = [str(node.target) for node in bundle.backward.nodes]
    assert not any("rng_state" in target for target in targets)
    assert "aten.native_dropout.default" not in targets  # the forward's draw is read, not drawn again
    assert "aten.mm.default" in targets or "aten.addmm.default" in targets  # the rest of the block recomputed


def test_dropout_in_a_checkpointed_block_trains_as_the_plain_module():
    torch._dynamo.reset()
    model, plain = CheckpointedDropout(), CheckpointedDropout()
    dcsched.shard(model)
    compiled = torch.compile(model, backend=dcsched.backend(algo="overlap", cost_model="analytic", gpu="h100"),
                             dynamic=False)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (model, plain)]
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        losses = []
        for run in (compiled, plain):
            torch.manual_seed(100 + step)  # the same dropout mask in both
            losses.append(run(x))
        for loss, optimizer in zip(losses, optimizers):
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert torch.allclose(losses[0], losses[1], rtol=1e-6, atol=0), step
