"""The memory FSDP2's policy takes on a step: what the budget ``fsdp`` names.

``dcsched train --memory-budget fsdp`` (``dcsched.backend(memory_budget="fsdp")``) plans within the peak
that dcsched's ``fsdp`` plan (FSDP2's policy: a bucket per block, one block prefetched, the root kept for the
backward) takes on the same step by the simulator, its collectives run as FSDP2 runs them. On gloo
(:data:`~dcsched.collective_issue.FSDP2_ON_GLOO`) FSDP2 issues them blocking (``unshard_async_op`` is False
by default, and the CPU has no stream to run them beside the compute), and gloo's staging copies are counted
(:mod:`dcsched.sim.staging`); elsewhere (NCCL, on its own streams: :data:`~dcsched.collective_issue.FSDP2`)
they run asynchronously, one reduce-scatter in flight. A planner given
this budget finds ``fsdp``'s own plan within it, so it also keeps within ``fsdp``'s collectives: whatever it
picks is no larger than FSDP2's policy and, by the simulator, no slower.

>>> from dcsched.graph.form import GraphForm
>>> from dcsched.synthetic import layered_stack
>>> from dcsched.collective_issue import FSDP2_ON_GLOO
>>> step = layered_stack(2)
>>> forms = {"forward": GraphForm(step.forward), "backward": GraphForm(step.backward)}
>>> fsdp_peak(forms, issue=FSDP2_ON_GLOO), fsdp_peak(forms)  # here blocking saves what gloo's copies cost
(13153920, 13153920)
"""

from __future__ import annotations

from typing import Mapping

from dcsched.budget import DEFAULT_SCOPE
from dcsched.collective_issue import FSDP2, CollectiveIssue
from dcsched.graph.form import GraphForm
from dcsched.schedulers.fsdp.scheduler import fsdp
from dcsched.sim.collectives import DEFAULT_LATENCY_MS
from dcsched.sim.plans import simulate_plan
from dcsched.sim.simulate import compile_view


def fsdp_peak(forms: Mapping[str, GraphForm], *, comm_latency_ms: float = DEFAULT_LATENCY_MS,
              scope: str = DEFAULT_SCOPE, issue: CollectiveIssue = FSDP2) -> int:
    """The largest graph peak (bytes of ``scope``) of ``fsdp``'s plan for the step, run as FSDP2 runs it.

    Parameters
    ----------
    forms : mapping of str to GraphForm
        The step's graphs (``'forward'``, ``'backward'``), with their costs.
    comm_latency_ms : float, optional
        The per-collective latency (:func:`dcsched.sim.collectives.latency_from_provenance`).
    scope : str, optional
        ``'all'`` (default) or ``'gathered'``.
    issue : CollectiveIssue, optional
        How FSDP2 issues the collectives: :data:`~dcsched.collective_issue.FSDP2` (default: asynchronous,
        one reduce-scatter in flight, no copies, as on NCCL) or
        :data:`~dcsched.collective_issue.FSDP2_ON_GLOO` (blocking, gloo's staging copies counted).

    Returns
    -------
    int
    """
    plans = fsdp(forms)
    return int(max(simulate_plan(compile_view(form, comm_latency_ms=comm_latency_ms), plans[name], name,
                                 detail=False, issue=issue).peak_in(scope)
                   for name, form in forms.items()))
