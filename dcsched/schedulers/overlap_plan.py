"""``overlap-plan``: one communication plan for the step, buckets and residency chosen within the budget.

Where :mod:`~dcsched.schedulers.overlap` moves each collective on its own,
this planner decides, for the forward and backward graphs together, which
collectives run as one (buckets) and which parameters stay gathered from the
forward to the backward (``'kept'`` residency), and picks each graph's order,
by the simulator, within ``budget_bytes`` of ``budget_scope``:

1. **Blocks.** ``fsdp``'s blocks (:func:`dcsched.schedulers.fsdp.step_blocks`:
   the period of the forward's parameter sizes, one block per transformer
   layer, the same parameters in the backward). A block is one all-gather
   bucket (and one reduce bucket). The root (embeddings, final norm, head) is
   no unit of its own: its parameters travel with the blocks beside them
   (``root_mode='joined'``), or in the forward as two units of their own
   (``'split'``); the step is planned both ways and the faster plan within
   the cap kept. The step issues no more collectives than ``fsdp``'s plan
   (FSDP2's count).
2. **Orders.** Candidates per graph, each with the block buckets
   (:func:`dcsched.schedulers.fsdp.bucketed`: a bucket's all-gathers move to where its first one
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
   then to the lower peak.
5. **Cuts.** The collectives ``fsdp``'s plan would issue and this one does
   not are spent where they shorten the step (:func:`_refine`): single cuts of
   the first and last blocks, and a graph's head (its first buckets) cut again
   into the pieces :func:`~dcsched.schedulers.head_pieces.head_pieces` finds.

When no bucketed order fits the budget (a budget near what gathering one
parameter at a time needs), the graph falls back to ``overlap``'s own plan,
every collective alone, which fits any budget ``overlap`` accepts.

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
import math
from typing import Iterable, Mapping, Sequence

from dcsched.budget import DEFAULT_SCOPE
from dcsched.errors import BudgetError
from dcsched.graph.form import GraphForm
from dcsched.plan import Plan
from dcsched.schedulers.fast_free import fast_free
from dcsched.schedulers.head_pieces import head_pieces
from dcsched.schedulers.fsdp import Blocks, bucketed, gathered_ids, just_in_time, kept_root, plan_of, step_blocks
from dcsched.schedulers.overlap.planner import UNLIMITED, check_scope
from dcsched.schedulers.overlap.scheduler import Overlap
from dcsched.schedulers.registry import register
from dcsched.sim.collectives import DEFAULT_LATENCY_MS
from dcsched.sim.simulate import CompiledGraph

#: How many blocks ahead the ``fsdp``-style candidates prefetch.
AHEAD = (1, 2)
#: How many blocks ahead the bucketed orders issue their all-gather buckets.
BUCKETS_AHEAD = (0, 1, 2)
#: Which blocks :func:`_refine` tries cutting, by position among each kind's blocks: the first two all-gather
#: blocks and the last (a graph waits on its first buckets; a forward's last compute waits on its last), the
#: last two reduce blocks (a backward ends with them).
CUT_BLOCKS = {0: (0, 1, -1), 1: (-2, -1)}
#: How many of a graph's fastest bucketed candidates :func:`_refine` cuts blocks of.
REFINED = 3
#: The most blocks :func:`_refine` cuts in a step.
MAX_CUTS = 16
#: How many of a candidate's first all-gather buckets :meth:`_GraphPlanner.head_cuts` cuts again, as one (each
#: tried: the model of the wait is closest over the buckets the compute waits on, which may be pieces of one
#: block already or several blocks).
HEAD_GROUPS = (1, 2, 3, 4)
#: The most collectives :meth:`_GraphPlanner.head_cuts` adds to a graph's head.
HEAD_MORE = 8


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One graph's order with its buckets (node numbers), simulated with the step's residency.

    ``base`` is the order the buckets were made from and ``groups`` the blocks (all-gather blocks, then
    reduce blocks) :func:`~dcsched.schedulers.fsdp.bucketed` made them of, so a block can be cut and the
    buckets made again;
    ``fsdp``'s own orders have none (their buckets sit where FSDP2 issues them).
    """

    source: str
    order: list[int]
    buckets: list[list[int]]
    #: the simulated step (ms) and collectives
    step_ms: float
    collectives: int
    #: the simulated peak (bytes of the budget's scope), measured only where a budget asks (None: not yet;
    #: 0 without a budget): the memory model costs twice the timeline, and most candidates are never chosen
    peak: float | None
    role: dict = dataclasses.field(default_factory=dict)
    base: list[int] | None = None
    groups: tuple[list[list[int]], list[list[int]]] | None = None
    ahead: int = 0

    def key(self) -> tuple:
        """What ranks candidates: step time, then collectives."""
        return (self.step_ms, self.collectives)


class _GraphOrders:
    """One graph's compiled form and the orders that do not depend on its blocks (each computed once, then
    shared by the planners of every unit layout :func:`overlap_plan` tries)."""

    def __init__(self, form: GraphForm, latency_ms: float, scope: str) -> None:
        self.form, self.scope, self.latency_ms = form, scope, latency_ms
        self.compiled = CompiledGraph(form, assume_zero=True, comm_latency_ms=latency_ms)
        self._bases: dict[str, list[int]] = {}
        self._jit: list[int] | None = None
        self._overlap: Overlap | None = None
        self._overlap_orders: dict[float, list[int] | BudgetError] = {}

    def fixed_bases(self) -> dict[str, list[int]]:
        """The orders to bucket that do not depend on the budget."""
        if not self._bases:
            index = self.form.index
            self._bases = {"fast-free": [index[n] for n in fast_free(self.form).order], "input": list(self.form.topo)}
        return self._bases

    def just_in_time(self) -> list[int]:
        """The input order, every parameter gathered just before it is read: ``fsdp``'s base (computed once)."""
        if self._jit is None:
            self._jit = just_in_time(self.form, list(self.form.topo))
        return self._jit

    def overlap_order(self, budget: float) -> list[int] | BudgetError:
        """``overlap``'s order under ``budget`` (node numbers), or its error where it refuses the budget."""
        if budget not in self._overlap_orders:
            if self._overlap is None:
                self._overlap = Overlap(self.form)
            try:
                names = self._overlap.order(budget, self.scope)
                self._overlap_orders[budget] = [self.form.index[n] for n in names]
            except BudgetError as exc:
                self._overlap_orders[budget] = exc
        return self._overlap_orders[budget]


class _GraphPlanner:
    """One graph's blocks and candidate orders; :meth:`best` simulates them with a residency."""

    def __init__(self, orders: _GraphOrders, blocks: Blocks, budget: float, graph: str = "") -> None:
        self.orders, self.form, self.scope, self.budget = orders, orders.form, orders.scope, budget
        #: How the step's kept parameters reach this graph: kept past its end (forward), held from its start
        #: (backward), or not at all.
        self.residency_role = {"forward": "keep", "backward": "held"}.get(graph)
        self.compiled = orders.compiled
        self.blocks, self.gathers, self.reduces = blocks, blocks.gathers, blocks.reduces
        self._fsdp: dict[str, tuple[list[int], list[list[int]]]] = {}

    def role(self, kept: frozenset) -> dict[str, frozenset]:
        """The simulator's ``keep`` / ``held`` argument for the step's ``kept`` parameters."""
        return {self.residency_role: kept} if self.residency_role and kept else {}

    def gathered_ids(self) -> set[int]:
        return gathered_ids(self.form, self.blocks)

    def fsdp_orders(self) -> dict[str, tuple[list[int], list[list[int]]]]:
        """FSDP2-style orders and buckets, prefetching :data:`AHEAD` blocks ahead (computed once)."""
        if not self._fsdp:
            base = self.orders.just_in_time()
            self._fsdp = {f"fsdp-{k}": bucketed(self.form, base, self.gathers, self.reduces, ahead=k) for k in AHEAD}
        return self._fsdp

    def candidates(self, budget: float, reserved: float, role: dict, pieces: int = 1) -> Iterable[Candidate]:
        """Every candidate order, bucketed and simulated (``reserved``: the kept parameters' bytes), each
        block cut into ``pieces`` buckets (more than one: a budget whole blocks do not fit in). ``overlap``'s
        own order, every collective alone, is no candidate: it is the fallback where nothing bucketed fits,
        since the plan issues no more collectives than ``fsdp`` wherever it can (one collective per parameter
        costs far more CPU on gloo than the simulator's communication stream shows)."""
        if pieces == 1:  # FSDP2's own orders, whole blocks only
            for source, (order, buckets) in self.fsdp_orders().items():
                yield self.simulated(source, order, buckets, **role)
        bases = dict(self.orders.fixed_bases())
        # overlap under what the kept parameters leave of the budget
        overlap_order = self.orders.overlap_order(budget - reserved if math.isfinite(budget) else budget)
        if not isinstance(overlap_order, BudgetError):
            bases["overlap"] = overlap_order
        groups = (_pieces(self.gathers, pieces), _pieces(self.reduces, pieces))
        label = f", blocks in {pieces}" if pieces > 1 else ""
        for source, base in bases.items():
            for ahead in BUCKETS_AHEAD:
                yield self.rebucketed(f"{source}, {ahead} ahead{label}", base, groups, role, ahead)

    def rebucketed(self, source: str, base: list[int], groups: tuple, role: dict, ahead: int) -> Candidate:
        order, buckets = bucketed(self.form, base, *groups, ahead=ahead)
        candidate = self.simulated(source, order, buckets, **role)
        return dataclasses.replace(candidate, base=base, groups=groups, ahead=ahead)

    def simulated(self, source: str, order: list[int], buckets: list[list[int]], *, keep: frozenset = frozenset(),
                  held: frozenset = frozenset()) -> Candidate:
        """The candidate's timeline simulated (its peak is measured by :meth:`fitted`, where a budget asks)."""
        step, collectives = self.compiled.timeline_figures(order, buckets=buckets, held=held, check=False)
        role = {"keep": keep, "held": held}
        return Candidate(source, order, buckets, step, collectives, None if math.isfinite(self.budget) else 0, role)

    def fitted(self, candidate: Candidate) -> Candidate | None:
        """``candidate`` with its peak measured, or None where it exceeds the budget."""
        if candidate.peak is None:
            result = self.compiled.simulate(candidate.order, detail=False, check=False, buckets=candidate.buckets,
                                            **candidate.role)
            peak = result.peak_bytes if self.scope == "all" else result.gathered_peak_bytes
            candidate = dataclasses.replace(candidate, peak=peak)
        return candidate if candidate.peak is not None and candidate.peak <= self.budget else None

    def fitting(self, budget: float, kept: frozenset) -> list[Candidate]:
        """The candidates within ``budget`` with the step's ``kept`` parameters, fastest first; where none
        with whole blocks fits, those with blocks cut in 2, 4, ... pieces (the fewest that fit)."""
        role = self.role(kept)
        reserved = sum(self.form.size[m] for group in self.gathers for m in group if self.form.ds_id[m] in kept) \
            if role else 0
        largest = max((len(b) for b in (*self.gathers, *self.reduces)), default=1)
        pieces = 1
        while True:
            found = self._fastest_fitting(self.candidates(budget, reserved, role, pieces))
            if found or pieces >= largest:
                return found
            pieces *= 2

    def _fastest_fitting(self, candidates: Iterable[Candidate]) -> list[Candidate]:
        """The fastest of ``candidates`` within the budget, and the :data:`REFINED` fastest that can be cut,
        each from another base order, fastest first (peaks measured in that order, until those are found)."""
        found: list[Candidate] = []
        bases: set[int] = set()  # one cuttable candidate per base order: they differ most after cuts
        for candidate in sorted(candidates, key=Candidate.key):
            if candidate.base is not None and id(candidate.base) in bases:
                continue
            fitted = self.fitted(candidate)
            if fitted is None or (found and fitted.base is None):
                continue
            found.append(fitted)
            if fitted.base is not None:
                bases.add(id(fitted.base))
                if len(bases) >= REFINED:
                    break
        return found

    def cuts(self, candidate: Candidate, kept: frozenset) -> Iterable[Candidate]:
        """The candidate with one block cut in two and bucketed again: the first and last
        :data:`CUT_BLOCKS`, each cut at :func:`_cut_points`."""
        if candidate.base is None or candidate.groups is None:
            return
        role = self.role(kept)
        held = role.get("held", frozenset())
        ds_id = self.form.ds_id
        position = {v: p for p, v in enumerate(candidate.base)}
        for which in (0, 1):
            blocks = candidate.groups[which]
            live = [k for k, b in enumerate(blocks)
                    if len(b) > 1 and (which or sum(1 for m in b if ds_id[m] not in held) > 1)]
            for k in dict.fromkeys(live[p] for p in CUT_BLOCKS[which] if -len(live) <= p < len(live)):
                members = blocks[k]
                for cut in _cut_points(len(members)):
                    cut_blocks = blocks[:k] + [members[:cut], members[cut:]] + blocks[k + 1:]
                    if which == 0:  # all-gather blocks go in the order they are needed (the root's pieces are not)
                        cut_blocks.sort(key=lambda block: min(position[m] for m in block))
                    groups = (cut_blocks, candidate.groups[1]) if which == 0 else (candidate.groups[0], cut_blocks)
                    yield self.rebucketed(candidate.source, candidate.base, groups, role, candidate.ahead)

    def head_cuts(self, candidate: Candidate, kept: frozenset, most: int) -> Iterable[Candidate]:
        """The candidate with its first :data:`HEAD_GROUPS` all-gather buckets cut again, into 1 to ``most``
        more collectives than they take now (at most :data:`HEAD_MORE`), as
        :func:`~dcsched.schedulers.head_pieces.head_pieces` finds the compute waits least (a held
        parameter's gather, which issues nothing, goes in the first piece)."""
        if candidate.base is None or candidate.groups is None:
            return
        role = self.role(kept)
        held = role.get("held", frozenset())
        groups, reduces = candidate.groups
        for count in HEAD_GROUPS:
            if count > len(groups):
                break
            # a held parameter's gather issues nothing: it rides in the first piece, and no piece is its own
            issuing = [[m for m in group if self.form.ds_id[m] not in held] for group in groups[:count]]
            members = [m for group in issuing for m in group]
            if len(members) < 2:
                continue
            resting = [m for group in groups[:count] for m in group if self.form.ds_id[m] in held]
            now = sum(1 for group in issuing if group)
            for pieces in head_pieces(self.form, candidate.order, members, now + min(most, HEAD_MORE),
                                      self.orders.latency_ms).values():
                pieces[0] = resting + pieces[0]
                yield self.rebucketed(candidate.source, candidate.base, (pieces + groups[count:], reduces), role,
                                      candidate.ahead)

    def merged(self, candidate: Candidate, kept: frozenset, budget: float) -> Candidate:
        """The candidate with neighbouring inner blocks merged wherever that costs no time and fits ``budget``
        (one pass over each kind, first and last blocks left alone)."""
        if candidate.base is None or candidate.groups is None:
            return candidate
        role = self.role(kept)
        for which in (0, 1):
            k = 1
            while candidate.groups is not None and k < len(candidate.groups[which]) - 2:
                blocks = candidate.groups[which]
                joined = blocks[:k] + [blocks[k] + blocks[k + 1]] + blocks[k + 2:]
                groups = (joined, candidate.groups[1]) if which == 0 else (candidate.groups[0], joined)
                trial = self.rebucketed(candidate.source, candidate.base, groups, role, candidate.ahead)
                if trial.step_ms <= candidate.step_ms and trial.collectives < candidate.collectives:
                    fitted = self.fitted(trial)
                    if fitted is not None:
                        candidate = fitted
                k += 1
        return candidate

    def fallback(self, budget: float) -> Candidate:
        """``overlap``'s own order, every collective alone (raises :class:`BudgetError` where it does)."""
        order = self.orders.overlap_order(budget)
        if isinstance(order, BudgetError):
            raise order
        return self.simulated("overlap (no buckets)", order, [])

    def plan(self, candidate: Candidate, kept: Iterable[int], held: frozenset) -> Plan:
        return plan_of(self.form, candidate.order, candidate.buckets, kept, held)


def _pieces(blocks: Sequence[Sequence[int]], pieces: int) -> list[list[int]]:
    """Each block cut into ``pieces`` consecutive parts of near-equal length (fewer where it is shorter).

    >>> _pieces([[1, 2, 3, 4, 5], [6]], 2)
    [[1, 2, 3], [4, 5], [6]]
    """
    if pieces <= 1:
        return [list(b) for b in blocks]
    parts: list[list[int]] = []
    for block in blocks:
        size = -(-len(block) // pieces)
        parts.extend(list(block[s:s + size]) for s in range(0, len(block), size))
    return parts


def _cut_points(n: int) -> list[int]:
    """Where a block of ``n`` members may be cut: after its first 1, 2, 4 and 8 members (a graph's first
    block fed in growing pieces), at a quarter, a half, and before its last member.

    >>> _cut_points(31), _cut_points(2)
    ([1, 2, 4, 7, 8, 15, 30], [1])
    """
    return sorted(c for c in {1, 2, 4, 8, n // 4, n // 2, n - 1} if 0 < c < n)


def _keep_counts(blocks: int) -> list[int]:
    """How many of the last forward blocks to try keeping: 0, 1, 2, 4, ... and all."""
    counts, j = [0], 1
    while j < blocks:
        counts.append(j)
        j *= 2
    return counts + ([blocks] if blocks else [])


@register("overlap-plan", step=True,
          description="one plan for the forward and backward: per-block bucketed collectives and parameters kept "
                      "gathered for the backward, chosen by simulation within memory_budget")
def overlap_plan(forms: Mapping[str, GraphForm], *, budget_bytes: float = UNLIMITED,
                 budget_scope: str = DEFAULT_SCOPE, comm_latency_ms: float = DEFAULT_LATENCY_MS) -> dict[str, Plan]:
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

    Returns
    -------
    dict of str to Plan
        Per graph: the order, its buckets and the step's residency (the same in every plan).

    Raises
    ------
    BudgetError
        When even ``overlap`` finds no order within the budget.
    OptionError
        For an unknown ``budget_scope``.

    Examples
    --------
    >>> from dcsched.synthetic import layered_stack
    >>> plans = overlap_plan({"graph": GraphForm(layered_stack(2).forward)})
    >>> {b.kind for b in plans["graph"].buckets}, dict(plans["graph"].residency)
    ({'allgather'}, {})
    """
    check_scope(budget_scope)
    fsdp_units = step_blocks(forms)
    root = kept_root(forms, fsdp_units)
    best: tuple | None = None
    cap = None
    # The root's parameters travel with the blocks beside them; in the forward, alone or with them: the
    # better of the two depends on the budget (a first bucket of the embeddings alone, or fewer collectives).
    orders = {name: _GraphOrders(form, comm_latency_ms, budget_scope) for name, form in forms.items()}
    for mode in ("joined", "split") if root else ("joined",):
        units = step_blocks(forms, root_mode=mode)
        planners = {name: _GraphPlanner(orders[name], units[name], budget_bytes, name) for name in forms}
        if cap is None:
            cap = _fsdp_collectives(planners, fsdp_units, root)
        planned = _plan_units(planners, budget_bytes, root, cap)
        if planned is not None:
            chosen = planned[0]
            figures = (sum(c.collectives for c in chosen.values()) > cap, sum(c.step_ms for c in chosen.values()),
                       sum(c.collectives for c in chosen.values()))
            if best is None or figures < best[0]:
                best = (figures, planners, *planned)
    if best is None:  # no bucketed order fits: overlap's own plan
        return {name: planner.plan(planner.fallback(budget_bytes), (), frozenset())
                for name, planner in planners.items()}
    _figures, planners, chosen, kept = best
    backward = planners.get("backward")
    return {name: planner.plan(chosen[name], sorted(kept), kept if planner is backward else frozenset())
            for name, planner in planners.items()}


def _plan_units(planners: dict[str, _GraphPlanner], budget: float, root: frozenset, cap: int
                ) -> tuple[dict[str, Candidate], frozenset] | None:
    """Each graph's candidate and the kept parameters, planned on the planners' units (steps 3 to 5 of the
    module docstring), or None where no bucketed order fits ``budget``."""
    forward, backward = planners.get("forward"), planners.get("backward")
    choices: list[tuple[tuple, dict[str, list[Candidate]], frozenset]] = []
    kept_sets: list[frozenset] = [frozenset()]
    if forward is not None and backward is not None:
        shared = backward.gathered_ids()
        keepable = [ids for ids in ({forward.form.ds_id[m] for m in group} & shared
                                    for group in reversed(forward.gathers))
                    if ids]  # needed last in the forward: first in the backward
        kept_sets = [frozenset().union(*keepable[:j]) for j in _keep_counts(len(keepable))]
        if root and root not in kept_sets:  # FSDP2's: the root alone
            kept_sets.append(root)
    for kept in kept_sets:
        picked = _fitting_step(planners, budget, kept)
        if picked is not None:
            firsts = [c[0] for c in picked.values()]
            key = (sum(c.step_ms for c in firsts), sum(c.collectives for c in firsts), max(c.peak or 0 for c in firsts))
            choices.append((key, picked, kept))
    if not choices:
        return None
    _key, picked, kept = min(choices, key=lambda choice: choice[0])
    return _refine(planners, picked, kept, cap - sum(c[0].collectives for c in picked.values()), budget), kept


def _fsdp_collectives(planners: dict[str, _GraphPlanner], found: Mapping[str, Blocks], root: frozenset) -> int:
    """The collectives per step of ``fsdp``'s plan (its units ``found``, the ``root`` kept): the planner's cap."""
    total = 0
    for name, planner in planners.items():
        order, buckets = bucketed(planner.form, planner.orders.just_in_time(), found[name].gathers,
                                  found[name].reduces, ahead=1)
        total += planner.simulated("fsdp", order, buckets, **planner.role(root)).collectives
    return total


def _fitting_step(planners: dict[str, _GraphPlanner], budget: float, kept: frozenset
                  ) -> dict[str, list[Candidate]] | None:
    """Each graph's candidates within ``budget`` keeping ``kept`` (:meth:`_GraphPlanner.fitting`), None where
    a graph has none."""
    picked: dict[str, list[Candidate]] = {}
    for name, planner in planners.items():
        found = planner.fitting(budget, kept)
        if not found:
            return None
        picked[name] = found
    return picked


def _refine(planners: dict[str, _GraphPlanner], fitting: dict[str, list[Candidate]], kept: frozenset, spare: int,
            budget: float) -> dict[str, Candidate]:
    """Each graph's plan, spending up to ``spare`` more collectives where they shorten the step.

    Each graph's :data:`REFINED` fastest bucketed candidates may have blocks
    cut (:meth:`_GraphPlanner.cuts`): one cut at a time, the one that shortens
    a graph's fastest plan most is made, while one does (and fits
    ``budget``). When the spare collectives run out, neighbouring blocks
    whose merging costs no time are merged (:meth:`_GraphPlanner.merged`),
    and what that frees is spent on cuts again. At most :data:`MAX_CUTS`
    cuts in all. A graph's head may be cut again (:func:`_cut_heads`), which
    takes several collectives at once: after the single cuts, or before them
    with what the merges free first, whichever makes the shorter step.
    """
    tried = []
    for heads_first in (False, True):
        best = {name: candidates[0] for name, candidates in fitting.items()}
        current = {name: [c for c in candidates if c.base is not None][:REFINED]
                   for name, candidates in fitting.items()}
        if heads_first:  # what merges that cost no time free goes to the heads first
            left = spare + _merge(planners, best, current, kept, budget)
            left -= _cut_heads(planners, best, current, kept, left)
            _single_cuts(planners, best, current, kept, left, budget)
        else:
            left = spare - _single_cuts(planners, best, current, kept, spare, budget)
            _cut_heads(planners, best, current, kept, left)
        tried.append((sum(c.step_ms for c in best.values()), _collectives(best), best))
    return min(tried, key=lambda t: t[:2])[2]


def _single_cuts(planners: dict[str, _GraphPlanner], best: dict[str, Candidate], current: dict[str, list[Candidate]],
                 kept: frozenset, spare: int, budget: float) -> int:
    """:func:`_refine`'s cuts and merges, in place; how many more collectives ``best`` issues after them."""
    start = _collectives(best)
    cuts = _cut(planners, best, current, kept, min(max(0, spare), MAX_CUTS), budget)
    if cuts < MAX_CUTS:
        freed = _merge(planners, best, current, kept, budget)
        _cut(planners, best, current, kept, min(max(0, spare - cuts) + freed, MAX_CUTS - cuts), budget)
    return _collectives(best) - start


def _merge(planners: dict[str, _GraphPlanner], best: dict[str, Candidate], current: dict[str, list[Candidate]],
           kept: frozenset, budget: float) -> int:
    """Neighbouring blocks merged where that costs no time (:meth:`_GraphPlanner.merged`), in ``current`` and,
    where no slower, in ``best``, in place; how many fewer collectives ``best`` issues, to spend where they
    shorten the step."""
    start = _collectives(best)
    for name, planner in planners.items():
        for k, candidate in enumerate(current[name]):
            current[name][k] = planner.merged(candidate, kept, budget)
            if current[name][k].key() <= best[name].key():
                best[name] = current[name][k]
    return start - _collectives(best)


def _collectives(best: Mapping[str, Candidate]) -> int:
    """The step's collectives: every graph's plan's."""
    return sum(c.collectives for c in best.values())


def _cut_heads(planners: dict[str, _GraphPlanner], best: dict[str, Candidate], current: dict[str, list[Candidate]],
               kept: frozenset, spare: int) -> int:
    """Cut each graph's head again (:meth:`_GraphPlanner.head_cuts`) where that shortens ``best``, within
    ``spare`` more collectives in the step, in place (each new best leads its graph's ``current``, so later
    cuts start from it): the graph whose cut saves most first. Returns how many more collectives
    ``best`` issues."""
    done: set[str] = set()
    added = 0
    while len(done) < len(planners):
        offers = []
        for name, planner in planners.items():
            if name in done:
                continue
            candidates = current[name] + ([] if any(c is best[name] for c in current[name]) else [best[name]])
            room = spare - added
            trials = (t for c in candidates for t in planner.head_cuts(c, kept, room)
                      if t.collectives - best[name].collectives <= room and t.step_ms < best[name].step_ms - 1e-12)
            for trial in sorted(trials, key=Candidate.key):
                fitted = planner.fitted(trial)
                if fitted is not None:
                    offers.append((best[name].step_ms - fitted.step_ms, name, fitted))
                    break
            else:
                done.add(name)
        if not offers:
            break
        _saved, name, trial = max(offers, key=lambda offer: offer[0])
        added += trial.collectives - best[name].collectives
        best[name] = trial
        current[name] = [trial] + current[name][:REFINED - 1]
        done.add(name)
    return added


def _cut(planners: dict[str, _GraphPlanner], best: dict[str, Candidate], current: dict[str, list[Candidate]],
         kept: frozenset, most: int, budget: float) -> int:
    """Make up to ``most`` cuts (:func:`_refine`) in ``best`` and ``current``, in place; how many were made."""
    # Each graph's most shortening cut, found again only after a cut in that graph.
    offers: dict[str, tuple[float, int, Candidate] | None] = {}
    for made in range(most):
        for name, planner in planners.items():
            if name in offers:
                continue
            offers[name] = None
            for k, candidate in enumerate(current[name]):
                for trial in planner.cuts(candidate, kept):
                    saved = best[name].step_ms - trial.step_ms
                    offer = offers[name]
                    if saved > 1e-12 and (offer is None or saved > offer[0] + 1e-12):
                        fitted = planner.fitted(trial)
                        if fitted is not None:
                            offers[name] = (saved, k, fitted)
        chosen = max((offer + (name,) for name, offer in offers.items() if offer is not None), default=None,
                     key=lambda offer: offer[0])
        if chosen is None:
            return made
        _saved, k, trial, name = chosen
        current[name][k] = best[name] = trial
        del offers[name]
    return most
