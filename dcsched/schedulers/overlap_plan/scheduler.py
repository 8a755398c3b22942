"""``overlap-plan``: one communication plan for the step, buckets and residency chosen within the budget.

Where :mod:`~dcsched.schedulers.overlap` moves each collective on its own,
this planner decides, for the forward and backward graphs together, which
collectives run as one (buckets) and which parameters stay gathered from the
forward to the backward (``'kept'`` residency), and picks each graph's order,
by the simulator, within ``budget_bytes`` of ``budget_scope``:

1. **Blocks.** ``fsdp``'s blocks (:func:`dcsched.schedulers.fsdp.scheduler.step_blocks`:
   the period of the forward's parameter sizes, one block per transformer
   layer, the same parameters in the backward). A block is one all-gather
   bucket (and one reduce bucket). The root (embeddings, final norm, head) is
   no unit of its own: its parameters travel with the blocks beside them
   (``root_mode='joined'``), or in the forward as two units of their own
   (``'split'``); the step is planned both ways and the faster plan within
   the cap kept (where ``fsdp``'s plan fits the budget; where it does not,
   the faster). Where neither keeps within the cap and ``fsdp``'s plan fits,
   the step is planned on FSDP2's own units too (the root one unit, kept for
   the backward: ``fsdp``'s plan is among those candidates). The step issues
   no more collectives than ``fsdp``'s plan (FSDP2's count) wherever that
   plan fits.
2. **Orders.** Candidates per graph, each with the block buckets
   (:func:`dcsched.schedulers.fsdp.scheduler.bucketed`: a bucket's all-gathers move to where its first one
   stands, its reduces to where its last one stands): ``fsdp``'s order
   prefetching one and two blocks ahead, and ``overlap``'s, ``fast-free``'s
   and the graph's own order.
3. **Residency.** Keeping a parameter gathered saves its backward all-gather
   (time and a collective) and costs its bytes from its forward release to
   its backward one. The parameters needed last in the forward (first in
   the backward) cost least, so the candidates keep the last ``j`` forward
   blocks, for ``j`` in 0, 1, 2, 4, ... and all of them, and the root alone
   (what FSDP2 keeps).
4. **Choice.** Every candidate is simulated with its buckets and residency
   (:meth:`dcsched.sim.simulate.CompiledGraph.simulate`); for each ``j`` each
   graph takes its fastest order within the budget, and the ``j`` with the
   shortest step (forward plus backward) wins; ties go to fewer collectives,
   then to the lower peak. Where ``fsdp``'s plan fits the budget, a ``j``
   within its collectives goes before one that fits only with blocks cut
   into more.
5. **Cuts.** The collectives ``fsdp``'s plan would issue and this one does
   not are spent where they shorten the step (:func:`~dcsched.schedulers.plan_refine.refine`): single cuts of
   the first and last blocks, and a graph's head (its first buckets) cut again
   into the pieces :func:`~dcsched.schedulers.head_pieces.head_pieces` finds;
   the refined plan is also polished (the boundaries before the last two
   reduce blocks moved, what merges free spent again), and both go on to
   step 6, the shorter final plan kept.

6. **Replication.** The small parameters the forward's first collective
   gathers may be kept whole on every rank (``'replicated'``: no gather,
   their gradients all-reduced) where that shortens the step within the
   budget and the cap (:func:`~dcsched.schedulers.overlap_plan.replicate.replicated_head`):
   the forward's first compute then waits on less.

7. **Never slower than ``overlap``.** Where ``fsdp``'s plan does not fit the
   budget (near the smallest one ``overlap`` accepts, every parameter gathered
   alone, just in time), no FSDP2-style count binds, and ``overlap``'s own
   orders with neighbouring collectives merged wherever that costs no time and
   fits (:func:`~dcsched.schedulers.overlap_plan.coalesce.coalesced`) replace the
   bucketed plan where their step is shorter, or as short with fewer
   collectives.

When no bucketed order fits the budget at all, the step takes those merged
orders of ``overlap``'s (step 7), which fit any budget ``overlap`` accepts.

A graph on its own (not named ``'forward'`` / ``'backward'``, or a step
without a backward) gets buckets alone: nothing to keep.

>>> from dcsched.synthetic import layered_stack
>>> stack = layered_stack(4)
>>> forms = {"forward": GraphForm(stack.forward), "backward": GraphForm(stack.backward)}
>>> plans = overlap_plan(forms)
>>> forms["forward"].check_order(list(plans["forward"].order))
>>> plans["forward"].residency == plans["backward"].residency
True
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from dcsched.budget import DEFAULT_SCOPE
from dcsched.collective_issue import FSDP2_ON_GLOO, SIMULATOR, CollectiveIssue
from dcsched.graph.form import GraphForm
from dcsched.errors import BudgetError, OptionError
from dcsched.plan import BLOCKING_OPTION, MERGED_OVERLAP_OPTION, REPLICATE_OPTION, STAGING_OPTION, Plan
from dcsched.schedulers.fsdp.scheduler import bucketed, kept_root, plan_of, reads_gathers_directly, step_blocks
from dcsched.schedulers.overlap.planner import UNLIMITED, check_scope
from dcsched.schedulers.overlap_plan.candidates import Candidate, GraphOrders, GraphPlanner, doubling_counts
from dcsched.schedulers.overlap_plan.coalesce import coalesced
from dcsched.schedulers.overlap_plan.refine import refine
from dcsched.schedulers.overlap_plan.replicate import REPLICATE_MAX_BYTES, replicated_head
from dcsched.schedulers.registry import register
from dcsched.sim.collectives import DEFAULT_LATENCY_MS
from dcsched.units import format_bytes


@register("overlap-plan", step=True,
          description="one plan for the forward and backward: per-block bucketed collectives and parameters kept "
                      "gathered for the backward, chosen by simulation within memory_budget")
def overlap_plan(forms: Mapping[str, GraphForm], *, budget_bytes: float = UNLIMITED,
                 budget_scope: str = DEFAULT_SCOPE, comm_latency_ms: float = DEFAULT_LATENCY_MS,
                 replicate_max_bytes: int = REPLICATE_MAX_BYTES, merged_overlap: bool = True,
                 staging: bool = False, blocking: bool = False) -> dict[str, Plan]:
    """The step's communication plan (module docstring).

    Parameters
    ----------
    forms : mapping of str to GraphForm
        The step's graphs; ``'forward'`` and ``'backward'`` are planned together.
    budget_bytes : float, optional
        The budget for each graph's peak, in bytes; ``math.inf`` (default) for no limit.
    budget_scope : str, optional
        ``'all'`` (all tensors, the default) or ``'gathered'`` (gathered parameters).
    comm_latency_ms : float, optional
        The per-collective latency the figures include (what a bucket pays once).
    replicate_max_bytes : int, optional
        The largest parameter (gathered bytes) step 6 may make ``'replicated'``; 0: none (what ``dcsched train``
        runs: it replicates only what ``--replicate-below`` made whole when the module was sharded).
    merged_overlap : bool, optional
        Step 7 (default True): where ``fsdp``'s plan does not fit the budget, ``overlap``'s orders with
        neighbouring collectives merged replace the bucketed plan where they are faster. False keeps the plan
        within buckets (what ``dcsched train`` runs on the CPU, where gloo's collectives take CPU from the
        compute, which the simulator does not charge: at ``--memory-budget 49MiB`` on bench_train's 2-rank
        steps the merged orders took 1.38-1.63x DDP's step against 1.22-1.33x for the bucketed plan).
    staging : bool, optional
        Simulate every peak as :data:`~dcsched.collective_issue.FSDP2_ON_GLOO` issues the collectives:
        gloo's staging copies counted (:mod:`dcsched.sim.staging`), each collective blocking: the least
        memory the runtime can run a plan in on gloo, which picks the fastest way of issuing them that fits
        (:func:`dcsched.train.backend.asynchrony`). Default False (the simulator's default,
        :data:`~dcsched.collective_issue.SIMULATOR`); ``dcsched train`` on gloo: True. The step times stay
        the simulator's (collectives beside the compute) unless ``blocking``.
    blocking : bool, optional
        Plan for a run that issues every collective blocking: each candidate's step time counts its
        collectives on the critical path (:attr:`~dcsched.collective_issue.CollectiveIssue.blocks_step`),
        so the planner weighs collectives by what they cost the step rather than by what they leave exposed.
        Default False.

    Returns
    -------
    dict of str to Plan
        Per graph: the order, its buckets and the step's residency (the same in every plan).

    Raises
    ------
    BudgetError
        When even ``overlap`` finds no order within the budget.
    OptionError
        For an unknown ``budget_scope``, a ``replicate_max_bytes`` that is no whole number of bytes, or a
        ``merged_overlap``, ``staging`` or ``blocking`` that is no bool.

    Examples
    --------
    >>> from dcsched.synthetic import layered_stack
    >>> plans = overlap_plan({"graph": GraphForm(layered_stack(2).forward)})
    >>> {b.kind for b in plans["graph"].buckets}, dict(plans["graph"].residency)
    ({'allgather'}, {})
    """
    check_scope(budget_scope)
    if isinstance(replicate_max_bytes, bool) or not isinstance(replicate_max_bytes, int) or replicate_max_bytes < 0:
        raise OptionError(REPLICATE_OPTION, f"must be a whole number of bytes, 0 or more (0: replicate nothing), "
                                            f"not {replicate_max_bytes!r}")
    for name, value in ((MERGED_OVERLAP_OPTION, merged_overlap), (STAGING_OPTION, staging),
                        (BLOCKING_OPTION, blocking)):
        if not isinstance(value, bool):
            raise OptionError(name, f"must be true or false, not {value!r}")
    issue = planning_issue(staging, blocking)
    orders = {name: GraphOrders(form, comm_latency_ms, budget_scope, issue) for name, form in forms.items()}
    for graph_orders in orders.values():  # every candidate's step time as the run issues its collectives
        graph_orders.compiled.timing = issue
    if any(reads_gathers_directly(form) for form in forms.values()):
        return _input_orders(orders, budget_bytes, budget_scope)
    fsdp_units = step_blocks(forms)
    root = kept_root(forms, fsdp_units)
    best: tuple | None = None
    fsdp_planners = {name: GraphPlanner(orders[name], fsdp_units[name], budget_bytes, name) for name in forms}
    cap = _fsdp_cap(fsdp_planners, root)
    # The root's parameters travel with the blocks beside them; in the forward, alone or with them: the
    # better of the two depends on the budget (a first bucket of the embeddings alone, or fewer collectives).
    # Where neither keeps within fsdp's count and fsdp's plan fits, FSDP2's own units (the root one unit, kept
    # for the backward): fsdp's plan is among their candidates, so they keep within the count.
    for mode in ("joined", "split", "unit") if root else ("joined",):
        if mode == "unit":
            if not cap[1] or (best is not None and not best[0][0]):  # a plan within the count, or none binds
                break
            planners = fsdp_planners
        else:
            units = step_blocks(forms, root_mode=mode)
            planners = {name: GraphPlanner(orders[name], units[name], budget_bytes, name) for name in forms}
        planned = _plan_units(planners, budget_bytes, root, cap)
        if planned is not None:
            for chosen in planned[0]:
                collectives = sum(c.collectives for c in chosen.values())
                # over fsdp's count last, where fsdp's plan fits the budget (as the kept sets are ranked)
                figures = (cap[1] and collectives > cap[0], sum(c.step_ms for c in chosen.values()), collectives)
                if best is None or figures < best[0]:
                    best = (figures, planners, *planned)
    if best is None:  # no bucketed order fits: overlap's own orders (neighbouring collectives merged: step 7)
        return {name: planner.plan(coalesced(planner, budget_bytes) if merged_overlap
                                   else planner.fallback(budget_bytes), (), frozenset())
                for name, planner in planners.items()}
    _figures, planners, refined, kept = best
    # each refinement with what replicating shortens (step 6); the shortest final plan, the first of equals
    finals = []
    for chosen in refined:
        replicated, final = replicated_head(planners, chosen, kept, budget_bytes, cap[0], replicate_max_bytes)
        finals.append((final, chosen, replicated))
    shortest, chosen, replicated = min(finals, key=lambda final: final[0])
    if merged_overlap and not cap[1]:  # no FSDP2-style plan fits: no count binds; overlap's orders merged may win
        merged = _coalesced_if_better(planners, shortest, budget_bytes)
        if merged is not None:
            chosen, kept, replicated = merged, frozenset(), frozenset()
    kept = kept - replicated
    backward = planners.get("backward")
    # a held or replicated parameter's all-gather issues nothing: plan_of leaves it out of its bucket
    return {name: planner.plan(chosen[name], sorted(kept), (kept if planner is backward else frozenset()) | replicated
                               ).replicating(replicated)
            for name, planner in planners.items()}


def _plan_units(planners: dict[str, GraphPlanner], budget: float, root: frozenset, cap: tuple[int, bool]
                ) -> tuple[list[dict[str, Candidate]], frozenset] | None:
    """Each graph's candidate as :func:`~dcsched.schedulers.plan_refine.refine` gives them (the refined plan,
    and the polished one where it differs: what is shorter before step 6 need not be after it), and the kept
    parameters, planned on the planners' units (steps 3 to 5 of the module docstring), or None where no
    bucketed order fits ``budget``. ``cap``: ``fsdp``'s collectives, and
    whether its plan fits ``budget`` (where it does, a kept set within the cap goes first)."""
    forward, backward = planners.get("forward"), planners.get("backward")
    choices: list[tuple[tuple, dict[str, list[Candidate]], frozenset]] = []
    kept_sets: list[frozenset] = [frozenset()]
    if forward is not None and backward is not None:
        shared = backward.gathered_ids()
        keepable = [ids for ids in ({forward.form.ds_id[m] for m in group} & shared
                                    for group in reversed(forward.gathers))
                    if ids]  # needed last in the forward: first in the backward
        kept_sets = [frozenset().union(*keepable[:j]) for j in [0, *doubling_counts(len(keepable))]]
        if root and root not in kept_sets:  # FSDP2's: the root alone
            kept_sets.append(root)
    for kept in kept_sets:
        picked = _fitting_step(planners, budget, kept)
        if picked is not None:
            firsts = [c[0] for c in picked.values()]
            collectives = sum(c.collectives for c in firsts)
            # Where fsdp's plan fits the budget, within its count first: a kept set that fits only with its
            # blocks cut (more collectives) is taken only where none fits within it. Where fsdp's plan does
            # not fit, there is no FSDP2-style plan at this memory to count against: the fastest goes.
            over = cap[1] and collectives > cap[0]
            key = (over, sum(c.step_ms for c in firsts), collectives, max(c.peak or 0 for c in firsts))
            choices.append((key, picked, kept))
    if not choices:
        return None
    _key, picked, kept = min(choices, key=lambda choice: choice[0])
    spare = cap[0] - sum(c[0].collectives for c in picked.values())
    return refine(planners, picked, kept, spare), kept


def _coalesced_if_better(planners: dict[str, GraphPlanner], planned: tuple[float, int], budget: float
                         ) -> dict[str, Candidate] | None:
    """Step 7: each graph's :func:`~dcsched.schedulers.overlap_plan.coalesce.coalesced` candidate where that step is
    shorter than the bucketed plan's (``planned``: its step and collectives, replication included), or as
    short with fewer collectives; None where it is not (or ``overlap`` refuses the budget)."""
    try:
        merged = {name: coalesced(planner, budget) for name, planner in planners.items()}
    except BudgetError:
        return None
    figures_merged = (sum(c.step_ms for c in merged.values()), sum(c.collectives for c in merged.values()))
    return merged if figures_merged < planned else None


def planning_issue(staging: bool, blocking: bool) -> CollectiveIssue:
    """How ``overlap-plan`` simulates its candidates: the peaks with gloo's staging copies (``staging``: as
    :data:`~dcsched.collective_issue.FSDP2_ON_GLOO`, the least memory), the step times with every collective
    blocking (``blocking``) or beside the compute (the simulator's model).

    >>> planning_issue(True, True) == FSDP2_ON_GLOO, planning_issue(False, False) == SIMULATOR
    (True, True)
    >>> planning_issue(True, False).blocks_step, planning_issue(False, True).blocks_step
    (False, True)
    """
    if blocking:
        return CollectiveIssue(async_gather=False, async_reduce=False, staging=staging)
    return dataclasses.replace(FSDP2_ON_GLOO if staging else SIMULATOR, blocking_in_step=False)


def _input_orders(orders: Mapping[str, GraphOrders], budget: float, scope: str) -> dict[str, Plan]:
    """A step that is not a captured one (a node other than a wait reads an all-gather: only a graph from a file),
    where blocks moved as FSDP2 moves them would not keep the order topological: each graph's input order,
    every collective alone, as ``fsdp`` plans it; BudgetError where that order's peak exceeds ``budget``."""
    plans = {}
    for name, graph_orders in orders.items():
        form, order = graph_orders.form, list(graph_orders.form.topo)
        peak = graph_orders.compiled.simulate(order, detail=False, check=False, issue=graph_orders.issue).peak_in(scope)
        if peak > budget:
            raise BudgetError(f"`memory_budget` {format_bytes(budget)} ({int(budget)} bytes) is too small for graph "
                              f"'{name}': a node reads an all-gather other than through its wait, so overlap-plan "
                              f"keeps its input order, which needs {format_bytes(peak)} ({peak} bytes) "
                              f"(`budget_scope='{scope}'`); pass `memory_budget={peak}` or more")
        plans[name] = plan_of(form, order, [], frozenset(), frozenset())
    return plans


def _fsdp_cap(planners: dict[str, GraphPlanner], root: frozenset) -> tuple[int, bool]:
    """The collectives per step of ``fsdp``'s plan (the planners' units, ``fsdp``'s own; the ``root`` kept),
    the planner's cap, and whether that plan fits every planner's budget."""
    total, fits = 0, True
    for planner in planners.values():
        order, buckets = bucketed(planner.form, planner.orders.just_in_time(), planner.gathers, planner.reduces,
                                  ahead=1)
        candidate = planner.simulated("fsdp", order, buckets, **planner.role(root))
        total += candidate.collectives
        fits = fits and planner.fitted(candidate) is not None
    return total, fits


def _fitting_step(planners: dict[str, GraphPlanner], budget: float, kept: frozenset
                  ) -> dict[str, list[Candidate]] | None:
    """Each graph's candidates within ``budget`` keeping ``kept`` (:meth:`GraphPlanner.fitting`), None where
    a graph has none."""
    picked: dict[str, list[Candidate]] = {}
    for name, planner in planners.items():
        found = planner.fitting(budget, kept)
        if not found:
            return None
        picked[name] = found
    return picked


