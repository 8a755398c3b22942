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
renamed into place, so a failure or a kill never leaves a partial output;
:func:`all_or_none` renames all of a command's outputs together, once every one
is written, and without ``--force`` never replaces a file that appeared while
the command ran. A replaced file keeps its mode (and owner, where permitted). A
temporary file is named ``.<name>.<pid>.<8 random characters>.tmp`` (the name
cut to fit 255 bytes); one left by a process that no longer runs (killed with
SIGKILL, say), owned by this user, is removed the next time that output is
written; no other file is touched.

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
dcsched.errors.OutputError: ...out.pt: exists already (pass `force=True` to replace it)
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

from dcsched.errors import OutputError, first_line

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
        raise OutputError(f"{path}: cannot be written ({exc.strerror})") from None
    return None if stat.S_ISREG(mode) else _describe(mode)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_output(path: Path, *, inputs: Iterable[Path] = (), force: bool = False, option: str = "") -> None:
    """Refuse ``path`` as an output by the rule in the module docstring (a one-line :class:`OutputError`)."""
    path = Path(path)
    what = f"{path}" if not option else f"{option} {path}"
    kind = _existing_kind(path)
    if kind is not None:
        raise OutputError(f"{what}: is {kind}; dcsched writes only regular files")
    for source in inputs:
        if _same_file(path, Path(source)) or Path(os.path.abspath(path)) == Path(os.path.abspath(source)):
            if not force:
                raise OutputError(f"{what}: would overwrite the input {source} (choose another path, "
                                   "or pass `force=True`)")
            break
    else:
        if path.exists() and not force:
            raise OutputError(f"{what}: exists already (pass `force=True` to replace it)")
    ancestor = Path(os.path.abspath(path)).parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputError(f"{what}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputError(f"{what}: directory {ancestor} is not writable")


def check_outputs(outputs: Mapping[str, Path], *, inputs: Iterable[Path] = (), force: bool = False) -> None:
    """Check every output of one command (``{option or label: path}``) and that no two share a path."""
    inputs = list(inputs)
    seen: dict[str, str] = {}
    for option, path in outputs.items():
        check_output(path, inputs=inputs, force=force, option=option)
        key = os.path.realpath(path)
        if key in seen:
            raise OutputError(f"{option} {path}: is also the output of {seen[key]}; give each output its own path")
        seen[key] = option


#: A temporary name mkstemp makes: ``.<name>.<pid>.<8 random characters>.tmp``.
_RANDOM = re.compile(r"[a-z0-9_]{8}")
#: The longest file name most file systems take (bytes).
NAME_MAX = 255


def _temp_prefix(name: str) -> str:
    """``.<name>.<pid>.``, the name cut so the whole temporary name fits :data:`NAME_MAX` bytes."""
    pid = str(os.getpid())
    room = NAME_MAX - len(f"..{pid}.") - 8 - len(TEMP_SUFFIX)
    short = name.encode()[:room].decode(errors="ignore")
    return f".{short}.{pid}."


def _remove_stale_temps(directory: Path, name: str) -> None:
    """Delete temporary files of ``name`` that dcsched made and whose writing process no longer runs.

    Only names dcsched itself makes (``.<name>.<pid>.<8 random characters>.tmp``), owned by this user.
    """
    head = _temp_prefix(name).rpartition(f".{os.getpid()}.")[0] + "."
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        if not (entry.name.startswith(head) and entry.name.endswith(TEMP_SUFFIX)):
            continue
        pid_text, dot, random = entry.name[len(head):-len(TEMP_SUFFIX)].partition(".")
        if not (dot and pid_text.isdigit() and _RANDOM.fullmatch(random)):
            continue
        if int(pid_text) == os.getpid() or _running(int(pid_text)):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.geteuid() or not entry.is_file(follow_symlinks=False):
                continue
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


class _Staged:
    """Outputs written to their temporary files, renamed into place together at :meth:`commit`."""

    def __init__(self, overwrite: bool) -> None:
        self.overwrite = overwrite
        self.files: list[tuple[str, Path]] = []

    def commit(self) -> None:
        try:
            if not self.overwrite:  # all or none: refuse before placing any
                for _tmp, path in self.files:
                    if os.path.lexists(path):
                        raise OutputError(f"{path}: was created while dcsched ran (pass `force=True` to replace it)")
            while self.files:
                tmp, path = self.files[0]
                _place(tmp, path, self.overwrite)
                self.files.pop(0)
        finally:
            self.discard()

    def discard(self) -> None:
        for tmp, _path in self.files:
            Path(tmp).unlink(missing_ok=True)
        self.files.clear()


_STAGE: contextvars.ContextVar[_Staged | None] = contextvars.ContextVar("dcsched_outputs_stage", default=None)


@contextlib.contextmanager
def all_or_none(*, force: bool) -> Iterator[None]:
    """Every :func:`write_atomic` in the block goes to its temporary file; all are renamed into place when the
    block ends without an error, none otherwise (a failing ``--plot`` leaves no ``-o`` behind).

    Without ``force`` an output that appeared meanwhile (another run, another user) is never replaced: the
    rename is a link that fails on an existing name.
    """
    staged = _Staged(overwrite=force)
    token = _STAGE.set(staged)
    try:
        yield
    except BaseException:
        staged.discard()
        raise
    finally:
        _STAGE.reset(token)
    staged.commit()


def _place(tmp: str, path: Path, overwrite: bool) -> None:
    """Rename ``tmp`` to ``path``: replacing a file there only when ``overwrite`` (keeping its mode and, where
    permitted, its owner), else failing if one appeared."""
    try:
        if overwrite:
            try:
                existing = os.stat(path)
            except FileNotFoundError:
                existing = None
            if existing is not None:
                os.chmod(tmp, stat.S_IMODE(existing.st_mode))
                with contextlib.suppress(PermissionError):
                    os.chown(tmp, existing.st_uid, existing.st_gid)
            os.replace(tmp, path)
            return
        try:
            os.link(tmp, path)  # atomic, and fails where a file exists: no check-then-rename race
        except FileExistsError:
            raise OutputError(f"{path}: was created while dcsched ran (pass `force=True` to replace it)") from None
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
                raise
            if os.path.lexists(path):  # a file system without hard links: the best check there is
                raise OutputError(f"{path}: was created while dcsched ran (pass `force=True` to replace it)") from None
            os.replace(tmp, path)
    except OSError as exc:
        raise OutputError(f"{path}: cannot be written ({exc.strerror or exc})") from None
    finally:
        Path(tmp).unlink(missing_ok=True)


def write_atomic(path: str | os.PathLike, write: Callable, *, overwrite: bool = True) -> None:
    """Call ``write(binary_file)`` on a temporary file beside ``path``, then rename it into place.

    Refuses a ``path`` that exists and is not a regular file. Missing directories are
    created. A failure (an exception, a full or read-only disk) leaves no
    file behind and is raised as a one-line :class:`OutputError` when it is
    the file system's. ``overwrite=False``: a file that exists at the rename is an error, never replaced.
    Inside :func:`all_or_none` the rename waits for the block's end.
    """
    path = Path(path)
    kind = _existing_kind(path)
    if kind is not None:
        raise OutputError(f"{path}: is {kind}; dcsched writes only regular files")
    directory = path.parent if str(path.parent) else Path(".")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{path}: cannot create directory {directory} ({exc.strerror})") from None
    _remove_stale_temps(directory, path.name)
    try:
        fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path.name), suffix=TEMP_SUFFIX, dir=directory)
    except OSError as exc:
        raise OutputError(f"{path}: cannot write in {directory} ({exc.strerror})") from None
    try:
        # mkstemp creates the file 0600; give it the mode a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        if exc.strerror is None:
            raise
        raise OutputError(f"{path}: cannot be written ({exc.strerror})") from None
    except RuntimeError as exc:  # torch.save on a full disk: "unexpected pos 64 vs 0"
        Path(tmp).unlink(missing_ok=True)
        raise OutputError(f"{path}: cannot be written (is the disk full? {first_line(exc)})") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    staged = _STAGE.get()
    if staged is not None:
        staged.files.append((tmp, path))
        return
    _place(tmp, path, overwrite)
