"""The budget-independent half of ``overlap``: one skeleton's all-gather placement (:class:`OverlapPlanner`).

:mod:`dcsched.schedulers.overlap.scheduler` (the scheduler) builds one planner per base
compute order and keeps the best placement; the steps and their proofs are in
``docs/overlap.md``.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator

import networkx as nx

from dcsched.budget import SCOPES, UNLIMITED, check_scope  # noqa: F401  (re-exported)
from dcsched.errors import BudgetError, DcschedError
from dcsched.graph.form import COMPUTE, REDUCE, GraphForm, output_last_indices
from dcsched.sim.simulate import Clocks, CompiledGraph, SimResult, compile_view
from dcsched.units import format_bytes
from dcsched.schedulers.overlap.maxtree import MaxTree
from dcsched.schedulers.overlap.placement import JUMP_RATIO, NO_LIMIT, Placement  # noqa: F401
from dcsched.schedulers.overlap.sink import sink_readers
from dcsched.schedulers.overlap.skeleton import MovableParts, build_skeleton, gather_windows, movable_parts
from dcsched.schedulers.fast_free.scheduler import fast_free_indices

#: Compute orders the skeleton can come from: fast-free's, the graph's own (input) order, or
#: fast-free's with each reader of a gathered parameter sunk to just before its first user.
BASES = ("fast-free", "input", "sunk")


class OverlapPlanner:
    """Everything about one graph that does not depend on the budget, computed once.

    ``plan(budget, scope)`` then places the all-gathers for one budget in
    O(G log N + N + E) (G all-gathers, N nodes, E edges), so a budget sweep
    costs one simulation per point. Positions are *slots*: slot ``j`` is just
    before the ``j``-th skeleton node; slot ``len(skeleton)`` is the end.

    Attributes: ``compiled`` (the simulator's form of the graph), ``skeleton``
    (node numbers), ``gathers`` (all-gathers in need order), ``need``,
    ``free`` and ``lo`` (per all-gather: first reader's slot, last slot its
    buffer lives, earliest slot its inputs allow), ``jit_peak`` and
    ``jit_gathered_peak`` (just-in-time gathering's peaks), ``fast_free`` (the
    simulation of fast-free's own order). ``shares``: a planner of the same graph whose compiled form,
    fast-free order and fast-free simulation this one reuses. ``fast_free_order``: where given,
    :func:`~dcsched.schedulers.fast_free.scheduler.fast_free_indices` of the graph, computed already (so not run again).
    """

    def __init__(self, view: nx.DiGraph | GraphForm, *, base: str = "fast-free", name: str | None = None,
                 compiled: CompiledGraph | None = None, shares: OverlapPlanner | None = None,
                 fast_free_order: list[int] | None = None):
        if base not in BASES:
            raise ValueError(f"unknown base order {base!r} (choose from {', '.join(BASES)})")
        self.base_name = base
        self._shares = shares
        self.guard_from: OverlapPlanner | None = None
        self._fast_free: SimResult | None = None
        self._movable: MovableParts | None = None
        if shares is not None:
            compiled = shares.compiled
        elif compiled is None:
            compiled = view if isinstance(view, CompiledGraph) else compile_view(view, assume_zero=True, name=name)
        self.compiled: CompiledGraph = compiled
        if shares is not None:
            ff = shares.fast_free_order
        else:
            self.compiled.check_input_order()
            # As the registered fast-free runs it: the output last, after any chain nothing reads.
            if fast_free_order is None:
                fast_free_order = fast_free_indices(self.compiled)
            ff = output_last_indices(self.compiled.kind, fast_free_order)
        self.fast_free_order: list[int] = ff
        if base == "fast-free":
            base_order = ff
        elif base == "input":
            base_order = list(self.compiled.topo)
        else:
            base_order = sink_readers(self.compiled, ff)
        self._build_skeleton(base_order)
        self._measure_jit()

    @property
    def fast_free(self) -> SimResult:
        """The simulation of fast-free's own order (run when first asked; shared with the planner this one
        ``shares`` fast-free's order with)."""
        if self._shares is not None:
            return self._shares.fast_free
        if self._fast_free is None:
            self._fast_free = self.compiled.simulate(self.fast_free_order, detail=False, check=False)
        return self._fast_free

    # -- construction ----------------------------------------------------------
    @property
    def movable(self) -> MovableParts:
        """Step 1's graph-only half (:func:`movable_parts`), computed once per graph: shared with the
        planner this one ``shares``."""
        if self._shares is not None:
            return self._shares.movable
        if self._movable is None:
            self._movable = movable_parts(self.compiled)
        return self._movable

    def _build_skeleton(self, base: list[int]) -> None:
        """Step 1 on ``base``: the skeleton, and each all-gather's window on it (``_skeleton``)."""
        parts = self.movable
        self._is_gather = parts.is_gather
        self.skeleton, self.wait_of = build_skeleton(self.compiled, parts, base)
        windows = gather_windows(self.compiled, parts, self.skeleton, self.wait_of, base)
        self.gathers, self.need, self.lo = windows.gathers, windows.need, windows.lo
        self.gather_sizes = [self.compiled.size[g] for g in self.gathers]
        self.slot_of, self.wait_groups = windows.slot_of, windows.wait_groups
        self._wait_slots, self._next_comm = windows.wait_slots, windows.next_comm

    def _measure_jit(self) -> None:
        """Just-in-time gathering (every all-gather at its need slot): where each buffer is freed, and so
        how late the next all-gather of its parameter may start. Its memory profile, which only a
        finite budget reads, is simulated when first asked for (:meth:`_jit_memory`)."""
        c = self.compiled
        m = len(self.skeleton)
        order, issue_pos = self._layout(self.need)
        c.check(order)
        # (dropped once _jit_memory has used it)
        self._jit_layout: tuple[list[int], list[int]] | None = order, issue_pos
        free_pos = c.free_positions(order, c.gather_owners)
        # Last slot each buffer lives: the skeleton node after which the simulator frees it (the
        # slot whose group holds the freeing position).
        free = []
        for k, g in enumerate(self.gathers):
            p = free_pos[g]
            free.append(m if p < 0 else max(bisect.bisect_right(issue_pos, p) - 1, self.need[k]))
        self.free = free
        # Previous gather of the same parameter: this one must follow its free.
        last_free: dict = {}
        for k, g in enumerate(self.gathers):
            d = c.ds_id[g]
            if d in last_free:
                self.lo[k] = min(self.need[k], max(self.lo[k], last_free[d] + 1))
            last_free[d] = max(last_free.get(d, -1), free[k])
        self.largest_gather = max((c.size[g] for g in self.gathers), default=0)
        self._memory: tuple[list, list, int, int] | None = None

    def _jit_memory(self) -> tuple[list, list, int, int]:
        """``(rest, fixed, jit_peak, jit_gathered_peak)``: what the model of movable buffers does not cover
        while each skeleton node runs under just-in-time gathering (``rest``: every other tensor;
        ``fixed``: gathered buffers that stay in the skeleton), and its peaks."""
        if self._memory is None:
            c = self.compiled
            # (set by _measure_jit, and dropped only below, once _memory holds what it was kept for)
            assert self._jit_layout is not None
            order, issue_pos = self._jit_layout
            memory, gathered_memory, _ = c.memory_with_frees(order)
            # Skeleton node j closes slot j's group: it sits just before slot j + 1's group.
            skeleton_pos = [p - 1 for p in issue_pos[1:]]
            used = self.gathered_usage(self.need)
            # (Exact on DeepCompile-style graphs; where ops are wired so that the model counts a
            # buffer longer than the simulator does, the correction is clamped to stay conservative.)
            gathered = list(map(gathered_memory.__getitem__, skeleton_pos))
            movable = list(map(min, used, gathered))  # (used has a last entry, for the end slot)
            rest = list(map(operator.sub, map(memory.__getitem__, skeleton_pos), movable))
            fixed = list(map(operator.sub, gathered, movable))
            rest.append(rest[-1] if rest else c.resident_bytes)
            fixed.append(fixed[-1] if fixed else 0)
            # (the peaks as the simulator reports them: no peak below what is resident, none below 0)
            self._memory = (rest, fixed, max(max(memory, default=c.resident_bytes), c.resident_bytes),
                            max(max(gathered_memory, default=0), 0))
            self._jit_layout = None
        return self._memory

    @property
    def rest(self) -> list:
        return self._jit_memory()[0]

    @property
    def fixed(self) -> list:
        return self._jit_memory()[1]

    @property
    def jit_peak(self) -> int:
        """Just-in-time gathering's all-tensor peak."""
        return self._jit_memory()[2]

    @property
    def jit_gathered_peak(self) -> int:
        """Just-in-time gathering's gathered peak."""
        return self._jit_memory()[3]

    @property
    def guard_floor(self) -> int:
        """The all-tensor floor of :meth:`all_tensor_cap`: just-in-time gathering's peak on the skeleton
        of ``guard_from`` (fast-free's, which :class:`~dcsched.schedulers.overlap.scheduler.Overlap` gives every
        planner of a graph; by default this one)."""
        return (self.guard_from or self).jit_peak

    # -- budget-independent queries -------------------------------------------
    def gathered_usage(self, slots: list[int]) -> list[int]:
        """Bytes of movable gathered buffers while each skeleton slot's node runs, gathers at ``slots``."""
        m = len(self.skeleton)
        diff = [0] * (m + 2)
        size = self.compiled.size
        for k, g in enumerate(self.gathers):
            diff[slots[k]] += size[g]
            diff[self.free[k] + 1] -= size[g]
        used, run = [], 0
        for j in range(m + 1):
            run += diff[j]
            used.append(run)
        return used

    def min_budget(self, scope: str = "gathered") -> int:
        """The smallest budget this skeleton can meet (just-in-time gathering's peak)."""
        return self.jit_gathered_peak if check_scope(scope) == "gathered" else self.jit_peak

    def assemble(self, slots: list[int], rank: list[int] | None = None) -> list[int]:
        """The full order (node numbers) with all-gather ``k`` at slot ``slots[k]`` (ties by ``rank``)."""
        return self._layout(slots, rank)[0]

    def _layout(self, slots: list[int], rank: list[int] | None = None,
                behind: dict[int, int] | None = None) -> tuple[list[int], list[int]]:
        """The order, and per slot the position where its all-gathers are issued.

        Slot ``j``'s group: the all-gathers placed there (need order), the
        skeleton reduces ``behind`` moves there, the waits of its node's inputs,
        then skeleton node ``j`` (unless it is a moved reduce).
        """
        skeleton, gathers = self.skeleton, self.gathers
        m = len(skeleton)
        inserted: dict[int, list[int]] = {}  # slot -> nodes placed before its skeleton node
        for k in (range(len(gathers)) if rank is None else sorted(range(len(gathers)), key=rank.__getitem__)):
            inserted.setdefault(slots[k], []).append(gathers[k])
        delta = [1] * m + [0]  # nodes each slot's group adds to the order
        if behind:
            for j, v in enumerate(skeleton):
                if v in behind:
                    inserted.setdefault(behind[v], []).append(v)
                    delta[j] = 0
        waits = self.wait_groups
        for j in self._wait_slots:
            inserted.setdefault(j, []).extend(waits[j])
        order: list[int] = []
        prev = 0
        for j in sorted(inserted):
            group = inserted[j]
            delta[j] += len(group)
            order.extend(skeleton[prev:j] if not behind else [v for v in skeleton[prev:j] if v not in behind])
            order.extend(group)
            prev = j
        order.extend(skeleton[prev:] if not behind else [v for v in skeleton[prev:] if v not in behind])
        issue_pos = list(itertools.accumulate(delta[:m], initial=0))
        return order, issue_pos

    def timeline(self, slots: list[int], rank: list[int] | None = None) -> tuple[list[int], list[int], SimResult]:
        """The order with all-gathers at ``slots``, each slot's issue position, and its simulation (series)."""
        order, issue_pos = self._layout(slots, rank)
        return order, issue_pos, self.compiled.simulate(order, detail="series", check=False)

    def reduces_behind(self, slots: list[int], rank: list[int] | None = None,
                       timeline: tuple[list[int], list[int], SimResult | Clocks] | None = None) -> dict[int, int]:
        """Step 6's variant: reduces that had not started when the next all-gather was issued, moved
        right behind that all-gather in the FIFO (the all-gather gates compute; a reduce gates
        nothing but the step's end). Returns {reduce node: slot}; empty when nothing would move.
        ``timeline``: :meth:`timeline` of these slots, if already simulated (its clocks suffice).
        """
        c = self.compiled
        order, issue_pos, res = timeline if timeline is not None else self.timeline(slots, rank)
        n = len(order)
        clock = [res.reach_ms[p] if p < n else res.step_ms for p in issue_pos]
        rank = rank if rank is not None else list(range(len(self.gathers)))
        placed = sorted(slots[k] for k in range(len(self.gathers)))
        pos_of = {v: i for i, v in enumerate(order)}
        moved = {}
        for j, v in enumerate(self.skeleton):
            if c.kind[v] != REDUCE or any(r not in self.slot_of for r in c.succs[v]):
                continue  # (a reduce that an all-gather or wait reads stays where it is)
            at = bisect.bisect_right(placed, j)
            if at == len(placed):
                break
            target = placed[at]
            readers = [self.slot_of[r] for r in c.succs[v] if r in self.slot_of]
            if readers and min(readers) < target:
                continue
            if clock[target] < res.start_ms[pos_of[v]] - 1e-12:
                moved[v] = target
        return moved

    def names(self, order: list[int]) -> list[str]:
        names = self.compiled.names
        return [names[i] for i in order]

    # -- placing for one budget ------------------------------------------------
    def capacity(self, budget: float, scope: str) -> list[float]:
        """Bytes of gathered parameters each slot may hold under ``budget``."""
        rest, fixed = self.rest, self.fixed
        if check_scope(scope) == "all":
            return [budget - r for r in rest]
        if budget == UNLIMITED:
            return [UNLIMITED] * len(rest)
        all_cap = self.all_tensor_cap(budget)
        return [min(budget - f, all_cap - r) for r, f in zip(rest, fixed)]

    def all_tensor_cap(self, budget: float) -> float:
        """In the gathered scope, the all-tensor memory a schedule may use under ``budget``.

        Fast-free's all-tensor peak plus what the budget adds over fast-free's
        gathered peak, but never below what just-in-time gathering on
        fast-free's skeleton needs (``guard_floor``).
        """
        if budget == UNLIMITED:
            return UNLIMITED
        ff = self.fast_free
        return max(self.guard_floor, ff.peak_bytes + (budget - ff.gathered_peak_bytes))

    def smallest_feasible(self, scope: str) -> int:
        """The smallest budget :meth:`feasible` accepts."""
        low = self.min_budget(scope)
        if scope == "gathered" and self.jit_peak > self.guard_floor:
            ff = self.fast_free
            low = max(low, self.jit_peak - ff.peak_bytes + ff.gathered_peak_bytes)
        return low

    def feasible(self, budget: float, scope: str) -> bool:
        """Whether this skeleton can meet ``budget`` (in the gathered scope: also the all-tensor cap)."""
        if budget == UNLIMITED:  # (without simulating just-in-time gathering's memory)
            return True
        if budget < self.min_budget(scope):
            return False
        return scope == "all" or self.jit_peak <= self.all_tensor_cap(budget)

    def check_budget(self, budget: float, scope: str, need: int | None = None) -> None:
        if budget == UNLIMITED:
            return
        need = self.min_budget(scope) if need is None else need
        if budget < need:
            what = "gathered parameters" if scope == "gathered" else "all tensors"
            raise BudgetError(
                f"`memory_budget` {format_bytes(budget)} ({int(budget)} bytes) is too small for "
                f"{self.compiled.name or 'this graph'}: overlap needs at least {format_bytes(need)} "
                f"({need} bytes) of {what} (`budget_scope='{scope}'`); pass `memory_budget={need}` or more")

    def earliest(self, budget: float, scope: str = "gathered", sequence: list[int] | None = None,
                 lookahead: int = 0, small_first: int = 0, passing: int = 0) -> list[int]:
        """Step 3: each all-gather at its earliest slot that fits the budget.

        All-gathers are taken in ``sequence`` (default: need order), each no
        earlier than the one before it, so the communication FIFO serves them in
        that order (an all-gather that cannot follow, being needed sooner, goes
        at its need slot).

        ``lookahead`` > 0 lets a large all-gather go ahead of smaller ones
        needed before it (at most ``lookahead`` places, each at most a
        ``JUMP_RATIO``-th of its size) when placing them first would push it
        later: two large buffers that exactly fill the budget leave no room
        for a small one beside them, so the small ones wait instead.
        ``small_first`` > 0 places the all-gathers of at most that many bytes
        first, in their own FIFO sequence, then the others in theirs: small
        parameters needed late (norm weights, a few KiB each but a full
        all-gather latency) can then fill the communication stream's idle time
        early, where larger ones needed before them do not fit (both: step 3b
        in ``docs/overlap.md``). ``passing`` > 0: where memory holds an
        all-gather back, each of the next ``passing`` ones that fits before it
        goes first, if that does not make it wait for more compute (two
        buffers that fill the budget exactly: the next layer's gathers run
        while the first is still in use). :attr:`last_sequence` records the
        resulting FIFO sequence.
        """
        placement = self._placement(budget, scope)
        size = self.gather_sizes
        slots = [0] * len(self.gathers)
        order = list(sequence if sequence is not None else range(len(self.gathers)))
        classes = [order]
        if small_first:
            classes = [[k for k in order if size[k] <= small_first], [k for k in order if size[k] > small_first]]
        used: list[int] = []
        for pending in classes:
            if lookahead or passing:
                placement.moving(pending[::-1], 0, slots, used, lookahead, passing)
            else:
                placement.in_order(pending, slots)
                used.extend(pending)
        if small_first:  # the FIFO sequence is program order: by slot, then by need
            used.sort(key=lambda k: (slots[k], k))
        self.last_sequence = used
        return slots

    def earliest_variants(self, budget: float, scope: str, variants) -> tuple[list[int], list]:
        """Need order's :meth:`earliest` slots, and per step 3b variant ``(lookahead, small_first,
        passing)`` its ``(slots, FIFO sequence)``, or None where its sequence is need order.

        The moving variants (lookahead, passing) share need order's placement up
        to their first move (:meth:`Placement.with_variants`).
        """
        shared = [v for v in variants if not v[1] and (v[0] or v[2])]
        plain, moved = self._placement(budget, scope).with_variants([(v[0], v[2]) for v in shared])
        placed_by = dict(zip(shared, moved))
        placed = []
        for lookahead, small_first, passing in variants:
            if (lookahead, small_first, passing) in placed_by:
                placed.append(placed_by[(lookahead, small_first, passing)])
                continue
            slots = self.earliest(budget, scope, lookahead=lookahead, small_first=small_first, passing=passing)
            sequence = self.last_sequence
            placed.append(None if sequence == sorted(sequence) else (slots, sequence))
        return plain, placed

    def _placement(self, budget: float, scope: str) -> Placement:
        """Step 3's placer against a fresh room for ``budget`` (unlimited: no room to keep, as every slot
        fits every buffer and the placement rules are unchanged)."""
        self.check_budget(budget, scope)
        check_scope(scope)
        return Placement(self, self._capacity_tree(budget, scope) if budget != UNLIMITED else NO_LIMIT)

    def _capacity_tree(self, budget: float, scope: str) -> MaxTree:
        """A fresh segment tree of each slot's room (negated) under ``budget``: the last one built is kept
        and copied, as step 3's placements for one budget all start from it."""
        cached = getattr(self, "_tree", None)
        if cached is None or cached[:2] != (budget, scope):
            # Whole bytes: memory is counted in them, and integer rooms keep every add and its undo exact.
            room = self.capacity(math.floor(budget), scope)
            cached = self._tree = (budget, scope, MaxTree([-c for c in room]))
        return cached[2].copy()

    @property
    def slot_work(self) -> list[float]:
        """Compute duration on the skeleton before each slot (slot ``len(skeleton)``: all of it)."""
        if getattr(self, "_work", None) is None:
            c, run, work = self.compiled, 0.0, []
            for v in self.skeleton:
                work.append(run)
                if c.kind[v] == COMPUTE:
                    run += c.duration[v]
            work.append(run)
            self._work = work
        return self._work

    def delay(self, slots: list[int], rank: list[int] | None = None) -> tuple[list[int], Clocks]:
        """Step 4: move each all-gather as late as keeps the simulated timeline; returns slots and the
        simulated clocks of ``slots`` (before the move).

        ``rank``: each all-gather's place in the FIFO sequence (default: need order).
        """
        order, issue_pos = self._layout(slots, rank)
        res = self.compiled.clocks(order)
        # Compute clock when the program reaches each slot's all-gathers; when each starts.
        n = len(order)
        clock = [res.reach_ms[p] if p < n else res.step_ms for p in issue_pos]
        start_ms = res.start_ms
        is_gather = self._is_gather
        gather_positions = itertools.compress(range(n), map(is_gather.__getitem__, order))
        start_of = {order[pos]: start_ms[pos] for pos in gather_positions}
        rank = rank if rank is not None else list(range(len(self.gathers)))
        program = sorted(range(len(self.gathers)), key=lambda k: (slots[k], rank[k]))
        new = list(slots)
        next_k = None
        for k in reversed(program):
            p = slots[k]
            limit = min(self.need[k], self._next_comm[p])
            if next_k is not None:  # never pass the next all-gather in program order
                limit = min(limit, new[next_k] if rank[k] < rank[next_k] else new[next_k] - 1)
            latest = bisect.bisect_right(clock, start_of[self.gathers[k]], 0, limit + 1) - 1
            new[k] = max(p, min(limit, latest))
            next_k = k
        return new, res

    def plan(self, budget: float, scope: str = "gathered") -> list[int]:
        """Slots of the all-gathers for ``budget`` (steps 3 and 4)."""
        slots = self.earliest(budget, scope)
        slots, _ = self.delay(slots)
        return slots

    def order(self, budget: float, scope: str = "gathered") -> list[str]:
        """The overlap order (node names) for ``budget`` bytes in ``scope``."""
        return self.names(self.assemble(self.plan(budget, scope)))

    def ahead_slots(self, k_ahead: int) -> list[int]:
        """The naive baseline: all-gather ``k`` issued where all-gather ``k - k_ahead`` is needed."""
        if k_ahead < 0:
            raise DcschedError(f"prefetch distance k must not be negative ({k_ahead})")
        slots = []
        prev = 0
        for k in range(len(self.gathers)):
            target = self.need[k - k_ahead] if k >= k_ahead else 0
            p = min(self.need[k], max(self.lo[k], prev, target))
            slots.append(p)
            prev = p
        return slots
