"""Test helper: a scheduler's order through the one entry, :func:`dcsched.schedulers.run`."""

from __future__ import annotations

from dcsched.budget import Budget
from dcsched.graph.form import GraphForm
from dcsched.schedulers import run


def scheduled(algo: str, graph, *, memory_budget=None, budget_scope=None, **options) -> list[str]:
    """``algo``'s order of ``graph`` (a networkx view, an FX graph or a form), node names.

    ``memory_budget`` / ``budget_scope`` are read into a :class:`~dcsched.budget.Budget` (none: no limit),
    as every entry point does.
    """
    budget = Budget.parse(memory_budget, scope=budget_scope)
    return list(run(algo, GraphForm(graph), budget=budget, **options).order)
