"""The collective kinds: one table of the ZeRO-3 communication ops that every part of dcsched reads.

A row (:class:`CollectiveKind`) says all that dcsched needs to know of one op:
its name in the ``dcsched`` and DeepSpeed ``dc`` namespaces and its schema
(registered with torch by :mod:`dcsched.graph.commops`), its integer
arguments (checked when a bundle loads), its role in a graph, the bucket kind
it may be fused into, and hooks for its runtime kernel and its modelled cost.
Roles (:mod:`dcsched.graph.roles`), plans' buckets (:mod:`dcsched.plan`,
:mod:`dcsched.bundle.plans`), the bundle checks, the op schemas, the
simulator's node kinds (:mod:`dcsched.graph.form`) and the runtime
(:mod:`dcsched.runtime.ops`) read this table instead of listing the kinds.

A row's ``role`` is one of :data:`ROLE_MEMORY`'s: what the simulator, the
schedulers and the runtime do with the node (each role is implemented once
there). ``'allgather'`` runs on the communication stream and allocates the
gathered parameter; ``'wait'`` is a view of it that waits for the collective;
``'release'`` is a view that frees the gathered buffer at its ``n_users``-th
call; ``'reduce'`` runs on the communication stream and outputs a shard-sized
gradient. A new kind with one of these roles is one row (:func:`register`),
its runtime kernel and its cost; nothing else changes.

This module imports nothing of dcsched (it is on the ground floor of the package's
layers: ``tools/import_cycles.py --layers``), so a kernel or cost is a plain
callable, or for the built-in kinds the name of a
:class:`~dcsched.runtime.ops.Zero3Runtime` method.

>>> [kind.name for kind in kinds()]
['allgather', 'wait', 'release', 'reduce']
>>> by_op("release_param").ints, by_op("reduce_grad").bucket, by_op("wait_allgather").memory
(('graph_id', 'id', 'n_users'), 'reduce', 'view')
>>> bucket_ops("allgather")
('allgather_param',)
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Callable, Iterator

#: The namespaces the ops are registered in: dcsched's own and DeepSpeed's (graphs built by DeepSpeed use it).
NAMESPACES = ("dcsched", "dc")
#: A row's role -> its memory behaviour, as the simulator and the last-use analysis model it:
#: ``'gathered'`` allocates the whole parameter; ``'view'`` aliases its input (and DeepSpeed's last-use
#: analysis sees it so); ``'frees'`` is a view that frees the gathered buffer at its ``n_users``-th call
#: (not aliasing for the last-use analysis); ``'shard'`` outputs a new shard-sized tensor.
ROLE_MEMORY = {"allgather": "gathered", "wait": "view", "release": "frees", "reduce": "shard"}
#: Roles that run on the communication stream (a collective of their own); the others run inline.
STREAM_ROLES = ("allgather", "reduce")
#: The bucket kinds a plan may fuse nodes into (:class:`dcsched.plan.Bucket`): one collective for all-gathers,
#: one for gradient reductions. A row names one of them (or none) in ``bucket``.
BUCKET_KINDS = ("allgather", "reduce")
#: The integer arguments a kind may take after its tensor, in this order.
INT_ARGUMENTS = ("graph_id", "id", "n_users")
_IDENTIFIER = re.compile(r"[a-z][a-z0-9_]{0,63}")



@dataclasses.dataclass(frozen=True)
class CollectiveKind:
    """One collective kind: a row of the table.

    Parameters
    ----------
    name : str
        The kind's name, as reports say it (``'allgather'``).
    op : str
        The op's name in both :data:`NAMESPACES` (``'allgather_param'``).
    schema : str
        Its torch schema, DeepSpeed's for the built-in kinds; the name must be ``op``.
    ints : tuple of str
        Its integer arguments after the tensor, a prefix of :data:`INT_ARGUMENTS`
        (``graph_id`` and ``id`` at least).
    role : str
        One of :data:`ROLE_MEMORY`: what the simulator, schedulers and runtime do with it.
    bucket : str or None
        The bucket kind (:data:`BUCKET_KINDS`) its nodes may be fused into with other kinds of that bucket,
        or None: never bucketed.
    kernel, fake : str or callable
        The runtime kernel and its shape-only (fake tensor) form: a
        :class:`~dcsched.runtime.ops.Zero3Runtime` method's name, or a function called with the
        installed runtime and then the op's arguments.
    cost : callable or None
        ``cost(nbytes, world_size, bandwidth_gbps, latency_us) -> ms`` of one node moving ``nbytes`` (the
        whole parameter or gradient); None: a collective role is priced as an all-gather or reduce-scatter of
        those bytes (:func:`dcsched.costmodels.formulas.comm_time_ms`), the others cost nothing.
    """

    name: str
    op: str
    schema: str
    ints: tuple[str, ...]
    role: str
    bucket: str | None
    kernel: str | Callable
    fake: str | Callable
    cost: Callable[[int, int, float, float], float] | None = None

    @property
    def memory(self) -> str:
        """Its memory behaviour (:data:`ROLE_MEMORY`)."""
        return ROLE_MEMORY[self.role]

    @property
    def on_stream(self) -> bool:
        """Whether it runs as a collective on the communication stream (:data:`STREAM_ROLES`)."""
        return self.role in STREAM_ROLES

    def check(self) -> None:
        """ValueError naming what is wrong with the row."""
        where = f"collective kind {self.name!r:.40}"
        for value, label in ((self.name, "name"), (self.op, "op")):
            if not isinstance(value, str) or not _IDENTIFIER.fullmatch(value):
                raise ValueError(f"{where}: its {label} {value!r:.40} is not a lower-case identifier")
        if not isinstance(self.schema, str) or not self.schema.startswith(f"{self.op}("):
            raise ValueError(f"{where}: its schema does not define {self.op}")
        if self.ints != INT_ARGUMENTS[:len(self.ints)] or len(self.ints) < 2:
            raise ValueError(f"{where}: its integer arguments are not graph_id, id[, n_users]")
        if self.role not in ROLE_MEMORY:
            raise ValueError(f"{where}: unknown role {self.role!r:.40} (one of {', '.join(ROLE_MEMORY)})")
        if self.bucket is not None and (self.bucket not in BUCKET_KINDS or self.role not in STREAM_ROLES):
            raise ValueError(f"{where}: bucket {self.bucket!r:.40} is not a bucket kind of its role")
        if (self.role == "release") != ("n_users" in self.ints):
            raise ValueError(f"{where}: a release, and only a release, takes n_users")


_BUILT_IN = (
    CollectiveKind("allgather", "allgather_param",
                   "allgather_param(Tensor a, int graph_id, int id, ScalarType? dtype=None) -> Tensor",
                   ("graph_id", "id"), "allgather", "allgather", "allgather", "gathered_like"),
    CollectiveKind("wait", "wait_allgather", "wait_allgather(Tensor(a) a, int graph_id, int id) -> Tensor(a)",
                   ("graph_id", "id"), "wait", None, "wait", "alias_like"),
    CollectiveKind("release", "release_param",
                   "release_param(Tensor(a) a, int graph_id, int id, int n_users) -> Tensor(a)",
                   ("graph_id", "id", "n_users"), "release", None, "release", "alias_like"),
    CollectiveKind("reduce", "reduce_grad", "reduce_grad(Tensor a, int graph_id, int id) -> Tensor",
                   ("graph_id", "id"), "reduce", "reduce", "reduce", "reduced_shard_like"),
)

#: The table: op name -> row, in registration order (read it through :func:`kinds` and :func:`by_op`).
_BY_OP: dict[str, CollectiveKind] = {kind.op: kind for kind in _BUILT_IN}
#: Functions called after the table changes (caches of what it says: roles memoised per op, ...).
_LISTENERS: list[Callable[[], None]] = []


def kinds() -> tuple[CollectiveKind, ...]:
    """Every kind in the table, the built-in ones first."""
    return tuple(_BY_OP.values())


def by_op(op: str) -> CollectiveKind:
    """The row of op ``op`` (KeyError for an op of no kind)."""
    return _BY_OP[op]


def find(op: str) -> CollectiveKind | None:
    """The row of op ``op``, or None."""
    return _BY_OP.get(op)


def op_names() -> tuple[str, ...]:
    """The ops of every kind."""
    return tuple(_BY_OP)


def bucket_ops(bucket: str) -> tuple[str, ...]:
    """The ops whose nodes a bucket of kind ``bucket`` may fuse."""
    return tuple(kind.op for kind in _BY_OP.values() if kind.bucket == bucket)


def qualified_ops() -> tuple[str, ...]:
    """``namespace.op.default`` of every kind in both namespaces (what a bundle's op allowlist holds)."""
    return tuple(f"{namespace}.{op}.default" for namespace in NAMESPACES for op in _BY_OP)


def on_change(listener: Callable[[], None]) -> None:
    """Call ``listener()`` whenever a kind is registered or unregistered."""
    _LISTENERS.append(listener)


def _changed() -> None:
    for listener in _LISTENERS:
        listener()


def register(kind: CollectiveKind) -> None:
    """Add ``kind`` to the table (this process only) and tell the listeners: the op schemas are registered
    with torch the next time :mod:`dcsched.graph.commops` defines ops (:func:`~dcsched.graph.commops.define`).

    Raises ValueError for a faulty row or an op or name the table has already.
    """
    kind.check()
    if kind.op in _BY_OP or any(k.name == kind.name for k in _BY_OP.values()):
        raise ValueError(f"collective kind {kind.name!r} (op {kind.op}) is in the table already")
    _BY_OP[kind.op] = kind
    _changed()


def unregister(op: str) -> None:
    """Take the kind of op ``op`` out of the table (a built-in kind cannot be)."""
    if any(kind.op == op for kind in _BUILT_IN):
        raise ValueError(f"{op} is a built-in collective kind")
    if _BY_OP.pop(op, None) is not None:
        _changed()


@contextlib.contextmanager
def registered(kind: CollectiveKind) -> Iterator[CollectiveKind]:
    """:func:`register` ``kind`` for the ``with`` block, then :func:`unregister` it."""
    register(kind)
    try:
        yield kind
    finally:
        unregister(kind.op)
