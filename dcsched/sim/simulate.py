"""Simulate one order of a ZeRO-3 graph: memory over time, two-stream step time, overlap.

The model (documented in full, with the lower bounds' proofs, in ``docs/simulator.md``):

Memory, in program order
    Every node allocates its ``tensor_size`` when it runs. View-like nodes
    (views, in-place ops, ``_unsafe_view``, ``getitem``, wait, release) allocate
    nothing and keep their source alive. A value is freed after its last reader
    (readers of its views included). Each output of a multi-output op is freed
    on its own: after its getitem's last reader, once the tuple is gone. Graph
    inputs are resident from the start; parameter shards (placeholders an
    all-gather reads) stay resident, at their sharded size.
    A gathered parameter's buffer is freed at its ``n_users``-th release,
    whatever views of it remain. A gradient is freed after its reduce-grad,
    which is its last reader.

Time, two streams
    Compute nodes run in order on the compute stream. All-gathers and
    reduce-grads are issued in program order onto one communication stream
    when the program reaches them and run there one at a time. A wait, or any
    reader of a gathered parameter (or of a reduce-grad's result), blocks the
    compute stream until that communication has finished. Waits, releases,
    placeholders and the output take no time.

:func:`simulate` works on a plain ``torch.fx.Graph`` or on the networkx view
(:func:`dcsched.graph.nxview.to_networkx`) with an order. Code that simulates many
orders of one graph (a scheduler's search) compiles it once with
:func:`compile_view` and calls :meth:`CompiledGraph.simulate`, which is O(N + E)
per order over plain integer arrays.

>>> import torch, torch.fx
>>> from dcsched.runtime import ops
>>> g = torch.fx.Graph()
>>> w = g.placeholder("w"); w.meta["tensor_size"] = 25
>>> ag = g.call_function(ops.allgather_param, (w, 0, 0)); ag.meta.update(device_time=2.0, tensor_size=100)
>>> wt = g.call_function(ops.wait_allgather, (ag, 0, 0)); wt.meta.update(device_time=0.0, tensor_size=100)
>>> y = g.create_node("call_function", torch.ops.aten.relu.default, (wt,), name="relu")
>>> y.meta.update(device_time=3.0, tensor_size=100)
>>> r = g.call_function(ops.release_param, (y, 0, 0, 1)); r.meta.update(device_time=0.0, tensor_size=100)
>>> _ = g.output((r,))
>>> res = simulate(g)
>>> res.peak_bytes, res.peak_node, res.gathered_peak_bytes, res.step_ms, res.exposed_comm_ms
(225, 'relu', 100, 5.0, 2.0)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Iterable, Sequence

import networkx as nx
import torch.fx

from dcsched.collective_issue import SIMULATOR, CollectiveIssue
from dcsched.errors import GraphError
from dcsched.sim.collectives import DEFAULT_LATENCY_MS, bucket_time_ms
from dcsched.sim.fused import HELD, Fused
from dcsched.sim.issue import bucket_indices
from dcsched.sim.memory import MemoryModel
from dcsched.sim.timeline import Timeline
from dcsched.sim.result import Clocks, ParamLifetime, SimResult  # noqa: F401  (simulate's results, imported from here too)
from dcsched.graph.form import (ALLGATHER, COMM_KINDS, COMPUTE, CONSTANT, KIND_NAMES, OUTPUT, PLACEHOLDER, REDUCE,
                                RELEASE, GraphForm)



@dataclasses.dataclass(frozen=True)
class Bounds:
    """Lower bounds on the step time that no order beats (proofs in docs/simulator.md)."""

    compute_ms: float
    comm_ms: float
    critical_path_ms: float
    #: first communication any parameter-dependent compute can wait for, plus that compute
    first_comm_then_dependent_ms: float
    #: earliest communication start, all communication, shortest tail after a communication
    comm_with_head_and_tail_ms: float

    @property
    def simple(self) -> float:
        return max(self.compute_ms, self.comm_ms)

    def with_buckets(self, saved_ms: float) -> Bounds:
        """The bounds for plans whose buckets save ``saved_ms`` of communication (docs/simulator.md).

        A bucket starts after all its members' inputs and lasts at least as
        long as each member, so the paths (critical path, first communication
        then its dependents) keep their length; only the communication total
        shrinks, by what the buckets save.
        """
        if not saved_ms:
            return self
        return dataclasses.replace(self, comm_ms=max(0.0, self.comm_ms - saved_ms),
                                   comm_with_head_and_tail_ms=max(0.0, self.comm_with_head_and_tail_ms - saved_ms))

    @property
    def tight(self) -> float:
        return max(self.compute_ms, self.comm_ms, self.critical_path_ms, self.first_comm_then_dependent_ms,
                   self.comm_with_head_and_tail_ms)




class CompiledGraph(MemoryModel, Timeline, GraphForm):
    """A graph's :class:`~dcsched.graph.form.GraphForm` with the simulator's storage model, for simulating
    many orders fast.

    Nodes are numbered by their position in the input order. Beside the
    form's lists (``names``, ``kind``, ``preds``, ``succs``, ``size``, ...),
    indexed by node number: ``duration`` (ms; 0 for nodes that take no time),
    ``alloc`` (bytes the node allocates when it runs), ``root`` (the node
    owning the storage a node's output lives in), ``reads`` (distinct storage
    roots a node reads), ``gates`` (communication nodes whose end a node must
    wait for), ``owned`` (bytes freed with a storage root: ``size`` except for
    a multi-output op, which keeps what its getitems do not own), ``part_of``
    (for a getitem owning one output of a multi-output op, that op's number;
    else -1).

    ``graph`` is a networkx view, an FX graph or a form (whose lists are
    shared). ``comm_latency_ms`` is the latency every communication figure
    includes (:func:`dcsched.sim.collectives.latency_from_provenance` of the
    bundle's provenance), what a bucket of collectives pays once
    (:meth:`simulate`'s ``buckets``). Raises :class:`GraphError` (naming the nodes) for a cycle,
    negative, NaN or non-numeric figures, and (unless ``assume_zero``) missing
    ``device_time`` or ``tensor_size`` (placeholders, constants and the
    output need none).
    """

    def __init__(self, graph: nx.DiGraph | torch.fx.Graph | GraphForm, *, assume_zero: bool = False,
                 name: str | None = None, comm_latency_ms: float = DEFAULT_LATENCY_MS):
        label = f"graph '{name}'" if name else "graph"
        super().__init__(graph, label=label)
        self.name = name
        #: The per-collective latency (ms) the communication figures include: what a bucket saves per extra member.
        self.comm_latency_ms = comm_latency_ms
        #: How :meth:`timeline_figures` times the collectives where its caller names no way
        #: (:data:`~dcsched.collective_issue.SIMULATOR`: blocking ones beside the compute).
        self.timing: CollectiveIssue = SIMULATOR
        self.missing = self._check_figures(label, assume_zero)
        #: Inputs (placeholders, constants) with no size at all, counted as 0 bytes.
        self.unsized_inputs = [self.names[i] for i, (k, nbytes) in enumerate(zip(self.kind, self.tensor_size))
                               if nbytes is None and k in (PLACEHOLDER, CONSTANT)]
        kind, time = self.kind, self.time
        self.duration = [float(time[i]) if kind[i] in (COMPUTE, ALLGATHER, REDUCE) else 0.0 for i in range(len(kind))]
        self.owned, self.part_of = self._split_multi_output()
        self._place_storage()
        self.compute_ms = sum(d for k, d in zip(kind, self.duration) if k == COMPUTE)
        self.comm_ms = sum(d for k, d in zip(kind, self.duration) if k in COMM_KINDS)
        self.num_allgathers = sum(1 for k in kind if k == ALLGATHER)
        self.num_reduces = sum(1 for k in kind if k == REDUCE)
        self._bounds: Bounds | None = None

    # -- construction helpers ------------------------------------------------
    def _check_figures(self, label: str, assume_zero: bool) -> dict[str, list[str]]:
        """The nodes missing a figure, by figure; raises for bad figures (and missing ones unless assumed 0)."""
        if all(_plain_figures(column) for column in (self.device_time, self.tensor_size)):
            return {}  # the usual profiled graph: every figure a non-negative int or float (checked at C speed)
        missing: dict[str, list[str]] = {"device_time": [], "tensor_size": []}
        bad: list[str] = []
        needs_none = (PLACEHOLDER, OUTPUT, CONSTANT)
        for i, (k, time, nbytes) in enumerate(zip(self.kind, self.device_time, self.tensor_size)):
            for key, value in (("device_time", time), ("tensor_size", nbytes)):
                if value is None:
                    if k not in needs_none:
                        missing[key].append(self.names[i])
                elif isinstance(value, bool) or not isinstance(value, (int, float)):
                    bad.append(f"{self.names[i]} {key}={value!r}")
                elif value < 0 or math.isnan(value):
                    bad.append(f"{self.names[i]} {key}={value}")
        if bad:
            raise GraphError(f"{label}: negative, NaN or non-numeric figures on {_some(bad)}")
        missing = {key: names for key, names in missing.items() if names}
        if missing and not assume_zero:
            what = "; ".join(f"no {key} on {_some(names)}" for key, names in missing.items())
            raise GraphError(f"{label}: {what} (profile the graph, or pass `assume_zero=True` to count missing "
                             "figures as 0)")
        return missing

    def _split_multi_output(self) -> tuple[list[int], list[int]]:
        """``(owned, part_of)``: the bytes each storage root frees, and each getitem's multi-output op.

        Multi-output ops (native_group_norm, convolution_backward, ...) return fresh tensors
        that die separately: each getitem owns its element's bytes, freed after its own
        readers (and not before the tuple, which lives until its last getitem). The op keeps
        the bytes no getitem takes. Only where every getitem has a figure and they add up
        to at most the op's own; otherwise the whole output lives as one storage.
        """
        kind, size, view_like, getitem, tensor_size = self.kind, self.size, self.view_like, self.getitem, \
            self.tensor_size
        owned = list(size)
        part_of = [-1] * len(kind)
        for i, users in enumerate(self.succs):
            if kind[i] != COMPUTE or view_like[i]:
                continue
            items = [s for s in users if getitem[s]]
            if not items or any(tensor_size[s] is None for s in items):
                continue
            taken = sum(size[s] for s in items)
            if taken > size[i]:
                continue
            owned[i] = size[i] - taken
            for s in items:
                part_of[s] = i
        return owned, part_of

    def _place_storage(self) -> None:
        """``root``, ``reads``, ``gates``, ``alloc``, what is resident and pinned, and the storage ``owners``."""
        kind, preds, view_like, part_of, size = self.kind, self.preds, self.view_like, self.part_of, self.size
        n = len(kind)
        # Storage: a view-like node lives in its first input's storage.
        root = list(range(n))
        for i in self.topo:
            if view_like[i] and preds[i] and kind[i] not in (PLACEHOLDER, OUTPUT) and part_of[i] < 0:
                root[i] = root[preds[i][0]]
        self.root = root
        no_gates: tuple[int, ...] = ()
        reads: list[tuple[int, ...]] = []
        gates: list[tuple[int, ...]] = []
        for i, ps in enumerate(preds):
            r: tuple[int, ...]
            if len(ps) == 1:
                r = (root[ps[0]],)
            else:
                r = tuple(dict.fromkeys([root[p] for p in ps]))
            reads.append(r)
            if kind[i] in COMM_KINDS or not r:
                gates.append(no_gates)
            else:
                gates.append(tuple([x for x in r if kind[x] in COMM_KINDS]) or no_gates)
        # An order-only edge (random ops kept in stream order, dcsched.graph.nxview) reads no value.
        for s, i in self.order_only:
            reads[i] = tuple(dict.fromkeys([root[p] for p in self.preds[i] if p != s]))
        self.reads = reads
        self.gates = gates
        self.alloc = [size[i] if kind[i] in (COMPUTE, ALLGATHER, REDUCE) and not view_like[i] else 0
                      for i in range(n)]
        # Inputs resident from the start; parameter shards (what an all-gather reads) never leave.
        resident = [k in (PLACEHOLDER, CONSTANT) for k in kind]
        self.pinned = [kind[i] == CONSTANT or (kind[i] == PLACEHOLDER
                       and any(kind[s] == ALLGATHER for s in self.succs[i])) for i in range(n)]
        self.resident_bytes = sum(size[i] for i in range(n) if resident[i])
        #: nodes owning storage that may be freed during the step
        self.owners = [i for i in range(n) if root[i] == i and self.owned[i] > 0 and not self.pinned[i]
                       and (self.alloc[i] > 0 or resident[i] or part_of[i] >= 0)]
        self.is_input = resident
        self._index_for_simulation()

    def _index_for_simulation(self) -> None:
        """What the simulation loops read per node: ``readers_of`` (per storage root, the nodes reading it),
        ``gathered_alloc``, ``is_comm``, ``timed`` (the node can move a clock), ``gather_or_release``,
        ``reduce_or_release`` and
        ``integral_sizes`` (every byte figure an int, so sums are exact in any order)."""
        kind, alloc = self.kind, self.alloc
        readers_of: list[list[int]] = [[] for _ in kind]
        for i, r in enumerate(self.reads):
            for x in r:
                readers_of[x].append(i)
        self.readers_of = readers_of
        self.gathered_alloc = [a if k == ALLGATHER else 0 for k, a in zip(kind, alloc)]
        self.is_comm = [k in COMM_KINDS for k in kind]
        self.timed = [c or bool(g) or d != 0 for c, g, d in zip(self.is_comm, self.gates, self.duration)]
        self.gather_or_release = [k == ALLGATHER or k == RELEASE for k in kind]
        self.reduce_or_release = [k == REDUCE or k == RELEASE for k in kind]
        self.integral_sizes = type(self.resident_bytes) is int and all(type(a) is int for a in alloc) \
            and all(type(o) is int for o in self.owned)

    def __len__(self) -> int:
        return len(self.names)

    # -- lower bounds ----------------------------------------------------------
    @property
    def bounds(self) -> Bounds:
        """Order-independent lower bounds on the step time (computed once, O(N + E))."""
        if self._bounds is None:
            self._bounds = self._compute_bounds()
        return self._bounds

    def _compute_bounds(self) -> Bounds:
        kind, dur, preds, succs, topo = self.kind, self.duration, self.preds, self.succs, self.topo
        n = len(kind)
        # head[i]: longest chain of durations that must finish before i starts
        head = [0.0] * n
        for i in topo:
            best = 0.0
            for p in preds[i]:
                t = head[p] + dur[p]
                if t > best:
                    best = t
            head[i] = best
        # tail[i]: longest chain of durations that must run after i ends
        tail = [0.0] * n
        has_dependent_compute = [False] * n
        for i in reversed(topo):
            best = 0.0
            dependent = False
            for s in succs[i]:
                t = dur[s] + tail[s]
                if t > best:
                    best = t
                if has_dependent_compute[s] or (kind[s] == COMPUTE and dur[s] > 0):
                    dependent = True
            tail[i] = best
            has_dependent_compute[i] = dependent
        critical = max((head[i] + dur[i] for i in range(n)), default=0.0)
        # Compute that depends (transitively) on some communication.
        after_comm = [False] * n
        for i in topo:
            after_comm[i] = kind[i] in COMM_KINDS or any(after_comm[p] for p in preds[i])
        dependent_compute = sum(dur[i] for i in range(n) if kind[i] == COMPUTE and after_comm[i])
        comm = [i for i in range(n) if kind[i] in COMM_KINDS]
        gating = [head[c] + dur[c] for c in comm if has_dependent_compute[c]]
        first_then_dependent = (min(gating) + dependent_compute) if gating else 0.0
        with_head_tail = (min(head[c] for c in comm) + self.comm_ms + min(tail[c] for c in comm)) if comm else 0.0
        return Bounds(self.compute_ms, self.comm_ms, critical, first_then_dependent, with_head_tail)

    # -- the simulation ----------------------------------------------------------
    def order_indices(self, order: Sequence | None, *, check: bool = True) -> list[int]:
        """Node numbers of ``order`` (names or numbers; None = the input order), checked topological."""
        if order is None:
            return list(self.topo)
        if isinstance(order, torch.fx.Graph):
            order = [node.name for node in order.nodes]
        idx = list(order)
        if idx and not isinstance(idx[0], int):
            try:
                idx = [self.index[v] for v in idx]
            except KeyError as exc:
                raise GraphError(f"order names {exc.args[0]!r}, which is not in the graph") from None
        if check:
            self.check(idx)
        return idx

    def check(self, idx: Sequence[int]) -> None:
        """Raise :class:`GraphError` unless ``idx`` runs every node once, inputs first."""
        n = len(self.names)
        placed = [False] * n
        if len(idx) != n:
            raise GraphError(f"order holds {len(idx)} nodes for a graph of {n}")
        for i in idx:
            if placed[i]:
                raise GraphError(f"order runs {self.names[i]!r} twice")
            for p in self.preds[i]:
                if not placed[p]:
                    raise GraphError(f"order runs {self.names[i]!r} before its input {self.names[p]!r}")
            placed[i] = True

    def simulate(self, order: Sequence | None = None, *, detail: bool | str = True, check: bool = True,
                 buckets: Sequence | None = None, keep: Iterable[int] = (), held: Iterable[int] = (),
                 issue: CollectiveIssue = SIMULATOR) -> SimResult:
        """Simulate ``order`` (names or node numbers; None = input order). O(N + E).

        ``detail``: True (everything), False (scalars only) or ``"series"`` (also the
        per-node series and the order as node numbers, ``indices``; no names, ``kinds``
        or ``params``).

        ``buckets``: collectives run as one (:class:`dcsched.plan.Bucket`
        objects, or sequences of member names or numbers). A bucket is issued
        when the order reaches its first member, as one collective taking
        :func:`dcsched.sim.collectives.bucket_time_ms` of its members' times with
        :attr:`comm_latency_ms`; every member's buffer is allocated there, and
        every member is done when it ends (the later members take no time where
        they stand). Checked (:meth:`bucket_indices`) unless ``check`` is false.
        No bucket (None or empty): exactly the simulation without buckets.

        ``keep`` and ``held`` run a plan's ``'kept'`` parameters (by ds_id):
        in the forward (``keep``) their gathered buffers are not freed at their
        release but stay to the graph's end; in the backward (``held``) they
        are gathered from the start (their bytes resident, counted as
        gathered), their all-gathers issue no collective and are ready at
        once (a bucket simply goes without them), and their release frees
        them as usual.

        ``issue``: how the run issues its collectives
        (:class:`~dcsched.collective_issue.CollectiveIssue`; default
        :data:`~dcsched.collective_issue.SIMULATOR`). With ``async_reduce``
        the gradient reduce-scatters run as the runtime runs them on a process
        group (:mod:`dcsched.runtime.distributed`): asynchronously, at most one
        in flight, so a gradient (a bucket's, for a bucket issued at its last
        member) lives until the next reduce-scatter is issued, or to the
        graph's end. With ``staging`` the memory series counts gloo's staging
        copies, the flat tensors its collectives allocate for themselves while
        they run (:mod:`dcsched.sim.staging`), each alive as ``async_gather``
        and ``async_reduce`` say. A blocking collective (``async_gather`` or
        ``async_reduce`` False, where ``issue.blocks_step``: every issue but
        :data:`~dcsched.collective_issue.SIMULATOR`) holds the compute stream
        from its issue point until it ends, so the step time adds it where no
        asynchronous one would (:meth:`Timeline._fused_timeline`).
        """
        idx = self.order_indices(order, check=check)
        keep, held = frozenset(keep), frozenset(held)
        if not buckets and not keep and not held and not issue.adds_memory and not issue.blocks_step:
            return self.simulate_with_frees(idx, detail=detail)[0]
        fused = self._fused(self.bucket_indices(buckets or (), idx), self._held_gathers(held), keep)
        fused = dataclasses.replace(fused, issue=issue)
        return self.simulate_with_frees(idx, detail=detail, fused=fused)[0]

    def timeline_figures(self, idx: list[int], *, buckets: Sequence | None = None, held: Iterable[int] = (),
                         check: bool = True, issue: CollectiveIssue | None = None) -> tuple[float, int]:
        """:meth:`simulate`'s step time and collectives alone (no memory model, a third of the cost) for the
        node numbers ``idx`` (unchecked) with ``buckets`` and the ``held`` parameters (ds_ids).
        ``check=False`` takes the buckets as lists of node numbers, each in ``idx``'s order
        (:meth:`bucket_indices`), unchecked. ``issue``: how the collectives are issued, as :meth:`simulate`
        times them; by default :attr:`timing` (a planner that plans for blocking collectives sets it once).

        Examples
        --------
        >>> from dcsched.synthetic import layered_stack
        >>> g = compile_view(layered_stack(1).forward)
        >>> result = g.simulate(None)
        >>> g.timeline_figures(list(g.topo)) == (result.step_ms, result.collectives)
        True
        """
        held = frozenset(held)
        issue = self.timing if issue is None else issue
        if not buckets and not held and not issue.blocks_step:
            return self._timeline(idx, False)[0], self.num_allgathers + self.num_reduces
        listed = self.bucket_indices(buckets or (), idx) if check else [list(b) for b in buckets or ()]
        fused = self._fused(listed, self._held_gathers(held))
        if issue.blocks_step:
            fused = dataclasses.replace(fused, issue=issue)
        return self._fused_timeline(idx, False, fused)[0], fused.collectives

    def _held_gathers(self, held: frozenset) -> list[int]:
        """The all-gathers of the ``held`` parameters (ds_ids), in node order."""
        if not held:
            return []
        by_param = self.__dict__.get("_gathers_by_param")
        if by_param is None:  # built once: a planner asks for many held sets of one graph
            by_param = {}
            for i, (k, d) in enumerate(zip(self.kind, self.ds_id)):
                if k == ALLGATHER:
                    by_param.setdefault(d, []).append(i)
            self.__dict__["_gathers_by_param"] = by_param
        return sorted(i for d in held for i in by_param.get(d, ()))

    def bucket_indices(self, buckets: Sequence, idx: Sequence[int]) -> list[list[int]]:
        """``buckets`` as lists of member numbers, each in the order ``idx`` runs them, checked against ``idx``
        (:func:`dcsched.sim.issue.bucket_indices`: GraphError for a bucket that cannot be issued there)."""
        return bucket_indices(self, buckets, idx)

    def simulate_with_frees(self, idx: list[int], *, detail: bool | str = "series",
                            buckets: list[list[int]] | None = None,
                            fused: Fused | None = None) -> tuple[SimResult, list[int]]:
        """:meth:`simulate` of the node numbers ``idx`` (taken as they are, unchecked), and
        :meth:`free_positions` of them (computed on the way). ``buckets``: lists of member numbers,
        each in ``idx``'s order (:meth:`bucket_indices`, unchecked); or ``fused``, the plan already read."""
        kind = self.kind
        if fused is None and buckets:
            fused = self._fused(buckets)
        memory, gathered, free = self.memory_with_frees(idx, fused=fused)
        peak, peak_pos = _first_peak(memory)
        gpeak, gpeak_pos = _first_peak(gathered)
        record = bool(detail)
        step, reach, start, end = self._timeline(idx, record) if fused is None else \
            self._fused_timeline(idx, record, fused)
        result = self._result(idx, step, peak, peak_pos, gpeak, gpeak_pos, record and detail != "series", fused)
        if record:
            result.memory, result.gathered_memory = memory, gathered
            result.reach_ms, result.start_ms, result.end_ms = reach, start, end
            if detail == "series":
                result.indices = idx
            else:
                result.kinds = [KIND_NAMES[kind[i]] for i in idx]
                result.params = self._lifetimes(idx, free, reach, end)
        return result, free

    def _fused(self, buckets: list[list[int]], held: Sequence[int] = (), keep: frozenset = frozenset()) -> Fused:
        """Per node, the bucket's first member (-1 outside buckets, :data:`HELD` for ``held`` all-gathers),
        and each first member's fused time; ``keep``: ds_ids whose gathered buffers outlive the graph."""
        lead = [-1] * len(self.names)
        for i in held:
            lead[i] = HELD
        if held:
            buckets = [[m for m in members if lead[m] != HELD] for members in buckets]  # held members leave
        buckets = [members for members in buckets if members]
        time: dict[int, float] = {}
        dur, latency = self.duration, self.comm_latency_ms
        for members in buckets:
            first = members[0]
            for m in members:
                lead[m] = first
            time[first] = bucket_time_ms([dur[m] for m in members], latency_ms=latency)
        saved = sum(dur[m] for members in buckets for m in members) - sum(time.values()) + sum(dur[i] for i in held)
        collectives = self.num_allgathers + self.num_reduces - sum(len(members) - 1 for members in buckets) \
            - len(held)
        return Fused(lead, time, max(0.0, saved), collectives, keep, int(sum(self.size[i] for i in held)))

    def _result(self, idx, step: float, peak: int, peak_pos: int, gpeak: int, gpeak_pos: int,
                with_order: bool, fused: Fused | None = None) -> SimResult:
        """The scalars of a simulation that ended at ``step`` ms with these peaks (``fused``: with buckets)."""
        n = len(idx)
        comm_ms = self.comm_ms if fused is None else self.comm_ms - fused.saved_ms
        exposed = max(0.0, step - self.compute_ms)
        overlap = 100.0 if comm_ms <= 0 else min(100.0, max(0.0, 100.0 * (comm_ms - exposed) / comm_ms))
        names = self.names
        bounds: object
        if fused is None:
            bounds = self._bounds if self._bounds is not None else (lambda: self.bounds)
        else:
            bounds = functools.partial(_bucketed_bounds, self, fused.saved_ms)
        resident = self.resident_bytes + (fused.held_bytes if fused is not None else 0)
        return SimResult(
            order=[names[i] for i in idx] if with_order else [],
            peak_bytes=max(peak, resident) if n else resident,
            peak_node=names[idx[peak_pos]] if peak_pos >= 0 else None,
            gathered_peak_bytes=max(gpeak, 0),
            gathered_peak_node=names[idx[gpeak_pos]] if gpeak > 0 else None,
            step_ms=step,
            compute_ms=self.compute_ms,
            comm_ms=comm_ms,
            exposed_comm_ms=exposed,
            overlap_pct=overlap,
            bounds=bounds,
            resident_bytes=resident,
            collectives=self.num_allgathers + self.num_reduces if fused is None else fused.collectives,
        )

    def _lifetimes(self, idx, free, reach, end) -> list[ParamLifetime]:
        names, kind = self.names, self.kind
        lifetimes = []
        for pos, i in enumerate(idx):
            if kind[i] != ALLGATHER:
                continue
            p = free[i]
            lifetimes.append(ParamLifetime(
                ds_id=self.ds_id[i], size_bytes=self.size[i], gather_node=names[i], gather_index=pos,
                free_node=names[idx[p]] if p >= 0 else None, free_index=p if p >= 0 else None,
                issued_ms=reach[pos], ready_ms=end[pos], freed_ms=end[p] if p >= 0 else end[-1]))
        return lifetimes


def _bucketed_bounds(compiled: CompiledGraph, saved_ms: float) -> Bounds:
    """``compiled``'s bounds for a plan whose buckets save ``saved_ms`` (:meth:`Bounds.with_buckets`)."""
    return compiled.bounds.with_buckets(saved_ms)


def _plain_figures(values: list) -> bool:
    """Whether every value is an int or a float (not a bool), none negative and none NaN."""
    return not values or (set(map(type, values)) <= {int, float} and min(values) >= 0
                          and not any(map(math.isnan, values)))


def _first_peak(series: list) -> tuple:
    """The largest value of ``series`` and its first position; (-1, -1) when no value exceeds -1."""
    peak = max(series, default=-1)
    return (peak, series.index(peak)) if peak > -1 else (-1, -1)


def _some(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{len(names)} node{'s' if len(names) != 1 else ''} ({shown}{more})"


def compile_view(view: nx.DiGraph | torch.fx.Graph | GraphForm, *, assume_zero: bool = False,
                 name: str | None = None, comm_latency_ms: float = DEFAULT_LATENCY_MS) -> CompiledGraph:
    """Check ``view``'s costs and compile it for fast repeated simulation.

    ``comm_latency_ms``: the per-collective latency the figures include (what a
    bucket pays once; :class:`CompiledGraph`). Raises :class:`GraphError`
    (naming the nodes) for a cycle, negative or NaN
    figures, and — unless ``assume_zero`` — missing ``device_time`` or
    ``tensor_size`` (placeholders, get_attr constants and the output need none).
    """
    return CompiledGraph(view, assume_zero=assume_zero, name=name, comm_latency_ms=comm_latency_ms)


def simulate(graph: torch.fx.Graph | nx.DiGraph | CompiledGraph, order: Sequence | None = None, *,
             assume_zero: bool = False, detail: bool = True, name: str | None = None,
             buckets: Sequence | None = None) -> SimResult:
    """Simulate ``graph`` run in ``order``: memory over time and the two-stream step time.

    See the module docstring for the model (docs/simulator.md in full).

    Parameters
    ----------
    graph : torch.fx.Graph, networkx.DiGraph or CompiledGraph
        A graph with dcsched or DeepSpeed ``dc`` ZeRO-3 ops and costs in
        ``node.meta['device_time']`` (ms) and ``['tensor_size']`` (bytes), its
        networkx view (:func:`dcsched.to_networkx`), or its compiled form.
    order : sequence of str, optional
        Node names in the order to run them; the graph's own order when None.
    assume_zero : bool
        Treat missing costs as 0 instead of refusing the graph.
    detail : bool
        Keep the per-node series and lifetimes (off: figures only, faster).
    name : str, optional
        The graph's name in the result (for reports).
    buckets : sequence, optional
        Collectives run as one (a plan's :attr:`~dcsched.plan.Plan.buckets`; see
        :meth:`CompiledGraph.simulate`), with the latency of a compiled ``graph`` or the default one.

    Returns
    -------
    SimResult
        Peak memory, gathered peak, step time, exposed communication, overlap
        and lower bounds (:class:`dcsched.sim.result.SimResult`).

    Raises
    ------
    GraphError
        A node without costs (unless ``assume_zero``), or an ``order`` that is
        not a topological order of exactly the graph's nodes.

    Examples
    --------
    >>> import dcsched
    >>> from dcsched.synthetic import random_graph
    >>> g = random_graph(3)
    >>> before = dcsched.simulate(g)
    >>> after = dcsched.simulate(dcsched.schedule(g, "fast-free"))
    >>> after.peak_bytes <= before.peak_bytes
    True
    """
    compiled = graph if isinstance(graph, CompiledGraph) else compile_view(graph, assume_zero=assume_zero, name=name)
    return compiled.simulate(order, detail=detail, buckets=buckets)
