"""What the tensors a forward saves for its backward hold in memory: their storages, each counted once.

A backward graph takes each saved tensor as its own placeholder, and the
simulator counts each at its recorded size (elements x element size). The
runtime holds storages, not tensors, and two cases differ:

- **Aliases.** Two saved tensors that are views of one storage in the
  forward (``view_10`` and ``detach_14`` of one attention output) hold that
  storage once, until the later of the two is last read.
- **Views larger or smaller than their storage.** A saved ``expand`` (GQA's
  repeated keys and values with one key-value head) records the expanded
  size but holds the unexpanded storage; a saved slice holds the whole
  storage it views.

:func:`saved_storage_bytes` gives, per backward placeholder whose figure
differs, the bytes the step's memory counts for it: each shared storage's
bytes (the forward's storage root, :class:`dcsched.sim.simulate.CompiledGraph`)
on the alias last read in the backward's captured order, 0 on the others.
Storages the forward gathers (all-gathered parameters: the runtime releases
them in place) keep their recorded figures.

>>> from dcsched import replay
>>> saved_storage_bytes(replay.example_bundle())
{}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dcsched.graph.form import COMPUTE, PLACEHOLDER

if TYPE_CHECKING:
    from dcsched.sim.simulate import CompiledGraph


def _saved_roots(bundle) -> tuple[dict[int, list[int]], CompiledGraph, list[Any]]:
    """The forward's storage roots of the saved outputs: {root: [backward placeholder positions]}, the forward's
    compiled view and the forward's output nodes (found once per bundle within :func:`dcsched.sim.reuse.reusing`)."""
    from dcsched.sim.reuse import once
    return once("saved roots", bundle, lambda: _find_saved_roots(bundle))


def _find_saved_roots(bundle) -> tuple[dict[int, list[int]], CompiledGraph, list[Any]]:
    from dcsched.graph.specs import flat_nodes
    from dcsched.sim.reuse import compiled
    forward = compiled(bundle.forward, assume_zero=True)
    output = next(node for node in bundle.forward.nodes if node.op == "output")
    outputs = flat_nodes(output.args)
    groups: dict[int, list[int]] = {}
    for position, entry in enumerate(bundle.backward_placeholders):
        if entry.get("kind") != "saved" or not 0 <= int(entry["index"]) < len(outputs):
            continue
        node = outputs[int(entry["index"])]
        number = forward.index.get(str(getattr(node, "name", "")))
        if number is not None:
            groups.setdefault(forward.root[number], []).append(position)
    return groups, forward, outputs


def saved_storage_bytes(bundle) -> dict[str, int]:
    """Backward placeholder name -> the bytes to count for it where that differs from its recorded figure (see
    the module docstring); empty without a backward graph."""
    from dcsched.graph.specs import recorded_bytes
    if bundle.backward is None:
        return {}
    groups, forward, _ = _saved_roots(bundle)
    placeholders = [node for node in bundle.backward.nodes if node.op == "placeholder"]
    position_of = {node: k for k, node in enumerate(bundle.backward.nodes)}

    def last_read(node) -> int:
        return max((position_of[user] for user in node.users), default=position_of[node])

    out: dict[str, int] = {}
    for root, members in groups.items():
        if forward.kind[root] not in (COMPUTE, PLACEHOLDER) or forward.pinned[root]:
            continue  # a gathered parameter (released in place) or a parameter shard: counted as recorded
        nodes = [placeholders[k] for k in members if k < len(placeholders)]
        if not nodes:
            continue
        carrier = max(nodes, key=last_read)
        storage = int(forward.owned[root])
        for node in nodes:
            count = storage if node is carrier else 0
            if count != recorded_bytes(node):
                out[node.name] = count
    return out


def saved_forward_roots(bundle) -> frozenset[int]:
    """The forward's storage roots (node numbers of its compiled view) that the saved outputs live in."""
    if bundle.backward is None:
        return frozenset()
    return frozenset(_saved_roots(bundle)[0])
