"""dcsched checkpoints are FSDP2's DCP layout: torch's tools read them, and FSDP2 and dcsched resume each other's.

One spawn of 2 gloo ranks trains a tiny GPT whose sizes split unevenly into
flat shards (vocab 63, seq 7: rank 0's share of the embedding ends half-way
through a row) under dcsched and under FSDP2 (``fully_shard``), each
checkpointing after step 2, and resumes each checkpoint under the other.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

import dcsched
import train_runs as runs
from dcsched.train import CheckpointError
from dcsched.train.checkpoint_layout import blocks

from gloo import GLOO_MARKS

CONFIG = {"vocab": 63, "seq": 7}
STEPS, SAVE_AT, BATCH = 4, 2, 4
#: A sharded Linear checkpointed by the earlier save_checkpoint (flattened parameters, JSON items).
FLAT = Path(__file__).parent / "golden" / "checkpoints" / "linear-adamw-flat-v1"


def gloo(test):
    """A test on the module's spawn (about 90 s on 2 loaded cores: five trainings, two of them compiled)."""
    return functools.reduce(lambda marked, mark: mark(marked), [*GLOO_MARKS, pytest.mark.slow], test)


def _train_fsdp(rank: int, world_size: int, save: str | None = None, resume: str | None = None) -> list[float]:
    """The GPT under FSDP2 (``fully_shard``, AdamW), checkpointed and resumed as FSDP2's documentation does:
    ``get_state_dict`` + ``dcp.save`` / ``dcp.load`` + ``set_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    model, _ = runs.model_of("gpt", **CONFIG)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=runs.LR)
    start = 0
    if resume is not None:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optimizer_state, "extra": {"step": 0}}
        dcp.load(state, checkpoint_id=resume)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = state["extra"]["step"]
    losses = []
    for step, inputs in enumerate(runs.global_batches("gpt", STEPS, BATCH, **CONFIG)):
        if step < start:
            continue
        loss = model(*runs.local_slice(inputs, rank, world_size))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(runs.mean_over_ranks(loss))
        if save is not None and step + 1 == SAVE_AT:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optim": optimizer_state, "extra": {"step": step + 1}},
                     checkpoint_id=save)
    return losses


def _interop(rank: int, world_size: int, port: int, out: str) -> None:
    """mp.spawn target: every run of the module's tests, results saved per rank."""
    from dcsched.runtime.distributed import shutdown
    runs.init_gloo(rank, world_size, port)
    ours, theirs = f"{out}/dcsched.ckpt", f"{out}/fsdp2.ckpt"
    try:
        results = {
            "dcsched": runs.train_dcsched("gpt", "none", STEPS, BATCH, rank, world_size, save=(ours, SAVE_AT),
                                          full_state=True, **CONFIG),
            "fsdp2": _train_fsdp(rank, world_size, save=theirs)}
        results["dcsched_state_at_save"] = runs.train_dcsched("gpt", "none", SAVE_AT, BATCH, rank, world_size,
                                                              full_state=True, **CONFIG)["state"]
        results["dcsched_from_fsdp2"] = runs.train_dcsched("gpt", "overlap", STEPS, BATCH, rank, world_size,
                                                           resume=theirs, **CONFIG)["losses"]
        results["fsdp2_from_dcsched"] = _train_fsdp(rank, world_size, resume=ours)
        torch.save(results, Path(out) / f"results{rank}.pt")
    finally:
        shutdown()


@pytest.fixture(scope="module")
def interop(tmp_path_factory):
    import torch.multiprocessing as mp
    out = tmp_path_factory.mktemp("interop")
    mp.spawn(_interop, args=(2, runs.free_port(), str(out)), nprocs=2, join=True)
    return {"out": out, "ranks": [torch.load(out / f"results{rank}.pt", weights_only=True) for rank in range(2)]}


def _model_part(state: dict) -> dict:
    return {key[len("model."):]: value for key, value in state.items() if key.startswith("model.")}


@gloo
def test_dcp_to_torch_save_makes_a_plain_state_dict_of_a_dcsched_checkpoint(interop, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from dcsched.train.checkpoint_files import SafeReader
    checkpoint = interop["out"] / "dcsched.ckpt"
    metadata = SafeReader(str(checkpoint)).read_metadata().state_dict_metadata
    embedding = metadata["model.tok.weight"]
    assert isinstance(embedding, TensorStorageMetadata) and tuple(embedding.size) == (63, 32)
    # rank 0 holds elements 0..1007 (31.5 rows), rank 1 the rest: whole rows and the two halves of row 31
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in embedding.chunks) == [
        ((0, 0), (31, 32)), ((31, 0), (1, 16)), ((31, 16), (1, 16)), ((32, 0), (31, 32))]
    dcp_to_torch_save(str(checkpoint), str(tmp_path / "plain.pt"))
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)
    model, _ = runs.model_of("gpt", **CONFIG)
    model.load_state_dict(_model_part(plain), strict=True)
    expected = interop["ranks"][0]["dcsched_state_at_save"]
    assert expected.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert plain["extra.step"] == SAVE_AT and plain["optim.param_groups.0.betas"] == (0.9, 0.999)
    moments = plain["optim.state.tok.weight.exp_avg"]
    assert moments.shape == (63, 32) and moments.abs().sum() > 0


@gloo
def test_an_fsdp2_checkpoint_resumes_under_dcsched_with_fsdp2s_losses(interop):
    for rank in interop["ranks"]:
        fsdp2 = rank["fsdp2"]
        assert len(fsdp2) == STEPS and fsdp2[0] != fsdp2[-1]
        assert rank["dcsched_from_fsdp2"] == pytest.approx(fsdp2[SAVE_AT:], rel=1e-5, abs=1e-6)


@gloo
def test_a_dcsched_checkpoint_resumes_under_fsdp2_with_dcscheds_losses(interop):
    for rank in interop["ranks"]:
        ours = rank["dcsched"]["losses"]
        assert rank["fsdp2_from_dcsched"] == pytest.approx(ours[SAVE_AT:], rel=1e-5, abs=1e-6)
        assert ours == pytest.approx(rank["fsdp2"], rel=1e-5, abs=1e-6)  # the same training, two ways


def _load_sharded(rank: int, world_size: int, port: int, checkpoint: str, out: str) -> None:
    """mp.spawn target: a fresh sharded GPT and AdamW load ``checkpoint``; the gathered full state is saved."""
    from dcsched.runtime.distributed import shutdown
    runs.init_gloo(rank, world_size, port)
    try:
        model, _ = runs.model_of("gpt", **CONFIG)
        dcsched.shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=runs.LR)
        step = dcsched.load_checkpoint(checkpoint, model, optimizer)["step"]
        exp_avg = optimizer.state[model.tok.weight]["exp_avg"]
        state = {key: value.clone() for key, value in model.state_dict().items()}
        if rank == 0:
            torch.save({"state": state, "step": step, "exp_avg": exp_avg.clone()}, Path(out) / "loaded.pt")
    finally:
        shutdown()


@gloo
def test_a_two_rank_checkpoint_loads_on_three_ranks_one_process_and_an_unsharded_model(interop, tmp_path):
    import torch.multiprocessing as mp
    checkpoint = str(interop["out"] / "dcsched.ckpt")
    expected = interop["ranks"][0]["dcsched_state_at_save"]
    mp.spawn(_load_sharded, args=(3, runs.free_port(), checkpoint, str(tmp_path)), nprocs=3, join=True)
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    assert loaded["step"] == SAVE_AT and loaded["exp_avg"].shape == (math.ceil(63 * 32 / 3),)
    for name, value in expected.items():
        assert torch.equal(loaded["state"][name], value), name
    for shard in (True, False):  # one process: sharded (world size 1) and a plain model
        model, _ = runs.model_of("gpt", **CONFIG)
        if shard:
            dcsched.shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=runs.LR)
        assert dcsched.load_checkpoint(checkpoint, model, optimizer)["step"] == SAVE_AT
        for name, value in model.state_dict().items():
            assert torch.equal(value, expected[name]), name


def _linear():
    """The Linear and AdamW FLAT was written from (tests/golden/checkpoints/make_flat.py), before its one step."""
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.arange(6.0).view(2, 3) / 10)
        model.bias.copy_(torch.tensor([0.5, -0.5]))
    return model


def _sharded_step(whole, whole_optimizer, sharded, sharded_optimizer):
    """One AdamW step of ``whole`` and of its one-process shards ``sharded``, with the same gradients."""
    whole_optimizer.zero_grad()
    whole(torch.ones(4, 3)).pow(2).sum().backward()
    for full, shard in zip(whole.parameters(), sharded.parameters()):
        shard.grad = full.grad.reshape(-1).clone()
    whole_optimizer.step()
    sharded_optimizer.step()


def test_a_flat_checkpoint_of_the_earlier_layout_still_resumes_sharded():
    # FLAT was written by the earlier save_checkpoint: a sharded Linear's parameters and AdamW moments flattened,
    # (numel,), its groups one JSON item. It loads into a sharded model and continues as an uninterrupted run.
    whole = _linear()
    whole_optimizer = torch.optim.AdamW(whole.parameters(), lr=0.01, betas=(0.8, 0.95))
    model = _linear()
    dcsched.shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    whole(torch.ones(4, 3)).pow(2).sum().backward()
    whole_optimizer.step()  # the step FLAT was taken after
    from dcsched.train.checkpoint_files import SafeReader
    metadata = SafeReader(str(FLAT)).read_metadata().state_dict_metadata
    assert tuple(metadata["model.weight"].size) == (6,) and "optim.param_groups" in metadata
    assert dcsched.load_checkpoint(FLAT, model, optimizer)["step"] == 1
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.95)
    _sharded_step(whole, whole_optimizer, model, optimizer)
    assert torch.allclose(model.weight, whole.weight.detach().reshape(-1), rtol=0, atol=1e-7)
    assert torch.allclose(model.bias, whole.bias.detach(), rtol=0, atol=1e-7)
    with pytest.raises(CheckpointError, match=r"'weight' is \(6,\) in the checkpoint, \(2, 3\) here"):
        dcsched.load_checkpoint(FLAT, _linear())  # flattened: only a sharded model reads it


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4).flatmap(
    lambda shape: st.tuples(st.just(tuple(shape)), st.integers(0, math.prod(shape)), st.integers(0, math.prod(shape)))))
def test_a_flat_range_is_a_few_blocks_that_tile_it_in_order(case):
    shape, start, stop = case
    start, stop = min(start, stop), max(start, stop)
    full = torch.arange(math.prod(shape)).view(shape)
    found = blocks(shape, start, stop)
    assert len(found) <= 2 * len(shape) - 1
    flat = start
    for offsets, sizes, first in found:  # each block holds the next elements of the range, contiguous
        assert first == flat
        region = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        assert torch.equal(region.reshape(-1), torch.arange(flat, flat + math.prod(sizes)))
        flat += math.prod(sizes)
    assert flat == stop
