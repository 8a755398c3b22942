"""``fsdp``: FSDP2's policy, one all-gather bucket per transformer block, prefetched one block ahead.

PyTorch FSDP2 (``fully_shard`` on each transformer block, then on the model)
makes each block one unit: its parameters are gathered by one collective
before the block runs, the next block's gather is issued when a block starts
(prefetch one block ahead), and in the backward the block's gradients are
reduced by one collective once the block's backward is done. The model's own
unit, the *root*, holds every parameter outside the blocks (embeddings, final
norm, head): gathered first, and not resharded after the forward (FSDP2's
heuristic: the backward would gather it again at once), so the backward
issues no all-gather of it; its gradients are reduced as one at the
backward's end. This module gives that policy as a step's
:class:`~dcsched.plan.Plan` s: buckets, and the root ``'kept'``.

**Finding the units.** A :class:`~dcsched.graph.form.GraphForm` knows each
parameter's ``ds_id`` and sizes, not its module name, so units are found from
the forward's structure (:func:`blocks`): the all-gathers are taken in the
order the parameters are first read (:func:`need_positions`) and their byte
sizes searched for the
period ``p`` (2 to :data:`MAX_BLOCK_PARAMS`) at which most of the sizes (at
least :data:`PERIOD_MATCH`) repeat ``p`` places later: a stack of identical
blocks. The periodic stretch is cut into blocks of ``p`` all-gathers; what
comes before and after it is the root (:func:`root_and_blocks`). With no
period, buckets of about ``sqrt(n)`` consecutive all-gathers stand in for
blocks, and there is no root. The backward gathers and reduces each unit's
parameters as the forward's units say, matched by ``ds_id``
(:func:`step_blocks`), the blocks in the order that graph first reads them
(the backward needs the last block first).

**The order.** The input order with every all-gather and its wait moved to
just before the first node that reads the gathered parameter
(:func:`just_in_time`: DeepCompile's graphs issue every all-gather near the
top, which would hold the whole model gathered beside the backward's
activations), then each all-gather bucket moved (its members one after
another) to where the previous bucket's first member stands: bucket k+1 is
issued when block k's parameters are first needed. The first two buckets go
before the first use. Waits stay where they are, so a block's compute waits
for its bucket. Each reduce bucket moves to where its last
member stood (every gradient of the block is ready there); the output comes
last. A member whose inputs would not have run at its bucket's place (none in
DeepCompile graphs) stays alone at its own place.

>>> from dcsched.synthetic import layered_stack
>>> stack = layered_stack(2)
>>> forms = {"forward": GraphForm(stack.forward), "backward": GraphForm(stack.backward)}
>>> plans = fsdp(forms)
>>> forms["forward"].check_order(list(plans["forward"].order))
>>> len(plans["forward"].buckets) < sum(1 for k in forms["forward"].kind if k == ALLGATHER)
True
"""

from __future__ import annotations

import dataclasses
import math
from typing import Hashable, Iterable, Mapping, Sequence

from dcsched.graph.form import ALLGATHER, REDUCE, WAIT, GraphForm, paused_gc
from dcsched.plan import Bucket, Plan
from dcsched.schedulers.registry import register
from dcsched.schedulers.fsdp.bucketing import Placement, bucketed, placement  # noqa: F401  (re-exported)

#: The most parameters one block may hold (the longest period searched).
MAX_BLOCK_PARAMS = 64
#: The share of sizes that must repeat one period later for a period to count as the block length.
PERIOD_MATCH = 0.7
#: How much less of a share a divisor of the best period may match and still be the block length (blocks that
#: differ a little, e.g. one layer of another width, are blocks still: FSDP2 wraps every layer).
DIVISOR_SLACK = 0.05


def blocks(keys: Sequence[Hashable]) -> list[tuple[int, int]]:
    """Cut a sequence of parameters (each by a key, e.g. its bytes) into blocks: ``(start, end)`` ranges.

    The period ``p`` in 2..:data:`MAX_BLOCK_PARAMS` (and at most half the
    sequence) at which the largest share of the keys, at least
    :data:`PERIOD_MATCH`, equal the key ``p`` places later (ties: the shortest)
    is the block length (a weight and bias pair repeats at 2, a block at its
    length, more often), or the shortest divisor of it whose share is at most
    :data:`DIVISOR_SLACK` less (blocks alike but for one that differs a little
    repeat best in pairs, yet each is a block). The blocks start where the
    first run of repeats starts; what comes before is one block, the rest
    after the last whole block another. No period: blocks of ``ceil(sqrt(n))``.

    Parameters
    ----------
    keys : sequence of hashable
        One key per parameter, in the order they are needed.

    Returns
    -------
    list of (int, int)
        Consecutive ranges covering ``range(len(keys))``.

    Examples
    --------
    >>> blocks([9, 1, 2, 3, 1, 2, 3, 1, 2, 3, 7])  # embedding, three blocks of three, head
    [(0, 1), (1, 4), (4, 7), (7, 10), (10, 11)]
    >>> layer, wider = [1, 2, 2, 2, 3, 4, 4, 4, 4, 4], [1, 5, 5, 5, 3, 4, 4, 4, 4, 4]
    >>> blocks(layer + wider + layer + layer)  # four layers, the second with a wider attention
    [(0, 10), (10, 20), (20, 30), (30, 40)]
    >>> blocks([5, 6, 7, 8])  # no period: about sqrt(n) each
    [(0, 2), (2, 4)]
    >>> blocks([])
    []
    """
    n = len(keys)
    if n <= 1:
        return [(0, n)] if n else []
    period, start = _period(keys)
    if not period:
        step = math.ceil(math.sqrt(n))
        return [(s, min(s + step, n)) for s in range(0, n, step)]
    ranges = [(0, start)] if start else []
    s = start
    while s + period <= n:
        ranges.append((s, s + period))
        s += period
    if s < n:
        ranges.append((s, n))
    return ranges


def _period(keys: Sequence[Hashable]) -> tuple[int, int]:
    """The block length of ``keys`` and where the blocks start (``(0, 0)``: no period): :func:`blocks`."""
    n = len(keys)
    ratios = {p: sum(1 for i in range(n - p) if keys[i] == keys[i + p]) / (n - p)
              for p in range(2, min(MAX_BLOCK_PARAMS, n // 2) + 1)}
    period, best = 0, PERIOD_MATCH
    for p, ratio in ratios.items():
        if ratio > best or (ratio == best and not period):
            period, best = p, ratio
    if not period:
        return 0, 0
    # a divisor of the period that matches nearly as well is the block: layers that repeat in pairs (the second
    # a little different) are two blocks, not one
    period = next((d for d in range(2, period) if period % d == 0 and ratios[d] >= max(PERIOD_MATCH,
                                                                                         best - DIVISOR_SLACK)),
                  period)
    return period, next(i for i in range(n - period) if keys[i] == keys[i + period])


def root_and_blocks(keys: Sequence[Hashable]) -> tuple[list[int], list[list[int]]]:
    """FSDP2's units of a sequence of parameters: the root's, and one block per period (:func:`blocks`).

    ``fully_shard`` is applied to each transformer block and then to the model: the model's own unit, the
    root, holds every parameter outside the blocks (embeddings before them, final norm and head after). So
    where the keys have a period, what :func:`blocks` puts before and after the periodic blocks is the root
    (positions, ascending); without a period there is no root and every block of :func:`blocks` stands.

    Examples
    --------
    >>> root_and_blocks([9, 1, 2, 3, 1, 2, 3, 1, 2, 3, 7])  # embedding, three blocks of three, head
    ([0, 10], [[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    >>> root_and_blocks([5, 6, 7, 8])
    ([], [[0, 1], [2, 3]])
    """
    ranges = blocks(keys)
    period, start = _period(keys) if len(keys) > 1 else (0, 0)
    if not period:
        return [], [list(range(s, e)) for s, e in ranges]
    root: list[int] = []
    periodic: list[list[int]] = []
    for s, e in ranges:
        if e - s == period and s >= start:
            periodic.append(list(range(s, e)))
        else:
            root.extend(range(s, e))
    return root, periodic


def need_positions(form: GraphForm, order: Sequence[int] | None = None) -> dict[int, int]:
    """Each all-gather's need: the position in ``order`` (default the input order) of the first node that
    reads what its wait returns (the wait's own position where nothing reads it).

    Examples
    --------
    >>> from dcsched.synthetic import layered_stack
    >>> form = GraphForm(layered_stack(2).backward)
    >>> need = need_positions(form)
    >>> all(need[g] > form.topo.index(g) for g in need)  # read after the gather, never at it
    True
    """
    order = form.topo if order is None else order
    pos = {v: p for p, v in enumerate(order)}
    need = {}
    for g in order:
        if form.kind[g] != ALLGATHER:
            continue
        waits, readers = _waits_and_readers(form, g)
        need[g] = min(map(pos.__getitem__, readers or waits or [g]))
    return need


def just_in_time(form: GraphForm, order: Sequence[int]) -> list[int]:
    """``order`` (node numbers) with each all-gather and its wait moved to just before the first node that reads
    the wait: every parameter gathered when it is first needed and no sooner. Still topological: a gather's and
    its wait's inputs come before their old places, and nothing but the wait's readers depend on them.

    Examples
    --------
    >>> from dcsched.synthetic import layered_stack
    >>> form = GraphForm(layered_stack(2).backward)
    >>> order = just_in_time(form, list(form.topo))
    >>> form.check_order(form.order_names(order))
    >>> need = need_positions(form, order)
    >>> between = [order[order.index(g):need[g]] for g in need]  # from each gather to its first reader
    >>> all(form.kind[v] in (ALLGATHER, WAIT) for nodes in between for v in nodes)
    True
    """
    pos = {v: p for p, v in enumerate(order)}
    moved: dict[int, list[int]] = {}  # first reader -> the gathers and waits issued right before it
    for g in order:
        if form.kind[g] != ALLGATHER:
            continue
        waits, readers = _waits_and_readers(form, g)
        if not readers:
            continue
        first = min(readers, key=pos.__getitem__)
        moved.setdefault(first, []).extend([g, *waits])
    placed = {v for chain in moved.values() for v in chain}
    result: list[int] = []
    for v in order:
        if v in placed:
            continue
        result.extend(moved.get(v, ()))
        result.append(v)
    return result


def _waits_and_readers(form: GraphForm, gather: int) -> tuple[list[int], list[int]]:
    """An all-gather's waits, and the nodes that read what they return."""
    waits = [w for w in form.succs[gather] if form.kind[w] == WAIT]
    return waits, [r for w in waits for r in form.succs[w]]


def reads_gathers_directly(form: GraphForm) -> bool:
    """Whether a node other than a wait reads an all-gather: never in a captured graph (DeepCompile's ops read
    a gathered parameter through its wait), possible in a graph from a file, where moving the gathers as FSDP2
    does would not keep the order topological."""
    return any(form.kind[r] != WAIT for g in range(len(form.kind)) if form.kind[g] == ALLGATHER
               for r in form.succs[g])


@dataclasses.dataclass(frozen=True)
class Blocks:
    """One graph's blocks (node numbers): all-gather blocks in the order they are needed, reduce blocks in
    the order they complete; ``root`` is the step's root unit (ds_ids, :func:`root_and_blocks`)."""

    gathers: list[list[int]]
    reduces: list[list[int]]
    root: frozenset = frozenset()


def step_blocks(forms: Mapping[str, GraphForm], *, root_mode: str = "unit") -> dict[str, Blocks]:
    """Every graph's blocks, as FSDP2's units: found in the forward, the same parameters in every graph.

    The forward's all-gathers (input order: the order parameters are needed) are cut into the root and the
    blocks (:func:`root_and_blocks`, by byte sizes); the root's all-gathers are one block, the first. Another
    graph (the backward) groups its all-gathers and its reduces by the forward block of each one's ds_id: a
    unit's parameters travel together both ways, as a module's flat parameter does. Its all-gather blocks go
    in the order of their first member, its reduce blocks in the order of their last one (where every
    gradient of the unit is ready). A parameter the forward does not gather joins the block before it. A
    step without a forward (a graph on its own) finds its units in each graph itself.

    ``root_mode``: ``'unit'`` (FSDP2's, the default); ``'joined'``: the root is no unit of its own, its
    parameters travel with the blocks they are needed beside, in every graph and both ways
    (:func:`_joined`): the embeddings with the first block, the final norm and head with the last, so no
    parameter is gathered long before its use or its gradient held to the backward's end, and the step
    issues fewer collectives; ``'split'``: as ``'joined'``, except that in the forward what the root holds
    before the blocks and after them are two units of their own (a first bucket no larger than the
    embeddings). ``overlap-plan`` plans with the last two.

    Examples
    --------
    >>> from dcsched.synthetic import layered_stack
    >>> stack = layered_stack(3)
    >>> found = step_blocks({"forward": GraphForm(stack.forward), "backward": GraphForm(stack.backward)})
    >>> len(found["forward"].gathers) == len(found["backward"].reduces), found["forward"].root == found["backward"].root
    (True, True)
    """
    found: dict[str, Blocks] = {}
    forward = forms.get("forward")
    unit: dict[int, int] | None = None
    root: frozenset = frozenset()
    if forward is not None:
        found["forward"], unit = _own_blocks(forward)
        root = found["forward"].root
    for name, form in forms.items():
        if name == "forward":
            own = unit or {}
        elif unit is None or (root_mode != "unit" and not root):
            # no forward, or (for the planner) a step without a root: the graph's own units, its reduces in
            # consecutive runs of a unit (a late gradient then does not hold back those ready long before)
            found[name], own = _own_blocks(form)
            if root_mode != "unit":
                found[name] = Blocks(found[name].gathers, _joined(form, REDUCE, own, frozenset()))
        else:
            found[name], own = Blocks(_grouped(form, ALLGATHER, unit, last=False),
                                      _grouped(form, REDUCE, unit, last=True), root), unit
        if root_mode != "unit" and found[name].root:
            loose = found[name].root
            if root_mode == "split" and name == "forward":
                found[name] = Blocks(_split_root(form, found[name].gathers), [], loose)
            else:
                found[name] = Blocks(_joined(form, ALLGATHER, own, loose), _joined(form, REDUCE, own, loose), loose)
    return found


def _own_blocks(form: GraphForm) -> tuple[Blocks, dict[int, int]]:
    """A graph's blocks found in its own all-gathers, and each gathered ds_id's block."""
    need = need_positions(form)
    nodes = sorted(need, key=need.__getitem__)  # the order the parameters are needed
    if not nodes:  # nothing gathered (a backward alone): reduces in blocks of their sizes
        reduces = [i for i in form.topo if form.kind[i] == REDUCE]
        return Blocks([], [reduces[s:e] for s, e in blocks([form.size[i] for i in reduces])]), {}
    root, periodic = root_and_blocks([form.size[i] for i in nodes])
    gathers = ([[nodes[k] for k in root]] if root else []) + [[nodes[k] for k in block] for block in periodic]
    unit = {form.ds_id[m]: k for k, group in enumerate(gathers) for m in group}
    root_ids = frozenset(form.ds_id[nodes[k]] for k in root)
    return Blocks(gathers, _grouped(form, REDUCE, unit, last=True), root_ids), unit


def _grouped(form: GraphForm, kind: int, unit: Mapping[int, int], *, last: bool) -> list[list[int]]:
    """The nodes of ``kind`` in input order, grouped by ``unit[ds_id]`` (unknown ds_ids: the group before),
    the groups ordered by where their parameters are first needed (:func:`need_positions`; ``last``: by their
    last member's place, where every gradient of the unit is ready)."""
    groups: dict[int, list[int]] = {}
    current = -1
    for i in form.topo:
        if form.kind[i] != kind:
            continue
        current = unit.get(form.ds_id[i], current)
        groups.setdefault(current, []).append(i)
    if not last:
        need = need_positions(form)
        return sorted(groups.values(), key=lambda g: min(need[m] for m in g))
    where = {m: p for p, m in enumerate(form.topo)}
    return sorted(groups.values(), key=lambda g: where[g[-1]])


def _split_root(form: GraphForm, gathers: list[list[int]]) -> list[list[int]]:
    """The forward's units with the root's (the first) split into what is needed before the blocks and after."""
    if len(gathers) < 2:
        return gathers
    need = need_positions(form)
    start = min(need[m] for m in gathers[1])
    before = [m for m in gathers[0] if need[m] < start]
    after = [m for m in gathers[0] if need[m] >= start]
    return [group for group in (before, *gathers[1:], after) if group]


def _joined(form: GraphForm, kind: int, unit: Mapping[int, int], loose: frozenset) -> list[list[int]]:
    """The nodes of ``kind`` in input order (all-gathers: in the order they are needed, :func:`need_positions`),
    cut where the unit changes; a ``loose`` (root) or unknown ds_id's node joins the group before it (the first
    group, where it comes before any)."""
    groups: list[list[int]] = []
    pending: list[int] = []
    current = None
    if kind == ALLGATHER:
        need = need_positions(form)
        nodes = sorted(need, key=need.__getitem__)
    else:
        nodes = [i for i in form.topo if form.kind[i] == kind]
    for i in nodes:
        block = None if form.ds_id[i] in loose else unit.get(form.ds_id[i])
        if block is None:
            (groups[-1] if groups else pending).append(i)
            continue
        if block != current:
            groups.append(pending + [i] if not groups else [i])
            pending, current = [], block
        else:
            groups[-1].append(i)
    return groups or ([pending] if pending else [])


def kept_root(forms: Mapping[str, GraphForm], found: Mapping[str, Blocks]) -> frozenset:
    """The root's ds_ids FSDP2 keeps gathered from the forward to the backward: those the backward gathers.

    FSDP2 does not reshard the root after the forward (its parameters would be gathered again at once for
    the backward), so the backward issues no all-gather of them; a step without both graphs keeps nothing.
    """
    if "forward" not in found or "backward" not in forms:
        return frozenset()
    return found["forward"].root & gathered_ids(forms["backward"], found["backward"])


def gathered_ids(form: GraphForm, blocks: Blocks) -> set[int]:
    """The ds_ids ``form`` gathers in ``blocks``' all-gather blocks."""
    return {form.ds_id[m] for group in blocks.gathers for m in group}


def plan_of(form: GraphForm, order: Sequence[int], buckets: Sequence[Sequence[int]], kept: Iterable[int],
            held: frozenset = frozenset()) -> Plan:
    """A :class:`~dcsched.plan.Plan` of node numbers: the order, the buckets (their ``held`` members' all-gathers
    left out: a held parameter issues none; buckets of one dropped) and ``kept`` as ``'kept'`` residency."""
    names, kind, ds_id = form.names, form.kind, form.ds_id
    made = []
    for members in buckets:
        members = [m for m in members if kind[m] != ALLGATHER or ds_id[m] not in held]
        if len(members) > 1:
            made.append(Bucket("allgather" if kind[members[0]] == ALLGATHER else "reduce",
                               [names[m] for m in members], [ds_id[m] for m in members]))
    return Plan([names[v] for v in order], buckets=made, residency={d: "kept" for d in sorted(kept)})


@register("fsdp", step=True,
          description="FSDP2's policy: one all-gather bucket per transformer block, prefetched one block ahead, "
                      "one reduce bucket per block; the root (embeddings, head) one unit kept for the backward")
def fsdp(forms: Mapping[str, GraphForm]) -> dict[str, Plan]:
    """FSDP2's units, buckets and one-block-ahead prefetch for the step's graphs (module docstring).

    Parameters
    ----------
    forms : mapping of str to GraphForm
        The step's graphs; ``'forward'`` and ``'backward'`` share their units (:func:`step_blocks`).

    Returns
    -------
    dict of str to Plan
        Per graph the order and one bucket per unit of two or more all-gathers (or reduces); the root's
        parameters the backward gathers are ``'kept'`` (:func:`kept_root`).

    Examples
    --------
    >>> from dcsched.synthetic import layered_stack
    >>> plans = fsdp({"graph": GraphForm(layered_stack(1).backward)})
    >>> {b.kind for b in plans["graph"].buckets} == {"allgather", "reduce"}
    True
    """
    if any(reads_gathers_directly(form) for form in forms.values()):
        # Not a captured step: its input order, every collective alone (no unit to prefetch or keep).
        return {name: plan_of(form, list(form.topo), [], frozenset(), frozenset()) for name, form in forms.items()}
    with paused_gc():
        found = step_blocks(forms)
        kept = kept_root(forms, found)
        plans = {}
        for name, form in forms.items():
            order, buckets = bucketed(form, just_in_time(form, list(form.topo)), found[name].gathers,
                                      found[name].reduces, ahead=1)
            plans[name] = plan_of(form, order, buckets, kept, kept if name == "backward" else frozenset())
    return plans
