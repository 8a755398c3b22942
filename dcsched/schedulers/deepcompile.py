"""``deepcompile``: DeepSpeed DeepCompile's own pipeline, fast-free's order and then its prefetch pass.

DeepSpeed 0.19.8 schedules a ZeRO-3 graph in two passes: ``fast_free_schedule``
(dcsched's ``fast-free``) and then ``schedule_prefetch``
(``deepspeed/compile/passes/prefetch.py``), which issues the all-gathers ahead
of their use, fused into groups, as far ahead as a memory budget allows. This
module restates the second pass (behaviour in ``docs/schedulers.md``):

Walk fast-free's order backwards, keeping the all-gathers seen so far and not
yet issued (*buffered*: an open group and a queue of closed groups, bytes
summed). At each node that is not a placeholder:

1. *Memory.* While the profiled peak of the node before it plus the buffered
   bytes exceeds the budget (or the buffered bytes exceed 4e9), issue the
   oldest closed group right after this node (closing the open group first if
   no closed one is left).
2. *Fusion.* An all-gather joins the open group if
   ``1.2 * max(t(open), t(own)) > t(open + own)`` and the sum stays under 1e9
   bytes (``t`` = the communication time model); otherwise the open group is
   closed and it starts a new one.
3. *Head.* At the first node after the placeholders every buffered group is
   issued, in the order their members are needed.

The profiled peak is dcsched's simulated all-tensor memory while each node of
fast-free's order runs (DeepSpeed measures it on the device); ``t`` is a line
``latency + bytes * seconds_per_byte`` fitted to the graph's own all-gathers
(DeepSpeed interpolates measured all-gathers of many sizes).

**How dcsched represents a fused group.** DeepSpeed inserts one
``prefetch_params_fused`` op per group and leaves each ``allgather_param`` in
place, where it then only waits for the prefetched buffer. dcsched adds no
node: the group's all-gathers move to where the fused op would be, one after
another in the order they are needed, and each wait stays where fast-free put
it, so its reader still waits for its own parameter. The plan's buckets are
the groups; the simulator runs each as one collective paying its latency
once, as DeepSpeed's fused prefetch does (docs/simulator.md, "Buckets").

>>> from dcsched.synthetic import layered_stack
>>> from dcsched.graph.nxview import to_networkx, check_order
>>> view = to_networkx(layered_stack(2).forward)
>>> plan = deepcompile_plan(view)
>>> check_order(view, plan.order)
>>> sum(len(group) for group in plan.groups) == sum(1 for v in view if view.nodes[v]["role"] == "allgather")
True
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Sequence

import networkx as nx

from dcsched.sim.simulate import ALLGATHER, PLACEHOLDER, CompiledGraph, compile_view
from dcsched.graph.form import GraphForm, paused_gc
from dcsched.schedulers.fast_free.scheduler import fast_free_indices
from dcsched.budget import UNLIMITED
from dcsched.plan import Bucket, Plan
from dcsched.schedulers.registry import register

#: DeepSpeed's prefetch pass: a group may hold at most this many bytes, all buffered groups together
#: at most MAX_BUFFERED_BYTES; an all-gather joins a group when fusing costs less than FUSE_SLACK
#: times the longer of the two collectives alone.
MAX_FUSE_BYTES = 1e9
MAX_BUFFERED_BYTES = 4e9
FUSE_SLACK = 1.2
#: Latency assumed when the graph's all-gathers all have one size (no line can be fitted): the one latency
#: dcsched's profiler used before its interconnect table (kept, so that plans stay as they were).
DEFAULT_LATENCY_MS = 0.020


@dataclasses.dataclass(frozen=True)
class CommModel:
    """An all-gather's time in ms: ``latency_ms + bytes * ms_per_byte``, and 0 for 0 bytes."""

    latency_ms: float
    ms_per_byte: float

    def __call__(self, nbytes: float) -> float:
        return 0.0 if nbytes == 0 else self.latency_ms + nbytes * self.ms_per_byte

    @classmethod
    def fit(cls, points: Sequence[tuple[int, float]]) -> "CommModel":
        """The least-squares line through ``(bytes, ms)`` points, latency and slope clamped at 0.

        >>> CommModel.fit([(1000, 1.5), (3000, 2.5)])
        CommModel(latency_ms=1.0, ms_per_byte=0.0005)
        >>> CommModel.fit([(1000, 1.0)])  # one size: the default latency, the rest is bandwidth
        CommModel(latency_ms=0.02, ms_per_byte=0.00098)
        """
        points = [(s, t) for s, t in points if s > 0]
        if not points:
            return cls(0.0, 0.0)
        n = len(points)
        mean_s = sum(s for s, _ in points) / n
        mean_t = sum(t for _, t in points) / n
        var = sum((s - mean_s) ** 2 for s, _ in points)
        if var == 0:
            latency = min(DEFAULT_LATENCY_MS, mean_t)
            return cls(latency, (mean_t - latency) / mean_s)
        slope = max(0.0, sum((s - mean_s) * (t - mean_t) for s, t in points) / var)
        latency = mean_t - slope * mean_s
        if latency < 0:
            latency, slope = 0.0, mean_t / mean_s
        return cls(latency, slope)


@dataclasses.dataclass(frozen=True)
class DeepCompilePlan:
    """The pipeline's result (node names).

    ``order``: dcsched's order; ``groups``: the fused groups as placed, each in
    the order needed; ``deepspeed``: the prefetch pass's own output, fast-free's
    order with each fused prefetch inserted as a tuple of its all-gathers
    (DeepSpeed's member order, the one needed last first).
    """

    order: list[str]
    groups: list[list[str]]
    deepspeed: list


def prefetch_pass(order: Sequence[int], *, is_placeholder: Sequence[bool], gather_bytes: Sequence[int | None],
                  peak: Sequence[float], budget: float, comm_time: Callable[[float], float]) -> list:
    """DeepSpeed's prefetch pass over ``order``: the new order, a fused group as a tuple of all-gathers.

    ``gather_bytes[v]`` is the size of all-gather ``v`` (None for other nodes),
    ``peak[v]`` the memory while ``v`` runs in ``order``. A group's tuple lists
    its members as DeepSpeed does, the one needed last first; it stands where
    the fused prefetch runs, and every node of ``order`` keeps its place.

    >>> ph, ag1, ag2, use1, use2 = range(5)
    >>> plan = prefetch_pass([ph, ag1, use1, ag2, use2], is_placeholder=[True] + [False] * 4,
    ...                      gather_bytes=[None, 10, 10, None, None], peak=[5, 15, 15, 15, 15],
    ...                      budget=100, comm_time=lambda b: b and 1 + b / 1000)
    >>> plan  # both gathers fused into one prefetch at the head
    [0, (2, 1), 1, 3, 2, 4]
    """
    rev = list(reversed(order))
    n = len(rev)
    out: list = []
    open_group: list[int] = []
    open_bytes = 0
    closed: collections.deque = collections.deque()  # (members, bytes), oldest (needed last) first
    buffered = 0
    for i, v in enumerate(rev):
        at_head = i + 1 == n or is_placeholder[rev[i + 1]]
        if not is_placeholder[v]:
            before = peak[rev[i + 1]] if i + 1 < n else 0
            while before + buffered > budget or buffered > MAX_BUFFERED_BYTES:
                if closed:
                    members, nbytes = closed.popleft()
                    buffered -= nbytes
                    out.append(tuple(members))
                elif open_group:
                    closed.append((open_group, open_bytes))
                    open_group, open_bytes = [], 0
                else:
                    break
            nbytes = gather_bytes[v]
            if nbytes is not None:
                fused = open_bytes + nbytes
                fuse = (max(comm_time(open_bytes), comm_time(nbytes)) * FUSE_SLACK > comm_time(fused)
                        and fused < MAX_FUSE_BYTES)
                if open_group and not fuse:
                    closed.append((open_group, open_bytes))
                    open_group, open_bytes = [], 0
                open_group.append(v)
                open_bytes += nbytes
                buffered += nbytes
        out.append(v)
        if not is_placeholder[v] and at_head:
            # Everything still buffered goes just before the first node after the placeholders.
            if open_group:
                closed.append((open_group, open_bytes))
            out.extend(tuple(members) for members, _ in closed)
            closed.clear()
            open_group, open_bytes, buffered = [], 0, 0
    out.reverse()
    return out


def place_groups(plan: list, preds: Sequence[Sequence[int]]) -> tuple[list[int], list[list[int]]]:
    """dcsched's form of a prefetch plan: each group's all-gathers where its fused prefetch stands.

    Members go in the order they are needed (the reverse of DeepSpeed's list);
    a member whose inputs have not run there (never in DeepCompile graphs,
    whose all-gathers read placeholders) stays at its own place. Returns the
    order and the groups as placed.

    >>> place_groups([0, (2, 1), 1, 3, 2, 4], preds=[(), (0,), (0,), (1,), (2,)])
    ([0, 1, 2, 3, 4], [[1, 2]])
    """
    done: set[int] = set()
    moved: set[int] = set()
    order: list[int] = []
    groups: list[list[int]] = []
    for item in plan:
        if isinstance(item, tuple):
            group = [g for g in reversed(item) if all(p in done for p in preds[g])]
            for g in group:
                done.add(g)
                moved.add(g)
            order.extend(group)
            if group:
                groups.append(group)
        elif item not in moved:
            done.add(item)
            order.append(item)
    return order, groups


def profiled_inputs(compiled: CompiledGraph, order: Sequence[int]) -> dict:
    """What the prefetch pass reads about ``order`` (keyword arguments of :func:`prefetch_pass`).

    The peak is the simulated all-tensor memory while each node runs; the
    communication model is fitted to the all-gathers, taken in ``order``.
    """
    profiled = compiled.simulate(order, detail=True, check=False)
    peak = [0] * len(compiled)
    for pos, v in enumerate(order):
        peak[v] = profiled.memory[pos]
    kind, size = compiled.kind, compiled.size
    comm_time = CommModel.fit([(size[v], compiled.duration[v]) for v in order if kind[v] == ALLGATHER])
    return dict(is_placeholder=[k == PLACEHOLDER for k in kind],
                gather_bytes=[size[v] if k == ALLGATHER else None for v, k in enumerate(kind)],
                peak=peak, comm_time=comm_time)


class DeepCompile:
    """The pipeline on one graph: fast-free's order and its profile computed once, :meth:`plan` per budget.

    Attributes: ``compiled`` (the simulator's form of the graph), ``fast_free``
    (fast-free's order, node numbers), ``inputs`` (:func:`profiled_inputs`).
    """

    def __init__(self, graph: GraphForm | nx.DiGraph, *, name: str | None = None):
        with paused_gc():
            form = graph if isinstance(graph, GraphForm) else GraphForm(graph)
            self.fast_free = fast_free_indices(form)
            self.compiled = compile_view(form, assume_zero=True, name=name)
            self.inputs = profiled_inputs(self.compiled, self.fast_free)

    def plan(self, budget_bytes: float = UNLIMITED) -> DeepCompilePlan:
        """The order and fused groups for ``budget_bytes`` (all-tensor bytes; ``math.inf``, the default: unlimited).

        Parameters
        ----------
        budget_bytes : float, optional
            The budget in bytes (a number: parse text with :meth:`dcsched.budget.Budget.parse` first).

        Returns
        -------
        DeepCompilePlan
        """
        budget = budget_bytes
        with paused_gc():
            plan = prefetch_pass(self.fast_free, budget=budget, **self.inputs)
            order, groups = place_groups(plan, self.compiled.preds)
        names = self.compiled.names
        return DeepCompilePlan([names[v] for v in order], [[names[g] for g in group] for group in groups],
                               [tuple(names[g] for g in item) if isinstance(item, tuple) else names[item]
                                for item in plan])

    def scheduled(self, budget_bytes: float = UNLIMITED) -> Plan:
        """:meth:`plan` as the registered scheduler gives it: the order, and one ``'allgather'``
        :class:`~dcsched.plan.Bucket` per fused group (ds_ids in the group's order)."""
        result = self.plan(budget_bytes)
        index, ds_id = self.compiled.index, self.compiled.ds_id
        buckets = tuple(Bucket("allgather", group, [ds_id[index[name]] for name in group]) for group in result.groups)
        return Plan(result.order, buckets=buckets)


def deepcompile_plan(graph: GraphForm | nx.DiGraph, budget_bytes: float = UNLIMITED) -> DeepCompilePlan:
    """The pipeline's order and fused groups for ``graph`` (``budget_bytes``: all-tensor bytes, default unlimited)."""
    return DeepCompile(graph).plan(budget_bytes)


@register("deepcompile", description="DeepSpeed 0.19.8's pipeline: fast-free's order, then its prefetch pass "
                                     "(all-gathers fused into groups issued ahead of use while all tensors "
                                     "fit memory_budget bytes; default unlimited)")
def deepcompile(form: GraphForm, *, budget_bytes: float = UNLIMITED) -> Plan:
    """DeepSpeed's pipeline on ``form`` under ``budget_bytes`` bytes of all tensors.

    Parameters
    ----------
    form : GraphForm
        The graph.
    budget_bytes : float, optional
        All-tensor budget in bytes; ``math.inf`` (default): unlimited (only the 4e9-byte buffer cap holds
        groups back).

    Returns
    -------
    Plan
        The order, and one ``'allgather'`` :class:`~dcsched.plan.Bucket` per fused group
        (DeepSpeed's ``prefetch_params_fused``, one member or more), in the order placed, members in the
        order needed (the runtime issues each bucket as one collective).

    Examples
    --------
    >>> from dcsched.synthetic import layered_stack
    >>> plan = deepcompile(GraphForm(layered_stack(2).forward))
    >>> all(b.kind == "allgather" for b in plan.buckets), max(len(b.members) for b in plan.buckets) > 1
    (True, True)
    """
    return DeepCompile(form).scheduled(budget_bytes)
