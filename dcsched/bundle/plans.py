"""The communication plans a bundle stores (version 3): per graph its buckets, and the step's residency.

A bundle's graphs are stored in their scheduled order, so of a
:class:`~dcsched.plan.Plan` only what the order does not say is written: each
graph's buckets, with members by node number (their position in the graph,
what the columns are indexed by, so no name is looked up at load), and the
residency, once for the whole step (it spans forward and backward). In the
document (``docs/bundle-format.md``)::

    "plans": {"forward": {"buckets": [{"kind": "allgather", "members": [12, 40], "ds_ids": [3, 4]}]}},
    "residency": {"3": "kept"}

Loading (:func:`read_plans`) checks the structure only, per bucket and in
tensor passes over all members: known kinds, every member a node of that
graph running an op of the bucket's kind (``allgather_param`` for
``'allgather'``, ``reduce_grad`` for ``'reduce'``: the kinds
:mod:`dcsched.collectives` puts in that bucket) with the ``ds_id`` the bucket gives, no node
in two buckets, known residencies for parameters of the table. Whether a
bucket's members are issued in an order it can run in is the simulator's to
say (:meth:`dcsched.sim.simulate.CompiledGraph.bucket_indices`).
:func:`plans_document` writes them, after the same checks.

>>> from dcsched import replay
>>> from dcsched.plan import Bucket, Plan
>>> bundle = replay.example_bundle()
>>> gathers = [n for n in bundle.forward.nodes if n.name.startswith("allgather")]
>>> bundle.plans["forward"] = Plan((), [Bucket("allgather", [n.name for n in gathers], [0, 1, 2])], {2: "kept"})
>>> plans_document(bundle)["residency"], len(plans_document(bundle)["plans"]["forward"]["buckets"])
({'2': 'kept'}, 1)
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from dcsched import collectives
from dcsched.plan import BUCKET_KINDS, RESIDENCIES, Bucket, Plan

#: The keys of a bucket entry and of a graph's plan entry.
_BUCKET_KEYS = {"kind", "members", "ds_ids"}
_INT64_END = 2**63


def _graph_collectives(stored) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A graph's bucketable collectives: node numbers, bucket kind (position in :data:`BUCKET_KINDS`), ds_id.

    ``stored`` is a checked :class:`~dcsched.bundle.columns.GraphColumns` or an FX graph.
    """
    from dcsched.bundle.columns import GraphColumns
    bucketed = [kind for kind in collectives.kinds() if kind.bucket is not None]
    if isinstance(stored, GraphColumns):
        nodes, which, ds_ids = stored.collectives([kind.op for kind in bucketed])
        bucket_of = torch.tensor([BUCKET_KINDS.index(kind.bucket) for kind in bucketed], dtype=torch.long)
        return nodes, bucket_of[which], ds_ids
    from dcsched.graph.roles import collective_of, ds_id_of
    found = []
    for v, node in enumerate(stored.nodes):
        kind = collective_of(node)
        if kind is not None and kind.bucket is not None:
            found.append((v, BUCKET_KINDS.index(kind.bucket), ds_id_of(node)))
    columns = list(zip(*found)) if found else [(), (), ()]
    nodes, kinds, ds_ids = (torch.tensor(c, dtype=torch.long) for c in columns)
    return nodes, kinds, ds_ids


def _node_names(stored) -> list[str]:
    from dcsched.bundle.columns import GraphColumns
    return stored.names if isinstance(stored, GraphColumns) else [node.name for node in stored.nodes]


def _bucket_entry(entry: Any, b: int, n: int, where: str) -> tuple[str, list[int], list[int]]:
    """One bucket's kind, members and ds_ids, their types and ranges checked (ValueError naming the fault)."""
    what = f"{where}: bucket #{b}"
    if not isinstance(entry, dict) or set(entry) != _BUCKET_KEYS:
        raise ValueError(f"{what} is not a table of kind, members and ds_ids")
    kind, members, ds_ids = entry["kind"], entry["members"], entry["ds_ids"]
    if kind not in BUCKET_KINDS:
        raise ValueError(f"{what} is of unknown kind {kind!r:.40} (known: {', '.join(BUCKET_KINDS)})")
    for values, label, end in ((members, "members", n), (ds_ids, "ds_ids", _INT64_END)):
        # ``type is int``: JSON's true is no node number, and a float would be truncated by torch.tensor.
        if not isinstance(values, list) or not all(type(v) is int for v in values):
            raise ValueError(f"{what}: its {label} are not a list of integers")
        if values and (min(values) < 0 or max(values) >= end):
            bad = next(v for v in values if not 0 <= v < end)
            raise ValueError(f"{what}: " + (f"member #{bad} is not a node of the graph" if label == "members"
                                            else f"ds_id {bad} is not a parameter id"))
    if not members or len(members) != len(ds_ids):
        raise ValueError(f"{what} has {len(members)} members and {len(ds_ids)} ds_ids (needs one or more, one "
                         "ds_id per member)")
    return kind, members, ds_ids


def _entries(entries: list, n: int) -> tuple[list, list, list] | None:
    """Kinds, member lists and ds_id lists of well-formed bucket entries, checked in bulk (a few passes over
    all values in C rather than several calls per bucket: 10^4 buckets at 10^5 nodes); None where any entry
    is not, for :func:`_bucket_entry` to say which and why."""
    try:
        if not all(type(e) is dict and len(e) == 3 for e in entries):
            return None
        kinds = [e["kind"] for e in entries]
        members = [e["members"] for e in entries]
        ds_ids = [e["ds_ids"] for e in entries]
        if not set(kinds) <= set(BUCKET_KINDS) or not set(map(type, members)) | set(map(type, ds_ids)) <= {list}:
            return None
        if list(map(len, members)) != list(map(len, ds_ids)) or not all(members):
            return None
        flat = [m for ms in members for m in ms]
        ids = [d for ds in ds_ids for d in ds]
        # ``type is int``: JSON's true is no number, and a float would be truncated by torch.tensor.
        if not set(map(type, flat)) | set(map(type, ids)) <= {int}:
            return None
        if min(flat) < 0 or max(flat) >= n or min(ids) < 0 or max(ids) >= _INT64_END:
            return None
    except (KeyError, TypeError):  # a missing key, an unhashable kind
        return None
    return kinds, members, ds_ids


def decode_buckets(entries: Any, stored, where: str) -> tuple[Bucket, ...]:
    """A graph's buckets from the document's entries (members by node number), checked (ValueError).

    Parameters
    ----------
    entries : Any
        The graph's ``buckets`` list as parsed from the document.
    stored : GraphColumns or torch.fx.Graph
        The graph (checked columns, or an FX graph).
    where : str
        Names the graph in messages.

    Returns
    -------
    tuple of Bucket
        Members by node name.

    Raises
    ------
    ValueError
        One line naming the bucket and node: an unknown kind, a member that is no node, or none of the
        bucket's op, a ds_id other than the node's, a node in two buckets.

    Examples
    --------
    >>> from dcsched import replay
    >>> graph = replay.example_bundle().forward
    >>> decode_buckets([{"kind": "allgather", "members": [4], "ds_ids": [0]}], graph, "graph 'forward'")
    (Bucket(kind='allgather', members=('allgather_ds_param_primals_1_0',), ds_ids=(0,)),)
    >>> decode_buckets([{"kind": "reduce", "members": [4], "ds_ids": [0]}], graph, "graph 'forward'")
    Traceback (most recent call last):
    ...
    ValueError: graph 'forward': bucket #0 (reduce): node allgather_ds_param_primals_1_0 is no reduce_grad
    """
    names = _node_names(stored)
    kinds, member_lists, ds_lists = _checked(entries, stored, names, where)
    return tuple(Bucket(k, [names[m] for m in ms], ds) for k, ms, ds in zip(kinds, member_lists, ds_lists))


def _checked(entries: Any, stored, names: list[str], where: str) -> tuple[list, list, list]:
    """:func:`decode_buckets`'s checks: the entries' kinds, member lists and ds_id lists, or ValueError."""
    if not isinstance(entries, list):
        raise ValueError(f"{where}: its buckets are not a list")
    if not entries:
        return [], [], []
    parsed = _entries(entries, len(names))
    if parsed is None:  # something is wrong: entry by entry, to name the first bucket at fault
        one_by_one = [_bucket_entry(entry, b, len(names), where) for b, entry in enumerate(entries)]
        parsed = ([k for k, _, _ in one_by_one], [m for _, m, _ in one_by_one], [d for _, _, d in one_by_one])
    kinds, member_lists, ds_lists = parsed
    members = torch.tensor([m for ms in member_lists for m in ms], dtype=torch.long)
    claimed = torch.tensor([d for ds in ds_lists for d in ds], dtype=torch.long)
    sizes = torch.tensor(list(map(len, member_lists)), dtype=torch.long)
    bucket = torch.repeat_interleave(torch.arange(len(kinds)), sizes)
    kind = torch.tensor([BUCKET_KINDS.index(k) for k in kinds], dtype=torch.long)[bucket]
    nodes, node_kind, node_ds = _graph_collectives(stored)
    kind_of = torch.full((len(names),), -1, dtype=torch.long)
    ds_of = torch.full((len(names),), -1, dtype=torch.long)
    kind_of[nodes], ds_of[nodes] = node_kind, node_ds
    wrong = kind_of[members] != kind
    if bool(wrong.any()):
        k = int(torch.nonzero(wrong)[0])
        b, label = int(bucket[k]), BUCKET_KINDS[int(kind[k])]
        ops = " or ".join(collectives.bucket_ops(label))
        raise ValueError(f"{where}: bucket #{b} ({label}): node {names[int(members[k])]} is no {ops}")
    wrong = ds_of[members] != claimed
    if bool(wrong.any()):
        k = int(torch.nonzero(wrong)[0])
        raise ValueError(f"{where}: bucket #{int(bucket[k])}: node {names[int(members[k])]} has ds_id "
                         f"{int(ds_of[members[k]])}, the bucket says {int(claimed[k])}")
    ordered = torch.sort(members).values
    twice = ordered[1:] == ordered[:-1]
    if bool(twice.any()):
        raise ValueError(f"{where}: node {names[int(ordered[int(torch.nonzero(twice)[0])])]} is in two buckets "
                         "(or twice in one)")
    return kinds, member_lists, ds_lists


def decode_residency(entry: Any, ds_ids: set[int]) -> dict[int, str]:
    """The step's residency from the document, checked.

    Parameters
    ----------
    entry : Any
        The document's ``residency``: decimal ds_id (``"3"``) -> ``'sharded'``, ``'kept'`` or ``'replicated'``.
    ds_ids : set of int
        The parameter table's ds_ids, the only keys allowed.

    Returns
    -------
    dict of int to str

    Raises
    ------
    ValueError
        One line: not a table, a key that is not a ds_id or names no parameter, an unknown residency.

    Examples
    --------
    >>> decode_residency({"3": "kept"}, {1, 3})
    {3: 'kept'}
    >>> decode_residency({"2": "kept"}, {1, 3})
    Traceback (most recent call last):
    ...
    ValueError: the residency names parameter 2, which is not in the parameter table
    """
    if not isinstance(entry, dict):
        raise ValueError("the residency is not a table of ds_id to residency")
    found = {}
    for key, value in entry.items():
        # The canonical spelling only ("3", not "03" or " 3"): one parameter, one key.
        if not key.isdigit() or not key.isascii() or len(key) > 19 or str(int(key)) != key:
            raise ValueError(f"the residency's key {key!r:.40} is not a ds_id")
        if int(key) not in ds_ids:
            raise ValueError(f"the residency names parameter {key}, which is not in the parameter table")
        if value not in RESIDENCIES:
            raise ValueError(f"parameter {key}'s residency {value!r:.40} is unknown (known: {', '.join(RESIDENCIES)})")
        found[int(key)] = value
    return found


def read_plans(doc: Mapping, stored: Mapping[str, Any], ds_ids: set[int]) -> dict:
    """``Bundle.plans`` from a version-3 document, checked (see the module docstring).

    Parameters
    ----------
    doc : Mapping
        The parsed document; its ``plans`` and ``residency`` are read (absent: none).
    stored : Mapping of str to GraphColumns or torch.fx.Graph
        The bundle's checked graphs by name.
    ds_ids : set of int
        The parameter table's ds_ids.

    Returns
    -------
    dict of str to Plan
        For each graph in ``doc['plans']``, a :class:`Plan` in the graph's own node order with its buckets
        and the step's residency.

    Raises
    ------
    ValueError
        One line naming the graph, bucket and node at fault.

    Examples
    --------
    >>> from dcsched import replay
    >>> bundle = replay.example_bundle()
    >>> doc = {"plans": {"forward": {"buckets": [{"kind": "allgather", "members": [4, 6], "ds_ids": [0, 1]}]}},
    ...        "residency": {"2": "kept"}}
    >>> plan = read_plans(doc, {"forward": bundle.forward}, {0, 1, 2})["forward"]
    >>> plan.buckets[0].members, plan.residency_of(2), len(plan.order)
    (('allgather_ds_param_primals_1_0', 'allgather_ds_param_primals_2_1'), 'kept', 21)
    """
    plans = doc.get("plans", {})
    if not isinstance(plans, dict):
        raise ValueError("the bundle's plans are not a table by graph name")
    residency = decode_residency(doc.get("residency", {}), ds_ids)
    if residency and not plans:
        raise ValueError("the bundle holds a residency but no plan")
    found = {}
    for name, entry in plans.items():
        if name not in stored:
            raise ValueError(f"the bundle holds a plan for graph {name!r:.40}, which it lacks")
        if not isinstance(entry, dict) or set(entry) != {"buckets"}:
            raise ValueError(f"the plan of graph '{name}' is not a table of buckets (the residency is the step's, "
                             "stored once)")
        buckets = decode_buckets(entry["buckets"], stored[name], f"the plan of graph '{name}'")
        found[name] = Plan(tuple(_node_names(stored[name])), buckets, residency)
    return found


def _encode_buckets(plan: Plan, stored, where: str) -> list[dict]:
    """``plan``'s buckets as document entries (members by node number), checked as a loader would."""
    names = _node_names(stored)
    if plan.order and tuple(plan.order) != tuple(names):
        raise ValueError(f"{where} orders the nodes otherwise than the graph (a stored plan runs the graph's own "
                         "order: Bundle.reordered(orders, plans=...))")
    if not plan.buckets:
        return []
    index = {name: v for v, name in enumerate(names)}
    entries = []
    for b, bucket in enumerate(plan.buckets):
        missing = [m for m in bucket.members if m not in index]
        if missing:
            raise ValueError(f"{where}: bucket #{b}: member {missing[0]!r:.80} is not a node of the graph")
        entries.append({"kind": bucket.kind, "members": [index[m] for m in bucket.members],
                        "ds_ids": list(bucket.ds_ids)})
    _checked(entries, stored, names, where)
    return entries


def _residency(plans: Mapping[str, Plan], ds_ids: set[int]) -> dict[str, str]:
    """The one residency of ``plans`` as the document's table (ValueError where the graphs' differ)."""
    first = None
    for name, plan in plans.items():
        if first is None:
            first = (name, dict(plan.residency))
        elif dict(plan.residency) != first[1]:
            raise ValueError(f"the plans of graphs '{first[0]}' and '{name}' differ in residency (a residency "
                             "spans the step)")
    residency = first[1] if first else {}
    for key in residency:
        if type(key) is not int or key not in ds_ids:
            raise ValueError(f"the residency names parameter {key!r:.40}, which is not in the parameter table")
    return {str(key): residency[key] for key in sorted(residency)}


def plans_document(bundle) -> dict:
    """The document's ``plans`` and ``residency`` for ``bundle.plans``, checked as a loader would.

    Parameters
    ----------
    bundle : Bundle

    Returns
    -------
    dict
        ``{"plans": {graph: {"buckets": [...]}}, "residency": {"<ds_id>": residency}}``, graphs in the
        bundle's order, residency keys by number.

    Raises
    ------
    ValueError
        A plan a loader would refuse, plans whose residencies differ, a plan whose non-empty order is not
        its graph's node order, a plan for a graph the bundle lacks.

    Examples
    --------
    See the module docstring.
    """
    plans: dict[str, Plan] = bundle.plans
    graphs = bundle.graph_names
    extra = sorted(set(plans) - set(graphs))
    if extra:
        raise ValueError(f"the bundle holds a plan for graph {extra[0]!r:.40}, which it lacks")
    for name, plan in plans.items():
        if not isinstance(plan, Plan):
            raise ValueError(f"the plan of graph '{name}' is a {type(plan).__name__}, not a dcsched.plan.Plan")
    ordered = {name: plans[name] for name in graphs if name in plans}
    residency = _residency(ordered, {p.ds_id for p in bundle.params})
    return {"plans": {name: {"buckets": _encode_buckets(plan, _stored(bundle, name), f"the plan of graph '{name}'")}
                      for name, plan in ordered.items()},
            "residency": residency}


def _stored(bundle, name: str):
    """Graph ``name`` as the bundle holds it: checked columns, or an FX graph (never building one)."""
    from dcsched.bundle.columns import GraphColumns
    stored = bundle.__dict__.get(f"_graph_{name}")
    return stored if isinstance(stored, GraphColumns) else getattr(bundle, name)


def plan_counts(plan: Plan | None, ds_ids: Sequence[int]) -> dict:
    """What ``dcsched show`` says of a graph's plan: buckets, their members, parameters by residency.

    Parameters
    ----------
    plan : Plan or None
        The graph's stored plan (None: no bucket, every parameter sharded).
    ds_ids : sequence of int
        The parameter table's ds_ids (the residencies are counted over them).

    Returns
    -------
    dict
        ``{"buckets": int, "members": int, "residency": {"sharded": int, "kept": int, "replicated": int}}``.

    Examples
    --------
    >>> plan_counts(Plan((), [Bucket("reduce", ["r1", "r2"], [0, 1])], {1: "kept"}), [0, 1, 2])
    {'buckets': 1, 'members': 2, 'residency': {'sharded': 2, 'kept': 1, 'replicated': 0}}
    >>> plan_counts(None, [0])["residency"]
    {'sharded': 1, 'kept': 0, 'replicated': 0}
    """
    plan = plan if plan is not None else Plan(())
    counts = {r: 0 for r in RESIDENCIES}
    for d in ds_ids:
        counts[plan.residency_of(d)] += 1
    return {"buckets": len(plan.buckets), "members": sum(len(b.members) for b in plan.buckets), "residency": counts}
