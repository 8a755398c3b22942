"""Version-1 bundles: a ``torch.save`` of plain data, read with ``torch.load(weights_only=True)``.

dcsched wrote these before version 2 (:mod:`dcsched.bundle.fileio`); they still load, through the same
checks as ever (:func:`dcsched.bundle.core.from_data`), and ``dcsched convert`` rewrites them as version 2.
"""

from __future__ import annotations

import pickle
import warnings
import zipfile
from pathlib import Path

import torch

from dcsched.errors import BundleError

#: How a file torch.save wrote begins: a zip archive (the format since torch 1.6) or a bare pickle.
TORCH_FILE_MAGIC = (b"PK\x03\x04", b"\x80")


def read_head(path: Path) -> bytes:
    """The file's first 16 bytes (BundleError when it cannot be read or is empty)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(16)
    except OSError as exc:
        raise BundleError(path, f"cannot be read ({exc.strerror or type(exc).__name__})") from None
    if not head:
        raise BundleError(path, "not a dcsched bundle (the file is empty)")
    return head


def check_magic(path: Path, head: bytes | None = None) -> None:
    """Refuse, before unpickling anything, a file that begins like neither a torch file nor a pickle."""
    head = read_head(path) if head is None else head
    if not head.startswith(TORCH_FILE_MAGIC):
        raise BundleError(path, "not a dcsched bundle (neither a safetensors file, a torch file nor a pickle)")


def load_v1(path: Path, head: bytes | None = None):
    """Read a version-1 bundle. Never executes code from the file; BundleError with the reason."""
    from dcsched.bundle.core import from_data
    check_magic(path, head)
    try:
        with warnings.catch_warnings():  # torch's note on a foreign pickle's protocol says nothing to a user
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if "weights only" in text.lower() or "global" in text.lower():
            raise BundleError(path, "not a dcsched bundle: it holds objects other than plain data "
                                    "(refused without running them)") from None
        raise BundleError(path, "not a dcsched bundle (unreadable pickle)") from None
    except (EOFError, zipfile.BadZipFile):
        raise BundleError(path, "file is truncated or corrupt") from None
    except RuntimeError as exc:
        text = str(exc).lower()
        if "zip" in text or "central directory" in text or "failed finding" in text or "eof" in text:
            raise BundleError(path, "file is truncated or corrupt") from None
        raise BundleError(path, f"not a readable torch file ({str(exc).splitlines()[0][:120]})") from None
    except Exception:  # any other parse failure of foreign bytes; nothing was executed
        raise BundleError(path, "not a dcsched bundle (not readable as a torch file)") from None
    return from_data(data, path)
