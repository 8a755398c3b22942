"""One plan on every rank: what the ranks of a process group agree on before the step's first collective.

Every rank captures, profiles and schedules its own copy of the step, and the
schedulers are pure functions of a graph and its figures. So the ranks run one
plan exactly when they hold the same graphs with the same figures. Two things
break that, and each has a guard here:

* **Different programs.** A rank that built another model, fed other input
  shapes or loaded another bundle would pair its collectives with the wrong
  parameters (gloo: a silent mix-up when sizes match, an abort when they do
  not; NCCL: a hang). :func:`check_same` compares a fingerprint of each part
  of the step (:func:`step_fingerprints`, :func:`plan_fingerprints`) across
  the ranks and raises :class:`RankMismatch`, one line naming the ranks that
  differ, on every rank alike.
* **Different figures.** A measured profile times each node on its own rank;
  the times differ by noise, and an order that depends on them would differ
  too. :func:`agree_figures` replaces every node's ``device_time`` with the
  element-wise maximum over the ranks (a synchronous step waits for its
  slowest rank at every collective) and the target memory with the smallest
  rank's, before any scheduler reads them.

Every function is a no-op without a process group of more than one rank, so
one process runs exactly as before.

>>> from dcsched import replay
>>> sorted(step_fingerprints(replay.example_bundle()))
['backward graph', 'forward graph', 'input table', 'parameter table']
>>> check_same(step_fingerprints(replay.example_bundle()), "compiled")  # one process: nothing to compare
"""

from __future__ import annotations

import hashlib
import json
from typing import Mapping

import torch

from dcsched.bundle.core import Bundle
from dcsched.bundle.graph_encoding import encode_graph
from dcsched.errors import DcschedError
from dcsched.plan import Plan

#: Node figures that are measured, so may differ between ranks before :func:`agree_figures`.
_MEASURED_META = ("device_time", "time_source")


class RankMismatch(DcschedError):
    """The ranks of a process group hold different steps or plans (they would pair collectives wrongly)."""


def group_size(group=None) -> int:
    """The process group's size; 1 where there is none."""
    import torch.distributed as dist
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _device(group=None) -> torch.device:
    """Where this group's collectives take their tensors: the current GPU under NCCL, else the CPU."""
    import torch.distributed as dist
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _digest(value) -> bytes:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).digest()


def _graph_data(graph, figures: bool) -> list[dict]:
    nodes = encode_graph(graph)
    if not figures:
        for node in nodes:
            for key in _MEASURED_META:
                node["meta"].pop(key, None)
    return nodes


def step_fingerprints(bundle: Bundle) -> dict[str, bytes]:
    """What a rank compiled, part by part: the parameter table, the inputs, each graph (figures left out).

    Two ranks with equal fingerprints hold the same step, node for node, so
    their graphs line up for :func:`agree_figures`.
    """
    parts = {
        "parameter table": [[p.name, list(p.shape), str(p.dtype), p.ds_id] for p in bundle.params],
        "input table": [[i.name, list(i.shape), str(i.dtype)] for i in bundle.inputs]
        + [bundle.forward_placeholders, bundle.backward_placeholders, bundle.num_user_outputs],
    }
    for name, graph in bundle.graphs.items():
        parts[f"{name} graph"] = _graph_data(graph, figures=False)
    return {what: _digest(value) for what, value in parts.items()}


def _plan_data(plan: Plan | None) -> dict:
    """A graph's buckets and the residency as plain data; no plan reads as an empty one (the same run)."""
    plan = plan if plan is not None else Plan(())
    return {"buckets": [[b.kind, list(b.members), list(b.ds_ids)] for b in plan.buckets],
            "residency": sorted(plan.residency.items())}


def plan_fingerprints(bundle: Bundle) -> dict[str, bytes]:
    """What a rank will run: each graph in its scheduled order with its figures and its plan's buckets and
    residency (``bundle.plans``), and the tables beside them.

    Examples
    --------
    >>> from dcsched import replay
    >>> from dcsched.plan import Plan
    >>> bundle = replay.example_bundle()
    >>> kept = bundle.reordered({}, plans={"forward": Plan((), residency={0: "kept"})})
    >>> plan_fingerprints(bundle)["forward plan"] == plan_fingerprints(kept)["forward plan"]
    False
    """
    parts = step_fingerprints(bundle)
    for name, graph in bundle.graphs.items():
        # The order and its figures, and what runs as one collective: two ranks bucketing one order
        # differently would issue collectives of different sizes.
        parts[f"{name} plan"] = _digest([_graph_data(graph, figures=True), _plan_data(bundle.plans.get(name))])
    return parts


def differing_ranks(digests: list[bytes]) -> list[int]:
    """The ranks outside the largest group of equal digests (rank 0's group wins a tie)."""
    counts: dict[bytes, int] = {}
    for digest in digests:
        counts[digest] = counts.get(digest, 0) + 1
    majority = max(counts, key=lambda d: (counts[d], d == digests[0]))
    return [rank for rank, digest in enumerate(digests) if digest != majority]


def ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def check_same(fingerprints: Mapping[str, bytes], what: str, group=None) -> None:
    """Raise :class:`RankMismatch` on every rank unless all ranks passed equal ``fingerprints``.

    ``what`` says what the ranks did with the step (``compiled``, ``scheduled``,
    ``loaded``). The ranks first exchange one 32-byte digest of all parts (a
    collective of the same size on every rank, so ranks holding different
    programs meet here safely before any collective of the step); only when
    those differ do they exchange the parts, to name the first that differs.
    """
    world = group_size(group)
    if world == 1:
        return
    import torch.distributed as dist
    whole = hashlib.sha256(b"".join(name.encode() + b"\0" + digest for name, digest in fingerprints.items()))
    mine = torch.frombuffer(bytearray(whole.digest()), dtype=torch.uint8).to(_device(group))
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    wholes = [bytes(t.cpu().tolist()) for t in everyone]
    if not differing_ranks(wholes):
        return
    parts: list = [None] * world
    dist.all_gather_object(parts, dict(fingerprints), group=group)
    names = list(dict.fromkeys(name for rank_parts in parts for name in rank_parts))
    for name in names:
        odd = differing_ranks([rank_parts.get(name, b"") for rank_parts in parts])
        if odd:
            break
    else:  # the same parts in another order: name the whole
        name, odd = "step", differing_ranks(wholes)
    others = [r for r in range(world) if r not in odd]
    raise RankMismatch(f"{ranks_text(odd)} {what} a different {name} from {ranks_text(others)}: every rank must run "
                       "the same model, input shapes and options, so that all ranks make one plan")


def agree_figures(bundle: Bundle, group=None) -> None:
    """Make ``bundle``'s measured figures the same on every rank, in place (see the module docstring).

    Call it after :func:`check_same` on :func:`step_fingerprints`, so the
    graphs line up node for node. ``device_time``: the element-wise maximum
    over the ranks; ``provenance['target_memory_bytes']``: the smallest known.
    """
    world = group_size(group)
    if world == 1:
        return
    import torch.distributed as dist
    device = _device(group)
    nodes = [node for graph in bundle.graphs.values() for node in graph.nodes]
    times = torch.tensor([float(node.meta.get("device_time", 0.0)) for node in nodes], dtype=torch.float64,
                         device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    for node, ms in zip(nodes, times.cpu().tolist()):
        if "device_time" in node.meta:
            node.meta["device_time"] = ms
    memory = bundle.provenance.get("target_memory_bytes")
    smallest = torch.tensor([float(memory) if memory is not None else float("inf")], dtype=torch.float64,
                            device=device)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN, group=group)
    if smallest.isfinite().item():  # unknown on every rank stays unknown
        bundle.provenance["target_memory_bytes"] = int(smallest.item())
