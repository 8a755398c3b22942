"""The schedule report: before and after figures of each algorithm, per graph, as plain data.

:func:`compare_bundle` runs the schedulers on every graph of a bundle and
simulates the input order ("before") and each algorithm's order ("after");
:meth:`Comparison.to_dict` is the JSON form ``dcsched schedule --json`` prints.
Nothing here reads or writes files or prints.

>>> import torch, torch.fx
>>> from dcsched.runtime import ops
>>> g = torch.fx.Graph()
>>> w = g.placeholder("w")
>>> ag = g.call_function(ops.allgather_param, (w, 0, 0)); ag.meta.update(device_time=1.0, tensor_size=8)
>>> wt = g.call_function(ops.wait_allgather, (ag, 0, 0)); wt.meta.update(device_time=0.0, tensor_size=8)
>>> _ = g.output((wt,))
>>> cmp = compare_graph(g, ["none"], name="forward")
>>> cmp.to_dict()["after"]["none"]["step_ms"], cmp.to_dict()["before"]["gathered_peak_bytes"]
(1.0, 8)
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable

import networkx as nx
import torch.fx

from dcsched import schedulers
from dcsched.budget import Budget, budget_for
from dcsched.bundle.core import Bundle
from dcsched.bundle.plans import plan_counts
from dcsched.errors import DcschedError, GraphError
from dcsched.graph.nxview import to_networkx
from dcsched.graph.form import ALLGATHER, REDUCE, GraphForm
from dcsched.plan import Plan
from dcsched.schedulers.registry import SchedulerInfo
from dcsched.sim.collectives import DEFAULT_LATENCY_MS, latency_from_provenance
from dcsched.sim.plans import check_stored_plans, simulate_plan
from dcsched.sim.simulate import CompiledGraph, SimResult, compile_view

#: JSON schema version of :meth:`Comparison.to_dict`.
REPORT_VERSION = 1

#: The figures a report shows per order, in display order (bytes, ms, percent).
FIGURE_KEYS = ("peak_bytes", "gathered_peak_bytes", "step_ms", "exposed_comm_ms", "overlap_pct", "collectives",
               "scheduler_s")

Progress = Callable[[str], None]
#: A scheduler as the comparison takes it: a registered name, or what :func:`dcsched.schedulers.get` returned.
Algorithm = str | SchedulerInfo


def resolved(algorithms: Iterable[Algorithm]) -> list[SchedulerInfo]:
    """Each algorithm's registry entry, looked up once (an entry given is kept as it is).

    Raises
    ------
    ScheduleError
        For an unknown name, before any work.

    Examples
    --------
    >>> [info.name for info in resolved(["none", schedulers.get("list")])]
    ['none', 'list']
    """
    return [algo if isinstance(algo, SchedulerInfo) else schedulers.get(algo) for algo in algorithms]


@dataclasses.dataclass
class GraphComparison:
    """One graph: the input order's simulation and each algorithm's order, simulation and run time."""

    name: str
    compiled: CompiledGraph
    before: SimResult
    after: dict[str, SimResult]
    #: each scheduler's whole result (order, buckets, residency)
    plans: dict[str, Plan]
    #: seconds each scheduler took to compute its order
    scheduler_s: dict[str, float]

    @property
    def orders(self) -> dict[str, list[str]]:
        """Each scheduler's order (node names), from its plan."""
        return {algo: list(plan.order) for algo, plan in self.plans.items()}

    @property
    def nodes(self) -> int:
        return len(self.compiled)

    @property
    def param_ids(self) -> list[int]:
        """The ds_ids of the parameters the graph gathers or reduces."""
        return sorted({d for d in self.compiled.ds_id if d is not None})

    def to_dict(self, *, params: bool = False) -> dict:
        bounds = self.compiled.bounds
        data = {
            "nodes": self.nodes,
            "allgathers": self.compiled.num_allgathers,
            "reduces": self.compiled.num_reduces,
            "compute_ms": self.compiled.compute_ms,
            "comm_ms": self.compiled.comm_ms,
            "lower_bound_ms": bounds.simple,
            "tight_lower_bound_ms": bounds.tight,
            "assumed_zero": {key: len(names) for key, names in self.compiled.missing.items()},
            "unsized_inputs": len(self.compiled.unsized_inputs),
            "before": _figures(self.before, None),
            "after": {algo: _figures(result, self.scheduler_s[algo]) for algo, result in self.after.items()},
            # each algorithm's communication plan, counted as `dcsched show` counts a stored one
            "plans": {algo: plan_counts(plan, self.param_ids) for algo, plan in self.plans.items()},
        }
        if params:
            data["params"] = {"before": [p.to_dict() for p in self.before.params],
                              **{algo: [p.to_dict() for p in r.params] for algo, r in self.after.items()}}
        return data


@dataclasses.dataclass
class Comparison:
    """Every graph of a bundle compared across ``algorithms``.

    ``skipped`` maps an algorithm left out to the reason (only with
    ``skip_failing``, e.g. a scheduler that needs an option not given).
    """

    algorithms: list[str]
    graphs: dict[str, GraphComparison]
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)

    def to_dict(self, *, params: bool = False, **extra) -> dict:
        """JSON-able report; ``extra`` keys (e.g. ``input``, ``outputs``) are added at the top level."""
        return {"version": REPORT_VERSION, **extra, "algorithms": list(self.algorithms),
                "skipped": dict(self.skipped),
                "graphs": {name: g.to_dict(params=params) for name, g in self.graphs.items()}}


def _figures(result: SimResult, scheduler_s: float | None) -> dict:
    figures = result.figures()
    figures["scheduler_s"] = scheduler_s
    return figures


def check_graph(view: nx.DiGraph | torch.fx.Graph | GraphForm, *, name: str, assume_zero: bool = False,
                comm_latency_ms: float = DEFAULT_LATENCY_MS) -> CompiledGraph:
    """Compile ``view`` for simulation, refusing what cannot be scheduled.

    ``comm_latency_ms``: the latency the communication figures include (what a bucket pays once).

    Raises :class:`GraphError` for a cycle, negative figures, missing figures
    (unless ``assume_zero``) and a graph with no parameters (no all-gather and
    no reduce-grad: nothing for a ZeRO-3 scheduler to place).
    """
    compiled = compile_view(view, assume_zero=assume_zero, name=name, comm_latency_ms=comm_latency_ms)
    if not any(k in (ALLGATHER, REDUCE) for k in compiled.kind):
        raise GraphError(f"graph '{name}' has no parameters (no allgather_param or reduce_grad node): "
                         "nothing to schedule")
    return compiled


def _zero_filled(view: nx.DiGraph) -> nx.DiGraph:
    """A copy of ``view`` with missing device_time/tensor_size set to 0 (for --assume-zero)."""
    filled = view.copy()
    for _, data in filled.nodes(data=True):
        for key in ("device_time", "tensor_size"):
            if data.get(key) is None:
                data[key] = 0
    return filled


def run_scheduler(form: GraphForm, algo: Algorithm, *, budget: Budget | None = None,
                  **options) -> tuple[Plan, float]:
    """Scheduler ``algo``'s plan of ``form`` (:func:`dcsched.schedulers.run`, order checked) and its seconds.

    Parameters
    ----------
    form : GraphForm
        The graph.
    algo : str or SchedulerInfo
        A registered scheduler, by name or as :func:`dcsched.schedulers.get` returned it.
    budget : Budget, optional
        For a scheduler that takes one (None: no limit).
    **options
        The scheduler's own options.

    Returns
    -------
    tuple of (Plan, float)
        The plan and the seconds the scheduler took.

    Raises
    ------
    ScheduleError, OptionError, BudgetError
        As :func:`dcsched.schedulers.run`.

    Examples
    --------
    >>> from dcsched.synthetic import layered_stack
    >>> plan, seconds = run_scheduler(GraphForm(layered_stack(1).forward), "fast-free")
    >>> plan.order[-1], seconds >= 0
    ('output', True)
    """
    started = time.perf_counter()
    plan = schedulers.run(algo, form, budget=budget, **options)
    return plan, time.perf_counter() - started


def compare_graph(graph: torch.fx.Graph | nx.DiGraph | GraphForm, algorithms: Iterable[Algorithm], *, name: str,
                  assume_zero: bool = False, compiled: CompiledGraph | None = None,
                  progress: Progress | None = None, options: dict | None = None,
                  skipped: dict[str, str] | None = None, budget: Budget | None = None,
                  describe: Callable[[DcschedError], str] = str,
                  planned: dict[str, tuple[Plan, float]] | None = None,
                  stored: Plan | None = None) -> GraphComparison:
    """Simulate ``graph``'s input order and each algorithm's order.

    Parameters
    ----------
    graph : torch.fx.Graph or networkx.DiGraph
        The graph or its networkx view.
    algorithms : iterable of str or SchedulerInfo
        Registered schedulers (:func:`resolved`).
    name : str
        The graph's name in messages and the report.
    assume_zero : bool, optional
        Count missing figures as 0 instead of refusing the graph.
    compiled : CompiledGraph, optional
        The simulator's form of ``graph``, if already built.
    progress : callable, optional
        Called with a message before each algorithm.
    options : dict, optional
        ``{algorithm: {option: value}}``, the schedulers' own options.
    skipped : dict, optional
        With one, an algorithm that raises :class:`DcschedError` is recorded
        there (name -> ``describe(error)``) and left out instead of stopping the comparison.
    budget : Budget, optional
        The memory budget for the schedulers that take one (None: no limit).
    describe : callable, optional
        How a skipped algorithm's error is worded (default ``str``).
    planned : dict, optional
        ``{algorithm: (plan, seconds)}``: this graph's plan from a scheduler
        that planned the whole step (:func:`compare_bundle`), used as it is.
    stored : Plan, optional
        The plan the graph comes with (a scheduled bundle's buckets and residency): "before" runs it.

    Returns
    -------
    GraphComparison

    Raises
    ------
    DcschedError
        A scheduler's error, without ``skipped``.

    Examples
    --------
    See the module docstring.
    """
    view = to_networkx(graph) if isinstance(graph, torch.fx.Graph) else graph
    compiled = compiled or compile_view(view, assume_zero=assume_zero, name=name)
    # One form for every algorithm (each gets its own copy of the form's attribute table); a form counts a
    # missing figure as 0 already (its ``time`` and ``size``).
    if isinstance(view, GraphForm):
        form = view
    else:
        form = GraphForm(_zero_filled(view) if compiled.missing else view, label=f"graph '{name}'")
    before = compiled.simulate(None) if stored is None else simulate_plan(compiled, stored, name, check=False)
    after, seconds, plans = {}, {}, {}
    for info in resolved(algorithms):
        algo = info.name
        if skipped is not None and algo in skipped:
            continue
        if progress:
            progress(f"{name}: scheduling {compiled.num_allgathers} all-gathers of {len(compiled)} nodes "
                     f"with {algo}")
        try:
            if planned and algo in planned:
                plan, seconds[algo] = planned[algo]
            else:
                plan, seconds[algo] = run_scheduler(GraphForm(form), info, budget=budget,
                                                    **(options or {}).get(algo, {}))
        except DcschedError as exc:
            if skipped is None:
                raise
            skipped[algo] = describe(exc)
            continue
        plans[algo] = plan
        # A plan's buckets run as one collective each (dcsched.sim.collectives), its kept parameters stay
        # gathered between the graphs (dcsched.sim.plans); buckets are checked.
        after[algo] = simulate_plan(compiled, plan, name, check=False)
    return GraphComparison(name, compiled, before, after, plans, seconds)


def compare_bundle(bundle: Bundle, algorithms: Iterable[Algorithm], *, assume_zero: bool = False,
                   progress: Progress | None = None, options: dict | None = None,
                   skip_failing: bool = False, budget: Budget | None = None,
                   describe: Callable[[DcschedError], str] = str) -> Comparison:
    """Check every graph first (nothing is scheduled if one is bad), then compare each.

    Parameters
    ----------
    bundle : Bundle
        The graphs.
    algorithms : iterable of str or SchedulerInfo
        Registered schedulers (:func:`resolved`).
    assume_zero, progress, describe
        As :func:`compare_graph`.
    options : dict, optional
        ``{algorithm: {option: value}}``, the schedulers' own options.
    skip_failing : bool, optional
        An algorithm that refuses a graph (:class:`DcschedError`) is left out of
        every graph and listed in :attr:`Comparison.skipped`, instead of stopping everything.
    budget : Budget, optional
        The memory budget for the schedulers that take one; None:
        :func:`dcsched.budget.budget_for` of ``bundle`` (the default rule: its device's memory less 10%, or no
        limit).

    Returns
    -------
    Comparison

    Raises
    ------
    GraphError
        For a graph that cannot be scheduled, or whose stored plan cannot be issued in its order
        (:func:`dcsched.sim.plans.check_stored_plans`), before any scheduling.
    ScheduleError
        For an unknown algorithm.
    DcschedError
        A scheduler's error, without ``skip_failing``.
    """
    infos = resolved(algorithms)  # an unknown name fails before any work
    budget = budget_for(None, bundle) if budget is None else budget
    views = {name: bundle.form(name) for name in bundle.graph_names}  # no FX graph, no networkx view
    latency = latency_from_provenance(bundle.provenance)
    compiled = {name: check_graph(view, name=name, assume_zero=assume_zero, comm_latency_ms=latency)
                for name, view in views.items()}
    check_stored_plans(bundle.plans, compiled)  # as replay checks them (dcsched.replay.replay_orders)
    skipped: dict[str, str] | None = {} if skip_failing else None
    planned = _plan_steps(views, [info for info in infos if info.step], budget=budget,
                          comm_latency_ms=latency, options=options, progress=progress, skipped=skipped,
                          describe=describe)
    graphs = {name: compare_graph(view, infos, name=name, compiled=compiled[name], progress=progress,
                                  options=options, skipped=skipped, budget=budget, describe=describe,
                                  planned={algo: plans[name] for algo, plans in planned.items()},
                                  stored=bundle.plans.get(name))
              for name, view in views.items()}
    skipped = skipped or {}
    for cmp in graphs.values():  # an algorithm skipped on a later graph leaves the earlier ones too
        for algo in skipped:
            cmp.after.pop(algo, None)
            cmp.scheduler_s.pop(algo, None)
            cmp.plans.pop(algo, None)
    return Comparison([info.name for info in infos if info.name not in skipped], graphs, skipped)


def _plan_steps(views: dict[str, GraphForm], algorithms: list[SchedulerInfo], *, budget: Budget,
                comm_latency_ms: float,
                options: dict | None, progress: Progress | None, skipped: dict[str, str] | None,
                describe: Callable[[DcschedError], str]) -> dict[str, dict[str, tuple[Plan, float]]]:
    """``{algorithm: {graph: (plan, seconds)}}`` for the schedulers that plan the step's graphs together
    (:func:`dcsched.schedulers.run_step`); the seconds are split evenly between the graphs."""
    planned: dict[str, dict[str, tuple[Plan, float]]] = {}
    for info in algorithms:
        algo = info.name
        if progress:
            progress(f"planning the step ({', '.join(views)}) with {algo}")
        started = time.perf_counter()
        try:
            plans = schedulers.run_step(info, {name: GraphForm(view) for name, view in views.items()}, budget=budget,
                                        comm_latency_ms=comm_latency_ms, **(options or {}).get(algo, {}))
        except DcschedError as exc:
            if skipped is None:
                raise
            skipped[algo] = describe(exc)
            continue
        share = (time.perf_counter() - started) / len(views)
        planned[algo] = {name: (plan, share) for name, plan in plans.items()}
    return planned


def scheduled_bundle(bundle: Bundle, comparison: Comparison, algo: str, *, input_name: str) -> Bundle:
    """``bundle`` with every graph in ``algo``'s order (same nodes, edges and meta), linted, and ``algo``'s
    plan for each graph (its buckets and residency; saved from bundle version 3 on).

    ``provenance["schedule"]`` records the algorithm and ``input_name`` (the input's file name).
    """
    plans = {name: comparison.graphs[name].plans[algo] for name in bundle.graph_names}
    result = bundle.reordered({name: list(plan.order) for name, plan in plans.items()}, plans=plans)
    result.provenance["schedule"] = {"algorithm": algo, "input": input_name}
    return result
