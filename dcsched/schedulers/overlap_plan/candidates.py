"""The candidates ``overlap-plan`` chooses among: one graph's orders with their buckets, simulated.

:class:`GraphOrders` holds a graph's compiled form and the orders that do not depend on its blocks (computed
once for every unit layout); :class:`GraphPlanner` makes one layout's candidates
(:mod:`dcsched.schedulers.overlap_plan.scheduler`, steps 2 to 4), fits them to the budget, and makes the moves step 5
(:mod:`dcsched.schedulers.overlap_plan.refine`) tries: a block cut, a head cut again, neighbouring blocks merged.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import math
from array import array
from typing import Iterable, Sequence

from dcsched.collective_issue import SIMULATOR, CollectiveIssue
from dcsched.errors import BudgetError
from dcsched.graph.form import ALLGATHER, GraphForm, paused_gc
from dcsched.plan import Plan
from dcsched.schedulers.fast_free.scheduler import fast_free_indices
from dcsched.schedulers.overlap_plan.head_pieces import head_pieces
from dcsched.schedulers.fsdp.bucketing import KNOWN_SIZE
from dcsched.schedulers.fsdp.scheduler import (Blocks, Placement, bucketed, gathered_ids, just_in_time, placement,
                                              plan_of)
from dcsched.schedulers.overlap.scheduler import Overlap
from dcsched.schedulers.overlap_plan.splice import BucketingRef, full, spliced
from dcsched.sim.plans import replicated_fused
from dcsched.sim.simulate import CompiledGraph

#: How many blocks ahead the ``fsdp``-style candidates prefetch.
AHEAD = (1, 2)
#: How many blocks ahead the bucketed orders issue their all-gather buckets.
BUCKETS_AHEAD = (0, 1, 2)
#: Which blocks :func:`~dcsched.schedulers.plan_refine.refine` tries cutting, by position among each kind's
#: blocks: the first two all-gather blocks and the last (a graph waits on its first buckets; a forward's last
#: compute waits on its last), the last two reduce blocks (a backward ends with them).
CUT_BLOCKS = {0: (0, 1, -1), 1: (-2, -1)}
#: How many of the last boundaries between a graph's reduce blocks :meth:`GraphPlanner.shifted` moves: those
#: before its last two blocks (a backward ends with them).
SHIFTED_BOUNDARIES = 2
#: The most points :func:`_shift_points` gives a boundary.
SHIFT_POINTS = 32
#: How many of a graph's fastest bucketed candidates :func:`~dcsched.schedulers.plan_refine.refine` cuts
#: blocks of.
REFINED = 3
#: How many of a candidate's first all-gather buckets :meth:`GraphPlanner.head_cuts` cuts again, as one (each
#: tried: the model of the wait is closest over the buckets the compute waits on, which may be pieces of one
#: block already or several blocks).
HEAD_GROUPS = (1, 2, 3, 4)
#: The most collectives :meth:`GraphPlanner.head_cuts` adds to a graph's head.
HEAD_MORE = 8
#: How many node numbers' worth of bucketed orders and buckets :meth:`GraphOrders.bucketed` keeps (8 bytes
#: each, a pointer to an int the base order holds already: 128 MiB), and of blocks' landings.
BUCKETED_KEPT = 1 << 24


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One graph's order with its buckets (node numbers), simulated with the step's residency.

    ``base`` is the order the buckets were made from and ``groups`` the blocks (all-gather blocks, then
    reduce blocks) :func:`~dcsched.schedulers.fsdp.scheduler.bucketed` made them of, so a block can be cut and the
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
    #: its parts, to bucket it again locally (:mod:`~dcsched.schedulers.overlap_plan.splice`); None: not bucketed
    bucketing: BucketingRef | None = dataclasses.field(default=None, compare=False, repr=False)

    def key(self) -> tuple:
        """What ranks candidates: step time, then collectives."""
        return (self.step_ms, self.collectives)


class GraphOrders:
    """One graph's compiled form and the orders that do not depend on its blocks (each computed once, then
    shared by the planners of every unit layout :func:`overlap_plan` tries)."""

    def __init__(self, form: GraphForm, latency_ms: float, scope: str, issue: CollectiveIssue = SIMULATOR) -> None:
        self.form, self.scope, self.latency_ms = form, scope, latency_ms
        #: how the peaks are simulated: the simulator's default, or on gloo with its staging copies counted and
        #: every collective blocking (:data:`~dcsched.collective_issue.FSDP2_ON_GLOO`), the least memory the
        #: runtime can run a plan in there (:func:`dcsched.train.backend.asynchrony` picks how it runs)
        self.issue = issue
        self.compiled = CompiledGraph(form, assume_zero=True, comm_latency_ms=latency_ms)
        self._bases: dict[str, list[int]] = {}
        self._jit: list[int] | None = None
        self._fast_free: list[int] | None = None
        self._overlap: Overlap | None = None
        self._overlap_orders: dict[float, list[int] | BudgetError] = {}
        #: per base order (by id, the order kept so its id is not reused): its placement
        self._placements: dict[int, tuple[list[int], Placement, dict]] = {}
        #: per (base order's id, ahead, blocks' digest), the latest used first out: what bucketing gives,
        #: and its figures per held set (the refinement tries the same blocks again: each graph's other
        #: candidates' cuts after every cut it makes)
        self._bucketed: collections.OrderedDict[tuple, tuple[tuple, tuple, tuple, dict]] = collections.OrderedDict()
        self._bucketed_size = 0
        #: per digest of (order, buckets, held): the simulated step and collectives
        self._figures: dict[bytes, tuple[float, int]] = {}

    def bucketed(self, base: list[int], groups: tuple, ahead: int, held: frozenset, parent: BucketingRef | None = None
                 ) -> tuple[list[int], list[list[int]], tuple[float, int], BucketingRef]:
        """:func:`~dcsched.schedulers.fsdp.scheduler.bucketed` of ``base`` with the blocks ``groups``, and the order's
        :meth:`figures` with the ``held`` parameters: each computed once per base, blocks and ``ahead`` (while
        that is among the last :data:`BUCKETED_KEPT` node numbers' worth bucketed), the base's placement once
        per base; and a reference to its parts, to bucket it again locally. ``parent``: the parts of a
        candidate of the same base, ahead and held parameters, with other blocks: where given, the order is
        made from them (:func:`~dcsched.schedulers.overlap_plan.splice.spliced`: the same order and figures,
        at the cost of what changed)."""
        key = (id(base), ahead, _digest(groups[0], [[-2]], groups[1]))
        if parent is not None and (parent.base is not base or parent.ahead != ahead or parent.held != held):
            parent = None
        found = self._bucketed.get(key)
        if found is not None and held in found[3]:  # made before: its parts are made again only if needed
            self._bucketed.move_to_end(key)
            order, buckets = _unpacked(found)
            return order, buckets, found[3][held], BucketingRef(None, parent, base, groups, ahead, held)
        placed = self._placed(base)
        if parent is not None:
            known = self._known(base)
            made = parent.made(self.form, self.compiled, placed, known)
            value = spliced(made, self.form, self.compiled, placed, groups, known) or \
                full(self.form, self.compiled, placed, base, groups, ahead, held, known)
            if found is None:
                found = self._kept(key, value.order, value.buckets)
            figures = found[3][held] = (value.clocks.step, value.fused.collectives)
            return list(value.order), [list(b) for b in value.buckets], figures, \
                BucketingRef(value, None, base, groups, ahead, held)
        if found is None:
            order, buckets = bucketed(self.form, base, *groups, ahead=ahead, placed=placed)
            found = self._kept(key, order, buckets)
        else:
            self._bucketed.move_to_end(key)
            order, buckets = _unpacked(found)
        found[3][held] = self.figures(order, buckets, held)
        return order, buckets, found[3][held], BucketingRef(None, None, base, groups, ahead, held)

    def _placed(self, base: list[int]) -> Placement:
        """The base order's placement, computed once per base (kept with it, so its id is not reused)."""
        if id(base) not in self._placements:
            self._placements[id(base)] = (base, placement(self.form, base), {})
        return self._placements[id(base)][1]

    def _known(self, base: list[int]) -> dict:
        """What :func:`~dcsched.schedulers.fsdp.bucketing.landings` found per block of ``base`` (emptied past
        :data:`BUCKETED_KEPT` node numbers: a bucket then looks changed, which costs time, never a figure)."""
        self._placed(base)
        known = self._placements[id(base)][2]
        if known.get(KNOWN_SIZE, 0) > BUCKETED_KEPT:
            known.clear()
        return known

    def _kept(self, key: tuple, order: list[int], buckets: list[list[int]]) -> tuple[tuple, tuple, tuple, dict]:
        """``order`` and ``buckets`` kept under ``key`` (tuples of the same int objects: copied at C speed, a
        pointer a node number; a fan-in's orders are long, and the same blocks come back after up to a few
        hundred others), the oldest let go past :data:`BUCKETED_KEPT`."""
        found = self._bucketed[key] = (tuple(order), tuple(map(tuple, buckets)), (), {})
        self._bucketed_size += 2 * len(order)
        while self._bucketed_size > BUCKETED_KEPT and len(self._bucketed) > 1:
            _key, (old, *_rest) = self._bucketed.popitem(last=False)
            self._bucketed_size -= 2 * len(old)
        return found

    def figures(self, order: list[int], buckets: list[list[int]], held: frozenset, *, key: bytes | None = None
                ) -> tuple[float, int]:
        """The simulated step (ms) and collectives of ``order`` with ``buckets`` and the ``held`` parameters,
        simulated once per distinct plan (by its digest, :func:`_plan_digest`: ``key`` where the caller has
        it already)."""
        if key is None:
            key = _plan_digest(array("i", order), array("i", itertools.chain.from_iterable(buckets)),
                               array("i", map(len, buckets)), held)
        found = self._figures.get(key)
        if found is None:
            found = self.compiled.timeline_figures(order, buckets=buckets, held=held, check=False)
            self._figures[key] = found
        return found

    def fixed_bases(self) -> dict[str, list[int]]:
        """The orders to bucket that do not depend on the budget."""
        if not self._bases:
            self._bases = {"fast-free": self.fast_free(), "input": list(self.form.topo)}
        return self._bases

    def fast_free(self) -> list[int]:
        """``fast-free``'s order (node numbers, the output where fast-free puts it), computed once: the
        ``fast-free`` base and the order ``overlap`` builds its first skeleton from."""
        if self._fast_free is None:
            with paused_gc():
                self.form.check_input_order()
                self._fast_free = fast_free_indices(self.form)
        return self._fast_free

    def just_in_time(self) -> list[int]:
        """The input order, every parameter gathered just before it is read: ``fsdp``'s base (computed once)."""
        if self._jit is None:
            self._jit = just_in_time(self.form, list(self.form.topo))
        return self._jit

    def overlap_order(self, budget: float) -> list[int] | BudgetError:
        """``overlap``'s order under ``budget`` (node numbers), or its error where it refuses the budget."""
        if budget not in self._overlap_orders:
            if self._overlap is None:
                self._overlap = Overlap(self.form, fast_free_order=self.fast_free())
            try:
                names = self._overlap.order(budget, self.scope)
                self._overlap_orders[budget] = [self.form.index[n] for n in names]
            except BudgetError as exc:
                self._overlap_orders[budget] = exc
        return self._overlap_orders[budget]


class GraphPlanner:
    """One graph's blocks and candidate orders; :meth:`best` simulates them with a residency."""

    def __init__(self, orders: GraphOrders, blocks: Blocks, budget: float, graph: str = "") -> None:
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

    def rebucketed(self, source: str, base: list[int], groups: tuple, role: dict, ahead: int,
                   parent: Candidate | None = None) -> Candidate:
        """``base`` bucketed with the blocks ``groups`` ``ahead`` blocks ahead, simulated with ``role``; made
        from ``parent``'s parts where given (a candidate of the same base with other blocks)."""
        order, buckets, (step, collectives), ref = self.orders.bucketed(
            base, groups, ahead, role.get("held", frozenset()), parent.bucketing if parent is not None else None)
        return Candidate(source, order, buckets, step, collectives, None if math.isfinite(self.budget) else 0,
                         {"keep": role.get("keep", frozenset()), "held": role.get("held", frozenset())}, base=base,
                         groups=groups, ahead=ahead, bucketing=ref)

    def simulated(self, source: str, order: list[int], buckets: list[list[int]], *, keep: frozenset = frozenset(),
                  held: frozenset = frozenset()) -> Candidate:
        """The candidate's timeline simulated (its peak is measured by :meth:`fitted`, where a budget asks)."""
        step, collectives = self.orders.figures(order, buckets, held)
        role = {"keep": keep, "held": held}
        return Candidate(source, order, buckets, step, collectives, None if math.isfinite(self.budget) else 0, role)

    def fitted(self, candidate: Candidate) -> Candidate | None:
        """``candidate`` with its peak measured, or None where it exceeds the budget."""
        if candidate.peak is None:
            result = self.compiled.simulate(candidate.order, detail=False, check=False, buckets=candidate.buckets,
                                            issue=self.orders.issue, **candidate.role)
            candidate = dataclasses.replace(candidate, peak=result.peak_in(self.scope))
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
                    groups = with_blocks(candidate.groups, which, cut_blocks)
                    yield self.rebucketed(candidate.source, candidate.base, groups, role, candidate.ahead, candidate)

    def shifted(self, candidate: Candidate, kept: frozenset) -> Iterable[Candidate]:
        """The candidate with the boundary between two neighbouring reduce blocks moved, as many collectives:
        each of the last :data:`SHIFTED_BOUNDARIES` boundaries, to every point :func:`_shift_points` gives (a
        cut's fixed points may leave a backward's last reduce bucket too long to hide behind its end)."""
        if candidate.base is None or candidate.groups is None:
            return
        role = self.role(kept)
        blocks = candidate.groups[1]
        for k in range(max(0, len(blocks) - 1 - SHIFTED_BOUNDARIES), len(blocks) - 1):
            joined, now = blocks[k] + blocks[k + 1], len(blocks[k])
            for point in _shift_points(len(joined), now):
                moved = blocks[:k] + [joined[:point], joined[point:]] + blocks[k + 2:]
                yield self.rebucketed(candidate.source, candidate.base, with_blocks(candidate.groups, 1, moved),
                                      role, candidate.ahead, candidate)

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
                                      candidate.ahead, candidate)

    def merged(self, candidate: Candidate, kept: frozenset) -> Candidate:
        """The candidate with neighbouring inner blocks merged wherever that costs no time and still fits the budget
        (one pass over each kind, first and last blocks left alone)."""
        if candidate.base is None or candidate.groups is None:
            return candidate
        role = self.role(kept)
        for which in (0, 1):
            k = 1
            while candidate.groups is not None and k < len(candidate.groups[which]) - 2:
                blocks = candidate.groups[which]
                joined = blocks[:k] + [blocks[k] + blocks[k + 1]] + blocks[k + 2:]
                groups = with_blocks(candidate.groups, which, joined)
                trial = self.rebucketed(candidate.source, candidate.base, groups, role, candidate.ahead, candidate)
                if trial.step_ms <= candidate.step_ms and trial.collectives < candidate.collectives:
                    fitted = self.fitted(trial)
                    if fitted is not None:
                        candidate = fitted
                k += 1
        return candidate

    def replicating(self, candidate: Candidate, kept: frozenset, replicated: frozenset) -> tuple[float, int, float]:
        """Step (ms), collectives and peak (bytes of the budget's scope) of ``candidate`` with the step's
        ``kept`` parameters and the ``replicated`` ones whole on every rank
        (:func:`~dcsched.sim.plans.replicated_fused`: no all-gather, resident all step, gradients all-reduced)."""
        role = self.role(kept - replicated)
        fused = replicated_fused(self.compiled, candidate.buckets, role.get("held", frozenset()),
                                 role.get("keep", frozenset()), replicated)
        fused = dataclasses.replace(fused, issue=self.orders.issue)
        result = self.compiled.simulate_with_frees(candidate.order, detail=False, fused=fused)[0]
        return result.step_ms, result.collectives, result.peak_in(self.scope)

    def first_collective(self, candidate: Candidate) -> list[int]:
        """The all-gathers (node numbers) of the first collective ``candidate`` issues: its first bucket, or
        its first all-gather alone (none in a graph without one)."""
        first = next((v for v in candidate.order if self.form.kind[v] == ALLGATHER), None)
        if first is None:
            return []
        return next((list(members) for members in candidate.buckets if first in members), [first])

    def fallback(self, budget: float) -> Candidate:
        """``overlap``'s own order, every collective alone (raises :class:`BudgetError` where it does)."""
        order = self.orders.overlap_order(budget)
        if isinstance(order, BudgetError):
            raise order
        return self.simulated("overlap (no buckets)", order, [])

    def plan(self, candidate: Candidate, kept: Iterable[int], held: frozenset) -> Plan:
        return plan_of(self.form, candidate.order, candidate.buckets, kept, held)


def _unpacked(found: tuple[tuple, tuple, tuple, dict]) -> tuple[list[int], list[list[int]]]:
    """A kept order and its buckets (:meth:`GraphOrders._kept`) as lists again."""
    return list(found[0]), list(map(list, found[1]))


def _digest(*parts: Sequence[Sequence[int]]) -> bytes:
    """A digest of lists of node numbers: their lengths, then their members (so different lists never read
    the same).

    >>> _digest([[1, 2], [3]]) == _digest([[1], [2, 3]]), _digest([[1, 2], [3]]) == _digest([[1, 2]], [[3]])
    (False, True)
    """
    lists = [members for part in parts for members in part]
    digest = hashlib.blake2b(array("q", map(len, lists)).tobytes(), digest_size=20)
    digest.update(array("q", itertools.chain.from_iterable(lists)).tobytes())
    return digest.digest()


def _plan_digest(order: array, members: array, sizes: array, held: frozenset) -> bytes:
    """A digest of a plan: its order, its buckets (``members`` one after another, ``sizes`` their lengths)
    and its ``held`` node numbers, each an ``array("i")`` but ``held``. The counts come first, so
    different plans never read the same.

    >>> one = _plan_digest(array("i", [1, 2]), array("i", [1, 2]), array("i", [2]), frozenset())
    >>> one == _plan_digest(array("i", [1, 2]), array("i", [1, 2]), array("i", [1, 1]), frozenset())
    False
    """
    digest = hashlib.blake2b(array("q", (len(order), len(sizes), len(held))).tobytes(), digest_size=20)
    for part in (order, sizes, members, array("i", sorted(held))):
        digest.update(part.tobytes())
    return digest.digest()


def with_blocks(groups: tuple, which: int, blocks: list[list[int]]) -> tuple:
    """``groups`` (all-gather blocks, reduce blocks) with those of kind ``which`` (0: all-gathers, 1: reduces)
    replaced by ``blocks``.

    >>> with_blocks(([[1]], [[2]]), 1, [[3]])
    ([[1]], [[3]])
    """
    return (blocks, groups[1]) if which == 0 else (groups[0], blocks)


def doubling_counts(n: int) -> list[int]:
    """1, 2, 4, ... below ``n``, and ``n``: how many of a sequence's first members a step tries.

    >>> doubling_counts(5), doubling_counts(1), doubling_counts(0)
    ([1, 2, 4, 5], [1], [])
    """
    counts, k = [], 1
    while k < n:
        counts.append(k)
        k *= 2
    return counts + ([n] if n else [])


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


def _shift_points(n: int, now: int) -> list[int]:
    """Where the boundary inside two neighbouring blocks of ``n`` members in all, now after the first
    ``now``, may move: every point where there are at most :data:`SHIFT_POINTS` (``now`` left out), else that
    many spread evenly and the four on either side of ``now``.

    >>> _shift_points(5, 2), len(_shift_points(100, 50))
    ([1, 3, 4], 36)
    """
    if n - 1 <= SHIFT_POINTS:
        points = set(range(1, n))
    else:
        points = {n * k // SHIFT_POINTS for k in range(1, SHIFT_POINTS)} | set(range(now - 4, now + 5))
    return sorted(p for p in points if 0 < p < n and p != now)
