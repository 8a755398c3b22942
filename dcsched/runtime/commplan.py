"""The communication plan as the runtime reads it: buckets of ds_ids by graph_id, kept and replicated parameters.

A scheduler's :class:`dcsched.plan.Plan` names nodes by graph name
(``bundle.plans``); the ZeRO-3 ops only carry ``(graph_id, ds_id)``.
:func:`comm_plan` turns ``bundle.plans`` and ``bundle.graph_ids`` into a
:class:`CommPlan`: per graph_id the all-gather and the reduce buckets as tuples
of ds_ids (in member order), the sets of kept and of replicated ds_ids and the
forward's graph_id. A ``'replicated'`` parameter is whole on every rank: its
gathers send nothing and its gradient is all-reduced (a reduce bucket of
replicated parameters is one all-reduce).

What it drops, splits or refuses, and why:

* buckets of one member (after the next rules): nothing to fuse;
* kept parameters from the all-gather buckets of graphs other than the
  forward: the backward reuses the forward's gathered buffer, nothing is sent;
* replicated parameters from every all-gather bucket: nothing is sent;
* a reduce bucket with replicated and sharded members is split in two, the
  replicated members (one all-reduce) after the sharded ones (one
  reduce-scatter), each in member order: the two are different collectives.
  A scheduler plans without knowing what the training run replicates, so
  its buckets may mix them; splitting keeps its plan runnable;
* a parameter ``'replicated'`` in one graph's plan and ``'kept'`` in another's
  is replicated (nothing to keep);
* a ds_id in two buckets of one kind in one graph: the runtime matches a
  gather to its bucket by ds_id, so that would be ambiguous (error).

An empty ``bundle.plans`` gives :data:`EMPTY`: every collective alone and
every parameter sharded, the runtime's behaviour before plans existed.

>>> from dcsched.plan import Bucket, Plan
>>> plans = {"forward": Plan(("a", "b", "c"), buckets=[Bucket("allgather", ["a", "b"], [0, 1])],
...                          residency={1: "kept"}),
...          "backward": Plan(("x", "y"), buckets=[Bucket("allgather", ["x", "y"], [1, 2]),
...                                                Bucket("reduce", ["r2", "r0"], [2, 0])])}
>>> plan = comm_plan(plans, {"forward": 0, "backward": 1})
>>> plan.allgather_buckets(0), plan.allgather_buckets(1), plan.reduce_buckets(1), sorted(plan.kept)
(((0, 1),), (), ((2, 0),), [1])
>>> plan.allgather_bucket_of(0, 1), plan.allgather_bucket_of(1, 2), plan.forward_graph_id
((0, 1), None, 0)
>>> comm_plan({}, {"forward": 0}).empty
True
>>> mixed = comm_plan({"backward": Plan(("x",), buckets=[Bucket("reduce", ["a", "b", "c"], [5, 6, 7])],
...                                     residency={5: "replicated", 7: "replicated"})}, {"backward": 1})
>>> mixed.reduce_buckets(1), sorted(mixed.replicated)  # (6,) alone: a bucket of one is dropped
(((5, 7),), [5, 7])
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Iterator, Mapping


from dcsched.errors import DcschedError

#: (all-gather buckets, reduce buckets) of one graph, each bucket a tuple of ds_ids.
_Buckets = tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True)
class GraphComm:
    """One graph's buckets: tuples of ds_ids, members in the order the plan needs them."""

    allgather: _Buckets = ()
    reduce: _Buckets = ()


@dataclasses.dataclass(frozen=True)
class CommPlan:
    """What the runtime runs: buckets per graph_id, kept and replicated ds_ids, the forward's graph_id.

    Examples
    --------
    >>> plan = CommPlan({1: GraphComm(reduce=((4, 5),))}, kept=frozenset({3}), forward_graph_id=0)
    >>> plan.reduce_bucket_of(1, 5), plan.reduce_bucket_of(0, 5), plan.empty
    ((4, 5), None, False)
    >>> CommPlan(replicated=frozenset({2})).is_replicated(2), CommPlan(replicated=frozenset({2})).empty
    (True, False)
    """

    graphs: Mapping[int, GraphComm] = dataclasses.field(default_factory=dict)
    kept: frozenset[int] = frozenset()
    forward_graph_id: int | None = None
    #: Parameters whole on every rank: no gather, their gradients all-reduced.
    replicated: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        # Lookups by (graph_id, ds_id), made once: the ops ask at every gather and reduce.
        gathers: dict[tuple[int, int], tuple[int, ...]] = {}
        reduces: dict[tuple[int, int], tuple[int, ...]] = {}
        for graph_id, comm in self.graphs.items():
            for table, buckets in ((gathers, comm.allgather), (reduces, comm.reduce)):
                for bucket in buckets:
                    for ds_id in bucket:
                        table[(graph_id, ds_id)] = bucket
        object.__setattr__(self, "_gathers", gathers)
        object.__setattr__(self, "_reduces", reduces)

    @property
    def empty(self) -> bool:
        """Whether the plan changes nothing (no bucket, nothing kept or replicated)."""
        return not (self.kept or self.replicated or self._gathers or self._reduces)  # type: ignore[attr-defined]

    def is_replicated(self, ds_id: int) -> bool:
        """Whether ``ds_id`` is whole on every rank (no gather; its gradient all-reduced)."""
        return ds_id in self.replicated

    def allgather_buckets(self, graph_id: int) -> _Buckets:
        """Graph ``graph_id``'s all-gather buckets."""
        comm = self.graphs.get(graph_id)
        return comm.allgather if comm is not None else ()

    def reduce_buckets(self, graph_id: int) -> _Buckets:
        """Graph ``graph_id``'s reduce buckets."""
        comm = self.graphs.get(graph_id)
        return comm.reduce if comm is not None else ()

    def allgather_bucket_of(self, graph_id: int, ds_id: int) -> tuple[int, ...] | None:
        """The all-gather bucket ``ds_id`` is in, in graph ``graph_id`` (None: gathered alone)."""
        return self._gathers.get((graph_id, ds_id))  # type: ignore[attr-defined]

    def reduce_bucket_of(self, graph_id: int, ds_id: int) -> tuple[int, ...] | None:
        """The reduce bucket ``ds_id`` is in, in graph ``graph_id`` (None: reduced alone)."""
        return self._reduces.get((graph_id, ds_id))  # type: ignore[attr-defined]

    def kept_in(self, graph_id: int | None, ds_id: int) -> bool:
        """Whether the forward (``graph_id``) keeps ``ds_id`` gathered for the backward.

        A replicated parameter counts as kept: in one process (nothing to
        communicate) replicated acts as kept; the distributed runtime handles
        replicated parameters before it asks.
        """
        return graph_id is not None and graph_id == self.forward_graph_id and \
            (ds_id in self.kept or ds_id in self.replicated)


#: No plan: every collective alone, every parameter sharded.
EMPTY = CommPlan()


def comm_plan(plans: Mapping[str, Any] | None, graph_ids: Mapping[str, int | None]) -> CommPlan:
    """The runtime's :class:`CommPlan` from ``bundle.plans`` (graph name -> Plan) and ``bundle.graph_ids``.

    Parameters
    ----------
    plans : mapping of str to Plan, optional
        The plans by graph name (``'forward'``, ``'backward'``); empty or None: :data:`EMPTY`.
    graph_ids : mapping of str to int
        The graph_id the ZeRO-3 ops of each graph carry.

    Returns
    -------
    CommPlan
        Buckets per graph_id, kept and replicated ds_ids, the forward's graph_id.

    Raises
    ------
    DcschedError
        A plan for a graph without a graph_id, or a ds_id in two buckets of one kind in one graph.

    Examples
    --------
    >>> from dcsched.plan import Plan
    >>> plan = comm_plan({"forward": Plan(("a",), residency={2: "replicated", 3: "kept"})}, {"forward": 0})
    >>> sorted(plan.replicated), sorted(plan.kept)
    ([2], [3])
    """
    if not plans:
        return EMPTY
    kept: set[int] = set()
    replicated: set[int] = set()
    for plan in plans.values():
        for ds_id, where in plan.residency.items():
            {"kept": kept, "replicated": replicated}.get(where, set()).add(int(ds_id))
    kept -= replicated  # whole on every rank: nothing to keep
    forward_id = graph_ids.get("forward")
    graphs: dict[int, GraphComm] = {}
    for name, plan in plans.items():
        graph_id = graph_ids.get(name)
        if graph_id is None:
            raise DcschedError(f"the bundle has a plan for graph {name!r} but no graph_id for it")
        skip = (kept if graph_id != forward_id else set()) | replicated
        gathers = _buckets(name, "allgather", (b.ds_ids for b in plan.buckets if b.kind == "allgather"), skip)
        reduces = _buckets(name, "reduce", _split((b.ds_ids for b in plan.buckets if b.kind == "reduce"),
                                                  replicated), set())
        if gathers or reduces:
            graphs[int(graph_id)] = GraphComm(gathers, reduces)
    if not graphs and not kept and not replicated:
        return EMPTY
    return CommPlan(graphs, frozenset(kept), forward_id, frozenset(replicated))


def _split(buckets: Iterable[tuple[int, ...]], replicated: set[int]) -> Iterator[tuple[int, ...]]:
    """Each reduce bucket as its sharded members (a reduce-scatter), then its replicated ones (an all-reduce)."""
    for bucket in buckets:
        sharded = tuple(d for d in bucket if int(d) not in replicated)
        whole = tuple(d for d in bucket if int(d) in replicated)
        yield from (part for part in (sharded, whole) if part)


def _buckets(graph: str, kind: str, buckets: Iterable[tuple[int, ...]], skip: set[int]) -> _Buckets:
    """The buckets of one kind in one graph, ``skip`` left out, single members dropped; checks overlaps."""
    seen: set[int] = set()
    kept = []
    for bucket in buckets:
        ds_ids = tuple(int(d) for d in bucket if int(d) not in skip)
        twice = sorted(seen.intersection(ds_ids)) or sorted({d for d in ds_ids if ds_ids.count(d) > 1})
        if twice:
            raise DcschedError(f"the {graph} plan puts ds_id {twice[0]} in two {kind} buckets (or twice in one); "
                               "the runtime matches a parameter to one bucket")
        seen.update(ds_ids)
        if len(ds_ids) > 1:
            kept.append(ds_ids)
    return tuple(kept)
