"""Steady figures: measured times made robust and put on a coarse grid before training plans from them.

A measured profile times each node a few times, and on a shared machine those
times move from run to run by a few percent typically and by 10-1000x where a
process was descheduled (a collective waits for the slower rank, so both see
it); a plan made from them would follow the noise. :func:`steady_figures`
makes a profiled bundle's measured figures steady, in place:

1. each measured all-gather and reduce-scatter costs the latency measured on
   its own (``provenance['comm_latency_ms']``: the median of many one-float
   all-gathers, the steadiest figure of the profile) plus the bandwidth term
   of the run's link (the interconnect table's, the same in every run; without
   a topology its kind's Theil-Sen slope over the step's collectives,
   :func:`collective_fit`), on a grid relative to the latency (a collective
   within a grid step of the latency costs the latency): the spikes and noise of
   single collectives move nothing;
2. every other measured figure, and the latency, is put on a grid of
   :data:`STEPS_PER_DOUBLING` points per factor of two *relative to the step's
   scale* (:func:`scale_ms`: the sum of its measured compute times), and the
   scale on a grid of its own (:func:`quantise_ms`): ``figure = quantise(scale)
   x quantise(figure / scale)``.

Why relative to the scale: a machine whose load changes between runs (or
within one: the other engineers' jobs on a shared host) moves every figure of
a run together, by up to 1.7x here between fresh runs, and a grid of absolute
times puts a figure near a rounding midpoint on different points run to run
(the measured latency, 0.21-0.35 ms over runs at one time of day, lies about
the midpoint 0.354 ms of 0.25 and 0.5, and one run in five planned its
backward otherwise). The planner's choices depend on the figures' ratios
alone: its simulator is linear in time and its budget is in bytes, so
multiplying every figure by a power of two (exact in floating point) changes
no comparison and no plan. The common scale is therefore rounded on its own,
where it moves every figure together and nothing in the plan, and each figure
is rounded as a ratio to the scale, which a load shared by the whole run does
not move (the latency over the scale lay within 0.19-0.24 in the same runs,
all on one point of the grid).

Why powers of two (``STEPS_PER_DOUBLING = 1``): over 5 fresh 2-rank runs of
a small GPT on the project's shared 2-core machine, after the median of 5
timed runs per node, a node's time lay within ``2**0.03``-``2**0.05`` of its
median over the runs for half the nodes and within ``2**0.27``-``2**0.50`` for
9 in 10 (``docs/train.md``, One plan per job). A finer grid puts those nodes on
different points run to run; powers of two keep each ratio within a factor
1.41 of its measurement (each figure within a factor 2: 1.41 for the ratio and
1.41 for the scale). Analytic and modelled figures do not move and are left
alone. A ratio near the midpoint of two grid points can still round either
way: a stored plan (``dcsched train --plan FILE``) is what makes a job's plan
one for good.

>>> quantise_ms(0.3), quantise_ms(0.36), quantise_ms(0.0)
(0.25, 0.5, 0.0)
>>> relative_ms(0.354, 1.48), relative_ms(0.354 * 0.95, 1.48 * 0.95)  # the run's load moves both: one plan
(0.5, 0.25)
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence

from dcsched.bundle.core import Bundle
from dcsched.costmodels.topology import Topology
from dcsched.graph.roles import Role, role_of

#: Grid points per factor of two of a steady figure (:func:`quantise_ms`): 1, powers of two (module docstring).
STEPS_PER_DOUBLING = 1
#: ``provenance['figures']`` of a bundle whose measured times were made steady.
STEADY = (f"measured times rounded to the nearest of {STEPS_PER_DOUBLING} point(s) per factor of two, relative to "
          "the step's measured compute (dcsched.profile.steady)")


def quantise_ms(ms: float, steps_per_doubling: int = STEPS_PER_DOUBLING) -> float:
    """``ms`` rounded to the nearest point ``2**(k/steps_per_doubling)`` (nearest in log scale); 0, negative and
    non-finite figures unchanged.

    >>> quantise_ms(3.0, 2), quantise_ms(1.0)
    (2.8284271247461903, 1.0)
    """
    if not (ms > 0 and math.isfinite(ms)):
        return ms
    return 2.0 ** (round(math.log2(ms) * steps_per_doubling) / steps_per_doubling)


def relative_ms(ms: float, scale: float, steps_per_doubling: int = STEPS_PER_DOUBLING) -> float:
    """``ms`` as ``quantise_ms(scale) * quantise_ms(ms / scale)``: on the grid relative to the step's ``scale``
    (module docstring), so that figures measured under one load keep their ratios whatever the load; a scale
    that is no positive finite number leaves ``ms`` on the absolute grid (:func:`quantise_ms`).

    >>> relative_ms(0.3, 1.0), relative_ms(0.3, 1.45), relative_ms(0.3, 0.0)
    (0.25, 0.5, 0.25)
    """
    if not (scale > 0 and math.isfinite(scale)) or not (ms > 0 and math.isfinite(ms)):
        return quantise_ms(ms, steps_per_doubling)
    return quantise_ms(scale, steps_per_doubling) * quantise_ms(ms / scale, steps_per_doubling)


def scale_ms(bundle: Bundle) -> float:
    """The step's scale: the sum of its measured compute figures (every node measured that is not an all-gather
    or a reduce), the figure a run's load moves as it moves each of them, and the steadiest (a sum of many).
    0 where none was measured."""
    measured = (node.meta.get("device_time") for graph in bundle.graphs.values() for node in graph.nodes
                if node.meta.get("time_source") == "measured" and role_of(node) not in (Role.ALLGATHER, Role.REDUCE))
    return math.fsum(float(ms) for ms in measured
                     if isinstance(ms, (int, float)) and math.isfinite(ms) and ms > 0)


def collective_fit(points: Sequence[tuple[float, float]]) -> float:
    """Milliseconds per byte of the collectives ``points`` (``(bytes, ms)``), by the Theil-Sen estimator: the
    median of the slopes between every two points of different sizes (0 where all have one size, never
    negative); a few collectives slowed down by a busy machine do not move it.

    >>> round(collective_fit([(100, 2.0), (200, 3.0), (300, 4.0), (400, 5.0), (500, 60.0)]), 6)
    0.01
    """
    slopes = [(y2 - y1) / (x2 - x1) for k, (x1, y1) in enumerate(points) for x2, y2 in points[k + 1:] if x2 != x1]
    return max(0.0, statistics.median(slopes)) if slopes else 0.0


def _steady_collectives(bundle: Bundle, steps_per_doubling: int, topology: Topology | None) -> bool:
    """Every measured all-gather's and reduce-scatter's time made ``latency + bandwidth term`` on the grid
    relative to the latency (whether any was: the steady latency, ``provenance['comm_latency_ms']``, given).

    The latency is the one measured on its own (the median of many runs of a one-float all-gather: steadier than
    any one collective's few runs). The bandwidth term is ``topology``'s link's (the interconnect table's, as a
    modelled collective's: the same in every run), else its kind's :func:`collective_fit` over the step's
    collectives times the node's bytes (``tensor_size``)."""
    from dcsched.costmodels.base import modelled_comm_time
    latency = bundle.provenance.get("comm_latency_ms")
    if not str(bundle.provenance.get("comm_time", "")).startswith("measured") or not isinstance(latency, float) \
            or not latency > 0:
        return False
    for role in (Role.ALLGATHER, Role.REDUCE):
        nodes = [node for graph in bundle.graphs.values() for node in graph.nodes if role_of(node) is role
                 and node.meta.get("time_source") == "measured" and isinstance(node.meta.get("device_time"), float)
                 and isinstance(node.meta.get("tensor_size"), int)]
        if topology is not None:
            link_latency = topology.link.latency_us / 1000
            terms = [max(0.0, modelled_comm_time(node, topology) - link_latency) for node in nodes]
        else:
            slope = collective_fit([(float(node.meta["tensor_size"]), node.meta["device_time"]) for node in nodes])
            terms = [slope * node.meta["tensor_size"] for node in nodes]
        for node, term in zip(nodes, terms):
            # on the grid relative to the latency: a collective within a grid step of it costs the latency
            node.meta["device_time"] = latency * quantise_ms((latency + term) / latency, steps_per_doubling)
    return True


def steady_figures(bundle: Bundle, steps_per_doubling: int = STEPS_PER_DOUBLING, *,
                   topology: Topology | None = None) -> None:
    """Make ``bundle``'s measured figures steady in place (see the module docstring): the measured latency
    (``provenance['comm_latency_ms']``) and every measured node's ``device_time`` rounded (:func:`quantise_ms`),
    the measured collectives as the latency plus ``topology``'s bandwidth term (where given, else a fit).

    Examples
    --------
    >>> from dcsched import replay
    >>> bundle = replay.example_bundle()
    >>> node = next(iter(bundle.forward.nodes))
    >>> node.meta.update(device_time=0.3, time_source="measured")
    >>> steady_figures(bundle)
    >>> node.meta["device_time"], bundle.provenance["figures"].startswith("measured times rounded")
    (0.25, True)
    """
    scale = scale_ms(bundle)
    latency = bundle.provenance.get("comm_latency_ms")
    if str(bundle.provenance.get("comm_time", "")).startswith("measured") and isinstance(latency, (int, float)):
        bundle.provenance["comm_latency_ms"] = relative_ms(float(latency), scale, steps_per_doubling)
    steady_comm = _steady_collectives(bundle, steps_per_doubling, topology)
    rounded = False
    for graph in bundle.graphs.values():
        for node in graph.nodes:
            if node.meta.get("time_source") == "measured" and "device_time" in node.meta and not (
                    steady_comm and role_of(node) in (Role.ALLGATHER, Role.REDUCE)):
                node.meta["device_time"] = relative_ms(float(node.meta["device_time"]), scale, steps_per_doubling)
                rounded = True
    if rounded:
        bundle.provenance["figures"] = STEADY
