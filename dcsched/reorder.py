"""``dcsched.schedule``: reorder an FX graph with a named scheduler.

>>> import torch, torch.fx
>>> g = torch.fx.Graph()
>>> x = g.placeholder("x")
>>> _ = g.output((x,))
>>> [n.name for n in schedule(g, "none").nodes]
['x', 'output']
"""

from __future__ import annotations

import torch.fx

from dcsched import schedulers
from dcsched.budget import Budget, budget_for
from dcsched.errors import OptionError
from dcsched.graph.form import GraphForm, paused_gc
from dcsched.graph.nxview import to_fx
from dcsched.plan import Plan


def plan(graph: torch.fx.Graph, algo: str = "fast-free", *, budget: Budget | None = None,
         memory_budget=None, budget_scope: str | None = None, **options) -> Plan:
    """Scheduler ``algo``'s :class:`~dcsched.plan.Plan` for ``graph`` (order checked).

    Parameters
    ----------
    graph : torch.fx.Graph
        Any FX graph with dcsched's or DeepSpeed's ``dc`` ZeRO-3 ops.
    algo : str, optional
        A registered scheduler (default ``'fast-free'``).
    budget : Budget, optional
        The memory budget, already read.
    memory_budget : str, int or float, optional
        Or the budget as given (``'40GiB'``, bytes, ``'unlimited'``); read here
        once (:func:`dcsched.budget.budget_for`: none given, no limit, as a bare
        graph records no device). Not both.
    budget_scope : str, optional
        ``'all'`` (default) or ``'gathered'``.
    **options
        The scheduler's own options (``k=3``).

    Returns
    -------
    Plan

    Raises
    ------
    OptionError
        For an unreadable budget or scope, or an option the scheduler does not take.
    BudgetError
        For a budget no order of the graph fits in.

    Examples
    --------
    >>> from dcsched.synthetic import layered_stack
    >>> p = plan(layered_stack(1).forward, "deepcompile", memory_budget="80GB")
    >>> p.order[-1], p.buckets[0].kind
    ('output', 'allgather')
    """
    info = schedulers.get(algo)  # looked up once, here (an unknown name fails first); run takes it as it is
    if budget is not None and memory_budget is not None:
        raise OptionError("memory_budget", "is given twice: pass `budget` or `memory_budget`, not both")
    schedulers.check_budget_taken([info], memory_budget=budget is not None or memory_budget is not None,
                                  budget_scope=budget_scope is not None)
    if info.takes_budget and (budget is None or budget_scope is not None):
        budget = budget_for(memory_budget if budget is None else budget, graph, scope=budget_scope)
    with paused_gc():
        return schedulers.run(info, GraphForm(graph), budget=budget, **options)


def order(graph: torch.fx.Graph, algo: str = "fast-free", **options) -> list[str]:
    """The node names of ``graph`` in the order scheduler ``algo`` picks (checked topological).

    Takes the arguments of :func:`plan`; the graph form comes straight from the
    FX graph (no networkx view: at 10^5 nodes the view costs more than the order).

    Examples
    --------
    >>> import torch.fx
    >>> g = torch.fx.Graph(); _ = g.output(g.placeholder("x"))
    >>> order(g, "none")
    ['x', 'output']
    """
    return list(plan(graph, algo, **options).order)


def schedule(graph: torch.fx.Graph, algo: str = "fast-free", **options) -> torch.fx.Graph:
    """A new FX graph with ``graph``'s nodes in the order scheduler ``algo`` picks.

    Works on any FX graph with dcsched's or DeepSpeed's ``dc`` ZeRO-3 ops; node
    costs come from ``node.meta['device_time']`` (ms) and ``['tensor_size']``
    (bytes).

    Parameters
    ----------
    graph : torch.fx.Graph
        The graph to reorder (left untouched).
    algo : str, optional
        A registered scheduler (default ``'fast-free'``).
    **options
        As for :func:`plan`: ``memory_budget`` (bytes, ``'40GiB'`` or
        ``'unlimited'``; none given: no limit) and ``budget_scope`` for the
        schedulers that take one, or ``budget=`` a :class:`~dcsched.budget.Budget`;
        the scheduler's own options.

    Returns
    -------
    torch.fx.Graph
        The same nodes in the new order. A plan's buckets and residency are not
        part of an FX graph (use :func:`plan` for them).

    Raises
    ------
    OptionError, BudgetError, ScheduleError
        See :func:`plan`.

    Examples
    --------
    See the module docstring.
    """
    # One pause for the whole call: each time the collector comes back on, its first collections traverse
    # every object of the large graphs in memory.
    with paused_gc():
        return to_fx(graph, order(graph, algo, **options))
