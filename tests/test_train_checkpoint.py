"""dcsched.save_checkpoint / load_checkpoint: stop, resume under another algorithm, same losses bit for bit."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import functools
import io
import os
import pickle
import re
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

import dcsched
import train_runs as runs
from dcsched.train import CheckpointError, checkpoint_files
from dcsched.train.checkpoint_files import CHECKSUMS, SafeReader, write_checksums
from dcsched.train.checkpoint_objects import decode_object, encode_object

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


# --- Hostile checkpoints: nothing in one runs, no path leaves it, nothing blocks, a failed save leaves nothing ---

LEGACY = Path(__file__).parent / "golden" / "checkpoints" / "linear-adamw-v0"  # written by save_checkpoint at 139f0c1


def _linear():
    """The model and optimizer LEGACY was written from, before its one step."""
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.arange(6.0).view(2, 3) / 10)
        model.bias.copy_(torch.tensor([0.5, -0.5]))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))


def _step(model, optimizer):
    optimizer.zero_grad()
    model(torch.ones(4, 3)).pow(2).sum().backward()
    optimizer.step()


def _checkpoint(tmp_path, form: str) -> Path:
    """A copy of LEGACY (flat layout, byte items pickled), or the same state saved by this dcsched."""
    path = tmp_path / "ckpt"
    if form == "legacy":
        shutil.copytree(LEGACY, path)
    else:
        model, optimizer = _linear()
        _step(model, optimizer)
        dcsched.save_checkpoint(path, model, optimizer,
                                extra={"step": 7, "data": torch.Generator().manual_seed(5).get_state()})
    return path


def _metadata(path: Path):
    return SafeReader(str(path)).read_metadata()


def _edit_item(path: Path, fqn: str, data: bytes | None = None, relative_path: str | None = None) -> None:
    """Replace item ``fqn``'s bytes in its data file (the items after it move) or its file name, and rewrite
    ``.metadata`` to match, as someone who can write the checkpoint would."""
    metadata = _metadata(path)
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn == fqn)
    if data is not None:
        file = path / info.relative_path
        content = file.read_bytes()
        file.write_bytes(content[:info.offset] + data + content[info.offset + info.length:])
        shift = len(data) - info.length
        for other, stored in metadata.storage_data.items():
            if stored.relative_path == info.relative_path and stored.offset > info.offset:
                metadata.storage_data[other] = dataclasses.replace(stored, offset=stored.offset + shift)
        info = metadata.storage_data[index] = dataclasses.replace(info, length=len(data))
    if relative_path is not None:
        metadata.storage_data[index] = dataclasses.replace(info, relative_path=relative_path)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


def _pickles(marker: Path) -> dict[str, bytes]:
    """extra.step as three pickles that would run ``touch marker``: bare, in a torch.save archive, and as the
    pre-zip torch.save stream whose first (magic-number) pickle is the call."""
    archive = io.BytesIO()
    torch.save(_Payload(marker), archive)
    legacy = io.BytesIO()
    torch.save(3, legacy, _use_new_zipfile_serialization=False)
    return {"pickle": pickle.dumps(_Payload(marker)), "torch.save archive": archive.getvalue(),
            "pre-zip torch.save stream": pickle.dumps(_Payload(marker), protocol=2) + legacy.getvalue()[11:]}


def _refused(path: Path, match: str) -> str:
    model, optimizer = _linear()
    with pytest.raises(CheckpointError, match=match) as caught:
        dcsched.load_checkpoint(path, model, optimizer)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(str(path))
    return message


@pytest.mark.parametrize("form", ["legacy", "current"])
@pytest.mark.parametrize("checksums", ["deleted", "rehashed"])
@pytest.mark.parametrize("kind", ["pickle", "torch.save archive", "pre-zip torch.save stream"])
def test_a_pickle_in_a_checkpoint_item_never_runs(tmp_path, form, checksums, kind):
    marker = tmp_path / "pwned"
    path = _checkpoint(tmp_path, form)
    _edit_item(path, "extra.step", _pickles(marker)[kind])
    if checksums == "deleted":
        (path / CHECKSUMS).unlink()
    else:  # the checksums agree: they are no signature
        write_checksums(path)
    _refused(path, "cannot read the checkpoint: rank 0: item 'extra.step' (is not an item dcsched writes|is not "
                   "plain data .it names posix.system)")
    assert not marker.exists()


def test_checkpoints_written_now_hold_pickles_that_name_no_class(tmp_path):
    import pickletools
    import zipfile
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    path = _checkpoint(tmp_path, "current")
    metadata = _metadata(path)
    objects = {key for key, meta in metadata.state_dict_metadata.items() if isinstance(meta, BytesStorageMetadata)}
    assert "extra.step" in objects and "optim.param_groups.0.betas" in objects and "optim.param_groups" not in objects
    content = (path / "__0_0.distcp").read_bytes()
    for index, info in metadata.storage_data.items():
        item = content[info.offset:info.offset + info.length]
        assert item.startswith(b"PK\x03\x04")  # a torch.save archive, as DCP's own readers expect
        if index.fqn in objects:  # plain data: not one opcode that names a class or calls one
            with zipfile.ZipFile(io.BytesIO(item)) as archive:
                pickled = archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))
            opcodes = {op.name for op, _arg, _pos in pickletools.genops(pickled)}
            assert not opcodes & {"GLOBAL", "STACK_GLOBAL", "REDUCE", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX",
                                  "BUILD", "PERSID", "BINPERSID"}, (index.fqn, opcodes)


def test_a_checkpoint_written_before_items_were_json_still_resumes(tmp_path):
    whole, whole_optimizer = _linear()
    for _ in range(2):
        _step(whole, whole_optimizer)
    model, optimizer = _linear()
    extra = dcsched.load_checkpoint(LEGACY, model, optimizer)  # its items are torch.save pickles of plain data
    assert extra["step"] == 7 and torch.equal(extra["data"], torch.Generator().manual_seed(5).get_state())
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.95)
    _step(model, optimizer)
    assert torch.allclose(model.weight, whole.weight, rtol=0, atol=1e-7)
    assert torch.allclose(model.bias, whole.bias, rtol=0, atol=1e-7)
    assert float(optimizer.state[model.weight]["step"]) == 2.0


@pytest.mark.parametrize("relative_path", ["../../../../../../../../etc/passwd", "/etc/passwd", "../outside.distcp"])
def test_an_item_whose_path_leaves_the_checkpoint_is_refused_unread(tmp_path, relative_path):
    path = _checkpoint(tmp_path, "current")
    shutil.copy(path / "__0_0.distcp", tmp_path / "outside.distcp")  # a valid shard, read only if the path is
    _edit_item(path, "model.weight", relative_path=relative_path)
    write_checksums(path)
    _refused(path, f"corrupt checkpoint metadata \\({re.escape(repr(relative_path))} resolves outside the "
                   "checkpoint directory\\)")


@pytest.mark.parametrize("checksums", ["kept", "deleted"])
def test_a_shard_linked_outside_the_checkpoint_is_refused_unread(tmp_path, checksums):
    path = _checkpoint(tmp_path, "current")
    outside = tmp_path / "outside.distcp"
    (path / "__0_0.distcp").rename(outside)  # the same bytes: the checksum agrees, the path alone refuses it
    (path / "__0_0.distcp").symlink_to(outside)
    if checksums == "deleted":
        (path / CHECKSUMS).unlink()
    _refused(path, "'__0_0.distcp' resolves outside the checkpoint directory")


def test_a_directory_swapped_for_a_link_after_the_check_is_not_followed(tmp_path, monkeypatch):
    # the race: the path resolves inside when checked, then a directory on it becomes a link out
    directory, outside = tmp_path / "ckpt", tmp_path / "outside"
    (directory / "sub").mkdir(parents=True)
    outside.mkdir()
    (directory / "sub" / "shard.distcp").write_bytes(b"inside")
    (outside / "shard.distcp").write_bytes(b"secret")
    checked = checkpoint_files.inside

    def check_then_swap(base, name):
        target = checked(base, name)
        shutil.rmtree(directory / "sub")
        (directory / "sub").symlink_to(outside)
        return target
    monkeypatch.setattr(checkpoint_files, "inside", check_then_swap)
    with pytest.raises(CheckpointError, match="sub/shard.distcp cannot be read"):
        checkpoint_files.open_inside(directory, "sub/shard.distcp")


def test_a_file_in_a_subdirectory_opens(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "shard.distcp").write_bytes(b"inside")
    with checkpoint_files.open_inside(tmp_path, "sub/shard.distcp") as stream:
        assert stream.read() == b"inside"


@pytest.mark.parametrize("checksums", ["kept", "deleted"])
def test_a_fifo_in_a_checkpoint_is_refused_without_waiting(tmp_path, checksums):
    path = _checkpoint(tmp_path, "current")
    fifo = path / "__0_0.distcp"
    fifo.unlink()
    os.mkfifo(fifo)
    if checksums == "deleted":
        (path / CHECKSUMS).unlink()

    def unblock():  # a blocking open would wait for a writer for ever: give it one after 10 s
        time.sleep(10)
        with contextlib.suppress(OSError), open(fifo, "wb"):
            pass
    threading.Thread(target=unblock, daemon=True).start()
    start = time.monotonic()
    _refused(path, "__0_0.distcp is not a regular file")
    assert time.monotonic() - start < 5


def test_a_deeply_nested_checksums_file_is_one_line(tmp_path):
    path = _checkpoint(tmp_path, "current")
    (path / CHECKSUMS).write_text("[" * 10**5 + "]" * 10**5)
    _refused(path, f"corrupt checkpoint \\({CHECKSUMS} nests deeper than 2 levels\\)")
    (path / CHECKSUMS).write_text('{"sha256": ["x"]}')
    _refused(path, "holds no")
    (path / CHECKSUMS).unlink()
    (path / CHECKSUMS).symlink_to("/etc/passwd")
    _refused(path, f"'{CHECKSUMS}' resolves outside the checkpoint directory")


class _FullDisk(io.FileIO):
    """A file on a disk that fills up after ``room`` bytes of the file named ``victim``."""

    victim, room = "", 0

    def write(self, data) -> int:
        if not os.path.basename(str(self.name)) == self.victim:
            return super().write(data)
        allowed = max(0, _FullDisk.room - self.tell())
        if allowed == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)
        return super().write(bytes(memoryview(data)[:allowed]))


@pytest.mark.parametrize("victim, room", [("__0_0.distcp", 700), ("__0_0.distcp", 0), (".metadata.tmp", 100),
                                          (CHECKSUMS, 10)])
def test_a_disk_full_mid_save_is_one_line_and_leaves_the_earlier_checkpoint(tmp_path, monkeypatch, victim, room):
    path = _checkpoint(tmp_path, "current")
    model, optimizer = _linear()
    for _ in range(2):
        _step(model, optimizer)
    monkeypatch.setattr(_FullDisk, "victim", victim)
    monkeypatch.setattr(_FullDisk, "room", room)
    monkeypatch.setattr(checkpoint_files, "raw_file", lambda name: _FullDisk(name, "wb"))
    with pytest.raises(CheckpointError, match=f"cannot write the checkpoint \\((rank 0: )?no space left on device "
                                              f"\\({re.escape(victim)}\\)\\); an earlier checkpoint there is "
                                              "unchanged") as caught:
        dcsched.save_checkpoint(path, model, optimizer, extra={"step": 8})
    assert "\n" not in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no .ckpt.partial left behind
    monkeypatch.undo()
    earlier, earlier_optimizer = _linear()
    _step(earlier, earlier_optimizer)
    fresh, fresh_optimizer = _linear()
    assert dcsched.load_checkpoint(path, fresh, fresh_optimizer)["step"] == 7
    assert torch.equal(fresh.weight, earlier.weight)


def test_values_that_are_not_plain_data_are_refused_before_anything_is_written(tmp_path):
    model, optimizer = _linear()
    with pytest.raises(CheckpointError, match=r"cannot save extra.when is a datetime: a checkpoint holds tensors "
                                              r"and plain data"):
        dcsched.save_checkpoint(tmp_path / "ckpt", model, optimizer, extra={"when": datetime.datetime.now()})
    assert list(tmp_path.iterdir()) == []


_PLAIN = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.lists(inner, max_size=4).map(tuple)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(_PLAIN)
def test_plain_data_comes_back_as_it_went_in(value):
    back = decode_object(encode_object(value), what="item")
    assert back == value and repr(back) == repr(value)  # tuples stay tuples, key order and types kept


def _archive(value) -> bytes:
    stream = io.BytesIO()
    torch.save(value, stream)
    return stream.getvalue()


_LOOP: list = []
_LOOP.append(_LOOP)


@pytest.mark.parametrize("data, match", [
    (_archive({"lr": torch.tensor(1.0)}), "is not plain data .it names torch._utils._rebuild_tensor_v2"),
    (_archive(_LOOP), "is not plain data .it nests deeper than 24 levels"),
    (_archive({1, 2}), "is not plain data .it names __builtin__.set"),
    (b"PK\x03\x04garbage", "is not plain data"),
    (b"[" * 10**5 + b"]" * 10**5, "is not an item dcsched writes"),
    (b'{"dcsched_object": 1, "value": ' + b'{"tuple": [' * 40 + b"]}" * 40 + b"}", "nests deeper than 52 levels"),
    (b'{"dcsched_object": 2, "value": 1}', "is a dcsched item of format .2.; this dcsched reads format 1"),
    (b'{"dcsched_object": 1, "value": {"set": [1]}}', "holds an object that is not a tagged tuple, dict or tensor"),
    (b'{"dcsched_object": 1, "value": {"tensor": {"dtype": "float32", "shape": [1000000000], "values": [1]}}}',
     "holds a malformed tensor record"),
    (b'{"dcsched_object": 1, "value": {"tensor": {"dtype": "object", "shape": [], "values": [1]}}}',
     "holds a malformed tensor record"),
])
def test_a_byte_item_is_plain_data_or_one_refusal(data, match):
    with pytest.raises(ValueError, match=f"^item {match}") as caught:
        decode_object(data, what="item")
    assert "\n" not in str(caught.value)


def test_plain_data_with_tensors_inside_comes_back():
    value = {"lr": torch.tensor(0.5, dtype=torch.bfloat16), "mask": torch.tensor([[True, False]]), "n": (1, [2.5])}
    back = decode_object(encode_object(value), what="item")
    assert back["n"] == (1, [2.5]) and back["lr"].dtype == torch.bfloat16 and float(back["lr"]) == 0.5
    assert torch.equal(back["mask"], value["mask"])
    assert decode_object(_archive({"betas": (0.9, 0.999), "fused": None}), what="item") == \
        {"betas": (0.9, 0.999), "fused": None}
