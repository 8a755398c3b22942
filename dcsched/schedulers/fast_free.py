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
pending all-gathers as one bitset (a Python int) and each last use's
all-gather ancestors as another, so a tier count is one ``&`` and a popcount;
a lazily updated heap of lower bounds on the counts (a count can fall by at
most the number of all-gathers scheduled since it was taken); candidate paths
cached until one of their nodes is scheduled; a reduce or output waits on one
pending all-gather of its set at a time. Candidates tied on the integer parts
of their scores are told apart by the exact difference of their device-time
sums, from a backward search that stops where their paths merge; only a
difference within float rounding error makes the two paths be built and
summed in DeepSpeed's order (so float ties still break as in DeepSpeed).

>>> from dcsched.synthetic import layered_stack
>>> from dcsched.nxview import to_networkx, check_order
>>> view = to_networkx(layered_stack(2).forward)
>>> order = fast_free(view)
>>> check_order(view, order)
"""

from __future__ import annotations

import heapq
import math

import networkx as nx

from ..lastuse import last_use_indices
from ..graphform import PLACEHOLDER, REDUCE, GraphForm, schedule_indexed
from .registry import register


@register("fast-free", description="DeepCompile's fast_free_schedule (DeepSpeed 0.19.8 order, no budget): "
                                   "gather the parameter that frees soonest, run it to its last use")
def fast_free(view: nx.DiGraph) -> list[str]:
    return schedule_indexed(view, fast_free_indices)


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
    n = len(g)
    preds, kind, size, time, names = g.preds, g.kind, g.size, g.time, g.names
    is_ag = g.is_allgather()
    scheduled = bytearray(n)
    order: list[int] = []
    for i in range(n):
        if kind[i] == PLACEHOLDER:
            scheduled[i] = 1
            order.append(i)
    ags = [i for i in range(n) if is_ag[i] and not scheduled[i]]
    if not ags:
        order.extend(i for i in range(n) if not scheduled[i])
        return order

    last_use, _ = last_use_indices(preds, g.aliasing)
    # An all-gather nobody reads is its own last use (DeepSpeed fails on it).
    last = {ag: (last_use[ag] if last_use[ag] is not None else ag) for ag in ags}
    releases = g.releases_by_ds_id()

    # Bit b stands for an all-gather; bits go by the position of its last use, so a
    # set's highest pending bit is usually the all-gather of it that runs last.
    by_last = sorted(ags, key=lambda ag: (last[ag], ag))
    bit_of = {ag: b for b, ag in enumerate(by_last)}
    ag_of_bit = by_last

    reduces = [i for i in range(n) if kind[i] == REDUCE]
    outputs = []
    if g.output is not None:
        outputs = [p for p in preds[g.output] if kind[p] != REDUCE]
    release_list = [r for rels in releases.values() for r in rels]
    targets = set(last.values()) | set(reduces) | set(outputs) | set(ags) | set(release_list)
    targets.update(p for ag in ags for p in preds[last[ag]])
    anc = _allgather_ancestors(g, bit_of, targets)
    # All-gathers among the ancestors of a parameter's releases (static).
    release_mask: dict = {}
    for d, rels in releases.items():
        mask = 0
        for r in rels:
            mask |= anc[r]
        release_mask[d] = mask
    size_of_bit = [size[ag] for ag in ag_of_bit]
    own_bit = {ag: 1 << b for ag, b in bit_of.items()}

    pending = (1 << len(ags)) - 1
    n_scheduled_ags = 0
    heap = [((anc[last[ag]]).bit_count(), ag) for ag in ags]
    heapq.heapify(heap)

    # Reduces and outputs wait on one pending all-gather of their set at a time.
    waiting: dict[int, list[int]] = {}
    ready_now: list[int] = []
    for t in reduces + outputs:
        mask = anc[t]
        if mask:
            waiting.setdefault(mask.bit_length() - 1, []).append(t)
        else:
            ready_now.append(t)
    reduce_rank = {r: k for k, r in enumerate(reduces)}
    output_rank = {o: k for k, o in enumerate(outputs)}

    tasks: dict[int, _Task] = {}
    watchers: dict[int, list[_Task]] = {}
    mark = [0] * n
    stamp = 0

    def requirements(root: int, out: list[int]) -> None:
        # Iterative post-order DFS over unscheduled ancestors, inputs in reading order;
        # nodes already marked with the current stamp count as scheduled.
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

    def make_task(ag: int) -> _Task:
        nonlocal stamp
        stamp += 1
        path: list[int] = []
        requirements(ag, path)
        until_ag = len(path)
        requirements(last[ag], path)
        until_last = len(path)
        for r in releases.get(g.ds_id[ag], ()):
            requirements(r, path)
        free_cost = sum([time[v] for v in path[until_ag:until_last]])
        ag_acc = sum([size[v] for v in path[:until_ag] if is_ag[v]])
        free_acc = sum([size[v] for v in path[until_ag:until_last] if is_ag[v]])
        n_ags = sum(1 for v in path if is_ag[v])
        if free_acc == 0:
            key = (n_ags, ag_acc, free_cost, names[ag])
        else:
            key = (free_acc, n_ags, ag_acc, free_cost, names[ag])
        task = _Task(ag, path, until_ag, free_acc, key)
        for v in path:
            w = watchers.get(v)
            if w is None:
                watchers[v] = [task]
            else:
                w.append(task)
        return task

    # A float sum of n terms in any order lies within sum_error of the exact sum
    # (recursive summation: gamma_{n-1} times the sum of magnitudes), so exact
    # sums further apart than twice that order the floats the same way.
    total_magnitude = math.fsum(abs(t) for t in time)
    unit = 2.0 ** -53
    sum_error = n * unit / (1 - n * unit) * total_magnitude if math.isfinite(total_magnitude) else math.inf

    # The backward search pops nodes in reverse of a topological order that puts
    # each node as late as it can go (depth-first post-order from the sinks), so
    # a gather and its wait sit beside their reader rather than at the head of
    # the graph, and two searches meet soon after their paths merge.
    rank: list[int] = []  # computed on the first comparison

    def compare_free_costs(a: int, b: int, task_of) -> int:
        """Sign of free_cost(a) - free_cost(b), as DeepSpeed's float sums compare.

        Decided from the exact difference of the two free paths, found by a
        backward search from both last uses that stops where their ancestors
        merge; only when that difference is within rounding error are the two
        paths built and summed in DeepSpeed's order.
        """
        nonlocal stamp
        if sum_error != math.inf:
            terms = _exclusive_times(a, b)
            for ag, sign in ((a, -1), (b, 1)):
                stamp += 1
                until: list[int] = []
                requirements(ag, until)
                terms.extend(sign * time[v] for v in until)
            diff = math.fsum(terms)
            if abs(diff) > 2.5 * sum_error:
                return -1 if diff < 0 else 1
        fa, fb = task_of(a).key[-2], task_of(b).key[-2]
        return -1 if fa < fb else (1 if fa > fb else 0)

    def _exclusive_times(a: int, b: int) -> list:
        """Device times of the unscheduled ancestors of a's last use that are not
        ancestors of b's (positive), and the other way round (negative)."""
        la, lb = last[a], last[b]
        terms: list = []
        if la == lb:
            return terms
        if not rank:
            rank.extend(_late_topological_rank(g))
        label = {la: 1, lb: 2}
        heap = sorted([(-rank[la], la), (-rank[lb], lb)])
        open_count = 2  # entries in the heap reached from one side only
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
        return terms

    def commit(nodes) -> None:
        nonlocal pending, n_scheduled_ags
        for v in nodes:
            scheduled[v] = 1
            order.append(v)
            stale = watchers.pop(v, None)
            if stale:
                for task in stale:
                    task.valid = False
            if is_ag[v]:
                b = bit_of[v]
                pending &= ~(1 << b)
                n_scheduled_ags += 1
                for t in waiting.pop(b, ()):
                    mask = anc[t] & pending
                    if mask:
                        waiting.setdefault(mask.bit_length() - 1, []).append(t)
                    else:
                        ready_now.append(t)

    def run_ready() -> None:
        nonlocal stamp
        ready = ready_now[:]
        ready_now.clear()
        for group, rank in ((reduce_rank, reduce_rank), (output_rank, output_rank)):
            for t in sorted((t for t in ready if t in group), key=rank.__getitem__):
                stamp += 1
                path: list[int] = []
                requirements(t, path)
                commit(path)

    while n_scheduled_ags < len(ags):
        # The tier: pending all-gathers of the smallest count. A heap entry's key minus the
        # all-gathers scheduled so far is a lower bound on its current count.
        best = None
        tier: list[int] = []
        evaluated = []
        while heap and (best is None or heap[0][0] - n_scheduled_ags <= best):
            _, ag = heapq.heappop(heap)
            if scheduled[ag]:  # no longer pending
                continue
            count = (anc[last[ag]] & pending).bit_count()
            evaluated.append((count + n_scheduled_ags, ag))
            if best is None or count < best:
                best, tier = count, [ag]
            elif count == best:
                tier.append(ag)
        for entry in evaluated:
            heapq.heappush(heap, entry)

        # Integer parts of the scores from the bitsets; the device-time sum (which
        # needs the path) only when they tie.
        scored = []
        for ag in tier:
            at_last = anc[last[ag]] & pending  # holds the all-gather's own bit
            if anc[ag] == own_bit[ag]:  # the usual case: no all-gather before this one
                before = at_last ^ own_bit[ag]
                ag_acc = size[ag]
            else:
                own = anc[ag] & pending
                before = at_last & ~own
                ag_acc = _bytes(own, size_of_bit)
            free_acc = _bytes(before, size_of_bit) if before else 0
            n_ags = ((at_last | release_mask.get(g.ds_id[ag], 0)) & pending).bit_count()
            scored.append((free_acc, n_ags, ag_acc, ag))
        if any(t[0] == 0 for t in scored):
            scored = [(n_ags, ag_acc, ag) for free_acc, n_ags, ag_acc, ag in scored if free_acc == 0]
            freeing = True
        else:
            freeing = False
        best_int = min(t[:-1] for t in scored)
        tied = [t[-1] for t in scored if t[:-1] == best_int]
        if len(tied) == 1:
            chosen_ag = tied[0]
        else:
            def task_of(ag):
                task = tasks.get(ag)
                if task is None or not task.valid:
                    task = tasks[ag] = make_task(ag)
                return task
            if _equal_free_costs(tied, g, last, scheduled, anc, bit_of):
                chosen_ag = min(tied, key=names.__getitem__)
            else:
                chosen_ag = tied[0]
                for ag in tied[1:]:
                    sign = compare_free_costs(ag, chosen_ag, task_of)
                    if sign < 0 or (sign == 0 and names[ag] < names[chosen_ag]):
                        chosen_ag = ag
        if freeing:
            task = tasks.get(chosen_ag)
            if task is None or not task.valid:
                task = make_task(chosen_ag)
            nodes = task.path
        else:
            stamp += 1
            nodes = []
            requirements(chosen_ag, nodes)
        tasks.pop(chosen_ag, None)
        commit(nodes)
        run_ready()

    order.extend(i for i in range(n) if not scheduled[i])
    return order


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
    return not any(anc[p] & mask for c, p in enumerate(inputs) if c not in own)


def _bytes(mask: int, size_of_bit: list) -> int:
    """Total size of the all-gathers in a bitset."""
    total = 0
    while mask:
        low = mask & -mask
        total += size_of_bit[low.bit_length() - 1]
        mask ^= low
    return total


def _allgather_ancestors(g: GraphForm, bit_of: dict[int, int], targets: set[int]) -> dict[int, int]:
    """For each target node, the bitset of all-gathers among it and its ancestors."""
    n = len(g)
    preds, succs = g.preds, g.succs
    remaining = [len(s) for s in succs]
    bits = [0] * n
    found: dict[int, int] = {}
    for i in range(n):
        ins = preds[i]
        if len(ins) == 1:
            b = bits[ins[0]]
        else:
            b = 0
            for p in ins:
                b |= bits[p]
        own = bit_of.get(i)
        if own is not None:
            b |= 1 << own
        bits[i] = b
        if i in targets:
            found[i] = b
        for p in ins:
            remaining[p] -= 1
            if not remaining[p]:
                bits[p] = 0  # no reader left: let the int go
    return found


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
