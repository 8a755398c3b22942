"""dcsched.shard and dcsched.backend in one process (world size 1)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import dcsched
from dcsched.profile.scripts import unwrap_dynamo_error
from dcsched.train import ShardingError


class Tied(nn.Module):
    """Tied embeddings, a frozen parameter, a parameter the forward never reads, and a BatchNorm."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.BatchNorm1d(6)
        self.scale = nn.Parameter(torch.full((6,), 0.5), requires_grad=False)
        self.unused = nn.Parameter(torch.ones(5))

    def forward(self, idx, targets):
        x = self.norm(self.embed(idx).mean(1)) * self.scale
        return nn.functional.cross_entropy(self.head(x), targets)


def test_shard_keeps_parameter_objects_and_shards_a_tied_parameter_once():
    model = Tied()
    before = list(model.parameters())
    sharding = dcsched.shard(model)
    assert list(model.parameters()) == before  # the same objects: an optimizer built earlier sees the shards
    assert [s.name for s in sharding.specs] == ["scale", "unused", "embed.weight", "norm.weight", "norm.bias"]
    assert [s.shape for s in sharding.specs] == [(6,), (5,), (10, 6), (6,), (6,)]
    assert model.embed.weight.shape == (60,) and model.head.weight is model.embed.weight
    # a frozen parameter is sharded too (it may be unfrozen after the compile); buffers stay whole
    assert not model.scale.requires_grad and model.norm.running_mean.shape == (6,)
    assert dcsched.shard(model) is sharding
    # Called eagerly, each submodule gathers its own parameters (the tied one in either module): the plain result.
    idx, targets = torch.tensor([[1, 2, 3], [4, 5, 9]]), torch.tensor([0, 7])
    assert torch.equal(model(idx, targets), Tied()(idx, targets))
    assert model.embed.weight.shape == (60,) and model.head.weight is model.embed.weight


def test_training_a_sharded_module_equals_eager_training_bit_for_bit():
    model = Tied()
    eager = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)  # built before sharding: fine
    dcsched.shard(model)
    compiled = torch.compile(model, backend=dcsched.backend(algo="overlap", cost_model="analytic", gpu="h100"),
                             dynamic=False)
    eager_optimizer = torch.optim.AdamW(eager.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        idx = torch.randint(0, 10, (4, 3), generator=generator)
        targets = torch.randint(0, 10, (4,), generator=generator)
        loss, expected = compiled(idx, targets), eager(idx, targets)
        assert torch.equal(loss, expected)
        for opt, value in ((optimizer, loss), (eager_optimizer, expected)):
            value.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert torch.equal(model.embed.weight.view(10, 6), eager.embed.weight)
    assert torch.equal(model.norm.running_mean, eager.norm.running_mean)  # BatchNorm statistics written back
    assert int(model.norm.num_batches_tracked) == 4
    assert torch.equal(model.unused, torch.ones(5))  # never read, never stepped (no gradient)


@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
def test_evaluation_without_gradients_runs_the_forward_alone_and_equals_eager(no_grad):
    torch._dynamo.reset()  # each sharded module's forward shares one code object: a fresh recompile budget
    # Evaluation first (before any training step), between steps, in train and eval mode (BatchNorm's
    # statistics read and, in train mode, updated as eager updates them).
    model = Tied()
    eager = copy.deepcopy(model)
    optimizer, eager_optimizer = (torch.optim.AdamW(m.parameters(), lr=0.1) for m in (model, eager))
    dcsched.shard(model)
    backend = dcsched.backend(algo="overlap", memory_budget="unlimited")  # the default, measured costs
    compiled = torch.compile(model, backend=backend, dynamic=False)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 10, (4, 3), generator=generator), torch.randint(0, 10, (4,), generator=generator))
               for _ in range(3)]
    for step, batch in enumerate(batches):
        for train_mode in (True, False):
            for module in (model, eager):
                module.train(train_mode)
            with no_grad():
                evaluated, expected = compiled(*batch), eager(*batch)
            assert not evaluated.requires_grad
            assert torch.equal(evaluated, expected), (step, train_mode)
        model.train(), eager.train()
        for opt, value in ((optimizer, compiled(*batch)), (eager_optimizer, eager(*batch))):
            value.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert torch.equal(model.embed.weight.view(10, 6), eager.embed.weight)
    assert torch.equal(model.norm.running_mean, eager.norm.running_mean)
    # Train mode with and without gradients, eval mode without (dynamo guards on both).
    assert len(backend.programs) == 3


class Broken(nn.Module):
    """A forward TorchDynamo breaks into three graphs: parameters before the break, after it, and none."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x, y):
        hidden = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        out = self.b(hidden)
        torch._dynamo.graph_break()
        return ((out - y) ** 2).mean()


def test_a_forward_broken_into_several_graphs_trains_each_sharded_and_scheduled():
    torch._dynamo.reset()  # each sharded module's forward shares one code object: a fresh recompile budget
    model = Broken()
    eager = copy.deepcopy(model)
    optimizer, eager_optimizer = (torch.optim.AdamW(m.parameters(), lr=0.1) for m in (model, eager))
    dcsched.shard(model)
    backend = dcsched.backend(algo="fast-free")
    compiled = torch.compile(model, backend=backend, dynamic=False)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, y = torch.randn(4, 4, generator=generator), torch.randn(4, 1, generator=generator)
        for opt, value in ((optimizer, compiled(x, y)), (eager_optimizer, eager(x, y))):
            value.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    # One program per graph that reads parameters (the loss after the second break reads none: run as traced).
    from dcsched.graph.roles import Role, role_of

    def gathered(program):
        names = {p.ds_id: p.name for p in program.bundle.params}
        return sorted(names[n.meta["ds_id"]] for n in program.bundle.forward.nodes if role_of(n) is Role.ALLGATHER)

    assert [gathered(program) for program in backend.programs] == [["a.bias", "a.weight"], ["b.bias", "b.weight"]]
    for name, param in eager.named_parameters():
        assert torch.equal(model.state_dict()[name], param), name


def test_a_submodule_replaced_after_compiling_stops_training_with_one_line():
    torch._dynamo.reset()  # each sharded module's forward shares one code object: a fresh recompile budget
    model = Tied()
    dcsched.shard(model)
    compiled = torch.compile(model, backend=dcsched.backend(algo="fast-free"), dynamic=False)
    idx, targets = torch.randint(0, 10, (4, 3)), torch.randint(0, 10, (4,))
    compiled(idx, targets).backward()
    model.norm = nn.BatchNorm1d(6)  # would be ignored: the scheduled step trains the sharded parameters
    with pytest.raises(Exception) as info:
        compiled(idx, targets)
    error = unwrap_dynamo_error(info.value)
    assert isinstance(error, ShardingError), info.value
    assert "Tied.norm.weight was replaced after dcsched.shard" in str(error)


def test_an_unsharded_module_is_refused_with_a_clear_error():
    model = nn.Linear(3, 1)
    compiled = torch.compile(model, backend=dcsched.backend())
    with pytest.raises(Exception) as info:
        compiled(torch.randn(2, 3))
    error = unwrap_dynamo_error(info.value)
    assert isinstance(error, ShardingError) and "dcsched.shard(model)" in str(error)


def test_backend_checks_its_options():
    with pytest.raises(dcsched.DcschedError, match="unknown scheduler"):
        dcsched.backend(algo="nope")
    with pytest.raises(dcsched.DcschedError, match="analytic cost model needs"):
        dcsched.backend(cost_model="analytic")
