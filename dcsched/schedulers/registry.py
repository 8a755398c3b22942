"""Schedulers by name, and :func:`run`, the one way to call one.

A scheduler is one module that registers one pure function::

    func(form: GraphForm, *, budget_bytes: float, budget_scope: str, **options) -> Plan

It takes the graph's :class:`~dcsched.graph.form.GraphForm` and keyword
options, and returns a :class:`~dcsched.plan.Plan` whose ``order``
holds every node (by name) once, in a topological order. ``budget_bytes``
(bytes, ``math.inf`` for no limit) and ``budget_scope`` (``'all'`` or
``'gathered'``) are passed only to a function that declares them; a
scheduler that needs networkx or the simulator's form builds it from the form.

An entry point (``dcsched schedule``, ``dcsched train``, :func:`dcsched.plan`)
looks the name up once (:func:`get`), refuses a budget the scheduler takes none
of with :func:`check_budget_taken` (the one refusal), and passes the
:class:`SchedulerInfo` it found down to :func:`run` / :func:`run_step`, which
take it as it is. :func:`run` checks the options, turns a
:class:`~dcsched.budget.Budget` into ``budget_bytes`` / ``budget_scope``, moves
the output last, and checks the order. The user-facing option names (:attr:`SchedulerInfo.options`) are
``memory_budget`` for ``budget_bytes`` and ``budget_scope``, as the command
line and :func:`dcsched.schedule` spell them.

A *step* scheduler (``register(..., step=True)``) plans the step's graphs
together, since what a plan keeps gathered trades forward memory for backward
communication::

    func(forms: dict[str, GraphForm], *, budget_bytes, budget_scope, comm_latency_ms, **options)
        -> dict[str, Plan]

:func:`run_step` is the entry for a whole step (every scheduler: one that
plans a graph at a time gets each graph alone); ``comm_latency_ms`` (the
latency the bundle's communication figures include) is passed only to a
function that declares it.

>>> from dcsched.plan import Plan
>>> @register("reverse-demo", description="demo only")
... def _demo(form: GraphForm) -> Plan:
...     return Plan(form.order_names(form.topo))
>>> "reverse-demo" in available()
True
>>> _ = unregister("reverse-demo")
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Iterable, Mapping

from dcsched.budget import Budget
from dcsched.errors import GraphError, OptionError, ScheduleError
from dcsched.graph.form import GraphForm, output_last, paused_gc
from dcsched.plan import Plan

#: A scheduler: ``func(form, **options) -> Plan``, or for a step scheduler ``func(forms, **options) -> {graph: Plan}``.
Scheduler = Callable[..., Any]
#: The scheduler function's budget parameters, and the option names users give for them.
BUDGET_PARAMETERS = {"budget_bytes": "memory_budget", "budget_scope": "budget_scope"}
#: What the caller knows of the graphs' costs, passed to a function that declares it (not a user option).
LATENCY_PARAMETER = "comm_latency_ms"
#: The budget options in words, for :func:`check_budget_taken`'s message.
BUDGET_NOUNS = {"memory_budget": "memory budget", "budget_scope": "budget scope"}


@dataclasses.dataclass(frozen=True)
class SchedulerInfo:
    """A registered scheduler: its name, function, one-line description and options.

    ``options`` lists the keyword options a caller may give, as users name
    them (``memory_budget`` for the function's ``budget_bytes``);
    ``takes_budget`` / ``takes_scope`` say whether the function reads a budget
    and its scope.
    """

    name: str
    func: Scheduler
    description: str
    #: keyword options, as users name them (besides the form)
    options: tuple[str, ...]
    takes_budget: bool = False
    takes_scope: bool = False
    #: Plans the step's graphs together (``func(forms: dict, ...) -> dict``).
    step: bool = False
    takes_latency: bool = False

    @property
    def own_options(self) -> tuple[str, ...]:
        """The options other than the budget's (passed to the function as given)."""
        return tuple(o for o in self.options if o not in BUDGET_PARAMETERS.values())


_REGISTRY: dict[str, SchedulerInfo] = {}


def register(name: str, *, description: str, step: bool = False) -> Callable[[Scheduler], Scheduler]:
    """Decorator: make ``func(form, **options) -> Plan`` available as ``name``.

    Parameters
    ----------
    name : str
        The name users pick it by (``--algo name``).
    description : str
        One line: what it does.
    step : bool, optional
        ``func`` plans the step's graphs together: ``func(forms, **options) -> {name: Plan}``.

    Returns
    -------
    callable
        The decorator; it returns ``func`` unchanged.

    Raises
    ------
    ValueError
        When another function is registered under ``name`` already.

    Examples
    --------
    See the module docstring.
    """

    def decorate(func: Scheduler) -> Scheduler:
        if name in _REGISTRY and _REGISTRY[name].func is not func:
            raise ValueError(f"scheduler {name!r} is registered twice")
        params = list(inspect.signature(func).parameters.values())[1:]
        names = [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        options = tuple(BUDGET_PARAMETERS.get(n, n) for n in names if n != LATENCY_PARAMETER)
        _REGISTRY[name] = SchedulerInfo(name, func, description, options,
                                        takes_budget="budget_bytes" in names, takes_scope="budget_scope" in names,
                                        step=step, takes_latency=LATENCY_PARAMETER in names)
        return func

    return decorate


def unregister(name: str) -> SchedulerInfo:
    """Remove scheduler ``name`` (tests and demos); returns what was registered.

    Raises
    ------
    KeyError
        For a name not registered.
    """
    return _REGISTRY.pop(name)


def get(name: str) -> SchedulerInfo:
    """The scheduler registered as ``name``.

    Parameters
    ----------
    name : str
        The scheduler's name.

    Returns
    -------
    SchedulerInfo

    Raises
    ------
    ScheduleError
        For an unknown name (the message lists the available ones).

    Examples
    --------
    >>> get("overlap").options
    ('memory_budget', 'budget_scope')
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ScheduleError(f"unknown scheduler '{name}' (available: {', '.join(available())})") from None


def check_budget_taken(infos: Iterable[SchedulerInfo], *, memory_budget: bool = False,
                       budget_scope: bool = False) -> None:
    """Refuse a budget (or scope) given where no selected scheduler takes one: the one refusal of every entry.

    ``dcsched schedule`` (each scheduler selected), ``dcsched train`` and
    :func:`dcsched.backend` (:meth:`dcsched.train.options.TrainOptions.check`),
    :func:`dcsched.plan` / :func:`dcsched.schedule` call it with what they
    were given, before any work.

    Parameters
    ----------
    infos : iterable of SchedulerInfo
        The schedulers selected (:func:`get`'s results); one that takes the
        option is enough.
    memory_budget, budget_scope : bool, optional
        Whether a memory budget, a budget scope was given.

    Raises
    ------
    OptionError
        Naming the option given (``memory_budget`` first), with the selected schedulers.

    Examples
    --------
    >>> check_budget_taken([get("overlap")], memory_budget=True, budget_scope=True)
    >>> check_budget_taken([get("fast-free")], memory_budget=True)
    Traceback (most recent call last):
    ...
    dcsched.errors.OptionError: memory_budget is given, but scheduler 'fast-free' takes no memory budget
    """
    infos = list(infos)
    for option, given in (("memory_budget", memory_budget), ("budget_scope", budget_scope)):
        if given and not any(option in info.options for info in infos):
            names = ", ".join(f"'{info.name}'" for info in infos)
            raise OptionError(option, f"is given, but scheduler {names} takes no {BUDGET_NOUNS[option]}")


def available() -> list[str]:
    """The registered schedulers' names, in registration order (the order of ``--algo all``).

    Examples
    --------
    >>> available()[:2]
    ['none', 'list']
    """
    return list(_REGISTRY)


def run(scheduler: str | SchedulerInfo, form: GraphForm, *, budget: Budget | None = None, **options) -> Plan:
    """Schedule ``form`` with ``scheduler``: the one entry to every scheduler.

    Parameters
    ----------
    scheduler : str or SchedulerInfo
        A registered scheduler's name (:func:`available`), or what :func:`get`
        returned for it (taken as it is: no second look-up).
    form : GraphForm
        The graph (:class:`~dcsched.graph.form.GraphForm` of an FX graph or of
        its networkx view).
    budget : Budget, optional
        The memory budget, for a scheduler that takes one (others ignore it);
        None: no limit (a bare graph records no device: the default rule,
        :func:`dcsched.budget.budget_for`, is the entry point's to apply). A
        scheduler that takes no scope reads the bytes as its own kind of
        budget (``deepcompile``: all tensors).
    **options
        The scheduler's own options (``k=3`` for ``prefetch-ahead``).

    Returns
    -------
    Plan
        Its order checked: a topological order of exactly the graph's nodes,
        placeholders in input order, output last.

    Raises
    ------
    ScheduleError
        For an unknown name, or an invalid order (a scheduler bug).
    OptionError
        For an option the scheduler does not take (``memory_budget`` here: pass ``budget``).
    BudgetError
        From the scheduler, for a budget no order of the graph fits in.

    Examples
    --------
    >>> from dcsched.synthetic import layered_stack
    >>> form = GraphForm(layered_stack(1).forward)
    >>> plan = run("overlap", form, budget=Budget.unlimited())
    >>> len(plan.order) == len(form), plan.buckets
    (True, ())
    """
    if not isinstance(form, GraphForm):
        raise TypeError(f"schedulers take a GraphForm, not {type(form).__name__} (GraphForm(graph) builds one)")
    return run_step(scheduler, {"graph": form}, budget=budget, **options)["graph"]


def run_step(scheduler: str | SchedulerInfo, forms: Mapping[str, GraphForm], *, budget: Budget | None = None,
             comm_latency_ms: float | None = None, **options) -> dict[str, Plan]:
    """Plan a step's graphs with ``scheduler``: together for a step scheduler, else each alone.

    Parameters
    ----------
    scheduler : str or SchedulerInfo
        As :func:`run`.
    forms : mapping of str to GraphForm
        The step's graphs by name (``'forward'``, ``'backward'``); a step
        scheduler takes any other name as a graph on its own.
    budget : Budget, optional
        As :func:`run`: one budget for every graph.
    comm_latency_ms : float, optional
        The latency (ms) the communication figures include, for a scheduler
        that costs buckets (:func:`dcsched.sim.collectives.latency_from_provenance`);
        None: the default one.
    **options
        The scheduler's own options.

    Returns
    -------
    dict of str to Plan
        One plan per graph, each order checked as :func:`run` checks it.

    Raises
    ------
    ScheduleError, OptionError, BudgetError
        As :func:`run`; a step scheduler that leaves out a graph is a ScheduleError.

    Examples
    --------
    >>> from dcsched.synthetic import layered_stack
    >>> stack = layered_stack(1)
    >>> plans = run_step("fast-free", {"forward": GraphForm(stack.forward), "backward": GraphForm(stack.backward)})
    >>> sorted(plans), plans["forward"].order[-1]
    (['backward', 'forward'], 'output')
    """
    info = scheduler if isinstance(scheduler, SchedulerInfo) else get(scheduler)
    name = info.name
    unknown = sorted(set(options) - set(info.own_options))
    if unknown:
        if set(unknown) & set(BUDGET_PARAMETERS.values()):
            raise OptionError(unknown[0], "is not an option of schedulers.run: pass budget=Budget.parse(...)")
        raise OptionError(unknown[0], f"is not an option of scheduler '{name}' (unknown: {', '.join(unknown)}; "
                                      f"it takes: {', '.join(info.options) or 'none'})")
    if info.takes_budget:
        chosen = budget if budget is not None else Budget.unlimited()
        options["budget_bytes"] = chosen.bytes
        if info.takes_scope:
            options["budget_scope"] = chosen.scope
    if info.takes_latency and comm_latency_ms is not None:
        options[LATENCY_PARAMETER] = comm_latency_ms
    with paused_gc():
        plans: dict[str, Any]
        if info.step:
            plans = info.func(dict(forms), **options)
            missing = sorted(set(forms) - set(plans)) if isinstance(plans, dict) else sorted(forms)
            if missing:
                raise ScheduleError(f"scheduler '{name}' returned no plan for graph {', '.join(missing)}")
        else:
            plans = {graph: info.func(form, **options) for graph, form in forms.items()}
        return {graph: _checked(name, forms[graph], plans[graph]) for graph in forms}


def _checked(name: str, form: GraphForm, plan: Plan) -> Plan:
    """``plan`` with the output last, its order checked (:class:`ScheduleError` names the scheduler)."""
    if not isinstance(plan, Plan):
        raise ScheduleError(f"scheduler '{name}' returned {type(plan).__name__}, not a Plan")
    # Every scheduler's order ends with the output, whatever its rule ranks there (graph.form.output_last).
    # (as a list, what output_last and check_order take; output_last hands back the same list when the
    # output already comes last)
    names = list(plan.order)
    order = output_last(form, names)
    if order is not names:
        plan = plan.with_order(order)
    try:
        form.check_order(order)
    except GraphError as exc:
        raise ScheduleError(f"scheduler '{name}' returned an invalid order: {exc}") from None
    return plan
