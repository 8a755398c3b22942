"""Live tensor bytes on any device, measured by watching storages come and go.

:class:`LiveBytes` is a ``TorchDispatchMode``: every op that runs under it has
the storages of its outputs recorded with their size, and a finalizer on each
storage takes the bytes off again when the storage is freed. Storages that
exist before the mode starts count once they are passed to :meth:`LiveBytes.track`.

A storage can also shrink without being freed: ZeRO-3's ``release_param``
frees an all-gathered buffer with ``untyped_storage().resize_(0)`` while views
of it are still referenced, and that call is no dispatched op. So after every
op that can resize storages (the ZeRO-3 comm ops and ``aten.resize_``/``set_``)
the tracker re-reads the size of the storages it holds, and counts the buffers
the runtime made inside the op, which no op returned and this mode (off while
its own handler runs) did not see: a bucket's flat input and output
(:meth:`dcsched.runtime.ops.Zero3Runtime.buffers`). What it cannot see is
scratch memory an op allocates and frees inside its kernel, and allocator
overheads: the figure is the sum of live tensor storages, as the simulator
models memory.

>>> import torch
>>> from dcsched.runtime import ops
>>> with LiveBytes() as tracker:
...     a = torch.ones(256)                       # 1 KiB
...     g = ops.allgather_param(a, 0, 7)          # 1 KiB more, a fresh buffer
...     w = ops.wait_allgather(g, 0, 7)
...     _ = ops.release_param(w, 0, 7, 1)         # frees the gathered buffer
...     del a
>>> tracker.peak, tracker.live
(2048, 0)
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dcsched.graph.roles import COMM_ROLES, role_of_target
from dcsched.runtime import ops

#: aten ops that change the size of an existing storage.
_RESIZING_OPS = ("resize_", "set_", "resize_as_")


def _resizes(func) -> bool:
    """An aten op that changes the size of an existing storage."""
    name = getattr(func, "_opname", None) or getattr(getattr(func, "_schema", None), "name", "")
    return name in _RESIZING_OPS


class LiveBytes(TorchDispatchMode):
    """Track the bytes of live tensor storages; ``peak`` is the highest total seen.

    Use as a context manager around the code to measure. ``live`` and ``peak``
    are bytes. :meth:`reset_peak` starts a new peak from the current total.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        # key: the storage's C++ address while alive -> [bytes counted, finalizer, weak ref]
        self._storages: dict[int, list] = {}

    # -- bookkeeping -------------------------------------------------------
    def _forget(self, key: int) -> None:
        entry = self._storages.pop(key, None)
        if entry is not None:
            self.live -= entry[0]

    def _add_storage(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._storages:
            return
        nbytes = storage.nbytes()
        finalizer = weakref.finalize(storage, self._forget, key)
        finalizer.atexit = False
        self._storages[key] = [nbytes, finalizer, weakref.ref(storage)]
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def track(self, tensors: Iterable) -> None:
        """Count the storages of ``tensors`` (any nesting of lists, tuples, dicts) from now on."""
        for value in tree_flatten(tensors)[0]:
            if isinstance(value, torch.Tensor) and not value.is_meta and value.layout == torch.strided:
                self._add_storage(value.untyped_storage())

    def resync(self) -> None:
        """Re-read every tracked storage's size (after a storage was resized in place)."""
        for entry in self._storages.values():
            storage = entry[2]()
            if storage is None:
                continue
            nbytes = storage.nbytes()
            if nbytes != entry[0]:
                self.live += nbytes - entry[0]
                entry[0] = nbytes
        self.peak = max(self.peak, self.live)

    def reset_peak(self) -> None:
        self.peak = self.live

    def close(self) -> None:
        """Stop watching: detach every finalizer (``live`` keeps its last value)."""
        for entry in self._storages.values():
            entry[1].detach()
        self._storages.clear()

    # -- the mode ----------------------------------------------------------
    def __enter__(self):
        # A copy-out the runtime made before this tracker watched (an unmeasured step's) is none of its
        # figures: left standing, it would be added to the first op seen here.
        ops.RUNTIME.transient_bytes()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if role_of_target("call_function", func) in COMM_ROLES:  # a ZeRO-3 op: it may resize storages
            self.resync()
            # what the runtime allocated inside the op (this mode is off there): a bucket's flat tensors,
            # those it still holds and those it held for a moment (its copy-out)
            self.track(ops.RUNTIME.buffers())
            self.peak = max(self.peak, self.live + ops.RUNTIME.transient_bytes())
        elif _resizes(func):
            self.resync()
        self.track(out)
        return out

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.close()
