"""``overlap-plan``'s step 6: small parameters needed first kept whole on every rank (``'replicated'``).

A step's forward waits on its first collective before its first compute can
start: nothing runs before it to hide it behind. A parameter that is never
sharded needs no gather (DeepSpeed keeps every parameter below
``stage3_param_persistence_threshold``, 1e5 elements by default, whole on
every rank for this reason); its gradient is all-reduced instead of
reduce-scattered (twice the bytes), and its bytes are resident for the whole
step. For the parameters the forward reads first, which the backward reads
last, that residency costs next to nothing, and a plan that keeps them gathered
from the forward to the backward (``'kept'``) holds them over nearly the same
span anyway.

:func:`replicated_head` tries replicating the small members (at most
``max_bytes`` each) of the forward's first collective, the first 1, 2, 4, ...
and all of them, simulating both graphs of the step
(:meth:`~dcsched.schedulers.overlap_plan.candidates.GraphPlanner.replicating`), and keeps
the set that shortens the step most within the budget and the collective cap.
A reduce bucket that mixes replicated and sharded gradients is two collectives
(:func:`dcsched.runtime.commplan.comm_plan` splits it), so a partial set can
cost the step a collective: the cap allows it, and only where the step is
shorter by more than a collective's latency for each collective added.
"""

from __future__ import annotations

from typing import Mapping

from dcsched.schedulers.overlap_plan.candidates import Candidate, GraphPlanner, doubling_counts
from dcsched.sim.collectives import latency_time_ms

#: DeepSpeed's default persistence threshold (1e5 elements) in bytes at 4 bytes an element: the largest
#: parameter ``overlap-plan`` replicates by default.
REPLICATE_MAX_BYTES = 400_000
#: Step times this close are equal (ms): replication must shorten the step by more.
SHORTER_MS = 1e-9


def replicated_head(planners: Mapping[str, GraphPlanner], chosen: Mapping[str, Candidate], kept: frozenset,
                    budget: float, cap: int, max_bytes: int = REPLICATE_MAX_BYTES
                    ) -> tuple[frozenset, tuple[float, int]]:
    """The ds_ids ``overlap-plan`` replicates: small members of the forward's first collective (module docstring).

    Parameters
    ----------
    planners : mapping of str to GraphPlanner
        The step's planners by graph name; only a step with a ``'forward'`` and a ``'backward'`` replicates.
    chosen : mapping of str to Candidate
        Each graph's chosen candidate (its order and buckets stay as they are).
    kept : frozenset of int
        The step's kept parameters (ds_ids); a replicated one is no longer kept.
    budget : float
        The budget for each graph's peak (bytes of the planners' scope).
    cap : int
        The most collectives the step may issue (or as many as the plan issues already, where that is more).
    max_bytes : int, optional
        The largest parameter (gathered bytes) to replicate; 0: none.

    Returns
    -------
    replicated : frozenset of int
        The ds_ids to replicate; empty where no set shortens the step within ``budget`` and ``cap``.
    figures : tuple of float and int
        The step (ms) and collectives with them replicated.
    """
    forward, backward = planners.get("forward"), planners.get("backward")
    step_now = sum(c.step_ms for c in chosen.values())
    collectives_now = sum(c.collectives for c in chosen.values())
    if forward is None or backward is None or max_bytes <= 0:
        return frozenset(), (step_now, collectives_now)
    form = forward.form
    small = list(dict.fromkeys(form.ds_id[m] for m in forward.first_collective(chosen["forward"])
                               if form.size[m] <= max_bytes))
    latency = forward.orders.latency_ms
    best_key: tuple | None = None
    best: frozenset = frozenset()
    for count in doubling_counts(len(small)):
        trial = frozenset(small[:count])
        figures = [planner.replicating(chosen[name], kept, trial) for name, planner in planners.items()]
        step, collectives, peak = sum(f[0] for f in figures), sum(f[1] for f in figures), max(f[2] for f in figures)
        # a collective more must save at least what the cost model charges one (its latency): the simulator
        # charges no CPU for issuing it, which on gloo costs more than that
        worth = step_now - SHORTER_MS - latency_time_ms(max(0, collectives - collectives_now), latency_ms=latency)
        if peak > budget or collectives > max(cap, collectives_now) or step >= worth:
            continue
        key = (step, collectives, peak)
        if best_key is None or key < best_key:
            best_key, best = key, trial
    return best, (best_key[:2] if best_key is not None else (step_now, collectives_now))

