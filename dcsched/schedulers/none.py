"""``none``: the input order, unchanged (the baseline every report compares with)."""

from __future__ import annotations

from dcsched.graph.form import GraphForm
from dcsched.plan import Plan
from dcsched.schedulers.registry import register


@register("none", description="the input order, unchanged")
def input_order(form: GraphForm) -> Plan:
    """The graph's own order (the form numbers nodes by input position).

    Parameters
    ----------
    form : GraphForm
        The graph.

    Returns
    -------
    Plan
        The input order; no buckets, every parameter sharded.

    Examples
    --------
    >>> from dcsched.synthetic import layered_stack
    >>> g = layered_stack(1).forward
    >>> list(input_order(GraphForm(g)).order) == [n.name for n in g.nodes]
    True
    """
    return Plan(form.names)
