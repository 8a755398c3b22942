"""Where dcsched writes files, and how, for every command (one rule, checked before any work).

The rule:

* An output goes to a **regular file**. A path naming a directory, a device,
  a FIFO or a socket is refused (``-o /dev/null`` never replaces the device
  node with a file).
* A **missing directory** on the way to an output is created when the output
  is written; the nearest existing ancestor must be a writable directory,
  which is checked up front.
* An **existing file** is replaced only with ``--force`` (Python:
  ``overwrite=True``); an input of the command counts as an existing file, so
  writing over the input also needs ``--force``.
* **Two outputs** of one command on one path are always refused.

:func:`check_outputs` applies the rule to all outputs of a command before it
does any work; :func:`write_atomic` writes one file through a temporary file
renamed into place, so a failure or a kill never leaves a partial output. A
temporary file is named ``.<name>.<pid>.<random>.tmp``; one left by a process
that no longer runs (killed with SIGKILL, say) is removed the next time that
output is written.

This module imports nothing heavy (no torch), so the CLI can check paths
before loading anything.

>>> import pathlib, tempfile
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> check_outputs({"-o": d / "new" / "out.pt"}, inputs=[d / "in.pt"])
>>> write_atomic(d / "new" / "out.pt", lambda f: f.write(b"data"))
>>> (d / "new" / "out.pt").read_bytes()
b'data'
>>> check_outputs({"-o": d / "new" / "out.pt"}, inputs=[])
Traceback (most recent call last):
...
dcsched.errors.DcschedError: ...out.pt: exists already (pass --force to replace it)
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Mapping

from .errors import DcschedError

TEMP_SUFFIX = ".tmp"


def _describe(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _existing_kind(path: Path) -> str | None:
    """None when ``path`` is missing or a regular file, else what it is (``'a FIFO'``)."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise DcschedError(f"{path}: cannot be written ({exc.strerror})") from None
    return None if stat.S_ISREG(mode) else _describe(mode)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_output(path: Path, *, inputs: Iterable[Path] = (), force: bool = False, option: str = "") -> None:
    """Refuse ``path`` as an output by the rule in the module docstring (a one-line :class:`DcschedError`)."""
    path = Path(path)
    what = f"{path}" if not option else f"{option} {path}"
    kind = _existing_kind(path)
    if kind is not None:
        raise DcschedError(f"{what}: is {kind}; dcsched writes only regular files")
    for source in inputs:
        if _same_file(path, Path(source)) or Path(os.path.abspath(path)) == Path(os.path.abspath(source)):
            if not force:
                raise DcschedError(f"{what}: would overwrite the input {source} (choose another path, "
                                   "or pass --force)")
            break
    else:
        if path.exists() and not force:
            raise DcschedError(f"{what}: exists already (pass --force to replace it)")
    ancestor = Path(os.path.abspath(path)).parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise DcschedError(f"{what}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise DcschedError(f"{what}: directory {ancestor} is not writable")


def check_outputs(outputs: Mapping[str, Path], *, inputs: Iterable[Path] = (), force: bool = False) -> None:
    """Check every output of one command (``{option or label: path}``) and that no two share a path."""
    inputs = list(inputs)
    seen: dict[str, str] = {}
    for option, path in outputs.items():
        check_output(path, inputs=inputs, force=force, option=option)
        key = os.path.realpath(path)
        if key in seen:
            raise DcschedError(f"{option} {path}: is also the output of {seen[key]}; give each output its own path")
        seen[key] = option


def _remove_stale_temps(directory: Path, name: str) -> None:
    """Delete ``.<name>.<pid>.*.tmp`` files whose writing process no longer runs."""
    prefix = f".{name}."
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        if not (entry.name.startswith(prefix) and entry.name.endswith(TEMP_SUFFIX)):
            continue
        pid_text = entry.name[len(prefix):].partition(".")[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid() or _running(int(pid_text)):
            continue
        try:
            os.unlink(entry.path)
        except OSError:
            pass


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_atomic(path: str | os.PathLike, write: Callable) -> None:
    """Call ``write(binary_file)`` on a temporary file beside ``path``, then rename it into place.

    Refuses a ``path`` that exists and is not a regular file. Missing directories are
    created. A failure (an exception, a full or read-only disk) leaves no
    file behind and is raised as a one-line :class:`DcschedError` when it is
    the file system's.
    """
    path = Path(path)
    kind = _existing_kind(path)
    if kind is not None:
        raise DcschedError(f"{path}: is {kind}; dcsched writes only regular files")
    directory = path.parent if str(path.parent) else Path(".")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DcschedError(f"{path}: cannot create directory {directory} ({exc.strerror})") from None
    _remove_stale_temps(directory, path.name)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=TEMP_SUFFIX, dir=directory)
    except OSError as exc:
        raise DcschedError(f"{path}: cannot write in {directory} ({exc.strerror})") from None
    try:
        # mkstemp creates the file 0600; give it the mode a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        if exc.strerror is None:
            raise
        raise DcschedError(f"{path}: cannot be written ({exc.strerror})") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
