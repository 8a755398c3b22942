"""Lower bounds on the step time beside the simulator's.

Through each communication node, at both ends of the step, and within a budget.

:mod:`dcsched.sim.simulate` reports ``lower_bound_ms`` = max(total compute, total
communication) and ``tight_lower_bound_ms`` (critical path; first
communication then the compute that depends on it; head, all communication,
tail). :func:`through_comm_bound` adds one bound per communication node ``c``:

    max(compute of c's ancestors, communication of c's ancestors)
    + duration(c)
    + max(compute of c's descendants, communication of c's descendants)

Proof (the simulator's model): the program reaches ``c`` only after every
ancestor has run; ancestor compute runs one node at a time on the compute
stream, so the compute clock is then at least the sum of its durations; an
ancestor communication precedes ``c`` in program order, so the FIFO
communication stream runs all of them, one at a time, before ``c`` starts.
Every descendant of ``c`` waits for ``c``: a direct reader is gated on ``c``
(or, being communication, queued behind it), and everything further down runs
after that reader; descendant compute then runs one at a time, and descendant
communication one at a time behind ``c``. No order can do better. For the first
all-gather of the forward graph this reads "the compute stream idles until the
first gather it needs has arrived, except for compute that needs no
parameter"; for the last reduce of the backward graph, "the last
communication is preceded by all the compute it depends on".

Computing it for every communication node costs O(C (N + E)); the bound uses
the ``limit`` nodes with the shortest chains before them and the ``limit``
with the shortest chains after them (those where it can bind), in one pass of
bitsets over the graph.

:func:`ends_bound` adds to the total compute the idle time the compute stream
cannot avoid before the first parameters arrive and the communication that
must follow the last compute (proof in its docstring); :func:`tight_bound` is
the largest of these and the simulator's. :func:`budget_bound` holds only for
orders within a memory budget.

>>> from dcsched.synthetic import layered_stack
>>> from dcsched.sim.simulate import compile_view
>>> c = compile_view(layered_stack(2).forward)
>>> through_comm_bound(c) >= max(c.compute_ms, c.comm_ms)
True
"""

from __future__ import annotations

import math

from dcsched.graph.form import ALLGATHER, COMM_KINDS, COMPUTE
from dcsched.sim.simulate import CompiledGraph


def through_comm_bound(compiled: CompiledGraph, limit: int = 48) -> float:
    """max over communication nodes ``c`` of the bound in the module docstring (ms)."""
    kind, dur, preds, succs, topo = compiled.kind, compiled.duration, compiled.preds, compiled.succs, compiled.topo
    n = len(kind)
    comm = [i for i in range(n) if kind[i] in COMM_KINDS]
    if not comm:
        return max(compiled.compute_ms, compiled.comm_ms)
    if len(comm) > 2 * limit:
        head = [0.0] * n
        for i in topo:
            head[i] = max((head[p] + dur[p] for p in preds[i]), default=0.0)
        tail = [0.0] * n
        for i in reversed(topo):
            tail[i] = max((tail[s] + dur[s] for s in succs[i]), default=0.0)
        by_head = sorted(comm, key=lambda i: (head[i], i))[:limit]
        by_tail = sorted(comm, key=lambda i: (tail[i], i))[:limit]
        comm = sorted(set(by_head) | set(by_tail))
    bit = {c: 1 << b for b, c in enumerate(comm)}
    # ancestors[i]: candidates that i descends from (i included); descendants likewise.
    below = [0] * n
    for i in topo:
        b = bit.get(i, 0)
        for p in preds[i]:
            b |= below[p]
        below[i] = b
    above = [0] * n
    for i in reversed(topo):
        b = bit.get(i, 0)
        for s in succs[i]:
            b |= above[s]
        above[i] = b
    k = len(comm)
    anc_compute, anc_comm = [0.0] * k, [0.0] * k
    desc_compute, desc_comm = [0.0] * k, [0.0] * k
    for i in range(n):
        d = dur[i]
        if not d:
            continue
        is_compute = kind[i] == COMPUTE
        if not is_compute and kind[i] not in COMM_KINDS:
            continue
        own = bit.get(i, 0)
        for mask, to_compute, to_comm in ((above[i] & ~own, anc_compute, anc_comm),
                                          (below[i] & ~own, desc_compute, desc_comm)):
            # i is an ancestor of the candidates in ``above[i]`` and a descendant of those in ``below[i]``
            for b in _bits(mask):
                if is_compute:
                    to_compute[b] += d
                else:
                    to_comm[b] += d
    best = 0.0
    for b, c in enumerate(comm):
        value = max(anc_compute[b], anc_comm[b]) + dur[c] + max(desc_compute[b], desc_comm[b])
        if value > best:
            best = value
    return max(best, compiled.compute_ms, compiled.comm_ms)


def tight_bound(compiled: CompiledGraph) -> float:
    """The tightest of the simulator's bound, :func:`through_comm_bound` and :func:`ends_bound` (ms)."""
    return max(compiled.bounds.tight, through_comm_bound(compiled), ends_bound(compiled))


def ends_bound(compiled: CompiledGraph, heads: int = 24, tails: int = 8) -> float:
    """Total compute plus the compute stream's forced idle at the start and the communication forced after its end.

    In milliseconds.

    Every order's step is at least ``C + H(v) + L(Q)`` (``C`` the total compute;
    either term may be left out), for a gated node ``v`` and a set ``Q`` of one
    or two communication nodes that all descend from ``v``:

    *Head.* The compute that runs before ``v`` starts is a set ``X`` of
    non-descendants of ``v``, closed under ancestors; every communication
    ancestor of ``v`` or of ``X`` has run, one at a time from time 0, by then.
    So the compute stream idled at least ``M(anc(v) + anc(X)) - d(X)`` before
    ``v``, and ``H(v)`` is the least of that over all such ``X`` (``d`` compute
    durations, ``M`` communication durations).

    *Tail.* Let ``q`` be the last of ``Q`` in program order and ``K`` the
    compute after it: no ancestor of any node of ``Q``, closed under
    descendants. ``q`` is issued once the compute before it has run (``C -
    d(K)`` plus the idle before, which includes ``H(v)`` as ``v`` precedes
    ``q``), and then ``q`` and every communication descendant of ``K`` run one
    at a time on the FIFO stream. So the step is at least ``C + H(v) + d(q) +
    M(desc(K)) - d(K)``, and ``L(Q)`` is the least over ``q`` in ``Q`` and
    all such ``K``. With ``Q`` = the two gradient reduces of a tied-size
    embedding and LM head, ``L(Q)`` says that one of the two is reduced after
    all the compute that can follow it, which is less than its own duration.

    Both minima are max-weight closure problems (compute gains its duration,
    communication costs its own), solved exactly by a minimum cut
    (:func:`max_selection`) over the compute nodes grouped by their
    communication ancestors (head) or descendants (tail). Candidates: the
    ``heads`` gated nodes with the least compute on a path before them, and
    for ``Q`` the singletons and pairs of the ``tails`` longest and the
    ``tails`` last communication nodes (any candidates give a valid bound).

    >>> from dcsched.synthetic import layered_stack
    >>> from dcsched.sim.simulate import compile_view
    >>> c = compile_view(layered_stack(2).backward)
    >>> ends_bound(c) >= c.compute_ms
    True
    """
    return _Ends(compiled, heads, tails).value()


class _Ends:
    """Bitsets over the communication nodes and the candidates, for :func:`ends_bound`."""

    def __init__(self, compiled: CompiledGraph, heads: int, tails: int):
        self.c = compiled
        kind, dur, preds, succs, topo = compiled.kind, compiled.duration, compiled.preds, compiled.succs, compiled.topo
        n = len(kind)
        self.comm = comm = [i for i in topo if kind[i] in COMM_KINDS]
        bit = {x: b for b, x in enumerate(comm)}
        canc, cdesc, chain = [0] * n, [0] * n, [0.0] * n  # communication ancestors / descendants (strict)
        for i in topo:
            m, longest = 0, 0.0
            for p in preds[i]:
                m |= canc[p] | (1 << bit[p] if p in bit else 0)
                longest = max(longest, chain[p] + (dur[p] if kind[p] == COMPUTE else 0.0))
            canc[i], chain[i] = m, longest
        for i in reversed(topo):
            m = 0
            for s in succs[i]:
                m |= cdesc[s] | (1 << bit[s] if s in bit else 0)
            cdesc[i] = m
        self.cost = [dur[i] for i in comm]
        # A wait or a view is dominated by the compute reading it (its ancestors and more): heads are compute.
        gated = sorted((i for i in topo if kind[i] == COMPUTE and compiled.gates[i]), key=lambda i: (chain[i], i))
        gated = gated[:4 * heads]
        self.heads = sorted(gated, key=lambda i: (chain[i] - self.comm_ms(canc[i]), i))[:heads]
        hbit = {v: j for j, v in enumerate(self.heads)}
        below = [0] * n  # head candidates each node descends from (or is)
        for i in topo:
            m = 1 << hbit[i] if i in hbit else 0
            for p in preds[i]:
                m |= below[p]
            below[i] = m
        slowest = sorted(comm, key=lambda i: (-dur[i], i))[:tails]
        self.tails = list(dict.fromkeys(slowest + comm[-tails:]))
        self.bit, self.canc, self.cdesc, self.below = bit, canc, cdesc, below
        self.head_groups: dict[tuple[int, int], float] = {}
        self.tail_groups: dict[int, float] = {}
        for i in range(n):
            if kind[i] == COMPUTE and dur[i] > 0:
                key = (canc[i], below[i])
                self.head_groups[key] = self.head_groups.get(key, 0.0) + dur[i]
                self.tail_groups[cdesc[i]] = self.tail_groups.get(cdesc[i], 0.0) + dur[i]

    def comm_ms(self, mask: int) -> float:
        cost = self.cost
        return sum(cost[b] for b in _bits(mask))

    def head(self, j: int) -> float:
        """H of the j-th head candidate (0 where it cannot be positive)."""
        own = self.canc[self.heads[j]]
        groups: dict[int, float] = {}
        for (ancestors, below), d in self.head_groups.items():
            if not (below >> j) & 1:
                key = ancestors & ~own
                groups[key] = groups.get(key, 0.0) + d
        wait = self.comm_ms(own)
        if wait <= groups.get(0, 0.0):  # the compute that needs no more communication fills it
            return 0.0
        return max(0.0, wait - max_selection(groups, self.cost))

    def value(self) -> float:
        c = self.c
        if not self.comm:
            return c.compute_ms
        heads = [self.head(j) for j in range(len(self.heads))]
        best = max(heads + [0.0])
        tails = self.tails
        items = list(self.tail_groups.items())
        net = [gain - self.comm_ms(mask) for mask, gain in items]
        standalone = sorted((k for k in range(len(items)) if net[k] > 0), key=lambda k: (-net[k], k))
        for q in [(x,) for x in tails] + [(a, b) for k, a in enumerate(tails) for b in tails[k + 1:]]:
            mask, common = 0, -1
            for x in q:
                mask |= 1 << self.bit[x]
                common &= self.below[x]
            before = max([0.0] + [h for j, h in enumerate(heads) if (common >> j) & 1])
            last = min(c.duration[x] for x in q)
            # A greedy choice of what can follow q bounds the exact one from below: skip the cut where even
            # that leaves nothing above the best so far.
            chosen, union = 0.0, 0
            for k in standalone:
                m, gain = items[k]
                if not m & mask:
                    extra = gain - self.comm_ms(m & ~union)
                    if extra > 0:
                        chosen, union = chosen + extra, union | m
            if before + last - chosen <= best:
                continue
            groups = {m: d for m, d in items if not m & mask}
            best = max(best, before + last - max_selection(groups, self.cost))
        return c.compute_ms + best


def max_selection(groups: dict[int, float], cost: list[float]) -> float:
    """max over sets S of ``groups`` (bitset -> gain) of the gains in S less the ``cost`` of every bit S's bitsets hold.

    A max-weight closure on a bipartite graph: the minimum cut between a source
    joined to each group (capacity: its gain) and a sink joined from each bit
    (capacity: its cost), group to bit unbounded, is what the best set gives
    up. Dinic's algorithm, O(V^2 E) at worst, on graphs of a few hundred nodes.

    >>> max_selection({0b01: 5.0, 0b11: 1.0, 0: 2.0}, [3.0, 4.0])
    4.0
    """
    total = sum(gain for mask, gain in groups.items() if not mask)
    items = [(mask, gain) for mask, gain in groups.items() if mask and gain > 0]
    if not items:
        return total
    bits = sorted({b for mask, _ in items for b in _bits(mask)})
    flow = _MaxFlow(2 + len(items) + len(bits))
    sink = 1
    node_of = {b: 2 + len(items) + k for k, b in enumerate(bits)}
    for k, (mask, gain) in enumerate(items):
        flow.edge(0, 2 + k, gain)
        for b in _bits(mask):
            flow.edge(2 + k, node_of[b], math.inf)
    for b, node in node_of.items():
        flow.edge(node, sink, cost[b])
    return total + max(0.0, sum(gain for _, gain in items) - flow.max_flow(0, sink))


class _MaxFlow:
    """Dinic's maximum flow on float capacities (edge e's reverse is e ^ 1)."""

    def __init__(self, n: int):
        self.adj: list[list[int]] = [[] for _ in range(n)]
        self.to: list[int] = []
        self.cap: list[float] = []

    def edge(self, a: int, b: int, capacity: float) -> None:
        for x, y, c in ((a, b, capacity), (b, a, 0.0)):
            self.adj[x].append(len(self.to))
            self.to.append(y)
            self.cap.append(c)

    def max_flow(self, s: int, t: int) -> float:
        total = 0.0
        while True:
            level = self._levels(s)
            if level[t] < 0:
                return total
            nxt = [0] * len(self.adj)
            while True:
                pushed = self._push(s, t, math.inf, level, nxt)
                if pushed <= FLOW_EPS:
                    break
                total += pushed

    def _levels(self, s: int) -> list[int]:
        level = [-1] * len(self.adj)
        level[s] = 0
        queue = [s]
        for x in queue:
            for e in self.adj[x]:
                y = self.to[e]
                if self.cap[e] > FLOW_EPS and level[y] < 0:
                    level[y] = level[x] + 1
                    queue.append(y)
        return level

    def _push(self, x: int, t: int, limit: float, level: list[int], nxt: list[int]) -> float:
        """One augmenting path of the level graph from ``x`` (depth 3 to 5 here, so recursion is shallow)."""
        if x == t:
            return limit
        adj, to, cap = self.adj[x], self.to, self.cap
        while nxt[x] < len(adj):
            e = adj[nxt[x]]
            y = to[e]
            if cap[e] > FLOW_EPS and level[y] == level[x] + 1:
                pushed = self._push(y, t, min(limit, cap[e]), level, nxt)
                if pushed > FLOW_EPS:
                    cap[e] -= pushed
                    cap[e ^ 1] += pushed
                    return pushed
            nxt[x] += 1
        return 0.0


#: Flow below this (ms) counts as none (float residue of subtracted capacities).
FLOW_EPS = 1e-12


def budget_bound(compiled: CompiledGraph, budget: float, window: int = 8) -> float:
    """A lower bound on the step time of every order whose gathered memory stays within ``budget`` bytes (ms).

    The bound behind "out of reach" in issue 5's benchmark: when two large
    gathered parameters fill the budget, a small one needed between their
    readers cannot be prefetched, so either the second large gather or the
    small ones are exposed. Two kinds of forced idle time of the compute
    stream are added up along a chain of compute nodes:

    *Head.* A compute node ``v`` cannot start before every all-gather that
    ``v`` or one of its ancestors reads has run, one at a time, from time 0.

    *Pair.* For compute nodes ``u`` and ``v`` (``v`` a descendant of ``u``),
    ``W`` an all-gather ``v`` reads and ``T`` the all-gathers read between
    them (by descendants of ``u`` that are ancestors of ``v``) that do not
    fit beside ``W`` and ``u``'s own parameters, every order has

        start(v) - end(u) >= min(duration(W), total duration of T)

    Proof (the simulator's model; gathered memory is counted at each program
    position, a gathered buffer lives from its all-gather to the release that
    frees it, or to its last reader). Either ``W`` is issued after ``u``: it
    starts no earlier than ``u`` ends (the program issues it after ``u`` ran)
    and ``v`` waits for it. Or ``W`` is issued before ``u``: then at ``u``'s
    position ``W`` and ``u``'s own parameters are live, and any ``t`` in
    ``T`` issued before ``u`` would be live too, over the budget; so every
    ``t`` is issued after ``u`` ends, they run one at a time on the
    communication stream, and ``v`` waits for all of them.

    *Chain.* For ``v_0, (u_1, v_1), (u_2, v_2), ...`` with each ``u_i`` a
    descendant-or-self of ``v_{i-1}`` and ``v_i`` of ``u_i``, the intervals
    ``[0, start(v_0)]`` and ``[end(u_i), start(v_i)]`` are disjoint. Inside
    the head interval only compute that is not a descendant of ``v_0`` can
    run, inside a pair's only compute that is neither an ancestor of ``u_i``
    nor a descendant of ``v_i``. The compute stream runs all compute one node
    at a time, so

        step >= total compute + sum over the chain of max(0, gap - compute that fits in it)

    (a node that fits in several gaps is subtracted from each: the bound only
    gets weaker). The best chain is found by dynamic programming over the
    readers of gathered parameters in topological order, trying the
    ``window`` readers before each ``v`` as its ``u``.

    Cost: ancestor and descendant bitsets for every node, O(N^2) bits (about
    60 MB and 1 s at 17,000 nodes, the 80-layer Llama backward graph); meant
    for analysis and benchmarks, not for a scheduler's inner loop.

    >>> from dcsched.synthetic import layered_stack
    >>> from dcsched.sim.simulate import compile_view
    >>> c = compile_view(layered_stack(2).forward)
    >>> budget_bound(c, float("inf")) >= c.compute_ms
    True
    """
    return _BudgetBound(compiled, budget).value(window)


class _BudgetBound:
    """The bitsets and tables :func:`budget_bound` works from, and its steps as methods."""

    def __init__(self, compiled: CompiledGraph, budget: float):
        self.c = compiled
        self.budget = budget
        kind, dur, topo, preds, succs = compiled.kind, compiled.duration, compiled.topo, compiled.preds, compiled.succs
        n = len(kind)
        self.gathers_read = [tuple(g for g in compiled.gates[i] if kind[g] == ALLGATHER) if kind[i] == COMPUTE
                             else () for i in range(n)]
        self.readers_of: dict[int, list[int]] = {}
        for i in range(n):
            for r in compiled.reads[i]:
                if kind[r] == ALLGATHER:
                    self.readers_of.setdefault(r, []).append(i)
        self.releases_of = compiled.releases_by_ds_id()
        # ancestors-or-self / descendants-or-self of every node, as bitsets over node numbers.
        self.anc = anc = [0] * n
        for i in topo:
            b = 1 << i
            for p in preds[i]:
                b |= anc[p]
            anc[i] = b
        self.desc = desc = [0] * n
        for i in reversed(topo):
            b = 1 << i
            for s in succs[i]:
                b |= desc[s]
            desc[i] = b
        compute_mask = 0
        for i in range(n):
            if kind[i] == COMPUTE and dur[i] > 0:
                compute_mask |= 1 << i
        self.compute_mask = compute_mask
        self.readers = [i for i in topo if self.gathers_read[i]]
        self.dependents: dict[int, int] = {}

    def value(self, window: int) -> float:
        """Total compute plus the best chain of forced idle intervals (dynamic programming over the readers)."""
        c, readers, anc, desc, gathers_read = self.c, self.readers, self.anc, self.desc, self.gathers_read
        dur = c.duration
        if len(c) == 0:
            return 0.0
        if self.budget == float("inf") or not readers:
            return c.compute_ms
        # reach[i]: the best chain ending at i or at one of its ancestors (where a next pair may start).
        reach = [0.0] * len(c)
        position = {v: k for k, v in enumerate(readers)}
        for i in c.topo:
            inherited = max((reach[p] for p in c.preds[i]), default=0.0)
            k = position.get(i)
            if k is not None:
                value = 0.0
                if k < HEAD_READERS:
                    needed = dict.fromkeys(g for x in readers[:k + 1] if (anc[i] >> x) & 1 for g in gathers_read[x])
                    head = sum(dur[g] for g in needed)
                    value = head - self.weight(self.compute_mask & ~desc[i], head)
                for at_u in range(max(0, k - window), k):
                    u = readers[at_u]
                    if not (desc[u] >> i) & 1:
                        continue
                    idle = self.pair_idle(at_u, k)
                    if idle > 0:
                        value = max(value, reach[u] + idle)
                inherited = max(inherited, value)
            reach[i] = inherited
        return c.compute_ms + max(reach)

    def weight(self, mask: int, limit: float) -> float:
        """Total compute duration of the nodes in ``mask`` (stops counting past ``limit``)."""
        dur = self.c.duration
        total = 0.0
        for x in _bits(mask):
            if total >= limit:
                break
            total += dur[x]
        return total

    def released_within(self, g: int, mask: int) -> bool:
        """Whether every release of ``g``'s parameter is in ``mask``."""
        return all((mask >> r) & 1 for r in self.releases_of.get(self.c.ds_id[g], ()))

    def held_through(self, g: int, u: int) -> bool:
        """Whether ``g``, issued before ``u``, is still live at ``u``.

        No release of its parameter can come before u, and something at or
        after u reads it (a buffer no release frees lives until its last reader).
        """
        desc = self.desc
        if not self.released_within(g, desc[u] & ~(1 << u)):
            return False
        return any((desc[u] >> r) & 1 for r in self.readers_of.get(g, ()))

    def depends_on(self, g: int) -> int:
        """Bitset of the nodes that cannot start before all-gather ``g`` has finished."""
        if g not in self.dependents:
            mask = 0
            for r in self.readers_of.get(g, ()):
                mask |= self.desc[r]
            self.dependents[g] = mask
        return self.dependents[g]

    def pair_idle(self, at_u: int, at_v: int) -> float:
        """The compute stream's forced idle time between readers[at_u] ending and readers[at_v] starting."""
        readers, gathers_read, alloc, dur = self.readers, self.gathers_read, self.c.alloc, self.c.duration
        u, v = readers[at_u], readers[at_v]
        own = [g for g in gathers_read[u] if self.held_through(g, u)]
        live = sum(alloc[g] for g in own)
        between = self.desc[u] & self.anc[v]
        candidates = dict.fromkeys(g for x in readers[at_u + 1:at_v + 1] if (between >> x) & 1
                                   for g in gathers_read[x] if g not in own)
        nearby = [g for g in candidates if self.held_through(g, u)]
        fill = self.compute_mask & ~self.anc[u] & ~self.desc[v]  # compute that could run between them
        best = 0.0
        for w in gathers_read[v]:
            if w in own or not self.held_through(w, u):
                continue
            room = self.budget - live - alloc[w]
            late = [t for t in nearby if t != w and alloc[t] > room]
            if not late:
                continue
            # Case W issued after u: idle >= duration(W) - compute not waiting for W.
            issued_after = dur[w] - self.weight(fill & ~self.depends_on(w), dur[w])
            # Case W issued before u: every t in ``late`` is issued after u; idle >= their total
            # duration - compute that can run before the last of them ends.
            exposed = sum(dur[t] for t in late)
            waits_for_all = -1
            for t in late:
                waits_for_all &= self.depends_on(t)
            issued_before = exposed - self.fill_beside(u, fill & ~waits_for_all, exposed, own, w, late, room)
            best = max(best, min(issued_after, issued_before))
        return best

    def fill_beside(self, u: int, mask: int, limit: float, own, w, late, room) -> float:
        """Compute in ``mask`` that can run while the ``late`` all-gathers run (case "W before u").

        A node that also needs another all-gather too large to be live beside u's parameters and W
        (so issued after u as well, on the same stream) fills at most what that all-gather adds to
        the wait: its group counts max(0, compute - that all-gather's duration).
        """
        desc, gathers_read, alloc, dur = self.desc, self.gathers_read, self.c.alloc, self.c.duration
        plain = 0.0
        groups: dict[int, float] = {}
        skip = set(own) | set(late) | {w}
        for x in _bits(mask):
            if plain >= limit:
                break
            # Run after u, x keeps g live at u's position if issued before it: so g is issued after u.
            later = (desc[u] | desc[x]) & ~(1 << u) & ~(1 << x)
            extra = [g for g in gathers_read[x] if g not in skip and alloc[g] > room and self.released_within(g, later)]
            if len(extra) == 1:
                groups[extra[0]] = groups.get(extra[0], 0.0) + dur[x]
            else:
                plain += dur[x]
        return plain + sum(max(0.0, total - dur[g]) for g, total in groups.items())


#: budget_bound tries a head interval before each of the first this many readers of gathered parameters.
HEAD_READERS = 32


def _bits(mask: int):
    """The set bits of ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low
