"""``overlap``: dcsched's memory-budgeted overlap scheduler.

The compute order is ``fast-free``'s, so activations live exactly as long as
they do under ``fast-free`` (the graph's own order and fast-free's with side
branches sunk are tried too, within the same memory limits); only the
communication moves (full write-up with guarantees and proofs:
``docs/overlap.md``):

1. *Skeleton.* Take ``fast-free``'s order without its all-gathers and their
   waits. Every gradient reduce and every parameter release moves up to right
   after its last input (a reduce is issued as soon as its gradient is ready,
   a gathered buffer is freed as soon as its last reader ran).
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
gathering needs raises :class:`~dcsched.errors.DcschedError` naming the
smallest budget that works.

Everything is integer-indexed and deterministic (no hash order, no timing).

>>> from dcsched.synthetic import layered_stack
>>> from dcsched.nxview import to_networkx, check_order
>>> from dcsched.simulate import simulate
>>> view = to_networkx(layered_stack(2).forward)
>>> scheduler = Overlap(view)
>>> order = overlap(view, memory_budget=scheduler.min_budget("all"))  # a budget over all tensors
>>> check_order(view, order)
>>> simulate(view, order).peak_bytes <= scheduler.min_budget("all")
True
>>> order = overlap(view, memory_budget=scheduler.min_budget(), budget_scope="gathered")
>>> simulate(view, order).gathered_peak_bytes <= scheduler.min_budget()
True
"""

from __future__ import annotations

import bisect
import math

import networkx as nx

from ..errors import DcschedError
from ..graphform import ALLGATHER, COMM_KINDS, COMPUTE, RELEASE, REDUCE, WAIT, GraphForm, paused_gc
from ..simulate import CompiledGraph, SimResult, compile_view
from .. import units
from ..units import format_bytes
from ._maxtree import MaxTree as _MaxTree
from ._sink import sink_readers
from .fast_free import fast_free_indices
from .registry import register

SCOPES = ("gathered", "all")
#: What a budget caps unless told otherwise: all tensors, the figure that decides an out-of-memory
#: error and the one a device budget (the CLI's default) and DeepCompile's own pipeline speak of.
DEFAULT_SCOPE = "all"
UNLIMITED = math.inf
#: Compute orders the skeleton can come from: fast-free's, the graph's own (input) order, or
#: fast-free's with each reader of a gathered parameter sunk to just before its first user.
BASES = ("fast-free", "input", "sunk")


@register("overlap", description="dcsched's memory-budgeted overlap: fast-free's compute order, each all-gather "
                                 "issued as early as memory_budget (bytes) allows and no earlier than it hides", takes_form=True)
def overlap(view: nx.DiGraph, *, memory_budget=None, budget_scope: str = DEFAULT_SCOPE) -> list[str]:
    """The overlap order of ``view`` under ``memory_budget`` bytes (``math.inf``: unlimited).

    ``budget_scope``: ``'all'`` (all tensors, the default) or ``'gathered'`` (gathered parameters).
    """
    budget = parse_budget(memory_budget)
    with paused_gc():
        return Overlap(view).order(budget, budget_scope)


def parse_budget(memory_budget) -> float:
    """Bytes from an int, a float (``math.inf`` = unlimited) or a size string ('6GiB', 'unlimited')."""
    if memory_budget is None:
        raise DcschedError("the overlap scheduler needs a memory budget: pass --memory-budget SIZE "
                           "(Python: memory_budget=bytes; math.inf for unlimited)")
    return units.parse_budget(memory_budget)


def check_scope(scope: str) -> str:
    if scope not in SCOPES:
        raise DcschedError(f"unknown budget scope {scope!r} (choose from {', '.join(SCOPES)})")
    return scope


class _NoLimit:
    """The segment tree of an unlimited budget: nothing is ever over it."""

    def add(self, lo: int, hi: int, value: float) -> None:
        pass

    def last_above(self, lo: int, hi: int, threshold: float) -> int:
        return -1


_NO_LIMIT = _NoLimit()


class OverlapPlanner:
    """Everything about one graph that does not depend on the budget, computed once.

    ``plan(budget, scope)`` then places the all-gathers for one budget in
    O(G log N + N + E) (G all-gathers, N nodes, E edges), so a budget sweep
    costs one simulation per point. Positions are *slots*: slot ``j`` is just
    before the ``j``-th skeleton node; slot ``len(skeleton)`` is the end.

    Attributes: ``compiled`` (the simulator's form of the graph), ``skeleton``
    (node numbers), ``gathers`` (all-gathers in need order), ``need``,
    ``free`` and ``lo`` (per all-gather: first reader's slot, last slot its
    buffer lives, earliest slot its inputs allow), ``jit`` (the simulation of
    just-in-time gathering), ``fast_free`` (the simulation of fast-free's own
    order).
    """

    def __init__(self, view: nx.DiGraph | GraphForm, *, base: str = "fast-free", name: str | None = None,
                 compiled: CompiledGraph | None = None, fast_free: list[int] | None = None):
        if base not in BASES:
            raise ValueError(f"unknown base order {base!r} (choose from {', '.join(BASES)})")
        self.base_name = base
        if compiled is None:
            compiled = view if isinstance(view, CompiledGraph) else compile_view(view, assume_zero=True, name=name)
        self.compiled = compiled
        if fast_free is None:
            self.compiled.check_input_order()
            fast_free = fast_free_indices(self.compiled)
        ff = fast_free
        self.fast_free_order = ff
        self.fast_free: SimResult = self.compiled.simulate(ff, detail=False, check=False)
        if base == "fast-free":
            base = ff
        elif base == "input":
            base = list(self.compiled.topo)
        else:
            base = sink_readers(self.compiled, ff)
        self._build_skeleton(base)
        self._build_needs(base)
        self._measure_jit()

    # -- construction ----------------------------------------------------------
    def _build_skeleton(self, base: list[int]) -> None:
        c = self.compiled
        kind, preds, succs = c.kind, c.preds, c.succs
        # Movable: an all-gather that reads no communication node, and the waits that read it
        # (and no other gather or wait) and have readers. Anything else (ZeRO-3 ops wired
        # unusually, a wait nobody reads) stays in the skeleton where the base order has it.
        movable = {v for v in base if kind[v] == ALLGATHER
                   and not any(kind[p] in (ALLGATHER, WAIT) for p in preds[v])}
        wait_of: dict[int, list[int]] = {g: [] for g in base if g in movable}
        attached = set()
        for v in base:
            if kind[v] != WAIT or not succs[v]:
                continue
            owners = [p for p in preds[v] if kind[p] in (ALLGATHER, WAIT)]
            if len(owners) == 1 and owners[0] in movable and not any(kind[s] == ALLGATHER for s in succs[v]):
                wait_of[owners[0]].append(v)
                attached.add(v)
        skeleton = [v for v in base if v not in movable and v not in attached]
        # Reduces and releases move up to right after their last input (when every input is a
        # skeleton node): the sort key of a moved node extends its latest input's key.
        key: dict[int, tuple] = {}
        counter = 0
        for i, v in enumerate(skeleton):
            ins = preds[v]
            if kind[v] in (REDUCE, RELEASE) and ins and all(p in key for p in ins):
                counter += 1
                key[v] = max(key[p] for p in ins) + (1, counter)
            else:
                key[v] = (i, 0, 0)
        skeleton.sort(key=key.__getitem__)
        self.skeleton = skeleton
        self.wait_of = wait_of

    def _build_needs(self, base: list[int]) -> None:
        c = self.compiled
        kind, preds, succs, ds_id = c.kind, c.preds, c.succs, c.ds_id
        skeleton = self.skeleton
        m = len(skeleton)
        slot_of = {v: j for j, v in enumerate(skeleton)}
        self.slot_of = slot_of
        base_pos = {v: i for i, v in enumerate(base)}
        # Skeleton nodes that count in the simulator's release bookkeeping, per parameter.
        marks: dict = {}
        for j, v in enumerate(skeleton):
            if kind[v] in (ALLGATHER, RELEASE):
                marks.setdefault(ds_id[v], []).append(j)

        entries = []
        for g, waits in self.wait_of.items():
            readers = [slot_of[r] for r in succs[g] if r in slot_of]
            readers += [slot_of[r] for w in waits for r in succs[w]]
            # Read by nobody at all: it stays at the skeleton node that followed it in the base.
            lo = max((slot_of[p] + 1 for p in preds[g]), default=0)
            # Read by nobody at all: it stays at the skeleton node that followed it in the base.
            need = min(readers) if readers else max(lo, next(
                (slot_of[v] for v in base[base_pos[g]:] if v in slot_of), m))
            # Never cross a release or all-gather of the same parameter: the buffer is freed at
            # the n-th release after its all-gather, so that count must not change.
            before = [j for j in marks.get(ds_id[g], ()) if j < need]
            if before:
                lo = max(lo, before[-1] + 1)
            entries.append((need, base_pos[g], g, min(lo, need)))
        entries.sort()
        self.gathers = [g for _, _, g, _ in entries]
        self.need = [need for need, _, _, _ in entries]
        self.lo = [lo for _, _, _, lo in entries]
        # Waits: right before their own first reader.
        self.wait_groups: list[list[int]] = [[] for _ in range(m + 1)]
        for g in self.gathers:
            for w in self.wait_of[g]:
                self.wait_groups[min(slot_of[r] for r in succs[w])].append(w)
        # The next skeleton slot holding a communication node, from each slot on.
        self._next_comm = [m] * (m + 1)
        nxt = m
        for j in range(m - 1, -1, -1):
            if kind[skeleton[j]] in COMM_KINDS:
                nxt = j
            self._next_comm[j] = nxt

    def _measure_jit(self) -> None:
        c = self.compiled
        m = len(self.skeleton)
        order, _ = self._layout(self.need)
        res = c.simulate(order, detail=True, check=True)
        self.jit = res
        free_pos = c.free_positions(order)
        group_of_pos = []
        skeleton_pos = [0] * m
        j = 0
        for pos, v in enumerate(order):
            group_of_pos.append(j)
            if j < m and v == self.skeleton[j]:
                skeleton_pos[j] = pos
                j += 1
        # Last slot each buffer lives: the skeleton node after which the simulator frees it.
        free = []
        for k, g in enumerate(self.gathers):
            p = free_pos[g]
            free.append(m if p < 0 else max(group_of_pos[p], self.need[k]))
        self.free = free
        # Previous gather of the same parameter: this one must follow its free.
        last_free: dict = {}
        for k, g in enumerate(self.gathers):
            d = c.ds_id[g]
            if d in last_free:
                self.lo[k] = min(self.need[k], max(self.lo[k], last_free[d] + 1))
            last_free[d] = max(last_free.get(d, -1), free[k])
        used = self.gathered_usage(self.need)
        # What the model of movable buffers does not cover, while each skeleton node runs:
        # ``rest`` (every other tensor) and ``fixed`` (gathered buffers that stay in the skeleton).
        # (Exact on DeepCompile-style graphs; where ops are wired so that the model counts a
        # buffer longer than the simulator does, the correction is clamped to stay conservative.)
        rest, fixed = [], []
        for j in range(m):
            pos = skeleton_pos[j]
            movable = min(used[j], res.gathered_memory[pos])
            rest.append(res.memory[pos] - movable)
            fixed.append(res.gathered_memory[pos] - movable)
        rest.append(rest[-1] if rest else c.resident_bytes)
        fixed.append(fixed[-1] if fixed else 0)
        self.rest, self.fixed = rest, fixed
        self.jit_gathered_peak = res.gathered_peak_bytes
        self.jit_peak = res.peak_bytes
        self.guard_floor = self.jit_peak
        self.largest_gather = max((c.size[g] for g in self.gathers), default=0)

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
        m = len(self.skeleton)
        late: list[list[int]] = [[] for _ in range(m + 1)]
        if behind:
            for j, v in enumerate(self.skeleton):
                if v in behind:
                    late[behind[v]].append(v)
        groups: list[list[int]] = [[] for _ in range(m + 1)]
        gathers = self.gathers
        for k in (range(len(gathers)) if rank is None else sorted(range(len(gathers)), key=rank.__getitem__)):
            groups[slots[k]].append(gathers[k])
        order: list[int] = []
        issue_pos = [0] * (m + 1)
        skeleton, waits = self.skeleton, self.wait_groups
        for j in range(m + 1):
            issue_pos[j] = len(order)
            if groups[j]:
                order.extend(groups[j])
            if late[j]:
                order.extend(late[j])
            if waits[j]:
                order.extend(waits[j])
            if j < m and not (behind and skeleton[j] in behind):
                order.append(skeleton[j])
        return order, issue_pos

    def reduces_behind(self, slots: list[int], rank: list[int] | None = None) -> dict[int, int]:
        """Step 6's variant: reduces that had not started when the next all-gather was issued, moved
        right behind that all-gather in the FIFO (the all-gather gates compute; a reduce gates
        nothing but the step's end). Returns {reduce node: slot}; empty when nothing would move.
        """
        c = self.compiled
        order, issue_pos = self._layout(slots, rank)
        res = c.simulate(order, detail=True, check=False)
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
        if budget < self.min_budget(scope):
            return False
        return scope == "all" or self.jit_peak <= self.all_tensor_cap(budget)

    def check_budget(self, budget: float, scope: str, need: int | None = None) -> None:
        need = self.min_budget(scope) if need is None else need
        if budget < need:
            what = "gathered parameters" if scope == "gathered" else "all tensors"
            raise DcschedError(
                f"memory budget {format_bytes(budget)} ({int(budget)} bytes) is too small for "
                f"{self.compiled.name or 'this graph'}: overlap needs at least {format_bytes(need)} "
                f"({need} bytes) of {what} (--budget-scope {scope}); pass --memory-budget {need} or more")

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
        self.check_budget(budget, scope)
        check_scope(scope)
        # Unlimited, every slot fits every buffer: no tree to keep (the placement rules are unchanged).
        tree = _MaxTree([-c for c in self.capacity(budget, scope)]) if budget != UNLIMITED else _NO_LIMIT
        size, lo_of, need, free = self.compiled.size, self.lo, self.need, self.free
        slots = [0] * len(self.gathers)
        order = list(sequence if sequence is not None else range(len(self.gathers)))
        classes = [order]
        if small_first:
            classes = [[k for k in order if size[self.gathers[k]] <= small_first],
                       [k for k in order if size[self.gathers[k]] > small_first]]

        def fit(k: int, after: int) -> int:
            lo, hi = max(lo_of[k], after), need[k]
            if lo >= hi:
                return hi
            blocked = tree.last_above(lo, hi, -size[self.gathers[k]])
            return lo if blocked < 0 else blocked + 1

        used: list[int] = []
        for pending in classes:
            pending = pending[::-1]  # a stack: the next all-gather is last
            prev = 0
            while pending:
                k = pending[-1]
                p = fit(k, prev)
                z = size[self.gathers[k]]
                for back in range(2, min(lookahead, len(pending) - 1) + 2):
                    j = pending[-back]
                    if size[self.gathers[j]] <= JUMP_RATIO * z:
                        continue
                    alone = fit(j, prev)
                    tree.add(p, free[k] + 1, z)
                    behind = fit(j, max(prev, p))
                    tree.add(p, free[k] + 1, -z)
                    if alone < behind:
                        del pending[-back]
                        pending.append(j)
                        k, p, z = j, alone, size[self.gathers[j]]
                        break
                pending.pop()
                if passing and p > max(lo_of[k], prev):
                    p, prev = self._pass(k, p, prev, pending, passing, fit, tree, slots, used)
                if z:
                    tree.add(p, free[k] + 1, z)
                slots[k] = p
                used.append(k)
                prev = max(prev, p)
        if small_first:  # the FIFO sequence is program order: by slot, then by need
            used.sort(key=lambda k: (slots[k], k))
        self.last_sequence = used
        return slots

    def _pass(self, k, p, prev, pending, passing, fit, tree, slots, used) -> tuple[int, int]:
        """Step 3b's *passing*: all-gather ``k``, held back by memory to slot ``p``, lets the next
        ``passing`` pending ones go first where each fits before ``p`` and leaves ``k`` waiting for
        no more compute (``work``: compute on the skeleton before a slot). Returns ``k``'s slot and
        the FIFO's last slot so far; the passers are placed (``slots``, ``used``, the tree)."""
        size, free, work = self.compiled.size, self.free, self.slot_work
        for j in [pending[-back] for back in range(1, min(passing, len(pending)) + 1)]:
            pj = fit(j, prev)
            if work[pj] >= work[p]:
                continue
            zj = size[self.gathers[j]]
            tree.add(pj, free[j] + 1, zj)
            after = fit(k, max(prev, pj))
            if work[after] > work[p] + 1e-12:
                tree.add(pj, free[j] + 1, -zj)
                continue
            pending.remove(j)
            slots[j] = pj
            used.append(j)
            prev, p = max(prev, pj), after
        return p, prev

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

    def delay(self, slots: list[int], rank: list[int] | None = None) -> tuple[list[int], SimResult]:
        """Step 4: move each all-gather as late as keeps the simulated timeline; returns slots and simulation.

        ``rank``: each all-gather's place in the FIFO sequence (default: need order).
        """
        order, issue_pos = self._layout(slots, rank)
        res = self.compiled.simulate(order, detail=True, check=False)
        # Compute clock when the program reaches each slot's all-gathers; when each starts.
        n = len(order)
        clock = [res.reach_ms[p] if p < n else res.step_ms for p in issue_pos]
        start_of = {}
        for pos, v in enumerate(order):
            if self.compiled.kind[v] == ALLGATHER:
                start_of[v] = res.start_ms[pos]
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


class Overlap:
    """The ``overlap`` scheduler on one graph: the best of three skeletons for each budget.

    Step 1 can start from fast-free's compute order, from the graph's own
    order, or from fast-free's with its side branches sunk
    (:func:`sink_readers`); each gives an :class:`OverlapPlanner`. For a
    budget, every planner that can meet it places its all-gathers (in need
    order and in step 3b's other sequences), and the order with the shortest
    simulated step wins (ties: fast-free's, which keeps activations shortest).
    """

    def __init__(self, view: nx.DiGraph | GraphForm, *, name: str | None = None):
        first = OverlapPlanner(view, name=name)
        second = OverlapPlanner(view, base="input", compiled=first.compiled, fast_free=first.fast_free_order)
        third = OverlapPlanner(view, base="sunk", compiled=first.compiled, fast_free=first.fast_free_order)
        second.guard_floor = third.guard_floor = first.jit_peak
        self.planners = [first, second, third]
        self.compiled = first.compiled
        self.fast_free = first.fast_free

    @property
    def largest_gather(self) -> int:
        return self.planners[0].largest_gather

    def min_budget(self, scope: str = "gathered") -> int:
        """The smallest budget this scheduler can meet (the smallest any skeleton meets)."""
        check_scope(scope)
        return min(p.smallest_feasible(scope) for p in self.planners)

    def plan(self, budget: float, scope: str = "gathered") -> tuple[list[int], SimResult]:
        """The chosen order (node numbers) and its simulation for ``budget`` bytes in ``scope``."""
        check_scope(scope)
        feasible = [p for p in self.planners if p.feasible(budget, scope)]
        if not feasible:  # raises, naming the smallest budget that works
            self.planners[0].check_budget(budget, scope, self.min_budget(scope))
        candidates = []
        for index, planner in enumerate(feasible):
            slots, timeline = planner.delay(planner.earliest(budget, scope))
            candidates.append((timeline.step_ms, index, slots, None, timeline))
        # Step 3b: other FIFO sequences (large before small, small first).
        for index, planner in enumerate(feasible):
            for lookahead, small, passing in FIFO_VARIANTS:
                small_first = max(1, planner.largest_gather // SMALL_FRACTION) if small else 0
                first = planner.earliest(budget, scope, lookahead=lookahead, small_first=small_first,
                                         passing=passing)
                sequence = planner.last_sequence
                if sequence == sorted(sequence):
                    continue
                rank = _ranks(sequence)
                slots, timeline = planner.delay(first, rank)
                candidates.append((timeline.step_ms, index, slots, rank, timeline))
        candidates.sort(key=lambda c: c[:2])
        step, index, slots, rank, timeline = candidates[0]
        improved = _reorder_fifo(feasible[index], budget, scope, timeline, rank)
        if improved is not None:
            step, slots, rank = improved
            candidates.insert(0, (step, index, slots, rank, None))
        # Step 6: the same placement with waiting reduces queued behind the next all-gather.
        planner = feasible[index]
        behind = planner.reduces_behind(slots, rank)
        if behind:
            order = planner._layout(slots, rank, behind)[0]
            result = self.compiled.simulate(order, detail=False, check=False)
            if result.step_ms < step - 1e-9 and self._fits(planner, result, budget, scope):
                return order, result
        for _, index, slots, rank, _ in candidates:
            order = feasible[index].assemble(slots, rank)
            result = self.compiled.simulate(order, detail=False, check=False)
            if self._fits(feasible[index], result, budget, scope):
                return order, result
        # The placement model is exact on DeepCompile-style graphs; should oddly wired ZeRO-3 ops
        # defeat it, gathering just in time always fits (the budget is at least its peak).
        order = feasible[0].assemble(feasible[0].need)
        return order, self.compiled.simulate(order, detail=False, check=False)

    @staticmethod
    def _fits(planner: OverlapPlanner, result: SimResult, budget: float, scope: str) -> bool:
        if scope == "all":
            return result.peak_bytes <= budget
        return result.gathered_peak_bytes <= budget and result.peak_bytes <= planner.all_tensor_cap(budget)

    def order(self, budget: float, scope: str = "gathered") -> list[str]:
        """The overlap order (node names) for ``budget`` bytes in ``scope``."""
        names = self.compiled.names
        return [names[i] for i in self.plan(budget, scope)[0]]


#: Step 5's effort: at most this many re-placements, each moving one all-gather at most WINDOW places,
#: for idle gaps of at least MIN_GAP of the step.
MAX_TRIALS = 8
WINDOW = 4
MIN_GAP = 0.002
#: Step 3b: a large all-gather may pass smaller ones (each at most 1/JUMP_RATIO of its size).
JUMP_RATIO = 4
#: Step 3b's placements tried beside plain need order: (lookahead, small all-gathers first, passing).
#: Small: at most 1/SMALL_FRACTION of the largest all-gather (a norm's weight beside a layer's matrix).
#: Passing: how many later all-gathers may go ahead of one that memory holds back.
FIFO_VARIANTS = ((1, False, 0), (2, False, 0), (0, True, 0), (0, False, 3))
SMALL_FRACTION = 64


def _ranks(sequence: list[int]) -> list[int]:
    """Each all-gather's place in the FIFO ``sequence``."""
    rank = [0] * len(sequence)
    for i, k in enumerate(sequence):
        rank[k] = i
    return rank


def _reorder_fifo(planner: OverlapPlanner, budget: float, scope: str, timeline: SimResult,
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
    for pos, v in enumerate(timeline.order):
        if kind[planner.compiled.index[v]] not in COMM_KINDS:
            continue
        k = k_of.get(planner.compiled.index[v])
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
            rank = _ranks(trial)
            slots, result = planner.delay(planner.earliest(budget, scope, trial), rank)
            if result.step_ms < best_step - 1e-9:
                best_step, best, sequence = result.step_ms, (result.step_ms, slots, rank), trial
                break
        if trials >= MAX_TRIALS:
            break
    return best
