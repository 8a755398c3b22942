"""Steady figures: measured times put on a coarse logarithmic grid before a plan is made from them.

A measured profile times each node once or a few times, and on a shared
machine those times move from run to run by tens of percent (measured below);
a plan made from them would follow the noise (one run bucketing a block
differently from the next). Training plans from figures rounded to the nearest
point of a grid of :data:`STEPS_PER_DOUBLING` points per factor of two
(:func:`quantise_ms`): each point stands for a band of about
+-``2**(1/(2*STEPS_PER_DOUBLING)) - 1`` around it, wider than the jitter
of most nodes, so most nodes fall on the same point in every run, and a plan
depends on the graph, the budget and the real costs, not on one
measurement's noise. Only measured figures are rounded (analytic and modelled
ones are the same in every run), and the measured per-collective latency with
them.

Why this grid (``STEPS_PER_DOUBLING = 1``: powers of two): over 5 fresh
2-rank runs of the example GPT on this project's shared 2-core machine
(load 10-14), a node's measured time was within a factor
``2**0.17`` (12%) of its median over the runs for half the nodes, ``2**0.6``
for 9 in 10 (``docs/train.md``, One plan per job). A grid finer than the
jitter rounds noise into different points run to run; powers of two keep each
node's figure within a factor 1.41 of what was measured, which moves the
simulator's step time by less than the jitter itself does, and put 9 nodes in
10 on the same point in every run.

>>> quantise_ms(0.3), quantise_ms(0.36), quantise_ms(0.0)
(0.25, 0.5, 0.0)
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence

from dcsched.bundle.core import Bundle

#: Grid points per factor of two of a steady figure (:func:`quantise_ms`): 1, powers of two (module docstring).
STEPS_PER_DOUBLING = 1
#: ``provenance['figures']`` of a bundle whose measured times were made steady.
STEADY = (f"measured times rounded to the nearest of {STEPS_PER_DOUBLING} point(s) per factor of two "
          "(dcsched.profile.steady)")


def quantise_ms(ms: float, steps_per_doubling: int = STEPS_PER_DOUBLING) -> float:
    """``ms`` rounded to the nearest point ``2**(k/steps_per_doubling)`` (nearest in log scale); 0, negative and
    non-finite figures unchanged.

    >>> quantise_ms(3.0, 2), quantise_ms(1.0)
    (2.8284271247461903, 1.0)
    """
    if not (ms > 0 and math.isfinite(ms)):
        return ms
    return 2.0 ** (round(math.log2(ms) * steps_per_doubling) / steps_per_doubling)


def collective_fit(points: Sequence[tuple[float, float]]) -> float:
    """Milliseconds per byte of the collectives ``points`` (``(bytes, ms)``), by the Theil-Sen estimator: the
    median of the slopes between every two points of different sizes (0 where all have one size, never
    negative); a few collectives slowed down by a busy machine do not move it.

    >>> round(collective_fit([(100, 2.0), (200, 3.0), (300, 4.0), (400, 5.0), (500, 60.0)]), 6)
    0.01
    """
    slopes = [(y2 - y1) / (x2 - x1) for k, (x1, y1) in enumerate(points) for x2, y2 in points[k + 1:] if x2 != x1]
    return max(0.0, statistics.median(slopes)) if slopes else 0.0


def _steady_collectives(bundle: Bundle) -> None:
    """Every measured all-gather's and reduce-scatter's time made ``latency + bytes * slope``: the latency
    measured on its own (``provenance['comm_latency_ms']``, the median of many runs of a one-float all-gather:
    steadier than any one collective's few runs), the slope its kind's :func:`collective_fit` over the step's
    collectives, at the node's bytes (``tensor_size``)."""
    from dcsched.graph.roles import Role, role_of
    latency = bundle.provenance.get("comm_latency_ms")
    if not str(bundle.provenance.get("comm_time", "")).startswith("measured") or not isinstance(latency, float):
        return
    for role in (Role.ALLGATHER, Role.REDUCE):
        nodes = [node for graph in bundle.graphs.values() for node in graph.nodes if role_of(node) is role
                 and node.meta.get("time_source") == "measured" and isinstance(node.meta.get("device_time"), float)
                 and isinstance(node.meta.get("tensor_size"), int)]
        points = [(float(node.meta["tensor_size"]), node.meta["device_time"]) for node in nodes]
        slope = collective_fit(points)
        for node, (size, _) in zip(nodes, points):
            node.meta["device_time"] = latency + slope * size


def steady_figures(bundle: Bundle, steps_per_doubling: int = STEPS_PER_DOUBLING) -> None:
    """Round ``bundle``'s measured figures in place (:func:`quantise_ms`): every node's ``device_time`` whose
    ``time_source`` is ``measured``, and ``provenance['comm_latency_ms']`` where the collectives were measured.

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
    latency = bundle.provenance.get("comm_latency_ms")
    if str(bundle.provenance.get("comm_time", "")).startswith("measured") and isinstance(latency, (int, float)):
        bundle.provenance["comm_latency_ms"] = quantise_ms(float(latency), steps_per_doubling)
    _steady_collectives(bundle)
    rounded = False
    for graph in bundle.graphs.values():
        for node in graph.nodes:
            if node.meta.get("time_source") == "measured" and "device_time" in node.meta:
                node.meta["device_time"] = quantise_ms(float(node.meta["device_time"]), steps_per_doubling)
                rounded = True
    if rounded:
        bundle.provenance["figures"] = STEADY
