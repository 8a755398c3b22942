"""A real script's habits on several gloo ranks, with the default (measured) cost model and ``overlap-plan``.

* A parameter frozen at the compile and unfrozen later (the backbone unfrozen after N steps) trains from then on
  with its gradient averaged across the ranks: the ranks' mean loss equals one eager process on the global batch.
* Batches whose shapes differ between ranks (an uneven last batch of 4, 4 and 3 rows; each rank padding its batch
  to its own length) train: every rank agrees how each step runs before any collective
  (:mod:`dcsched.train.agreement`), and the ranks' mean loss equals eager's mean of the same per-rank losses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import train_runs as runs
from gloo import GLOO_MARKS

pytestmark = GLOO_MARKS

#: Per step, each rank's (rows, length) of the GPT runs: an uneven last batch (a global batch of 11 on 3 ranks,
#: then a full one again); each rank padding to its own length.
SHAPES = {
    "uneven": [[(4, 8)] * 3, [(4, 8)] * 3, [(4, 8), (4, 8), (3, 8)], [(4, 8)] * 3],
    "padded": [[(2, 8)] * 3, [(2, 5), (2, 8), (2, 6)], [(2, 8), (2, 5), (2, 5)], [(2, 8)] * 3],
    # rank 2 builds another model (d_model 16) and takes 3 rows: its step differs in structure, not only in shape
    "other-model": [[(4, 8), (4, 8), (3, 8)]],
}


def _gpt_batches(shapes: list[list[tuple[int, int]]]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, each rank's (tokens, targets) of its own rows and length."""
    generator = torch.Generator().manual_seed(1234)
    vocab = runs.CONFIGS["gpt"]["vocab"]
    out = []
    for step in shapes:
        ranks = []
        for rows, length in step:
            tokens = torch.randint(0, vocab, (rows, length + 1), generator=generator)
            ranks.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
        out.append(ranks)
    return out


def _gpt_steps(shapes: str, rank: int | None) -> dict:
    """The GPT example trained on ``SHAPES[shapes]``: on ``rank`` under dcsched (``losses``: the ranks' mean loss per
    step; ``captured``: the steps this rank ran as captured, not planned), or eagerly in one process (``rank`` None:
    the mean of every rank's loss, the gradient of their mean)."""
    import dcsched
    torch._dynamo.reset()
    model, _ = runs.model_of("gpt", **({"d_model": 16} if shapes == "other-model" and rank == 2 else {}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=runs.LR)
    run, backend = model, dcsched.backend(algo="overlap-plan")
    if rank is not None:
        dcsched.shard(model)
        run = torch.compile(model, backend=backend, dynamic=False)
    losses = []
    for step in _gpt_batches(SHAPES[shapes]):
        if rank is None:
            loss = torch.stack([run(*inputs) for inputs in step]).mean()
        else:
            loss = run(*step[rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(runs.mean_over_ranks(loss) if rank is not None else float(loss.detach()))
    return {"losses": losses, "captured": sum(program.captured_steps for program in backend.programs)}


def _llama_unfrozen(rank: int | None, world_size: int = 2, steps: int = 3, unfreeze_at: int | None = 1) -> list[float]:
    """Hugging Face Llama with its embeddings frozen, unfrozen before step ``unfreeze_at``; a global batch of 2 rows,
    each rank taking its share (``rank`` None: one eager process on the whole batch)."""
    import dcsched
    import hf_models
    torch._dynamo.reset()
    model = hf_models.build("llama")
    model.train()
    embeddings = model.get_input_embeddings().weight
    embeddings.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=hf_models.LR)
    run = model
    if rank is not None:
        dcsched.shard(model)
        run = torch.compile(model, backend=dcsched.backend(algo="overlap-plan"), dynamic=False)
    losses = []
    for step, batch in enumerate(hf_models.batches("llama", steps)):
        if step == unfreeze_at:
            embeddings.requires_grad_(True)  # the habit: unfreeze after N steps
        rows = {key: value[:2] for key, value in batch.items()}
        if rank is not None:
            share = 2 // world_size
            rows = {key: value[rank * share:(rank + 1) * share].clone() for key, value in rows.items()}
        loss = run(**rows).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(runs.mean_over_ranks(loss) if rank is not None else float(loss.detach()))
    return losses


def _spawned(rank: int, world_size: int, port: int, out_dir: str, what: list[str]) -> None:
    from dcsched.errors import DcschedError
    from dcsched.profile.scripts import unwrap_dynamo_error
    from dcsched.runtime.distributed import shutdown
    runs.init_gloo(rank, world_size, port)
    try:
        results: dict = {}
        for label in what:
            try:
                results[label] = _llama_unfrozen(rank, world_size) if label == "unfrozen" else _gpt_steps(label, rank)
            except Exception as exc:  # noqa: BLE001 (TorchDynamo wraps the backend's errors)
                error = unwrap_dynamo_error(exc)
                if not isinstance(error, DcschedError):
                    raise
                results[label] = {"error": str(error)}
        torch.save(results, Path(out_dir) / f"habits{rank}.pt")
    finally:
        shutdown()


def _spawn(tmp_path: Path, world_size: int, what: list[str]) -> list[dict]:
    import torch.multiprocessing as mp
    mp.spawn(_spawned, args=(world_size, runs.free_port(), str(tmp_path), what), nprocs=world_size, join=True)
    return [torch.load(tmp_path / f"habits{rank}.pt", weights_only=True) for rank in range(world_size)]


def test_a_parameter_unfrozen_after_the_compile_trains_with_its_gradient_averaged(tmp_path):
    pytest.importorskip("transformers")
    plain = _llama_unfrozen(None)
    results = _spawn(tmp_path, 2, ["unfrozen"])
    for rank in range(2):
        assert results[rank]["unfrozen"] == pytest.approx(plain, rel=1e-5), rank
    # unfrozen, the embeddings train: step 2's loss is not the one of a run that never unfreezes them
    never = _llama_unfrozen(None, unfreeze_at=None)
    assert never[:2] == plain[:2] and never[2] != pytest.approx(plain[2], rel=1e-5)


def test_batches_of_other_shapes_on_some_ranks_train_as_eager_and_other_steps_stop_with_one_line(tmp_path):
    results = _spawn(tmp_path, 3, ["uneven", "padded", "other-model"])
    for shapes, captured in (("uneven", 1), ("padded", 2)):
        plain = _gpt_steps(shapes, None)["losses"]
        for rank in range(3):
            assert results[rank][shapes]["losses"] == pytest.approx(plain, rel=1e-5), (shapes, rank)
            # the steps whose shapes differ ran as captured on every rank, the others (the last too) as planned
            assert results[rank][shapes]["captured"] == captured, (shapes, rank)
    # A step that differs in structure (another model on rank 2) stops every rank with one line naming it.
    for rank in range(3):
        message = results[rank]["other-model"]["error"]
        assert "\n" not in message
        assert message.startswith("rank 2 of GPT ran a step of another structure than ranks 0, 1 (inputs rank 2: "
                                  "(3, 8) int64, (3, 8) int64; rank 0: (4, 8) int64, (4, 8) int64)"), message


def test_dcsched_train_with_an_uneven_batch_on_three_ranks_trains_as_eager(tmp_path):
    # Under torchrun the ranks meet after each compile they make together; rank 2's compile for its 3 rows is its
    # own (not met), and the compile every rank makes next (2 rows each) meets as one.
    import subprocess
    import sys

    from test_cli_train_distributed import _env, torchrun
    script = Path(__file__).with_name("uneven_batch_script.py")
    eager = subprocess.run([sys.executable, str(script), "eager"], env=_env(), capture_output=True, text=True,
                           timeout=300)
    assert eager.returncode == 0, eager.stderr[-3000:]
    trained = subprocess.run([*torchrun(), "--nproc-per-node", "3", "--master-port", str(runs.free_port()), "-m",
                              "dcsched", "train", str(script), "--algo", "overlap-plan", "--no-progress",
                              "--timeout", "60"], env=_env(), capture_output=True, text=True, timeout=600)
    assert trained.returncode == 0, trained.stderr[-3000:]

    def losses(out: str) -> list[float]:
        return next(json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("losses "))
    assert losses(trained.stdout) == pytest.approx(losses(eager.stdout), rel=1e-5)


class _Net(torch.nn.Module):
    """Two linear layers; ``extra``, where set, scales the output (a parameter added after dcsched.shard)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)

    def forward(self, x):
        out = self.second(torch.relu(self.first(x))).sum()
        extra = self.__dict__.get("late")
        return out * extra.sum() if extra is not None else out


def test_freezing_and_unfreezing_after_the_compile_train_as_eager_in_one_process():
    import dcsched
    model = _Net()
    eager = _Net()
    dcsched.shard(model)
    compiled = torch.compile(model, backend=dcsched.backend(algo="overlap"), dynamic=False)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    generator = torch.Generator().manual_seed(0)
    for step in range(4):
        for m in (model, eager):  # frozen at step 1, unfrozen again at step 3
            m.first.weight.requires_grad_(step not in (1, 2))
        x = torch.randn(3, 4, generator=generator)
        ours, theirs = compiled(x), eager(x)
        assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-7), step
        ours.backward()
        theirs.backward()
        assert (model.first.weight.grad is None) == (step in (1, 2))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def test_a_graph_taking_a_trainable_parameter_dcsched_did_not_shard_is_one_line():
    import dcsched
    from dcsched.profile.scripts import unwrap_dynamo_error
    from dcsched.train import ShardingError
    model = _Net()
    dcsched.shard(model)
    model.__dict__["late"] = torch.nn.Parameter(torch.ones(2))  # after the shard: never sharded
    compiled = torch.compile(model, backend=dcsched.backend(), dynamic=False)
    with pytest.raises(Exception) as raised:
        compiled(torch.randn(3, 4))
    error = unwrap_dynamo_error(raised.value)
    assert isinstance(error, ShardingError)
    assert str(error).startswith("a trainable parameter of shape (2,) from outside _Net is not sharded by "
                                 "dcsched.shard"), str(error)
    assert "\n" not in str(error)
