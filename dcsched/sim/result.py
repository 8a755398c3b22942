"""What one simulation of an order gives: :class:`SimResult` (figures and per-node series),
:class:`ParamLifetime` (one gathered buffer's life) and :class:`Clocks` (the streams' clocks alone).
:mod:`dcsched.sim.simulate` computes them."""

from __future__ import annotations

import dataclasses

from dcsched.collectives import STREAM_ROLES


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
    ``detail="series"`` (what the schedulers read) ``order``, ``kinds`` and
    ``params``, and ``indices`` holds the order as node numbers instead.
    """

    order: list[str]
    peak_bytes: int
    peak_node: str | None
    gathered_peak_bytes: int
    gathered_peak_node: str | None
    step_ms: float
    compute_ms: float
    #: the step's communication time: every all-gather's and reduce-grad's, a bucket's as one collective
    comm_ms: float
    exposed_comm_ms: float
    overlap_pct: float
    #: the graph's order-independent lower bounds (:class:`dcsched.sim.simulate.Bounds`), or a function giving
    #: them: computed when first read, so the simulations inside a scheduler never pay for them
    bounds: object = dataclasses.field(repr=False, compare=False)
    resident_bytes: int
    #: collectives issued in the step: every all-gather and reduce-grad, a bucket of them once
    collectives: int = 0
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
    #: the order as node numbers of the compiled graph (``detail="series"`` only)
    indices: list[int] = dataclasses.field(default_factory=list, repr=False)

    def peak_in(self, scope: str) -> int:
        """The peak a budget of ``scope`` bounds: all tensors' (``'all'``) or the gathered parameters'."""
        return self.peak_bytes if scope == "all" else self.gathered_peak_bytes

    @property
    def lower_bound_ms(self) -> float:
        """max(total compute, total communication): no order is faster."""
        return self._bounds().simple

    @property
    def tight_lower_bound_ms(self) -> float:
        """The tightest order-independent lower bound dcsched proves (``docs/overlap.md``)."""
        return self._bounds().tight

    def _bounds(self):
        if callable(self.bounds):
            self.bounds = self.bounds()
        return self.bounds

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
            "collectives": self.collectives,
        }

    def memory_timeline(self) -> tuple[list[float], list[int], list[int]]:
        """``(times_ms, all_bytes, gathered_bytes)``: memory as a step function of simulated time.

        One sample per node, at the time it allocates (a comm node at its issue,
        a compute node when it starts), then one at the step's end.
        """
        if not self.memory:
            raise ValueError("this result was simulated with detail=False: no series")
        times = [self.reach_ms[i] if self.kinds[i] in STREAM_ROLES else self.start_ms[i]
                 for i in range(len(self.order))]
        times.append(self.step_ms)
        return times, self.memory + [self.memory[-1]], self.gathered_memory + [self.gathered_memory[-1]]


@dataclasses.dataclass
class Clocks:
    """The two streams' clocks of one order, without the memory model (what timing searches read).

    ``indices``: the order as node numbers; the series are indexed by position
    in it and equal :class:`SimResult`'s of the same order, as does ``step_ms``.
    """

    indices: list[int]
    step_ms: float
    reach_ms: list[float]
    start_ms: list[float]
    end_ms: list[float]
