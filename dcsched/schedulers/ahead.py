"""``prefetch-ahead``: the naive prefetch baseline, each all-gather issued ``k`` all-gathers ahead of its need.

It keeps exactly the compute order of :mod:`dcsched.schedulers.overlap.scheduler`
(fast-free's, reduces and releases right after their inputs) and puts
all-gather number ``i`` (in the order they are needed) just before the first
reader of all-gather number ``i - k``, with no regard for memory. ``k = 0``
gathers just in time. It is the bar the ``overlap`` scheduler is measured
against in ``benchmarks/bench_quality.py``.

>>> from dcsched.synthetic import layered_stack
>>> from dcsched.graph.nxview import to_networkx, check_order
>>> view = to_networkx(layered_stack(2).forward)
>>> from dcsched.graph.form import GraphForm
>>> check_order(view, prefetch_ahead(GraphForm(view), k=2).order)
"""

from __future__ import annotations

from dcsched.errors import OptionError
from dcsched.graph.form import GraphForm
from dcsched.plan import Plan
from dcsched.schedulers.overlap.scheduler import OverlapPlanner
from dcsched.schedulers.registry import register

DEFAULT_K = 2


@register("prefetch-ahead", description="naive baseline: fast-free's compute order, each all-gather issued "
                                        "k all-gathers ahead of its need (default k=2), memory ignored")
def prefetch_ahead(form: GraphForm, *, k: int = DEFAULT_K) -> Plan:
    """fast-free's compute order with all-gather ``i`` issued ``k`` all-gathers ahead of its need.

    Parameters
    ----------
    form : GraphForm
        The graph.
    k : int, optional
        How many all-gathers ahead (default 2; 0: just in time).

    Returns
    -------
    Plan
        The order (node names); no buckets, every parameter sharded.

    Raises
    ------
    OptionError
        For a ``k`` that is not a whole number.

    Examples
    --------
    >>> from dcsched.synthetic import layered_stack
    >>> prefetch_ahead(GraphForm(layered_stack(1).forward), k=1).order[-1]
    'output'
    """
    if isinstance(k, bool) or not isinstance(k, int):
        raise OptionError("k", f"must be a whole number of all-gathers (prefetch-ahead), not {k!r}")
    planner = OverlapPlanner(form)
    return Plan(planner.names(planner.assemble(planner.ahead_slots(k))))
