"""Where a plan's buckets are issued in an order, and whether they can be: one check for every runner.

A bucket runs its members as one collective, issued where its first member
stands in the order; so every member's input must have run by then.
:func:`bucket_indices` reads a plan's buckets against an order of a
:class:`~dcsched.graph.form.GraphForm` (the simulator's
:class:`~dcsched.sim.simulate.CompiledGraph` is one) and refuses those that
cannot be issued, so the simulator, ``schedule`` and ``replay``
(:func:`dcsched.sim.plans.check_stored_plans`) judge a plan alike, without
compiling anything.

>>> from dcsched import replay
>>> from dcsched.graph.form import GraphForm
>>> form = GraphForm(replay.example_bundle().forward)
>>> bucket_indices(form, [["allgather_ds_param_primals_2_1", "allgather_ds_param_primals_1_0"]], form.topo)
[[4, 6]]
"""

from __future__ import annotations

from typing import Sequence

from dcsched.errors import GraphError
from dcsched.graph.form import COMM_KINDS, KIND_NAMES, GraphForm


def bucket_indices(form: GraphForm, buckets: Sequence, idx: Sequence[int]) -> list[list[int]]:
    """``buckets`` as lists of member numbers, each in the order ``idx`` runs them, checked against ``idx``.

    Parameters
    ----------
    form : GraphForm
        The graph.
    buckets : sequence
        :class:`~dcsched.plan.Bucket` objects or lists of members (node names or numbers).
    idx : sequence of int
        The order the graph runs in (node numbers).

    Returns
    -------
    list of list of int
        Each bucket's members, in the order ``idx`` runs them (the first is where it is issued).

    Raises
    ------
    GraphError
        A member that is not a node, not an all-gather or a reduce, of another kind than the bucket's other
        members, in two buckets, or whose input runs after the bucket's first member in ``idx`` (the bucket
        is issued there).
    """
    pos_of = [-1] * len(form.names)
    for pos, i in enumerate(idx):
        pos_of[i] = pos
    kind, names, index, preds = form.kind, form.names, form.index, form.preds
    seen: set[int] = set()
    result: list[list[int]] = []
    for bucket in buckets:
        members = getattr(bucket, "members", bucket)
        nodes: list[int] = []
        for m in members:
            found = m if isinstance(m, int) else index.get(m)
            if found is None or not 0 <= found < len(names):
                raise GraphError(f"bucket member {m!r} is not in the graph")
            i = found
            if kind[i] not in COMM_KINDS:
                raise GraphError(f"bucket member {names[i]!r} is a {KIND_NAMES[kind[i]]}, not an all-gather "
                                 "or a reduce")
            if i in seen:
                raise GraphError(f"{names[i]!r} is in two buckets")
            seen.add(i)
            nodes.append(i)
        if not nodes:
            continue
        if len({kind[i] for i in nodes}) > 1:
            raise GraphError(f"bucket {names[nodes[0]]!r}... mixes all-gathers and reduces")
        nodes.sort(key=pos_of.__getitem__)
        first = pos_of[nodes[0]]
        for i in nodes:
            for p in preds[i]:
                if pos_of[p] > first:
                    raise GraphError(f"bucket of {names[nodes[0]]!r} is issued before its member {names[i]!r}'s "
                                     f"input {names[p]!r} has run")
        result.append(nodes)
    return result
