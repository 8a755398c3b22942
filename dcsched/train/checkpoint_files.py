"""A checkpoint's files read safely: no code runs, no path leaves the directory, checksums against corruption.

``torch.distributed.checkpoint`` (DCP) reads a checkpoint trusting it: its
``.metadata`` with :func:`pickle.load`, its non-tensor items with
``torch.load(weights_only=False)``, and each data file at whatever
``relative_path`` the metadata names. :class:`SafeReader` is DCP's
file-system reader with each of those replaced:

- ``.metadata`` is read by an unpickler that builds only the classes such a
  file holds (DCP's metadata records, ``torch.Size``, dtypes, paths);
- every file named there must resolve (links followed) to a regular file
  inside the checkpoint directory, opened without following a link and
  without blocking, so a path out (``../../etc/passwd``), a link out or a FIFO
  is refused before a byte is read (:func:`open_inside`);
- non-tensor items are decoded by :mod:`dcsched.train.checkpoint_objects`
  (JSON, or an older checkpoint's plain-data pickle read without classes),
  handed to :class:`SafeLoadPlanner`; tensor items are read as DCP reads
  them, ``torch.load(weights_only=True)``.

DCP stores no checksum, so a flipped byte in a ``.distcp`` shard file loads
as a wrong number. :func:`write_checksums` records the SHA-256 of every file
of a finished checkpoint in ``dcsched-checksums.json``; :func:`verify_checksums`
checks them before anything is loaded (a checkpoint written before dcsched
kept checksums loads unchecked). They detect corruption, not tampering:
whoever can write the checkpoint can rewrite them; loading is safe without
them because nothing in a checkpoint executes.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from dcsched.bundle.checks import DTYPES
from dcsched.errors import DcschedError
from dcsched.safeparse import loads
from dcsched.train.checkpoint_objects import decode_object

#: The file of a checkpoint that holds its other files' SHA-256 digests.
CHECKSUMS = "dcsched-checksums.json"
#: Largest checksums file read (a few hundred bytes per data file).
MAX_CHECKSUMS_BYTES = 16 << 20


class CheckpointError(DcschedError):
    """A checkpoint that cannot be written or read back into this model; the message says why."""


#: What a DCP metadata file may build: (module, name), besides the dtypes.
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
}
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata records and nothing else (see the module docstring)."""

    def find_class(self, module: str, name: str):
        import torch.distributed.checkpoint.metadata as metadata
        if module == _METADATA_MODULE and isinstance(getattr(metadata, name, None), type):
            return getattr(metadata, name)
        if (module == "torch" and name in DTYPES) or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a checkpoint's metadata never holds")


def inside(directory: Path, name: object) -> str:
    """The real path of ``name`` in ``directory`` (links resolved); CheckpointError when it leaves it.

    >>> import tempfile
    >>> inside(Path(tempfile.gettempdir()), "../../etc/passwd")
    Traceback (most recent call last):
    ...
    dcsched.train.checkpoint_files.CheckpointError: '../../etc/passwd' resolves outside the checkpoint directory
    """
    if not isinstance(name, str) or not name or "\x00" in name:
        raise CheckpointError(f"{str(name)[:80]!r} is not a file name")
    base = os.path.realpath(directory)
    target = os.path.realpath(os.path.join(base, name))
    if target == base or os.path.commonpath([base, target]) != base:
        raise CheckpointError(f"{name[:200]!r} resolves outside the checkpoint directory")
    return target


def open_inside(directory: Path, name: object) -> BinaryIO:
    """``name`` in ``directory`` opened for reading: a regular file inside it (links resolved), opened
    without following a link and without blocking (a FIFO is refused, never waited on).

    The resolved path is opened one component at a time from the directory's own descriptor, none of them
    followed if it is a link, so a directory inside swapped for a link between the check and the open is
    refused rather than followed out.

    Raises CheckpointError (one line) for a path out, a missing file, or anything but a regular file.
    """
    target = inside(directory, name)
    base = os.path.realpath(directory)
    parts = os.path.relpath(target, base).split(os.sep)
    cloexec = getattr(os, "O_CLOEXEC", 0)
    descriptor = -1
    try:
        descriptor = os.open(base, os.O_RDONLY | os.O_DIRECTORY | cloexec)
        for part in parts[:-1]:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | cloexec, dir_fd=descriptor)
            os.close(descriptor)
            descriptor = inner
        if not stat.S_ISREG(os.lstat(parts[-1], dir_fd=descriptor).st_mode):
            raise CheckpointError(f"{name} is not a regular file")
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | cloexec
        opened = os.open(parts[-1], flags, dir_fd=descriptor)
    except FileNotFoundError:
        raise CheckpointError(f"{name} is missing") from None
    except OSError as error:
        raise CheckpointError(f"{name} cannot be read ({error.strerror or error})") from None
    finally:
        if descriptor >= 0:
            os.close(descriptor)
    if not stat.S_ISREG(os.fstat(opened).st_mode):  # replaced between the two looks
        os.close(opened)
        raise CheckpointError(f"{name} is not a regular file")
    return os.fdopen(opened, "rb")


def check_storage(directory: Path, metadata) -> set[str]:
    """The files ``metadata``'s items are read from; CheckpointError when an item's record is malformed, names a
    path outside ``directory`` or asks for a stream transform (dcsched writes none)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    files = set()
    for index, info in (metadata.storage_data or {}).items():
        if not isinstance(info, _StorageInfo):
            raise CheckpointError(f"item {getattr(index, 'fqn', index)!r} has no file record")
        inside(directory, info.relative_path)
        numbers = (info.offset, info.length)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers):
            raise CheckpointError(f"item {index.fqn!r} has a negative or non-integer offset or length")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"item {index.fqn!r} is stored through a stream transform, which dcsched "
                                  "never writes")
        files.add(info.relative_path)
    return files


class _Window(io.RawIOBase):
    """Bytes ``offset`` to ``offset + length`` of ``stream``, as a file of their own (an item, read in place)."""

    def __init__(self, stream: BinaryIO, offset: int, length: int) -> None:
        super().__init__()
        self._stream, self._offset, self._length, self._position = stream, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = min(max(0, base + position), self._length)
        return self._position

    def readinto(self, buffer) -> int:
        count = min(len(buffer), self._length - self._position)
        if count <= 0:
            return 0
        self._stream.seek(self._offset + self._position)
        got = self._stream.readinto(memoryview(buffer)[:count])  # type: ignore[attr-defined]
        self._position += got
        return got


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner for a flat state dict, taking non-tensor items already decoded (:class:`SafeReader`)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False)

    def load_object(self, read_item, value) -> None:
        self.original_state_dict[read_item.dest_index.fqn] = value  # the dict dcp.load was given

    def load_bytes(self, read_item, value) -> None:  # DCP's would torch.load(weights_only=False) them
        raise CheckpointError(f"item {read_item.dest_index.fqn!r}: byte items are read by SafeReader only")


class SafeReader(FileSystemReader):
    """DCP's file-system reader with nothing in the checkpoint trusted (see the module docstring); load with
    :class:`SafeLoadPlanner`."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        with open_inside(Path(self.path), name) as stream:
            metadata = _MetadataUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not checkpoint metadata")
        check_storage(Path(self.path), metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        if hasattr(self, "load_id"):
            metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        from torch.futures import Future
        if not isinstance(planner, SafeLoadPlanner):
            raise CheckpointError("SafeReader reads with a SafeLoadPlanner only")
        per_file: dict[str, list] = {}
        for request in plan.items:
            per_file.setdefault(self.storage_data[request.storage_index].relative_path, []).append(request)
        for name, requests in per_file.items():
            with open_inside(Path(self.path), name) as stream:
                size = os.fstat(stream.fileno()).st_size
                for request in requests:
                    self._read_item(stream, size, name, request, planner)
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_item(self, stream: BinaryIO, size: int, name: str, request, planner: SafeLoadPlanner) -> None:
        from torch.distributed.checkpoint.planner import LoadItemType
        info = self.storage_data[request.storage_index]
        fqn = request.storage_index.fqn
        if info.offset + info.length > size:
            raise CheckpointError(f"{name} ends before item {fqn!r} (truncated)")
        if request.type == LoadItemType.BYTE_IO:
            stream.seek(info.offset)
            try:
                planner.load_object(request, decode_object(stream.read(info.length), what=f"item {fqn!r}"))
            except ValueError as error:
                raise CheckpointError(str(error)) from None
            return
        tensor = torch.load(_Window(stream, info.offset, info.length), map_location="cpu", weights_only=True)
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"item {fqn!r} is a {type(tensor).__name__}, not a tensor")
        for dim, (offset, length) in enumerate(zip(request.storage_offsets, request.lengths)):
            if length < tensor.size(dim):
                tensor = tensor.narrow(dim, offset, length)
        target = planner.resolve_tensor(request).detach()
        if target.size() != tensor.size():
            raise CheckpointError(f"item {fqn!r} is {tuple(tensor.size())} in {name}, {tuple(target.size())} "
                                  "in the checkpoint's metadata")
        target.copy_(tensor)
        planner.commit_tensor(request, target)


def _digest(stream: BinaryIO) -> str:
    sha = hashlib.sha256()
    for block in iter(lambda: stream.read(1 << 20), b""):
        sha.update(block)
    return sha.hexdigest()


def raw_file(path: str) -> io.FileIO:
    """The unbuffered file each file of a checkpoint is written to (a test replaces it to fill the disk)."""
    return io.FileIO(path, "wb")


def write_checksums(directory: Path) -> None:
    """Record the SHA-256 of every file in the finished checkpoint ``directory`` (which this process wrote)."""
    digests = {}
    for file in sorted(p for p in directory.iterdir() if p.is_file() and p.name != CHECKSUMS):
        with open(file, "rb") as stream:
            digests[file.name] = _digest(stream)
    with io.BufferedWriter(raw_file(str(directory / CHECKSUMS))) as stream:
        stream.write(json.dumps({"sha256": digests}, indent=1, sort_keys=True).encode("utf-8"))


def _recorded(directory: Path) -> dict[str, str] | None:
    """The digests ``dcsched-checksums.json`` records by file name; None where the checkpoint has none."""
    try:
        os.lstat(directory / CHECKSUMS)
    except FileNotFoundError:
        return None  # written before dcsched kept checksums
    except OSError as error:
        raise CheckpointError(f"{CHECKSUMS} cannot be read ({error.strerror or error})") from None
    with open_inside(directory, CHECKSUMS) as stream:
        text = stream.read(MAX_CHECKSUMS_BYTES + 1)
    try:
        record = loads(text, what=CHECKSUMS, max_depth=2, max_bytes=MAX_CHECKSUMS_BYTES)
    except ValueError as error:
        raise CheckpointError(str(error)) from None
    digests = record.get("sha256") if isinstance(record, dict) else None
    if not isinstance(digests, dict) or not all(isinstance(v, str) for v in digests.values()):
        raise CheckpointError(f"{CHECKSUMS} holds no {{\"sha256\": {{file: digest}}}} record")
    return digests


def verify_checksums(directory: Path, needed: Iterable[str] = ()) -> None:
    """CheckpointError (one line, ``corrupt checkpoint (...)``) when a file of ``directory`` is missing, not a
    regular file inside it, or differs from its recorded digest, or a file in ``needed`` has no digest."""
    try:
        digests = _recorded(directory)
        if digests is None:
            return
        for name in sorted(set(needed) - set(digests)):
            raise CheckpointError(f"{name} has no recorded checksum")
        for name, expected in sorted(digests.items()):
            with open_inside(directory, name) as stream:
                if _digest(stream) != expected:
                    raise CheckpointError(f"{name} differs from the file that was saved: its SHA-256 does "
                                          "not match")
    except CheckpointError as error:
        raise CheckpointError(f"{directory}: corrupt checkpoint ({error})") from None
