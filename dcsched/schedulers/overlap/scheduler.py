"""``overlap``: dcsched's memory-budgeted overlap scheduler.

The compute order is ``fast-free``'s, so activations live exactly as long as
they do under ``fast-free`` (the graph's own order and fast-free's with side
branches sunk are tried too, within the same memory limits); only the
communication moves (full write-up with guarantees and proofs:
``docs/overlap.md``):

1. *Skeleton.* Take ``fast-free``'s order without its all-gathers and their
   waits. Every gradient reduce and every parameter release moves up to right
   after its last input (a reduce is issued as soon as its gradient is ready,
   also through free views such as a transpose, a gathered buffer is freed as
   soon as its last reader ran).
2. *Need.* Each all-gather's *need slot* is the skeleton position of its first
   reader; its wait goes right before that reader; its buffer lives until the
   release that frees it (a fixed skeleton position).
3. *Earliest under the budget.* All-gathers go in need order (so the
   communication stream, a FIFO, serves them earliest-deadline first), each at
   the earliest skeleton slot, no earlier than the previous all-gather's,
   where its buffer fits under the budget at every slot up to its free. A
   segment tree over the slots answers "last slot that does not fit" in
   O(log N).
   Also tried: a large all-gather may go ahead of the one or two smaller
   ones needed before it when they would hold it back (two large buffers
   can fill the budget with no room for a small one), and the small
   all-gathers may be placed first, in their own sequence (filling idle
   communication early); the shortest simulated step wins.
4. *Late as still hides them.* The order is simulated; walking the all-gathers
   backwards, each moves to the latest slot whose issue time is still no later
   than the moment the communication stream starts it (never past another
   communication node), so the simulated timeline is unchanged and each buffer
   is held no longer than needed.

The budget caps gathered parameters (``budget_scope='gathered'``) or all
tensors (``'all'``). With ``'gathered'`` the schedule also never adds more
all-tensor memory over ``fast-free``'s peak than the budget adds over
``fast-free``'s gathered peak (so at ``fast-free``'s gathered peak, its
all-tensor peak is no higher either). A budget below what just-in-time
gathering needs raises :class:`~dcsched.errors.BudgetError` naming the
smallest budget that works.

Everything is integer-indexed and deterministic (no hash order, no timing).

>>> from dcsched.synthetic import layered_stack
>>> from dcsched.graph.nxview import to_networkx, check_order
>>> from dcsched.sim.simulate import simulate
>>> view = to_networkx(layered_stack(2).forward)
>>> scheduler = Overlap(view)
>>> form = GraphForm(view)
>>> order = overlap(form, budget_bytes=scheduler.min_budget("all")).order  # a budget over all tensors
>>> check_order(view, order)
>>> simulate(view, order).peak_bytes <= scheduler.min_budget("all")
True
>>> order = overlap(form, budget_bytes=scheduler.min_budget(), budget_scope="gathered").order
>>> simulate(view, order).gathered_peak_bytes <= scheduler.min_budget()
True
"""

from __future__ import annotations

import networkx as nx

from dcsched.graph.form import COMM_KINDS, OUTPUT, GraphForm, paused_gc
from dcsched.sim.simulate import Clocks, SimResult
from dcsched.budget import DEFAULT_SCOPE
from dcsched.errors import DcschedError
from dcsched.plan import Plan
from dcsched.schedulers.overlap.sink import sink_readers  # noqa: F401
from dcsched.schedulers.overlap.planner import BASES, JUMP_RATIO, SCOPES, UNLIMITED, OverlapPlanner, check_scope  # noqa: F401
from dcsched.schedulers.registry import register





@register("overlap", description="dcsched's memory-budgeted overlap: fast-free's compute order, each all-gather "
                                 "issued as early as memory_budget (bytes) allows and no earlier than it hides")
def overlap(form: GraphForm, *, budget_bytes: float = UNLIMITED, budget_scope: str = DEFAULT_SCOPE) -> Plan:
    """The overlap order of ``form`` under ``budget_bytes`` bytes of ``budget_scope``.

    Parameters
    ----------
    form : GraphForm
        The graph.
    budget_bytes : float, optional
        The budget in bytes; ``math.inf`` (default) for no limit.
    budget_scope : str, optional
        ``'all'`` (all tensors, the default) or ``'gathered'`` (gathered parameters).

    Returns
    -------
    Plan
        The order; no buckets, every parameter sharded.

    Raises
    ------
    BudgetError
        When ``budget_bytes`` is below the smallest budget any order meets (the message names it).
    OptionError
        For an unknown ``budget_scope``.

    Examples
    --------
    >>> from dcsched.synthetic import layered_stack
    >>> len(overlap(GraphForm(layered_stack(1).forward)).order) > 0
    True
    """
    check_scope(budget_scope)
    with paused_gc():
        return Plan(Overlap(form).order(budget_bytes, budget_scope))


class Overlap:
    """The ``overlap`` scheduler on one graph: the best of three skeletons for each budget.

    Step 1 can start from fast-free's compute order, from the graph's own
    order, or from fast-free's with its side branches sunk
    (:func:`sink_readers`); each gives an :class:`OverlapPlanner`. For a
    budget, every planner that can meet it places its all-gathers (in need
    order and in step 3b's other sequences), and the order with the shortest
    simulated step wins (ties: fast-free's, which keeps activations shortest).
    """

    def __init__(self, view: nx.DiGraph | GraphForm, *, name: str | None = None,
                 fast_free_order: list[int] | None = None):
        first = OverlapPlanner(view, name=name, fast_free_order=fast_free_order)
        second = OverlapPlanner(view, base="input", shares=first)
        third = OverlapPlanner(view, base="sunk", shares=first)
        second.guard_from = third.guard_from = first
        self.planners = [first, second, third]
        self.compiled = first.compiled

    @property
    def fast_free(self) -> SimResult:
        """The simulation of fast-free's order (run when first asked: a budget over all tensors needs none)."""
        return self.planners[0].fast_free

    @property
    def largest_gather(self) -> int:
        return self.planners[0].largest_gather

    def min_budget(self, scope: str = "gathered") -> int:
        """The smallest budget this scheduler can meet (the smallest any skeleton meets)."""
        check_scope(scope)
        return min(p.smallest_feasible(scope) for p in self.planners)

    def plan(self, budget: float, scope: str = "gathered") -> tuple[list[int], SimResult]:
        """The chosen order (node numbers) and its simulation for ``budget`` bytes in ``scope``."""
        order, result = self._select(budget, scope)
        return order, result if result is not None else self.compiled.simulate(order, detail=False, check=False)

    def _select(self, budget: float, scope: str) -> tuple[list[int], SimResult | None]:
        """:meth:`plan`'s order, and its simulation where choosing it needed one (None where it did not:
        at an unlimited budget every order fits, so only the streams' clocks are simulated).

        The output comes last, as in every base order (a chain that feeds nothing the graph returns runs
        before it); the budget was checked on this very order."""
        order, result = self._choose(budget, scope)
        if self.compiled.kind[order[-1]] != OUTPUT:  # every base order ends with the output: a placement bug
            raise DcschedError("overlap placed a node after the graph's output (please report this graph)")
        return order, result

    def _choose(self, budget: float, scope: str) -> tuple[list[int], SimResult | None]:
        check_scope(scope)
        feasible = [p for p in self.planners if p.feasible(budget, scope)]
        if not feasible:  # raises, naming the smallest budget that works
            self.planners[0].check_budget(budget, scope, self.min_budget(scope))
        candidates = self._candidates(feasible, budget, scope)
        step, index, slots, rank, timeline = candidates[0]
        improved = _reorder_fifo(feasible[index], budget, scope, timeline, rank)
        if improved is not None:
            step, slots, rank = improved
            candidates.insert(0, (step, index, slots, rank, None))
        # Step 6: the same placement with waiting reduces queued behind the next all-gather.
        planner = feasible[index]
        order, issue_pos = planner._layout(slots, rank)
        clocks = self.compiled.clocks(order)  # step 6 reads it, and it is the first order checked
        behind = planner.reduces_behind(slots, rank, (order, issue_pos, clocks))
        if behind:
            moved = planner._layout(slots, rank, behind)[0]
            moved_clocks = self.compiled.clocks(moved)
            if moved_clocks.step_ms < step - 1e-9:
                fits, result = self._check_fit(planner, moved, budget, scope)
                if fits:
                    return moved, result
        for number, (_, index, slots, rank, _) in enumerate(candidates):
            if number:
                order = feasible[index].assemble(slots, rank)
            fits, result = self._check_fit(feasible[index], order, budget, scope)
            if fits:
                return order, result
        # The placement model is exact on DeepCompile-style graphs; should oddly wired ZeRO-3 ops
        # defeat it, gathering just in time always fits (the budget is at least its peak).
        order = feasible[0].assemble(feasible[0].need)
        return order, None

    @staticmethod
    def _candidates(feasible: list[OverlapPlanner], budget: float, scope: str) -> list[tuple]:
        """Steps 3, 3b and 4 on every feasible skeleton: ``(step_ms, planner index, slots, FIFO rank or
        None, clocks)`` per distinct placement, shortest simulated step first (ties: planner order)."""
        candidates: list[tuple[float, int, list[int], list[int] | None, Clocks]] = []
        variants = []
        for index, planner in enumerate(feasible):
            asked = [(lookahead, max(1, planner.largest_gather // SMALL_FRACTION) if small else 0, passing)
                     for lookahead, small, passing in FIFO_VARIANTS]
            first, placed = planner.earliest_variants(budget, scope, asked)
            slots, timeline = planner.delay(first)
            candidates.append((timeline.step_ms, index, slots, None, timeline))
            variants.append(placed)
        # Step 3b: other FIFO sequences (large before small, small first), planner by planner; two
        # variants that place alike (lookahead 1 and 2 often do) are timed once.
        for index, planner in enumerate(feasible):
            seen = set()
            for found in variants[index]:
                if found is None or found[1] == sorted(found[1]):
                    continue
                placement = (tuple(found[0]), tuple(found[1]))
                if placement in seen:
                    continue
                seen.add(placement)
                rank = fifo_ranks(found[1])
                slots, timeline = planner.delay(found[0], rank)
                candidates.append((timeline.step_ms, index, slots, rank, timeline))
        candidates.sort(key=lambda c: c[:2])
        return candidates

    def _check_fit(self, planner: OverlapPlanner, order: list[int], budget: float,
                   scope: str) -> tuple[bool, SimResult | None]:
        """Whether ``order`` fits ``budget``, and its simulation if that took one (an unlimited budget
        takes none)."""
        if budget == UNLIMITED:
            return True, None
        result = self.compiled.simulate(order, detail=False, check=False)
        return self._fits(planner, result, budget, scope), result

    @staticmethod
    def _fits(planner: OverlapPlanner, result: SimResult, budget: float, scope: str) -> bool:
        if scope == "all":
            return result.peak_bytes <= budget
        return result.gathered_peak_bytes <= budget and result.peak_bytes <= planner.all_tensor_cap(budget)

    def order(self, budget: float, scope: str = "gathered") -> list[str]:
        """The overlap order (node names) for ``budget`` bytes in ``scope``."""
        names = self.compiled.names
        return [names[i] for i in self._select(budget, scope)[0]]


#: Step 5's effort: at most this many re-placements, each moving one all-gather at most WINDOW places,
#: for idle gaps of at least MIN_GAP of the step.
MAX_TRIALS = 8
WINDOW = 4
MIN_GAP = 0.002
#: Step 3b's placements tried beside plain need order: (lookahead, small all-gathers first, passing).
#: Small: at most 1/SMALL_FRACTION of the largest all-gather (a norm's weight beside a layer's matrix).
#: Passing: how many later all-gathers may go ahead of one that memory holds back.
FIFO_VARIANTS = ((1, False, 0), (2, False, 0), (0, True, 0), (0, False, 3))
SMALL_FRACTION = 64


def fifo_ranks(sequence: list[int]) -> list[int]:
    """Each all-gather's place in the FIFO ``sequence``."""
    rank = [0] * len(sequence)
    for i, k in enumerate(sequence):
        rank[k] = i
    return rank


def _reorder_fifo(planner: OverlapPlanner, budget: float, scope: str, timeline: Clocks,
                  rank: list[int] | None = None):
    """Step 5: where the communication stream idles before an all-gather that memory held back, try
    issuing that all-gather ahead of the few before it in the FIFO (a big one waiting behind a
    small one that fills the budget); keep a move only if the simulated step gets shorter.

    Returns ``(step_ms, slots, rank)`` of the best order found, or None. Deterministic: gaps are
    tried largest first, ties by position.
    """
    kind = planner.compiled.kind
    k_of = {g: k for k, g in enumerate(planner.gathers)}
    gaps = []
    busy_until = 0.0
    for pos, v in enumerate(timeline.indices):
        if kind[v] not in COMM_KINDS:
            continue
        k = k_of.get(v)
        idle = timeline.start_ms[pos] - busy_until
        if k is not None and idle > MIN_GAP * timeline.step_ms and timeline.start_ms[pos] == timeline.reach_ms[pos]:
            gaps.append((-idle, pos, k))
        busy_until = timeline.end_ms[pos]
    if not gaps:
        return None
    gaps.sort()
    sequence = list(range(len(planner.gathers)))
    if rank is not None:
        sequence.sort(key=rank.__getitem__)
    best = None
    best_step = timeline.step_ms
    trials = 0
    for _, _, k in gaps:
        at = sequence.index(k)
        for back in range(1, WINDOW + 1):
            if at - back < 0 or trials >= MAX_TRIALS:
                break
            trials += 1
            trial = sequence[:at - back] + [k] + sequence[at - back:at] + sequence[at + 1:]
            rank = fifo_ranks(trial)
            slots, result = planner.delay(planner.earliest(budget, scope, trial), rank)
            if result.step_ms < best_step - 1e-9:
                best_step, best, sequence = result.step_ms, (result.step_ms, slots, rank), trial
                break
        if trials >= MAX_TRIALS:
            break
    return best
