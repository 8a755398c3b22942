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
(:func:`dcsched.nxview.to_networkx`) with an order. Code that simulates many
orders of one graph (a scheduler's search) compiles it once with
:func:`compile_view` and calls :meth:`CompiledGraph.simulate`, which is O(N + E)
per order over plain integer arrays.

>>> import torch, torch.fx
>>> from dcsched import ops
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
import math
from typing import Sequence

import networkx as nx
import torch.fx

from .errors import GraphError
from .graphform import (ALLGATHER, COMM_KINDS, COMPUTE, CONSTANT, KIND_NAMES, OUTPUT, PLACEHOLDER, REDUCE, RELEASE,
                        GraphForm)



@dataclasses.dataclass(frozen=True)
class ParamLifetime:
    """Where one gathered parameter lives in a simulated order.

    Positions index the simulated order; times are milliseconds from the step's
    start. The buffer exists from the all-gather's issue (``issued_ms``) until
    the node that frees it has run (``freed_ms``).
    """

    ds_id: int | None
    size_bytes: int
    gather_node: str
    gather_index: int
    free_node: str | None
    free_index: int | None
    issued_ms: float
    ready_ms: float
    freed_ms: float

    @property
    def held_nodes(self) -> int:
        """Nodes run while the buffer exists (the all-gather's own slot excluded)."""
        return (self.free_index - self.gather_index) if self.free_index is not None else 0

    @property
    def held_ms(self) -> float:
        return self.freed_ms - self.issued_ms

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data.update(held_nodes=self.held_nodes, held_ms=self.held_ms)
        return data


@dataclasses.dataclass
class SimResult:
    """Figures of one simulated order. Bytes and milliseconds.

    Scalars are always filled. ``order``, the per-node series (``memory`` ...
    ``end_ms``, indexed by position in ``order``) and ``params`` are filled
    when the simulation ran with ``detail=True`` (the default of
    :func:`simulate`); with ``detail=False`` they are empty lists, with
    ``detail="series"`` (what the schedulers read) ``kinds`` and ``params``.
    """

    order: list[str]
    peak_bytes: int
    peak_node: str | None
    gathered_peak_bytes: int
    gathered_peak_node: str | None
    step_ms: float
    compute_ms: float
    comm_ms: float
    exposed_comm_ms: float
    overlap_pct: float
    lower_bound_ms: float
    tight_lower_bound_ms: float
    resident_bytes: int
    #: memory of all tensors while each node runs (after it allocated, before frees)
    memory: list[int] = dataclasses.field(default_factory=list, repr=False)
    #: memory of gathered parameters while each node runs
    gathered_memory: list[int] = dataclasses.field(default_factory=list, repr=False)
    #: role of each node ('compute', 'allgather', ...; get_attr constants are 'constant')
    kinds: list[str] = dataclasses.field(default_factory=list, repr=False)
    #: when the program reaches each node (a comm node's issue time; a compute node's time before it waits)
    reach_ms: list[float] = dataclasses.field(default_factory=list, repr=False)
    #: when each node starts and ends on its stream
    start_ms: list[float] = dataclasses.field(default_factory=list, repr=False)
    end_ms: list[float] = dataclasses.field(default_factory=list, repr=False)
    params: list[ParamLifetime] = dataclasses.field(default_factory=list, repr=False)

    def figures(self) -> dict:
        """The scalar figures as a JSON-able dict."""
        return {
            "peak_bytes": self.peak_bytes,
            "peak_node": self.peak_node,
            "gathered_peak_bytes": self.gathered_peak_bytes,
            "gathered_peak_node": self.gathered_peak_node,
            "step_ms": self.step_ms,
            "compute_ms": self.compute_ms,
            "comm_ms": self.comm_ms,
            "exposed_comm_ms": self.exposed_comm_ms,
            "overlap_pct": self.overlap_pct,
            "lower_bound_ms": self.lower_bound_ms,
            "tight_lower_bound_ms": self.tight_lower_bound_ms,
            "resident_bytes": self.resident_bytes,
        }

    def scalars(self) -> SimResult:
        """This result as ``detail=False`` gives it: the scalars, every list empty."""
        return dataclasses.replace(self, order=[], memory=[], gathered_memory=[], kinds=[], reach_ms=[], start_ms=[],
                                   end_ms=[], params=[])

    def memory_timeline(self) -> tuple[list[float], list[int], list[int]]:
        """``(times_ms, all_bytes, gathered_bytes)``: memory as a step function of simulated time.

        One sample per node, at the time it allocates (a comm node at its issue,
        a compute node when it starts), then one at the step's end.
        """
        if not self.memory:
            raise ValueError("this result was simulated with detail=False: no series")
        times = [self.reach_ms[i] if self.kinds[i] in ("allgather", "reduce") else self.start_ms[i]
                 for i in range(len(self.order))]
        times.append(self.step_ms)
        return times, self.memory + [self.memory[-1]], self.gathered_memory + [self.gathered_memory[-1]]


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

    @property
    def tight(self) -> float:
        return max(self.compute_ms, self.comm_ms, self.critical_path_ms, self.first_comm_then_dependent_ms,
                   self.comm_with_head_and_tail_ms)


class CompiledGraph(GraphForm):
    """A graph's :class:`~dcsched.graphform.GraphForm` with the simulator's storage model, for simulating
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
    shared). Raises :class:`GraphError` (naming the nodes) for a cycle,
    negative, NaN or non-numeric figures, and (unless ``assume_zero``) missing
    ``device_time`` or ``tensor_size`` (placeholders, constants and the
    output need none).
    """

    def __init__(self, graph: nx.DiGraph | torch.fx.Graph | GraphForm, *, assume_zero: bool = False,
                 name: str | None = None):
        label = f"graph '{name}'" if name else "graph"
        super().__init__(graph, label=label)
        self.name = name
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
            raise GraphError(f"{label}: {what} (profile the graph, or pass --assume-zero / assume_zero=True "
                             "to count missing figures as 0)")
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
        reads = []
        gates = []
        no_gates = ()
        for i, ps in enumerate(preds):
            if len(ps) == 1:
                r = (root[ps[0]],)
            else:
                r = tuple(dict.fromkeys([root[p] for p in ps]))
            reads.append(r)
            if kind[i] in COMM_KINDS or not r:
                gates.append(no_gates)
            else:
                gates.append(tuple([x for x in r if kind[x] in COMM_KINDS]) or no_gates)
        # An order-only edge (random ops kept in stream order, dcsched.nxview) reads no value.
        for s, i in self.order_only:
            reads[i] = tuple(dict.fromkeys([root[p] for p in self.preds[i] if p != s]))
        self.reads: list[tuple[int, ...]] = reads
        self.gates: list[tuple[int, ...]] = gates
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

    def free_positions(self, idx: Sequence[int]) -> list[int]:
        """For each node number, the position in ``idx`` after which its storage is freed (-1: never).

        Only storage owners (:attr:`owners`) get a position; others get -1.
        """
        n = len(idx)
        kind, reads, ds_id, n_users = self.kind, self.reads, self.ds_id, self.n_users
        last = [-1] * len(self.names)
        released: dict[int, int] = {}
        current: dict = {}
        count: dict = {}
        for pos in range(n):
            i = idx[pos]
            for r in reads[i]:
                last[r] = pos
            k = kind[i]
            if k == ALLGATHER:
                current[ds_id[i]] = i
                count[ds_id[i]] = 0
            elif k == RELEASE:
                d = ds_id[i]
                gather = current.get(d)
                if gather is not None:
                    c = count[d] + 1
                    if c >= n_users[i]:
                        released[gather] = pos
                        del current[d]
                    else:
                        count[d] = c
        free = [-1] * len(self.names)
        pos_of = None
        part_of = self.part_of
        for r in self.owners:
            p = released.get(r, last[r])
            if part_of[r] >= 0:  # an element of a multi-output op: the tuple holds it too
                p = max(p, last[part_of[r]])
            if p < 0 and not self.is_input[r]:
                if pos_of is None:
                    pos_of = {i: pos for pos, i in enumerate(idx)}
                p = pos_of[r]  # nobody reads it: freed right after it runs
            free[r] = p
        return free

    def simulate(self, order: Sequence | None = None, *, detail: bool | str = True, check: bool = True) -> SimResult:
        """Simulate ``order`` (names or node numbers; None = input order). O(N + E).

        ``detail``: True (everything), False (scalars only) or ``"series"`` (also the
        order and the per-node series, without ``kinds`` and ``params``).
        """
        idx = self.order_indices(order, check=check)
        n = len(idx)
        kind, dur, alloc, owned, gates = self.kind, self.duration, self.alloc, self.owned, self.gates
        free = self.free_positions(idx)
        free_all = [0] * n
        free_gathered = [0] * n
        for r in self.owners:
            p = free[r]
            if p >= 0:
                free_all[p] += owned[r]
                if kind[r] == ALLGATHER:
                    free_gathered[p] += owned[r]

        mem = self.resident_bytes
        gmem = 0
        peak = gpeak = -1
        peak_pos = gpeak_pos = -1
        tc = tq = 0.0  # compute stream's clock; when the communication stream is next free
        done = {}
        record = bool(detail)
        memory, gathered, reach, start, end = [], [], [], [], []
        for pos in range(n):
            i = idx[pos]
            k = kind[i]
            a = alloc[i]
            if a:
                mem += a
                if k == ALLGATHER:
                    gmem += a
            if mem > peak:
                peak, peak_pos = mem, pos
            if gmem > gpeak:
                gpeak, gpeak_pos = gmem, pos
            if k == ALLGATHER or k == REDUCE:
                s = tc if tc > tq else tq
                tq = s + dur[i]
                done[i] = tq
                if record:
                    reach.append(tc)
                    start.append(s)
                    end.append(tq)
            else:
                arrived = tc
                for g in gates[i]:
                    e = done[g]
                    if e > tc:
                        tc = e
                if record:
                    reach.append(arrived)
                    start.append(tc)
                tc += dur[i]
                if record:
                    end.append(tc)
            if record:
                memory.append(mem)
                gathered.append(gmem)
            f = free_all[pos]
            if f:
                mem -= f
                gmem -= free_gathered[pos]

        step = tc if tc > tq else tq
        result = self._result(idx, step, peak, peak_pos, gpeak, gpeak_pos, record)
        if record:
            result.memory, result.gathered_memory = memory, gathered
            result.reach_ms, result.start_ms, result.end_ms = reach, start, end
            if detail != "series":
                result.kinds = [KIND_NAMES[kind[i]] for i in idx]
                result.params = self._lifetimes(idx, free, reach, start, end)
        return result

    def _result(self, idx, step: float, peak: int, peak_pos: int, gpeak: int, gpeak_pos: int,
                with_order: bool) -> SimResult:
        """The scalars of a simulation that ended at ``step`` ms with these peaks."""
        n = len(idx)
        exposed = max(0.0, step - self.compute_ms)
        overlap = 100.0 if self.comm_ms <= 0 else min(100.0, max(0.0, 100.0 * (self.comm_ms - exposed) / self.comm_ms))
        bounds = self.bounds
        names = self.names
        return SimResult(
            order=[names[i] for i in idx] if with_order else [],
            peak_bytes=max(peak, self.resident_bytes) if n else self.resident_bytes,
            peak_node=names[idx[peak_pos]] if peak_pos >= 0 else None,
            gathered_peak_bytes=max(gpeak, 0),
            gathered_peak_node=names[idx[gpeak_pos]] if gpeak > 0 else None,
            step_ms=step,
            compute_ms=self.compute_ms,
            comm_ms=self.comm_ms,
            exposed_comm_ms=exposed,
            overlap_pct=overlap,
            lower_bound_ms=bounds.simple,
            tight_lower_bound_ms=bounds.tight,
            resident_bytes=self.resident_bytes,
        )

    def _lifetimes(self, idx, free, reach, start, end) -> list[ParamLifetime]:
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


def _some(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{len(names)} node{'s' if len(names) != 1 else ''} ({shown}{more})"


def compile_view(view: nx.DiGraph | torch.fx.Graph, *, assume_zero: bool = False,
                 name: str | None = None) -> CompiledGraph:
    """Check ``view``'s costs and compile it for fast repeated simulation.

    Raises :class:`GraphError` (naming the nodes) for a cycle, negative or NaN
    figures, and — unless ``assume_zero`` — missing ``device_time`` or
    ``tensor_size`` (placeholders, get_attr constants and the output need none).
    """
    return CompiledGraph(view, assume_zero=assume_zero, name=name)


def simulate(graph: torch.fx.Graph | nx.DiGraph | CompiledGraph, order: Sequence | None = None, *,
             assume_zero: bool = False, detail: bool = True, name: str | None = None) -> SimResult:
    """Simulate ``graph`` run in ``order`` (node names; None = the graph's own order).

    ``graph`` is a ``torch.fx.Graph`` (dcsched or DeepSpeed ``dc`` ZeRO-3 ops,
    costs in ``node.meta['device_time']`` ms and ``['tensor_size']`` bytes), its
    networkx view, or a :class:`CompiledGraph`. See the module docstring for
    the model. ``detail=False`` skips the per-node series and lifetimes.
    """
    compiled = graph if isinstance(graph, CompiledGraph) else compile_view(graph, assume_zero=assume_zero, name=name)
    return compiled.simulate(order, detail=detail)
