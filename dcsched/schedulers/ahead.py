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
>>> check_order(view, prefetch_ahead(view, k=2))
"""

from __future__ import annotations

import networkx as nx

from dcsched.errors import DcschedError
from dcsched.schedulers.overlap.scheduler import OverlapPlanner
from dcsched.schedulers.registry import register

DEFAULT_K = 2


@register("prefetch-ahead", description="naive baseline: fast-free's compute order, each all-gather issued "
                                        "k all-gathers ahead of its need (default k=2), memory ignored", takes_form=True)
def prefetch_ahead(view: nx.DiGraph, *, k: int = DEFAULT_K) -> list[str]:
    if isinstance(k, bool) or not isinstance(k, int):
        raise DcschedError(f"prefetch-ahead: k must be a whole number of all-gathers, not {k!r}")
    planner = OverlapPlanner(view)
    return planner.names(planner.assemble(planner.ahead_slots(k)))
