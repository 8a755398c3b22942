"""dcsched.save_checkpoint / load_checkpoint: stop, resume under another algorithm, same losses bit for bit."""

from __future__ import annotations

import functools
import os
import pickle

import pytest
import torch

import dcsched
import train_runs as runs
from dcsched.train import CheckpointError

from gloo import GLOO_MARKS


def gloo(test):
    return functools.reduce(lambda marked, mark: mark(marked), GLOO_MARKS, test)


@gloo
def test_two_ranks_resume_under_another_algorithm_and_continue_bit_for_bit(two_rank_training, tmp_path):
    # two_rank_training's 20 uninterrupted fast-free GPT steps checkpoint after step 10; here fresh processes
    # build a fresh model and optimizer, load the checkpoint and train steps 11-20 with overlap.
    losses = two_rank_training["ranks"][0]["gpt-fast-free"]["losses"]
    resumed = runs.spawn(tmp_path, 2, [("gpt", "gpt", "overlap", 20, 4, {"resume": two_rank_training["checkpoint"]})])
    assert len(losses) == 20 and losses[0] != losses[-1]
    assert losses[:runs.CHECKPOINT_AT] + resumed[0]["gpt"]["losses"] == losses  # the 20 losses, bit for bit
    assert resumed[1]["gpt"]["losses"] == losses[runs.CHECKPOINT_AT:]


def test_resume_in_one_process_under_another_algorithm_continues_bit_for_bit(tmp_path):
    path = tmp_path / "ckpt"
    whole = runs.train_dcsched("convnet-bn", "none", 6, 4, save=(path, 3))["losses"]
    resumed = runs.train_dcsched("convnet-bn", "overlap", 6, 4, resume=path)["losses"]
    assert resumed == whole[3:]  # BatchNorm statistics, AdamW state and parameters all came back
    assert whole[0] != whole[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing partial left beside it


class _Payload:
    """Unpickling this would run code: it must never happen."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_missing_corrupt_or_foreign_checkpoint_is_one_clear_error(tmp_path):
    model, _ = runs.model_of("gpt")
    dcsched.shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        dcsched.load_checkpoint(tmp_path / "nowhere", model, optimizer)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        dcsched.load_checkpoint(tmp_path / "empty", model, optimizer)
    path = tmp_path / "ckpt"
    dcsched.save_checkpoint(path, model, optimizer)
    shards = sorted(path.glob("*.distcp"))
    intact = {data: data.read_bytes() for data in shards}
    for data, content in intact.items():  # 64 flipped bytes in the middle: same size, wrong numbers
        middle = len(content) // 2
        data.write_bytes(content[:middle] + bytes(b ^ 0xFF for b in content[middle:middle + 64])
                         + content[middle + 64:])
    with pytest.raises(CheckpointError, match=r"corrupt checkpoint \(__0_0.distcp differs from the file that was "
                                              r"saved: its SHA-256 does not match\)"):
        dcsched.load_checkpoint(path, model, optimizer)
    for data, content in intact.items():
        data.write_bytes(content[:16])
    with pytest.raises(CheckpointError, match="corrupt checkpoint"):
        dcsched.load_checkpoint(path, model, optimizer)
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))  # a planted metadata file runs no code
    with pytest.raises(CheckpointError, match="corrupt checkpoint metadata"):
        dcsched.load_checkpoint(path, model, optimizer)
    assert not marker.exists()
    (path / ".metadata").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="corrupt checkpoint metadata"):
        dcsched.load_checkpoint(path, model, optimizer)
    other, _ = runs.model_of("gpt", d_model=16)
    dcsched.shard(other)
    dcsched.save_checkpoint(path, other)  # replaces the corrupt checkpoint
    with pytest.raises(CheckpointError, match="in the checkpoint"):
        dcsched.load_checkpoint(path, model)
    with pytest.raises(CheckpointError, match="no optimizer state"):
        dcsched.load_checkpoint(path, other, torch.optim.AdamW(other.parameters()))
    with pytest.raises(CheckpointError, match="not a checkpoint; refusing"):
        dcsched.save_checkpoint(tmp_path, model)  # a directory of other things is never replaced
    assert isinstance(CheckpointError("x"), dcsched.DcschedError)
