"""Writing a checkpoint's files: non-tensor items as plain data, and a failed write reported as the OS said it.

DCP's default save planner pickles every non-tensor item with ``torch.save``,
whatever it holds; :class:`PlainSavePlanner` writes them with
:func:`~dcsched.train.checkpoint_objects.encode_item`: a ``torch.save``
archive naming no class (so torch's own readers, ``dcp_to_torch_save`` and
FSDP2's ``dcp.load``, read the checkpoint), or dcsched's JSON where plain
pickle cannot hold the value.

``torch.save`` turns an ``OSError`` from the stream it writes (a full disk)
into ``RuntimeError: [enforce fail at inline_container.cc] ... unexpected
pos``. :class:`SafeWriter` opens every file through a stream that remembers
the first ``OSError`` it met and raises that one instead, so the failure reads
``No space left on device``.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os

from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from dcsched.train import checkpoint_files
from dcsched.train.checkpoint_objects import encode_item


class PlainSavePlanner(DefaultSavePlanner):
    """DCP's save planner (one item per key: no flattening) writing non-tensor items as plain data."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False)

    def transform_object(self, write_item, object):
        from torch.distributed.checkpoint.planner import WriteItemType
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(encode_item(object, write_item.index.fqn))
        return object


class _Recording(io.BufferedWriter):
    """A buffered file that hands the first OSError it meets to ``record`` before raising it."""

    def __init__(self, raw: io.FileIO, record) -> None:
        super().__init__(raw)
        self._record = record

    def write(self, data) -> int:
        try:
            return super().write(data)
        except OSError as error:
            self._record(error)
            raise

    def flush(self) -> None:
        try:
            super().flush()
        except OSError as error:
            self._record(error)
            raise


class _RecordingFileSystem(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.failure: OSError | None = None

    def _record(self, error: OSError) -> None:
        if self.failure is None:
            self.failure = error

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = _Recording(checkpoint_files.raw_file(str(path)), self._record)
        try:
            yield stream
        finally:
            try:
                stream.close()
            except OSError as error:
                self._record(error)
                raise


class SafeWriter(FileSystemWriter):
    """DCP's file-system writer whose failures are the ``OSError`` a file write met (see the module docstring)."""

    def __init__(self, path) -> None:
        super().__init__(path, thread_count=1)
        self.fs = _RecordingFileSystem()

    def _reraise(self) -> None:
        failure = self.fs.failure
        if failure is not None:
            code = failure.errno or errno.EIO
            raise OSError(code, failure.strerror or os.strerror(code), failure.filename) from None

    def write_data(self, plan, planner):
        try:
            return super().write_data(plan, planner)
        except Exception:  # torch.save's RuntimeError for a failed write: raise the OSError under it
            self._reraise()
            raise

    def finish(self, metadata, results) -> None:
        try:
            super().finish(metadata, results)
        except Exception:  # torch.save's RuntimeError for a failed write: raise the OSError under it
            self._reraise()
            raise
