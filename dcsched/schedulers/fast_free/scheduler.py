"""``fast-free``: DeepCompile's free-early all-gather scheduler, exact and fast.

The order is exactly the one DeepSpeed 0.19.8's ``fast_free_schedule`` gives
with no memory budget (see ``docs/schedulers.md``). In short, starting from
the placeholders, each round:

1. *Tier*: among the pending all-gathers, keep those whose last use depends on
   the fewest pending all-gathers (the all-gather itself included).
2. For each of them, the *path*: the unscheduled ancestors of the all-gather
   (depth-first, inputs in reading order, post-order), then those of its last
   use, then those of each of its parameter's releases. Score: the all-gathers
   the path schedules, the bytes gathered before and after the all-gather,
   the device time from the all-gather to the last use, the node name.
3. A candidate that needs no further all-gather before its last use runs its
   whole path (it gathers, uses and frees); if there is none, the best
   candidate only runs the path up to its all-gather.
4. Every reduce-grad, then every graph output, whose pending all-gathers are
   all scheduled now runs with its unscheduled ancestors.

What remains runs in input order at the end.

The implementation is incremental, so a round costs about what it changes,
not the size of the graph: a scheduled-mark array instead of rebuilt sets; the
candidates grouped by last use, a group's plain members as size buckets whose
largest competes as one candidate (:mod:`dcsched.schedulers.fast_free.groups`:
a fan-in of N parameters is N rounds of one candidate each, its free costs
summed for the whole bucket at once by :mod:`dcsched.schedulers.fast_free.free_costs`); the
pending all-gathers as one bitset (a Python int) and each last use's
all-gather ancestors as another, so a tier count is one ``&`` and a popcount
(kept packed, :mod:`dcsched.schedulers.fast_free.gather_sets`, so they take memory linear in the graph);
a lazily updated heap of lower bounds on the counts (a count can fall by at
most the number of all-gathers scheduled since it was taken); the all-gathers
at count 1 (their count stays 1 until they run) in a second such heap, keyed
by a lower bound on their score, so a parallel branch's all-gather that loses
round after round (an expert beside its siblings, a copy of a stacked graph)
is not scored again each round; candidate paths
cached until one of their nodes is scheduled, and kept for the candidates that
lost a tie (they usually tie again); a reduce or output waits on one
pending all-gather of its set at a time. Candidates tied on the integer parts
of their scores are told apart by the exact difference of their device-time
sums, from a backward search that stops where their paths merge; only a
difference within float rounding error makes the two paths be built and
summed in DeepSpeed's order (so float ties still break as in DeepSpeed).

>>> from dcsched.synthetic import layered_stack
>>> from dcsched.graph.nxview import to_networkx, check_order
>>> view = to_networkx(layered_stack(2).forward)
>>> from dcsched.graph.form import GraphForm
>>> order = fast_free(GraphForm(view)).order
>>> check_order(view, order)
"""

from __future__ import annotations

import heapq
import math


from dcsched.graph.lastuse import last_use_indices
from dcsched.graph.form import PLACEHOLDER, REDUCE, GraphForm, schedule_indexed
from dcsched.schedulers.fast_free.gather_sets import (EMPTY, Packed, allgather_ancestors, pack, packed_count,
                                                      total_size, union, unpack)
from dcsched.plan import Plan
from dcsched.schedulers.fast_free.free_costs import FOLDS_ARE_SEQUENTIAL
from dcsched.schedulers.fast_free.groups import SizeBuckets
from dcsched.schedulers.registry import register


@register("fast-free", description="DeepCompile's fast_free_schedule (DeepSpeed 0.19.8 order, no budget): "
                                   "gather the parameter that frees soonest, run it to its last use")
def fast_free(form: GraphForm) -> Plan:
    """DeepSpeed 0.19.8's ``fast_free_schedule`` order of ``form`` (no budget).

    Parameters
    ----------
    form : GraphForm
        The graph.

    Returns
    -------
    Plan
        The order (node names); no buckets, every parameter sharded.

    Examples
    --------
    >>> from dcsched.synthetic import layered_stack
    >>> fast_free(GraphForm(layered_stack(1).forward)).order[-1]
    'output'
    """
    return Plan(schedule_indexed(form, fast_free_indices))


class _Task:
    """A candidate all-gather's path and score, valid until one of its nodes is scheduled."""

    __slots__ = ("ag", "path", "until_ag", "free_acc", "key", "valid")

    def __init__(self, ag, path, until_ag, free_acc, key):
        self.ag = ag
        self.path = path
        self.until_ag = until_ag
        self.free_acc = free_acc
        self.key = key
        self.valid = True


def fast_free_indices(g: GraphForm) -> list[int]:
    """The fast-free order as input positions (see the module docstring)."""
    return FastFreeRun(g).run()


class FastFreeRun:
    """One run of fast-free over a graph form: the incremental state of the module docstring.

    ``run()`` returns the order; the other methods are its steps (a round's
    tier, choice and commit; the candidates' paths and their device-time
    comparison).
    """

    def __init__(self, g: GraphForm):
        n = len(g)
        self.g = g
        self.is_ag = is_ag = g.is_allgather()
        self.scheduled = bytearray(n)
        self.order: list[int] = []
        for i in range(n):
            if g.kind[i] == PLACEHOLDER:
                self.scheduled[i] = 1
                self.order.append(i)
        self.ags = [i for i in range(n) if is_ag[i] and not self.scheduled[i]]
        self.n_scheduled_ags = 0
        # Per-candidate paths (valid until one of their nodes runs) and the DFS stamp.
        self.tasks: dict[int, _Task] = {}
        self.watchers: dict[int, list[_Task]] = {}
        self.mark = [0] * n
        self.stamp = 0
        # The backward search's rank, computed on the first comparison (see _exclusive_times).
        self.rank: list[int] = []
        # A float sum of n terms in any order lies within sum_error of the exact sum
        # (recursive summation: gamma_{n-1} times the sum of magnitudes), so exact
        # sums further apart than twice that order the floats the same way.
        total_magnitude = math.fsum(abs(t) for t in g.time)
        unit = 2.0 ** -53
        self.sum_error = n * unit / (1 - n * unit) * total_magnitude if math.isfinite(total_magnitude) else math.inf
        if self.ags:
            self._index_allgathers()

    def _index_allgathers(self) -> None:
        """Last uses, the all-gather bitsets, the tier heap and the reduces and outputs waiting on gathers."""
        g, ags = self.g, self.ags
        preds, kind = g.preds, g.kind
        last_use, _ = last_use_indices(preds, g.aliasing)
        # An all-gather nobody reads is its own last use (DeepSpeed fails on it).
        self.last = last = {ag: (last_use[ag] if last_use[ag] is not None else ag) for ag in ags}
        self.releases = releases = g.releases_by_ds_id()
        # Bit b stands for an all-gather; bits go by the position of its last use, so a
        # set's highest pending bit is usually the all-gather of it that runs last.
        by_last = sorted(ags, key=lambda ag: (last[ag], ag))
        self.bit_of = bit_of = {ag: b for b, ag in enumerate(by_last)}
        reduces = [i for i in range(len(g)) if kind[i] == REDUCE]
        outputs = [p for p in preds[g.output] if kind[p] != REDUCE] if g.output is not None else []
        targets = set(last.values()) | set(reduces) | set(outputs) | set(ags)
        targets.update(r for rels in releases.values() for r in rels)
        targets.update(p for use in set(last.values()) for p in preds[use])
        # Packed sets (see pack): read through unpack.
        self.anc = anc = allgather_ancestors(g, bit_of, targets)
        # All-gathers among the ancestors of a parameter's releases (static).
        self.release_mask = {d: pack(union(unpack(anc[r]) for r in rels)) for d, rels in releases.items()}
        self.size_of_bit = [g.size[ag] for ag in by_last]
        self.pending = (1 << len(ags)) - 1
        # Sizes that are ints subtract exactly, and the buckets' free costs are DeepSpeed's sums where
        # Python's sum adds left to right; otherwise every member is scored alone, as DeepSpeed does.
        bucketed = FOLDS_ARE_SEQUENTIAL and self.sum_error != math.inf and min(g.time, default=0) >= 0 and \
            all(type(g.size[ag]) is int for ag in ags)
        self.groups = SizeBuckets(g, ags, last, anc, self.release_mask, bucketed=bucketed)
        # The tier heap: one entry per last use (its all-gathers share their count).
        self.heap = [(packed_count(anc[use]), use) for use in self.groups.members]
        heapq.heapify(self.heap)
        # The all-gathers whose count is 1 (only their own bit: it stays so until they run), with lower
        # bounds on their number of all-gathers scheduled (see _one_tier).
        self.one: list[tuple[int, int, int]] = []
        self.support: dict[int, Packed] = {}
        self.in_one = bytearray(len(g))
        # Candidates that lost a tie to a rival whose path shares none of theirs (see _break_tie).
        self.lost_tie = bytearray(len(g))
        self.n_one = 0
        # Reduces and outputs wait on one pending all-gather of their set at a time.
        self.waiting: dict[int, list[int]] = {}
        self.ready_now: list[int] = []
        for t in reduces + outputs:
            mask = unpack(anc[t])
            if mask:
                self.waiting.setdefault(mask.bit_length() - 1, []).append(t)
            else:
                self.ready_now.append(t)
        self.reduce_rank = {r: k for k, r in enumerate(reduces)}
        self.output_rank = {o: k for k, o in enumerate(outputs)}

    def run(self) -> list[int]:
        """The order: rounds until every all-gather ran, then the rest in input order."""
        while self.n_scheduled_ags < len(self.ags):
            tier = self._tier()
            chosen_ag, freeing = (self._choose_one(), True) if tier is None else self._choose(tier)
            if freeing:
                task = self.tasks.get(chosen_ag)
                if task is None or not task.valid:
                    task = self._make_task(chosen_ag)
                nodes = task.path
            else:
                nodes = self._requirements_of(chosen_ag)
            self.tasks.pop(chosen_ag, None)
            self._commit(nodes)
            self._run_ready()
        scheduled = self.scheduled
        self.order.extend(i for i in range(len(self.g)) if not scheduled[i])
        return self.order

    # -- one round ---------------------------------------------------------------
    def _tier(self) -> list[int] | None:
        """The last uses of the smallest count (pending all-gathers they wait for) among those of pending
        all-gathers; None when that count is 1: the tier is then :attr:`one`'s pending entries.

        All-gathers sharing a last use share its count, so the heap holds last uses. A heap entry's key
        minus the all-gathers scheduled so far is a lower bound on its current count. A last use found at
        count 1 has one pending all-gather, which moves to :attr:`one` for good (its own bit stays
        pending until it runs), so a candidate that loses round after round (a parallel branch's
        all-gather, an expert beside its siblings) is not counted again.
        """
        heap, anc, pending = self.heap, self.anc, self.pending
        done = self.n_scheduled_ags
        limit = 1 if self.n_one else None  # no count above it is in the tier
        best = None
        tier: list[int] = []
        evaluated = []
        while heap and (limit is None or heap[0][0] - done <= limit):
            _, use = heapq.heappop(heap)
            count = (unpack(anc[use]) & pending).bit_count()
            if count == 0:  # every all-gather it waits for ran
                continue
            member = self.groups.pending_member(use, self.scheduled)
            if member is None:  # its members ran; it waits on others' all-gathers
                continue
            if count == 1:
                self._join_one(member)
                if limit is None:
                    limit = 1
                continue
            evaluated.append((count + done, use))
            if best is None or count < best:
                best, tier = count, [use]
            elif count == best:
                tier.append(use)
            if limit is None or count < limit:
                limit = count
        for entry in evaluated:
            heapq.heappush(heap, entry)
        if self.n_one and (best is None or best > 1):
            return None
        return tier

    def _join_one(self, ag: int) -> None:
        """Move ``ag`` (count 1) to :attr:`one`, keyed by a lower bound on its score."""
        support = unpack(self.anc[self.last[ag]]) | unpack(self.release_mask.get(self.g.ds_id[ag], EMPTY))
        self.support[ag] = pack(support)
        n_ags = (support & self.pending).bit_count()
        heapq.heappush(self.one, (n_ags + self.n_scheduled_ags, self.g.size[ag], ag))
        self.in_one[ag] = 1
        self.n_one += 1

    def _choose_one(self) -> int:
        """:meth:`_choose` of the count-1 tier: every candidate frees, the score is (all-gathers the path
        schedules, the all-gather's bytes), then the device time and the name.

        The first part falls by at most one per all-gather scheduled, so
        :attr:`one`'s keys (the part plus the all-gathers scheduled when it was
        taken) are lower bounds as :meth:`_tier`'s are, and only the candidates
        that can still tie the best are scored again.
        """
        heap, scheduled, support, pending = self.one, self.scheduled, self.support, self.pending
        done = self.n_scheduled_ags
        best = None
        tied: list[int] = []
        evaluated = []
        while heap and (best is None or (heap[0][0] - done, heap[0][1]) <= best):
            _, size, ag = heapq.heappop(heap)
            if scheduled[ag]:
                continue
            n_ags = (unpack(support[ag]) & pending).bit_count()
            evaluated.append((n_ags + done, size, ag))
            score = (n_ags, size)
            if best is None or score < best:
                best, tied = score, [ag]
            elif score == best:
                tied.append(ag)
        for entry in evaluated:
            heapq.heappush(heap, entry)
        return self._break_tie(tied)

    def _choose(self, tier: list[int]) -> tuple[int, bool]:
        """The best candidate among the tier's last uses' pending all-gathers, and whether it frees (needs
        no other all-gather before its last use).

        Integer parts of the scores from the bitsets; the device-time sum
        (which needs the path) only when they tie.
        """
        # (free_acc, n_ags, ag_acc, ag), then (n_ags, ag_acc, ag) once only freeing ones are left
        scored: list[tuple[int, ...]] = []
        for use in tier:
            at_last = unpack(self.anc[use]) & self.pending  # holds each member's own bit
            best = self.groups.winner(use, self.scheduled, self._requirements_of)
            if best is not None:
                size, waited = self.g.size[best], self.groups.waited_bytes(use, at_last, self.size_of_bit)
                scored.append((waited - size, at_last.bit_count(), size, best))
            alone = self.groups.scored_alone[use]
            alone[:] = [ag for ag in alone if not self.scheduled[ag]]
            scored.extend(self._score(ag, at_last) for ag in alone)
        freeing = any(t[0] == 0 for t in scored)
        if freeing:
            scored = [(n_ags, ag_acc, ag) for free_acc, n_ags, ag_acc, ag in scored if free_acc == 0]
        best_int = min(t[:-1] for t in scored)
        return self._break_tie([t[-1] for t in scored if t[:-1] == best_int]), freeing

    def _score(self, ag: int, at_last: int) -> tuple[int, ...]:
        """``(free_acc, n_ags, ag_acc, ag)`` of a candidate, ``at_last`` its last use's pending all-gathers."""
        g, anc, pending, bit_of, size = self.g, self.anc, self.pending, self.bit_of, self.g.size
        if packed_count(anc[ag]) == 1:  # the usual case: no all-gather before this one
            before = at_last ^ (1 << bit_of[ag])
            ag_acc = size[ag]
        else:
            own = unpack(anc[ag]) & pending
            before = at_last & ~own
            ag_acc = total_size(own, self.size_of_bit)
        free_acc = total_size(before, self.size_of_bit) if before else 0
        n_ags = ((at_last | unpack(self.release_mask.get(g.ds_id[ag], EMPTY))) & pending).bit_count()
        return free_acc, n_ags, ag_acc, ag

    def _break_tie(self, tied: list[int]) -> int:
        """Of candidates tied on the integer parts of their scores, the one of least device time from the
        all-gather to its last use, then of least name (in any order of ``tied``: a total order)."""
        if len(tied) == 1:
            return tied[0]
        g, names = self.g, self.g.names
        if _equal_free_costs(tied, g, self.last, self.scheduled, self.anc, self.bit_of):
            return min(tied, key=names.__getitem__)
        chosen_ag = tied[0]
        for ag in tied[1:]:
            sign, disjoint = self._compare_free_costs(ag, chosen_ag)
            loser = ag
            if sign < 0 or (sign == 0 and names[ag] < names[chosen_ag]):
                loser, chosen_ag = chosen_ag, ag
            # A loser on a parallel branch (its path disjoint from the winner's) usually ties again: its path
            # stays valid until it runs, so it is worth caching. Where the paths share nodes (a tied
            # embedding's path holds all the compute not yet run), the winner's run invalidates it.
            if disjoint:
                self.lost_tie[loser] = 1
        return chosen_ag

    def _commit(self, nodes) -> None:
        """Run ``nodes``: mark them, drop the paths they invalidate, wake what waited on their all-gathers."""
        scheduled, order, watchers, is_ag = self.scheduled, self.order, self.watchers, self.is_ag
        for v in nodes:
            scheduled[v] = 1
            order.append(v)
            stale = watchers.pop(v, None)
            if stale:
                for task in stale:
                    task.valid = False
                    self.lost_tie[task.ag] = 0  # not a parallel branch after all
            if is_ag[v]:
                b = self.bit_of[v]
                self.pending &= ~(1 << b)
                self.n_scheduled_ags += 1
                if self.in_one[v]:
                    self.n_one -= 1
                for t in self.waiting.pop(b, ()):
                    mask = unpack(self.anc[t]) & self.pending
                    if mask:
                        self.waiting.setdefault(mask.bit_length() - 1, []).append(t)
                    else:
                        self.ready_now.append(t)

    def _run_ready(self) -> None:
        """Every reduce, then every output, whose all-gathers have all run, with its unscheduled ancestors."""
        ready = self.ready_now[:]
        self.ready_now.clear()
        for rank in (self.reduce_rank, self.output_rank):
            for t in sorted((t for t in ready if t in rank), key=rank.__getitem__):
                self._commit(self._requirements_of(t))

    # -- paths -------------------------------------------------------------------
    def _requirements_of(self, root: int) -> list[int]:
        """The unscheduled ancestors of ``root`` and ``root``, in post-order (a fresh stamp)."""
        self.stamp += 1
        path: list[int] = []
        self._requirements(root, path)
        return path

    def _requirements(self, root: int, out: list[int]) -> None:
        """Append to ``out`` the unscheduled ancestors of ``root`` not yet marked with the current stamp.

        Iterative post-order DFS, inputs in reading order.
        """
        scheduled, mark, stamp, preds = self.scheduled, self.mark, self.stamp, self.g.preds
        if scheduled[root] or mark[root] == stamp:
            return
        mark[root] = stamp
        stack = [root]
        cursor = [0]
        while stack:
            v = stack[-1]
            ins = preds[v]
            k = cursor[-1]
            pushed = False
            while k < len(ins):
                p = ins[k]
                k += 1
                if not scheduled[p] and mark[p] != stamp:
                    mark[p] = stamp
                    cursor[-1] = k
                    stack.append(p)
                    cursor.append(0)
                    pushed = True
                    break
            if not pushed:
                stack.pop()
                cursor.pop()
                out.append(v)

    def _make_task(self, ag: int) -> _Task:
        """``ag``'s path (its ancestors, its last use's, its releases') and DeepSpeed's score of it."""
        g, is_ag = self.g, self.is_ag
        time, size = g.time, g.size
        path = self._requirements_of(ag)
        until_ag = len(path)
        self._requirements(self.last[ag], path)
        until_last = len(path)
        for r in self.releases.get(g.ds_id[ag], ()):
            self._requirements(r, path)
        free_cost = sum([time[v] for v in path[until_ag:until_last]])
        ag_acc = sum([size[v] for v in path[:until_ag] if is_ag[v]])
        free_acc = sum([size[v] for v in path[until_ag:until_last] if is_ag[v]])
        n_ags = sum(1 for v in path if is_ag[v])
        key: tuple[float | str, ...]  # (free_acc dropped when 0), n_ags, ag_acc, free_cost, name
        if free_acc == 0:
            key = (n_ags, ag_acc, free_cost, g.names[ag])
        else:
            key = (free_acc, n_ags, ag_acc, free_cost, g.names[ag])
        task = _Task(ag, path, until_ag, free_acc, key)
        watchers = self.watchers
        for v in path:
            w = watchers.get(v)
            if w is None:
                watchers[v] = [task]
            else:
                w.append(task)
        return task

    def _task_of(self, ag: int) -> _Task:
        task = self.tasks.get(ag)
        if task is None or not task.valid:
            task = self.tasks[ag] = self._make_task(ag)
        return task

    def _has_task(self, ag: int) -> bool:
        task = self.tasks.get(ag)
        return task is not None and task.valid

    def _compare_free_costs(self, a: int, b: int) -> tuple[int, bool]:
        """Sign of free_cost(a) - free_cost(b), as DeepSpeed's float sums compare, and whether their
        paths were found disjoint (a search that walked both whole, as building them would).

        Decided from the exact difference of the two free paths, found by a
        backward search from both last uses that stops where their ancestors
        merge; only when that difference is within rounding error are the two
        paths built and summed in DeepSpeed's order.
        """
        # A candidate that lost a tie on a parallel branch usually ties again: its path is cached until
        # one of its nodes runs, and two cached sums compare as DeepSpeed's floats do. (Each such loss
        # came from a search that walked the whole path, so building it once costs no more.)
        lost = self.lost_tie
        if lost[a] and lost[b] or lost[a] and self._has_task(b) or lost[b] and self._has_task(a):
            return self._compare_cached_sums(a, b), True
        disjoint = False
        if self.sum_error != math.inf:
            time = self.g.time
            terms, disjoint = self._exclusive_times(a, b)
            for ag, sign in ((a, -1), (b, 1)):
                terms.extend(sign * time[v] for v in self._requirements_of(ag))
            diff = math.fsum(terms)
            if abs(diff) > 2.5 * self.sum_error:
                return (-1 if diff < 0 else 1), disjoint
        return self._compare_cached_sums(a, b), disjoint

    def _compare_cached_sums(self, a: int, b: int) -> int:
        """Sign of the two paths' device-time sums in DeepSpeed's order (building the paths not cached)."""
        fa, fb = self._task_of(a).key[-2], self._task_of(b).key[-2]
        return -1 if fa < fb else (1 if fa > fb else 0)

    def _exclusive_times(self, a: int, b: int) -> tuple[list, bool]:
        """Device times of the unscheduled ancestors of a's last use that are not
        ancestors of b's (positive), and the other way round (negative); and
        whether the two sets of ancestors are disjoint (the searches never met).

        The search pops nodes in reverse of a topological order that puts each
        node as late as it can go (depth-first post-order from the sinks), so a
        gather and its wait sit beside their reader rather than at the head of
        the graph, and two searches meet soon after their paths merge.
        """
        la, lb = self.last[a], self.last[b]
        terms: list = []
        if la == lb:
            return terms, False
        rank, time, preds, scheduled = self.rank, self.g.time, self.g.preds, self.scheduled
        if not rank:
            rank.extend(_late_topological_rank(self.g))
        label = {la: 1, lb: 2}
        heap = sorted([(-rank[la], la), (-rank[lb], lb)])
        open_count = 2  # entries in the heap reached from one side only
        disjoint = True
        while open_count:
            v = heapq.heappop(heap)[1]
            lab = label[v]
            if lab != 3:
                open_count -= 1
                terms.append(time[v] if lab == 1 else -time[v])
            for p in preds[v]:
                if scheduled[p]:
                    continue
                old = label.get(p)
                if old is None:
                    label[p] = lab
                    heapq.heappush(heap, (-rank[p], p))
                    if lab != 3:
                        open_count += 1
                elif old | lab != old:
                    label[p] = 3
                    open_count -= 1
                    disjoint = False
        return terms, disjoint


def _equal_free_costs(tied, g: GraphForm, last, scheduled, anc, bit_of) -> bool:
    """Whether the tied candidates' device-time sums are provably equal, without their paths.

    True when they share their last use L, each is a gather whose inputs are all
    scheduled and whose wait (reading only it) L reads directly, the waits are
    consecutive among L's inputs, cost 0, and the gathers cost the same and feed
    no other input of L. Then their free paths differ only by where the same
    gather time sits between zeros, so DeepSpeed's left-to-right sums are equal
    floats and the name decides. (The common case: a layer norm's weight and bias
    in a profiled graph, where waits cost 0.)
    """
    preds, succs, time = g.preds, g.succs, g.time
    use = last[tied[0]]
    inputs = preds[use]
    slot = {p: c for c, p in enumerate(inputs)}
    t0 = time[tied[0]]
    slots = []
    for ag in tied:
        if last[ag] != use or time[ag] != t0 or any(not scheduled[p] for p in preds[ag]):
            return False
        wait = next((u for u in succs[ag] if u in slot and preds[u] == (ag,)), None)
        if wait is None or time[wait] != 0:
            return False
        slots.append(slot[wait])
    slots.sort()
    if slots != list(range(slots[0], slots[0] + len(slots))):
        return False
    own = set(slots)
    mask = 0
    for ag in tied:
        mask |= 1 << bit_of[ag]
    return not any(unpack(anc[p]) & mask for c, p in enumerate(inputs) if c not in own)


def _late_topological_rank(g: GraphForm) -> list[int]:
    """Rank of each node in a depth-first post-order from the sinks (inputs in reading order).

    A topological order in which a node comes right before the first reader
    that needs it, not at its input position.
    """
    n = len(g)
    preds, succs = g.preds, g.succs
    rank = [-1] * n
    counter = 0
    roots = ([g.output] if g.output is not None else []) + [i for i in range(n) if not succs[i]]
    for root in roots:
        if rank[root] >= 0:
            continue
        rank[root] = -2  # on the stack
        stack = [(root, iter(preds[root]))]
        while stack:
            v, ins = stack[-1]
            for p in ins:
                if rank[p] == -1:
                    rank[p] = -2
                    stack.append((p, iter(preds[p])))
                    break
            else:
                stack.pop()
                rank[v] = counter
                counter += 1
    return rank

