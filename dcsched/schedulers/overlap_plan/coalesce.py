"""``overlap-plan``'s step 7: never slower than ``overlap`` at the same budget.

Steps 1 to 6 plan in blocks, within ``fsdp``'s collective count. At a budget
near the smallest ``overlap`` accepts (every parameter gathered alone, just in
time), whole or cut blocks may not fit where ``overlap``'s order does, or fit
only in an order that waits longer: the bucketed plan is then slower than
``overlap``'s own. ``fsdp``'s plan does not fit such a budget either, so no
FSDP2-style count binds there, and the planner takes ``overlap``'s order with
neighbouring collectives run as one wherever that costs no time and fits the
budget (:func:`coalesced`): as fast as ``overlap``, or faster, with fewer
collectives than it.
"""

from __future__ import annotations

from typing import Sequence

from dcsched.graph.form import ALLGATHER, REDUCE
from dcsched.schedulers.overlap_plan.candidates import Candidate, GraphPlanner, with_blocks


def coalesced(planner: GraphPlanner, budget: float) -> Candidate:
    """``overlap``'s own order under ``budget`` with neighbouring collectives merged into buckets wherever
    the step gets no longer and the peak stays within ``budget``.

    One greedy pass over the all-gathers in the order they are issued, then over the reduces: a run of
    neighbours grows while each merge keeps the step at most what it was and the plan within the budget, by
    1, 2, 4, ... more while that succeeds and fewer once it does not (a run of hundreds costs a few dozen
    simulations). :func:`~dcsched.schedulers.fsdp.scheduler.bucketed` places each bucket: its all-gathers where its
    first stands, its reduces where its last stands. The result is never slower than ``overlap``'s order.

    Parameters
    ----------
    planner : GraphPlanner
        The graph's planner (its budget scope and latency); no parameter is kept.
    budget : float
        The budget for the graph's peak (bytes of the planner's scope).

    Returns
    -------
    Candidate
        The coalesced candidate (``overlap``'s own where no merge helps).

    Raises
    ------
    BudgetError
        Where ``overlap`` itself refuses ``budget``.

    Examples
    --------
    >>> from dcsched.graph.form import GraphForm
    >>> from dcsched.schedulers.fsdp.scheduler import step_blocks
    >>> from dcsched.schedulers.overlap_plan.candidates import GraphOrders
    >>> from dcsched.synthetic import layered_stack
    >>> form = GraphForm(layered_stack(2).forward)
    >>> planner = GraphPlanner(GraphOrders(form, 0.05, "all"), step_blocks({"graph": form})["graph"], float("inf"))
    >>> alone, merged = planner.fallback(float("inf")), coalesced(planner, float("inf"))
    >>> merged.step_ms <= alone.step_ms, merged.collectives < alone.collectives
    (True, True)
    """
    alone = planner.fallback(budget)
    best = planner.fitted(alone)
    if best is None:  # overlap's order is over the budget by the simulator's measure: nothing to merge within it
        return alone
    base, kind = best.order, planner.form.kind
    groups = ([[v] for v in base if kind[v] == ALLGATHER], [[v] for v in base if kind[v] == REDUCE])
    for which in (0, 1):
        k, span = 0, 1
        while k < len(groups[which]) - 1:
            joined = _joined(groups[which], k, span)
            trial_groups = with_blocks(groups, which, joined)
            trial = planner.rebucketed("overlap, coalesced", base, trial_groups, {}, 0, best)
            fitted = planner.fitted(trial) if trial.step_ms <= best.step_ms else None
            if fitted is not None and fitted.collectives < best.collectives:
                best, groups = fitted, trial_groups  # the run at k grows on, by twice as many next
                span *= 2
            elif span > 1:
                span //= 2
            else:
                k += 1
    return best


def _joined(groups: Sequence[list[int]], k: int, span: int) -> list[list[int]]:
    """``groups`` with the ``k``-th and up to ``span`` next made one.

    >>> _joined([[1], [2], [3]], 1, 1), _joined([[1], [2], [3]], 0, 4)
    ([[1], [2, 3]], [[1, 2, 3]])
    """
    return [*groups[:k], [m for group in groups[k:k + span + 1] for m in group], *groups[k + span + 1:]]
