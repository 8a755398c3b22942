"""A lower bound on the step time through each communication node, beside the simulator's.

:mod:`dcsched.simulate` reports ``lower_bound_ms`` = max(total compute, total
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

>>> from dcsched.synthetic import layered_stack
>>> from dcsched.simulate import compile_view
>>> c = compile_view(layered_stack(2).forward)
>>> through_comm_bound(c) >= max(c.compute_ms, c.comm_ms)
True
"""

from __future__ import annotations

from .simulate import COMM_KINDS, COMPUTE, CompiledGraph


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
            while mask:
                low = mask & -mask
                b = low.bit_length() - 1
                if is_compute:
                    to_compute[b] += d
                else:
                    to_comm[b] += d
                mask ^= low
    best = 0.0
    for b, c in enumerate(comm):
        value = max(anc_compute[b], anc_comm[b]) + dur[c] + max(desc_compute[b], desc_comm[b])
        if value > best:
            best = value
    return max(best, compiled.compute_ms, compiled.comm_ms)


def tight_bound(compiled: CompiledGraph) -> float:
    """The tighter of the simulator's bound and :func:`through_comm_bound` (ms)."""
    return max(compiled.bounds.tight, through_comm_bound(compiled))
