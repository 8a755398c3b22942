"""Simulating a :class:`~dcsched.plan.Plan`: its order, its buckets and the step's residency, for one graph.

A plan's ``'kept'`` parameters reach the simulator differently in the two
graphs of a step: the forward keeps their gathered buffers past its end
(``keep``), the backward finds them gathered from its start (``held``)
(:meth:`dcsched.sim.simulate.CompiledGraph.simulate`). :func:`residency_roles`
says which, by the graph's name; :func:`simulate_plan` runs the whole plan.
``'replicated'`` parameters are the same in every graph (``replicated``):
whole on every rank, no gather, resident for the whole step, their
gradients all-reduced (:func:`replicated_fused`).

>>> from dcsched.plan import Plan
>>> plan = Plan(("x",), residency={3: "kept", 4: "sharded"})
>>> residency_roles(plan, "forward"), residency_roles(plan, "backward"), residency_roles(plan, "graph")
({'keep': frozenset({3})}, {'held': frozenset({3})}, {})
>>> residency_roles(Plan(("x",), residency={5: "replicated"}), "backward")
{'replicated': frozenset({5})}
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from dcsched.collective_issue import SIMULATOR, CollectiveIssue
from dcsched.errors import GraphError
from dcsched.graph.form import PLACEHOLDER, REDUCE, GraphForm
from dcsched.plan import Plan
from dcsched.sim.collectives import all_reduce_time_ms, bucket_time_ms
from dcsched.sim.fused import Fused
from dcsched.sim.result import SimResult
from dcsched.sim.issue import bucket_indices
from dcsched.sim.simulate import CompiledGraph

#: How the step's kept parameters reach each graph (by name): kept past the forward, held from the backward's start.
ROLE_OF_GRAPH = {"forward": "keep", "backward": "held"}


def kept_ids(plan: Plan) -> frozenset:
    """The ds_ids the plan keeps gathered from the forward to the backward.

    Examples
    --------
    >>> sorted(kept_ids(Plan((), residency={1: "kept", 2: "sharded", 5: "kept"})))
    [1, 5]
    """
    return frozenset(d for d, where in plan.residency.items() if where == "kept")


def replicated_ids(plan: Plan) -> frozenset:
    """The ds_ids the plan holds whole on every rank.

    Examples
    --------
    >>> sorted(replicated_ids(Plan((), residency={1: "kept", 2: "replicated"})))
    [2]
    """
    return frozenset(d for d, where in plan.residency.items() if where == "replicated")


def residency_roles(plan: Plan, graph: str) -> dict[str, frozenset]:
    """The simulator's ``keep`` / ``held`` / ``replicated`` arguments for ``plan``'s residency in graph ``graph``.

    Parameters
    ----------
    plan : Plan
        The graph's plan (its residency is the step's).
    graph : str
        ``'forward'``, ``'backward'``, or another name (a graph on its own: nothing kept).

    Returns
    -------
    dict
        ``{'keep': ids}`` for the forward, ``{'held': ids}`` for the backward, else (or with nothing kept)
        nothing; and ``{'replicated': ids}`` in any graph where the plan replicates some.

    Examples
    --------
    >>> residency_roles(Plan(()), "forward")
    {}
    """
    kept = kept_ids(plan)
    role = ROLE_OF_GRAPH.get(graph)
    roles = {role: kept} if role and kept else {}
    replicated = replicated_ids(plan)
    return {**roles, "replicated": replicated} if replicated else roles


def simulate_plan(compiled: CompiledGraph, plan: Plan, graph: str, *, detail: bool | str = True,
                  check: bool = True, issue: CollectiveIssue = SIMULATOR) -> SimResult:
    """Simulate graph ``graph`` run as ``plan`` says: its order, buckets and the step's residency.

    Parameters
    ----------
    compiled : CompiledGraph
        The graph, compiled (:func:`dcsched.sim.simulate.compile_view`).
    plan : Plan
        Its plan (an empty order: the graph's own).
    graph : str
        The graph's name in the step (:func:`residency_roles`).
    detail, check, issue : optional
        As :meth:`~dcsched.sim.simulate.CompiledGraph.simulate` (``issue``: how the run issues its
        collectives, :class:`~dcsched.collective_issue.CollectiveIssue`).

    Returns
    -------
    SimResult

    Examples
    --------
    >>> from dcsched.synthetic import layered_stack
    >>> from dcsched.sim.simulate import compile_view
    >>> from dcsched.schedulers.fsdp.scheduler import fsdp
    >>> from dcsched.graph.form import GraphForm
    >>> forward = layered_stack(2).forward
    >>> plan = fsdp({"forward": GraphForm(forward)})["forward"]
    >>> simulate_plan(compile_view(forward), plan, "forward").collectives == len(plan.buckets)  # every gather in one
    True
    """
    order = list(plan.order) if plan.order else None  # a plan stored without its order runs the graph's own
    roles = residency_roles(plan, graph)
    replicated = roles.pop("replicated", frozenset())
    if not replicated:
        return compiled.simulate(order, detail=detail, check=check, buckets=plan.buckets, issue=issue, **roles)
    idx = compiled.order_indices(order, check=check)
    fused = replicated_fused(compiled, compiled.bucket_indices(plan.buckets, idx), roles.get("held", frozenset()),
                             roles.get("keep", frozenset()), replicated)
    return compiled.simulate_with_frees(idx, detail=detail, fused=dataclasses.replace(fused, issue=issue))[0]


def replicated_fused(compiled: CompiledGraph, buckets: list[list[int]], held: frozenset, keep: frozenset,
                     replicated: frozenset) -> Fused:
    """The plan as one simulation reads it, with ``replicated`` parameters (ds_ids), whole on every rank.

    Their all-gathers are as ``held`` ones (no collective, ready when
    reached, the bytes resident from the graph's start) and their buffers
    are never freed (as ``keep``) in either graph; each reduce of one is an
    all-reduce (:func:`~dcsched.sim.collectives.all_reduce_time_ms`), a reduce
    bucket split into its sharded members and its replicated ones, as
    :func:`dcsched.runtime.commplan.comm_plan` splits it for the runtime.

    Parameters
    ----------
    compiled : CompiledGraph
        The graph.
    buckets : list of list of int
        The plan's buckets as node numbers (:meth:`CompiledGraph.bucket_indices`).
    held, keep, replicated : frozenset of int
        ds_ids: the backward's held kept parameters, the forward's kept ones, the replicated ones.

    Returns
    -------
    Fused

    Examples
    --------
    >>> from dcsched import replay
    >>> from dcsched.sim.simulate import compile_view
    >>> compiled = compile_view(replay.example_bundle().forward)
    >>> replicated_fused(compiled, [], frozenset(), frozenset(), frozenset({1})).collectives  # 3 gathers less 1
    2
    """
    ds_id, kind, dur, latency = compiled.ds_id, compiled.kind, compiled.duration, compiled.comm_latency_ms
    whole = [[m for m in members if kind[m] == REDUCE and ds_id[m] in replicated] for members in buckets]
    bucketed = {m for members in whole for m in members}
    parts = [[m for m in members if m not in bucketed] for members in buckets] + whole
    alone = [[i] for i in range(len(kind)) if kind[i] == REDUCE and ds_id[i] in replicated and i not in bucketed]
    gathers = compiled._held_gathers(replicated)
    fused = compiled._fused([p for p in parts if p] + alone, compiled._held_gathers(held) + gathers,
                            keep | replicated)
    all_reduces = [w for w in whole if w] + alone
    for members in all_reduces:
        fused.time[members[0]] = bucket_time_ms([all_reduce_time_ms(dur[m], latency) for m in members],
                                                latency_ms=latency)
    # The input a replicated gather reads is the whole parameter, which the gathered bytes (resident from the
    # start) already count: its shard-sized placeholder holds nothing more.
    shards = {p for i in gathers for p in compiled.preds[i] if kind[p] == PLACEHOLDER}
    return dataclasses.replace(fused, held_bytes=fused.held_bytes - int(sum(compiled.size[p] for p in shards)),
                               all_reduces=frozenset(members[0] for members in all_reduces))


def check_stored_plans(plans: Mapping[str, Plan], forms: Mapping[str, GraphForm]) -> None:
    """Refuse a stored plan whose buckets cannot be issued in its graph's order: what every command that runs
    or simulates a bundle's plans (``schedule``, ``replay``) checks before using them.

    A loaded plan is sound in structure (:mod:`dcsched.bundle.plans`: members of the graph, of the bucket's
    op, in one bucket each); whether its graph's order can issue each bucket where it stands (every member's
    input run before the bucket's first member) is this check (:func:`dcsched.sim.issue.bucket_indices`, as
    the simulator reads buckets).

    Parameters
    ----------
    plans : Mapping of str to Plan
        The plans by graph name (``bundle.plans``); an empty order is the graph's own.
    forms : Mapping of str to GraphForm
        The graphs by name (a :class:`~dcsched.sim.simulate.CompiledGraph` is one); a plan of a graph not
        here is not checked.

    Raises
    ------
    GraphError
        One line naming the graph and the bucket that cannot be issued, and why.

    Examples
    --------
    >>> from dcsched import replay
    >>> from dcsched.plan import Bucket
    >>> bundle = replay.example_bundle()
    >>> reduces = [n.name for n in bundle.backward.nodes if n.name.startswith("reduce")]
    >>> plans = {"backward": Plan((), [Bucket("reduce", reduces[:2], [2, 0])])}
    >>> check_stored_plans(plans, {"backward": GraphForm(bundle.backward)})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    dcsched.errors.GraphError: graph 'backward': its stored plan cannot run: bucket of ... is issued before ...
    """
    for name, plan in plans.items():
        form = forms.get(name)
        if form is None or not plan.buckets:
            continue
        try:
            idx = [form.index[n] for n in plan.order] if plan.order else form.topo
            bucket_indices(form, plan.buckets, idx)
        except KeyError as exc:
            raise GraphError(f"graph '{name}': its stored plan orders {exc.args[0]!r:.80}, which is not in the "
                             "graph") from None
        except GraphError as exc:
            raise GraphError(f"graph '{name}': its stored plan cannot run: {exc}") from None


def check_bundle_plans(bundle: Any) -> None:
    """:func:`check_stored_plans` of ``bundle.plans`` against its graphs (their forms: nothing compiled, no
    figure read).

    Raises
    ------
    GraphError
        As :func:`check_stored_plans`.

    Examples
    --------
    >>> from dcsched import replay
    >>> check_bundle_plans(replay.example_bundle())  # no plans: nothing to refuse
    """
    planned = [name for name, plan in bundle.plans.items() if plan.buckets and name in bundle.graph_names]
    check_stored_plans(bundle.plans, {name: bundle.form(name) for name in planned})
