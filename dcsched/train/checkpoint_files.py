"""A checkpoint's files read safely: metadata without arbitrary unpickling, shard files against checksums.

``torch.distributed.checkpoint`` keeps a checkpoint's table of contents in
``.metadata``, a pickle it reads with :func:`pickle.load`: a file planted
there would run code on ``--resume``. :class:`SafeReader` reads it with an
unpickler that builds only the classes such a file holds (DCP's metadata
records, ``torch.Size``, dtypes, paths) and refuses any other.

DCP stores no checksum, so a flipped byte in a ``.distcp`` shard file loads
as a wrong number. :func:`write_checksums` records the SHA-256 of every file
of a finished checkpoint in ``dcsched-checksums.json``; :func:`verify_checksums`
checks them before anything is loaded (a checkpoint written before dcsched
kept checksums loads unchecked).
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader

from dcsched.errors import DcschedError
from dcsched.bundle.checks import DTYPES

#: The file of a checkpoint that holds its other files' SHA-256 digests.
CHECKSUMS = "dcsched-checksums.json"

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


class SafeReader(FileSystemReader):
    """DCP's file-system reader with ``.metadata`` read by :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
        locate = getattr(self, "_get_metadata_path", None)
        path = locate(kwargs.get("rank")) if locate is not None else self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not checkpoint metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        if hasattr(self, "load_id"):
            metadata.storage_meta.load_id = self.load_id
        return metadata


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def write_checksums(directory: Path) -> None:
    """Record the SHA-256 of every file in the finished checkpoint ``directory``."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != CHECKSUMS)
    digests = {p.name: _digest(p) for p in files}
    (directory / CHECKSUMS).write_text(json.dumps({"sha256": digests}, indent=1, sort_keys=True))


def verify_checksums(directory: Path, error: type[DcschedError]) -> None:
    """Raise ``error`` (one line) when a file of ``directory`` is missing or differs from its recorded digest."""
    record = directory / CHECKSUMS
    if not record.is_file():
        return  # written before dcsched kept checksums
    try:
        digests = json.loads(record.read_text())["sha256"]
        names = {str(name): str(value) for name, value in digests.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise error(f"{directory}: corrupt checkpoint ({CHECKSUMS} cannot be read)") from None
    for name, expected in sorted(names.items()):
        file = directory / name
        if Path(name).name != name or not file.is_file():
            raise error(f"{directory}: corrupt checkpoint ({name} is missing)")
        if _digest(file) != expected:
            raise error(f"{directory}: corrupt checkpoint ({name} differs from the file that was saved: "
                        "its SHA-256 does not match)")
