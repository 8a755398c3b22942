"""The memory / step-time trade-off of the ``overlap`` scheduler.

:func:`sweep` schedules one graph with ``overlap`` at a range of memory
budgets and simulates each order: one :class:`SweepRow` per budget (budget,
all-tensor peak, gathered peak, step time, exposed communication, overlap).
It is the core of ``dcsched schedule graph.pt --algo overlap --sweep``. The
budget-independent work (fast-free's order, the skeleton, the just-in-time
simulation) is done once, so each point costs one placement and one
simulation.

>>> from dcsched.synthetic import layered_stack
>>> rows = sweep(layered_stack(2).forward, points=3)
>>> rows[0].budget_bytes == rows[0].min_budget_bytes, rows[-1].budget_bytes
(True, inf)
>>> all(r.gathered_peak_bytes <= r.budget_bytes for r in rows)
True
>>> rows[0].step_ms >= rows[-1].step_ms
True
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import networkx as nx
import torch.fx

from dcsched.bundle.core import Bundle
from dcsched.errors import DcschedError
from dcsched.graph.nxview import to_networkx
from dcsched.graph.form import paused_gc
from dcsched.budget import DEFAULT_MARGIN, DEFAULT_SCOPE, UNLIMITED, Budget, check_scope  # noqa: F401
from dcsched.schedulers.overlap.scheduler import Overlap


@dataclasses.dataclass(frozen=True)
class SweepRow:
    """One point of the trade-off curve. Bytes and milliseconds; ``budget_bytes`` may be ``inf``."""

    budget_bytes: float
    scope: str
    min_budget_bytes: int
    peak_bytes: int
    gathered_peak_bytes: int
    step_ms: float
    exposed_comm_ms: float
    overlap_pct: float
    lower_bound_ms: float
    tight_lower_bound_ms: float

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        if data["budget_bytes"] == UNLIMITED:
            data["budget_bytes"] = None  # JSON has no infinity: None means unlimited
        return data


def _view(graph) -> nx.DiGraph:
    if isinstance(graph, torch.fx.Graph):
        return to_networkx(graph)
    if isinstance(graph, nx.DiGraph):
        return graph
    raise DcschedError(f"sweep takes an FX graph or its networkx view, not {type(graph).__name__}")


def default_budgets(scheduler: Overlap, scope: str = "gathered", points: int = 8) -> list[float]:
    """``points`` budgets from the smallest that works to what unlimited memory uses, then unlimited.

    In the gathered scope the list also holds fast-free's gathered peak and
    max(fast-free's gathered peak, 2 x the largest all-gather) when they lie
    in that range (the budgets ``benchmarks/bench_quality.py`` checks).
    """
    low = scheduler.min_budget(scope)
    _, unlimited = scheduler.plan(UNLIMITED, scope)
    high = unlimited.gathered_peak_bytes if scope == "gathered" else unlimited.peak_bytes
    high = max(high, low)
    budgets = {low}
    steps = max(1, points - 1)
    for i in range(1, steps + 1):
        budgets.add(low + (high - low) * i // steps)
    if scope == "gathered":
        ff = scheduler.fast_free.gathered_peak_bytes
        for extra in (ff, max(ff, 2 * scheduler.largest_gather)):
            if low <= extra <= high:
                budgets.add(extra)
    return sorted(budgets) + [UNLIMITED]


def sweep(graph: torch.fx.Graph | nx.DiGraph, budgets: Iterable | None = None, *, scope: str = DEFAULT_SCOPE,
          points: int = 8, name: str | None = None) -> list[SweepRow]:
    """Schedule ``graph`` with ``overlap`` at each budget and simulate.

    Parameters
    ----------
    graph : torch.fx.Graph or networkx.DiGraph
        The graph.
    budgets : iterable, optional
        Budgets as :meth:`dcsched.budget.Budget.parse` reads them (bytes, ``'6GiB'``,
        ``'unlimited'``), each read once here; None: :func:`default_budgets`.
    scope : str, optional
        ``'all'`` (default) or ``'gathered'``.
    points : int, optional
        How many budgets :func:`default_budgets` picks.
    name : str, optional
        The graph's name in messages.

    Returns
    -------
    list of SweepRow
        In ascending budget order.

    Raises
    ------
    BudgetError
        For a budget below the smallest that works (the message says which that is).
    OptionError
        For an unreadable budget or scope.

    Examples
    --------
    See the module docstring.
    """
    check_scope(scope)
    with paused_gc():
        scheduler = Overlap(_view(graph), name=name)
        if budgets is None:
            chosen = default_budgets(scheduler, scope, points)
        else:
            chosen = sorted(Budget.parse(b, scope).bytes for b in budgets)
        results = [(budget, scheduler.plan(budget, scope)[1]) for budget in chosen]
    rows = []
    for budget, result in results:
        rows.append(SweepRow(
            budget_bytes=budget, scope=scope, min_budget_bytes=scheduler.min_budget(scope),
            peak_bytes=result.peak_bytes, gathered_peak_bytes=result.gathered_peak_bytes,
            step_ms=result.step_ms, exposed_comm_ms=result.exposed_comm_ms, overlap_pct=result.overlap_pct,
            lower_bound_ms=result.lower_bound_ms, tight_lower_bound_ms=result.tight_lower_bound_ms))
    return rows


def sweep_bundle(bundle: Bundle, *, scope: str = DEFAULT_SCOPE, progress=None) -> dict[str, list[SweepRow]]:
    """:func:`sweep` of every graph of ``bundle`` (graph name -> rows); ``progress(message)`` before each."""
    curves = {}
    for name, graph in bundle.graphs.items():
        if progress:
            progress(f"{name}: sweeping memory budgets with overlap")
        curves[name] = sweep(graph, scope=scope, name=name)
    return curves
