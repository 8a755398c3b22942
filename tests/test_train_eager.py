"""Eager code around a sharded module (dcsched.train.eager): full parameters in eager module calls, one line for
any other read of a stand-in, never a crash.

One process: the uncompiled module and a checkpointed block TorchDynamo leaves to eager equal the plain module;
reads of a stand-in outside its module's call stop with one line. Two gloo ranks (one spawn, the default cost
model): a Hugging Face Llama with non-reentrant gradient checkpointing (a SIGSEGV before) trains with the plain
losses, then the uncompiled model's evaluation and greedy ``generate`` equal the plain model's; an eager call with
gradients reduce-scatters them into the shards.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import dcsched
from dcsched.profile.scripts import unwrap_dynamo_error
from dcsched.runtime.distributed import shard_of
from dcsched.train.sharding import ShardingError

import eager_runs
from gloo import on_gloo_ranks


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)
        self.norm = torch.nn.LayerNorm(6)

    def forward(self, x):
        return self.norm(torch.tanh(self.lin(x)))


class Checkpointed(torch.nn.Module):
    """Two blocks, the second under non-reentrant checkpointing in a region TorchDynamo leaves to eager."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = Block(), Block()
        self.head = torch.nn.Linear(6, 1)

    def forward(self, x):
        h = self.first(x)
        h = torch._dynamo.disable(lambda h: checkpoint(self.second, h, use_reentrant=False))(h)
        return self.head(h).square().mean()


def inputs(step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(step))


def test_a_checkpointed_block_left_to_eager_trains_as_the_plain_module():
    torch._dynamo.reset()
    model, plain = Checkpointed(), Checkpointed()
    dcsched.shard(model)
    compiled = torch.compile(model, backend=dcsched.backend(algo="overlap", cost_model="analytic", gpu="h100"),
                             dynamic=False)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (model, plain)]
    for step in range(3):
        losses = [compiled(inputs(step)), plain(inputs(step))]
        for loss, optimizer in zip(losses, optimizers):
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert torch.allclose(losses[0], losses[1], rtol=1e-6, atol=0), step
    assert model.second.lin.weight.shape == (36,)  # trained as shards, put back after each eager call


def test_the_uncompiled_module_runs_eagerly_with_its_gradients_in_the_shards():
    model = eager_runs.Hooked()
    plain = copy.deepcopy(model)
    dcsched.shard(model)
    x = inputs(0)
    loss, expected = model(x), plain(x)
    assert torch.equal(loss, expected)
    loss.backward()
    expected.backward()
    for (name, shard), full in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(shard.grad, full.grad.reshape(-1)), name
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))
    assert [type(p) for p in model.parameters()] == [torch.nn.Parameter] * 4  # the shards are back


def _first_error(call) -> str:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 (TorchDynamo may wrap it)
        error = unwrap_dynamo_error(exc)
        assert isinstance(error, ShardingError), repr(error)
        message = str(error)
        assert "\n" not in message
        return message
    raise AssertionError("nothing raised")


class PrintsInForward(eager_runs.Hooked):
    def forward(self, x):
        h = self.lin(x)
        torch._dynamo.graph_break()
        print(self.norm.weight)
        return self.norm(h).sum()


class SumsInForward(eager_runs.Hooked):
    def forward(self, x):
        h = self.lin(x)
        torch._dynamo.graph_break()
        return self.norm(h).sum() + self.norm.weight.sum().item()


def test_a_parameter_summed_across_a_graph_break_is_the_full_one():
    # TorchDynamo puts the sum in the graph after the break, which dcsched runs on the gathered weight.
    torch._dynamo.reset()
    model = SumsInForward()
    with torch.no_grad():
        model.norm.weight.uniform_()
    plain = copy.deepcopy(model)
    dcsched.shard(model)
    compiled = torch.compile(model, backend=dcsched.backend(algo="none", cost_model="analytic", gpu="h100"),
                             dynamic=False)
    assert torch.allclose(compiled(inputs(0)), plain(inputs(0)), rtol=1e-6, atol=0)


@pytest.mark.parametrize("make", [lambda: eager_runs.Hooked(hooked=True), PrintsInForward],
                         ids=["hook-prints", "graph-break-prints"])
def test_an_eager_read_of_a_stand_in_stops_with_one_line_naming_it(make):
    torch._dynamo.reset()
    model = make()
    dcsched.shard(model)
    compiled = torch.compile(model, backend=dcsched.backend(algo="none", cost_model="analytic", gpu="h100"),
                             dynamic=False)
    message = _first_error(lambda: compiled(inputs(0)))
    assert message.startswith("LayerNorm's parameter norm.weight was read by eager code outside its module's call")
    assert "model.state_dict()" in message and "runs only compiled" not in message


def test_a_stand_in_answers_its_metadata_and_refuses_its_bytes():
    model = eager_runs.Hooked()
    sharding = dcsched.shard(model)
    stand_in = sharding.specs[0].stand_in
    assert (tuple(stand_in.shape), stand_in.dtype, stand_in.numel(), stand_in.dim()) == ((6, 6), torch.float32, 36, 2)
    assert stand_in.requires_grad and stand_in.untyped_storage().nbytes() == 0
    for read in (lambda: stand_in.sum(), lambda: print(stand_in), lambda: stand_in.data, lambda: stand_in * 2,
                 lambda: torch.nn.functional.linear(torch.ones(6), stand_in)):
        assert _first_error(read).startswith("Linear's parameter lin.weight was read by eager code")
    # Outside a forward the parameter is this rank's shard, as the optimizer steps it.
    assert model.lin.weight.shape == (36,) and float(model.lin.weight.sum()) == float(eager_runs.Hooked().lin.weight.sum())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    pytest.importorskip("transformers")
    return eager_runs.spawn(tmp_path_factory.mktemp("eager2"))


@pytest.fixture(scope="module")
def plain_llama():
    return eager_runs.checkpointed_llama(None)


@pytest.mark.slow
@on_gloo_ranks
def test_checkpointed_hugging_face_llama_trains_on_two_ranks_as_the_plain_model(two_ranks, plain_llama):
    for rank in range(2):
        losses = two_ranks[rank]["llama"]["losses"]
        assert torch.allclose(torch.tensor(losses), torch.tensor(plain_llama["losses"]), rtol=1e-5, atol=0), rank
    assert plain_llama["losses"][-1] != plain_llama["losses"][0]


@pytest.mark.slow
@on_gloo_ranks
def test_uncompiled_evaluation_and_generate_on_two_ranks_equal_the_plain_model(two_ranks, plain_llama):
    for rank in range(2):
        result = two_ranks[rank]["llama"]
        assert torch.allclose(result["logits"], plain_llama["logits"], rtol=1e-4, atol=1e-5), rank
        assert torch.equal(result["tokens"], plain_llama["tokens"]), rank
    assert plain_llama["tokens"].shape == (eager_runs.PROMPT_ROWS, eager_runs.PROMPT_TOKENS + eager_runs.NEW_TOKENS)


@pytest.mark.slow
@on_gloo_ranks
def test_eager_calls_gather_and_reduce_scatter_on_two_ranks(two_ranks):
    plain = eager_runs.Hooked()
    loss = plain(torch.linspace(-1, 1, 24).view(4, 6))
    loss.backward()
    for rank in range(2):
        result = two_ranks[rank]["eager"]
        assert result["loss"] == float(loss.detach())
        for (name, grad), full in zip(result["grads"].items(), plain.parameters()):
            assert torch.allclose(grad, shard_of(full.grad, rank, 2), rtol=1e-6, atol=1e-7), (rank, name)


@pytest.mark.slow
@on_gloo_ranks
def test_a_hook_reading_a_parameter_stops_both_ranks_with_one_line(two_ranks):
    for rank in range(2):
        assert two_ranks[rank]["refused"].startswith(
            "ShardingError: LayerNorm's parameter norm.weight was read by eager code"), rank
