"""The simulator's figures for a replayed bundle, re-sharded to the replay's world size."""

from __future__ import annotations

from typing import Iterable

import torch
import torch.fx

from dcsched.bundle.core import Bundle
from dcsched.collective_issue import SIMULATOR, CollectiveIssue
from dcsched.errors import DcschedError
from dcsched.bundle.resharding import resharded
from dcsched.graph.specs import flat_nodes, recorded_bytes


def _meta_bytes(nodes: Iterable[torch.fx.Node]) -> int:
    return sum(recorded_bytes(node) for node in nodes)


def simulate_graph(bundle: Bundle, name: str, *, issue: CollectiveIssue = SIMULATOR):
    """Graph ``name`` of ``bundle`` simulated as its plan runs it (buckets, kept parameters), or in its own
    order without one, at the bundle's latency, its collectives issued as ``issue`` says
    (:func:`dcsched.sim.plans.simulate_plan`'s)."""
    from dcsched.plan import Plan
    from dcsched.sim.collectives import latency_from_provenance
    from dcsched.sim.plans import simulate_plan
    from dcsched.sim.simulate import compile_view

    compiled = compile_view(bundle.graphs[name], comm_latency_ms=latency_from_provenance(bundle.provenance))
    return simulate_plan(compiled, bundle.plans.get(name) or Plan(()), name, detail=False, check=False,
                         issue=issue)


def simulated_figures(bundle: Bundle, world_size: int | None = None, *,
                      issue: CollectiveIssue = SIMULATOR) -> tuple[dict | None, str]:
    """The simulator's step figures for ``bundle``'s own order, and a note on how they were made.

    With ``world_size`` given and different from the one the bundle was
    profiled for, parameter shards and reduced gradients are re-sized to it
    first, so the figures compare like for like with a replay at that size.

    Returns ``(None, why)`` when the simulator is not installed or the bundle
    lacks costs. A graph with a plan runs it (its buckets as one collective
    each, its kept parameters gathered across); ``issue``: how its
    collectives are issued (:data:`~dcsched.collective_issue.PROCESS_GROUP`:
    as a process group runs them, one reduce-scatter in flight;
    :class:`~dcsched.collective_issue.CollectiveIssue`). The forward and
    backward are simulated separately; ``step_ms`` is their sum and ``peak_bytes`` the larger of the forward's peak
    and the backward's peak plus what the real step holds across it (the
    forward's inputs and user outputs that the backward does not take).
    """
    profiled_for = bundle.provenance.get("world_size")
    resized = world_size is not None and isinstance(profiled_for, int) and profiled_for != world_size
    if resized and world_size is not None:
        bundle = resharded(bundle, world_size)
    try:
        forward = simulate_graph(bundle, "forward", issue=issue)
        backward = simulate_graph(bundle, "backward", issue=issue) if bundle.backward is not None else None
    except DcschedError as exc:
        return None, f"not simulated: {exc}"
    peak = forward.peak_bytes
    held = 0
    if backward is not None:
        output = next(node for node in bundle.forward.nodes if node.op == "output")
        outputs = flat_nodes(output.args)
        saved = {outputs[int(e["index"])] for e in bundle.backward_placeholders
                 if e.get("kind") == "saved" and 0 <= int(e["index"]) < len(outputs)}
        inputs = [node for node in bundle.forward.nodes if node.op in ("placeholder", "get_attr")]
        users = outputs[:bundle.num_user_outputs]
        held = _meta_bytes(n for n in dict.fromkeys(inputs + users) if n not in saved)
        peak = max(peak, backward.peak_bytes + held)
    figures = {
        "peak_bytes": int(peak),
        "step_ms": forward.step_ms + (backward.step_ms if backward else 0.0),
        "forward_ms": forward.step_ms,
        "backward_ms": backward.step_ms if backward else None,
        "forward_peak_bytes": forward.peak_bytes,
        "backward_peak_bytes": backward.peak_bytes if backward else None,
        "held_across_bytes": held,
    }
    source = bundle.provenance.get("time_source") or bundle.provenance.get("device") or "bundle costs"
    note = f"dcsched.simulate on the bundle's costs ({source})"
    if resized:
        note += f"; sizes re-sharded from the profiled world size {profiled_for} to this run's {world_size}"
    return figures, note


#: Printed under a replay of a bundle whose compute times were measured on the CPU (errors seen: docs/simulator.md).
CPU_TIMING_CAVEAT = ("costs measured on the CPU: the simulated step time is a rough guide only (errors from -67% "
                     "to +85x seen; see docs/simulator.md, 'Step time on CPU-profiled bundles')")


def timing_caveat(provenance: dict) -> str | None:
    """The caveat on simulated step times for a bundle whose compute times were measured on the CPU, else None.

    The bundle's provenance says how its times were obtained: ``cost_model``
    (``measured``, ``analytic``, ``calibrated``) and ``device`` (what they were
    measured on, ``cpu (...)`` or ``cuda:N (...)``). Analytic and calibrated
    times are estimates for a GPU, not CPU measurements, so they carry none.

    >>> timing_caveat({"cost_model": "measured", "device": "cpu (x86_64, 2 threads)"}) is not None
    True
    >>> timing_caveat({"cost_model": "analytic", "device": "h100 (analytic, not run)"}) is None
    True
    """
    measured = provenance.get("cost_model") == "measured"
    on_cpu = str(provenance.get("device", "")).startswith("cpu")
    return CPU_TIMING_CAVEAT if measured and on_cpu else None


def percent_error(simulated: float | None, measured: float | None) -> float | None:
    """(simulated - measured) / measured in percent; None where either is missing or measured is 0.

    >>> percent_error(110, 100)
    10.0
    """
    if simulated is None or measured is None or not measured:
        return None
    return 100.0 * (simulated - measured) / measured
