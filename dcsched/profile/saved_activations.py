"""What a partitioned step saves for its backward, and what it would save without its checkpointed regions.

The min-cut partitioner's forward returns the step's outputs first and then
what it saves for the backward; :func:`saved_bytes` adds up the sizes of the
saved tensors the forward computes (a saved forward input, a parameter or the
batch, is no activation: it exists anyway). :func:`without_checkpointing`
copies a joint graph with the recompute tags of checkpointed regions removed,
keeping those dcsched puts on parameter views
(:data:`dcsched.profile.checkpointing.PARAM_VIEWS_REGION`), so partitioning the
copy (with no activation memory budget) gives the same step as captured
without checkpointing. The recording
backend (:mod:`dcsched.profile.recording`) does both and the bundle's provenance
keeps the figures (:mod:`dcsched.bundle.saved_memory`).
"""

from __future__ import annotations

import torch
import torch.fx

from dcsched.profile import checkpointing

#: The region id every node of a joint graph gets where it has no other (what the min-cut partitioner expects).
DEFAULT_REGION = 1


def tensor_bytes(node: torch.fx.Node) -> int:
    """The bytes of the tensor ``node`` makes (its ``val`` meta); 0 for a non-tensor or a symbolic size."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return 0
    try:
        return int(value.numel()) * value.element_size()
    except (TypeError, RuntimeError):  # a symbolic size: not a figure
        return 0


def saved_bytes(forward: torch.fx.Graph, num_fwd_outputs: int) -> int:
    """Bytes of the tensors a partitioned forward saves for the backward that it computes itself.

    The forward's outputs past the first ``num_fwd_outputs`` are the saved values (then sizes); each
    distinct node counts once, forward inputs not at all.

    Examples
    --------
    >>> import torch, torch.fx
    >>> g = torch.fx.Graph()
    >>> x = g.placeholder("x"); x.meta["val"] = torch.empty(4, 8)
    >>> y = g.call_function(torch.relu, (x,)); y.meta["val"] = torch.empty(4, 8)
    >>> out = g.output((y, x, y, y))
    >>> saved_bytes(g, 1)  # y once (128 bytes), x a forward input
    128
    """
    output = next(iter(forward.find_nodes(op="output")))
    values = list(output.args[0])[num_fwd_outputs:]
    seen: set[torch.fx.Node] = set()
    total = 0
    for value in values:
        if isinstance(value, torch.fx.Node) and value.op != "placeholder" and value not in seen:
            seen.add(value)
            total += tensor_bytes(value)
    return total


def _in_checkpointed_region(node: torch.fx.Node) -> bool:
    return "recompute" in node.meta and node.meta.get("ac_graph_id") != checkpointing.PARAM_VIEWS_REGION


def has_checkpointed_regions(joint: torch.fx.Graph) -> bool:
    """Whether any node of ``joint`` carries a checkpoint policy other than dcsched's on parameter views."""
    return any(_in_checkpointed_region(node) for node in joint.nodes)


def checkpoints(joint: torch.fx.Graph) -> bool:
    """Whether partitioning ``joint`` recomputes by request: checkpointed regions, or an activation memory
    budget below 1 (``torch._functorch.config.activation_memory_budget``: the partitioner's own choice)."""
    from torch._functorch import config as functorch_config
    return functorch_config.activation_memory_budget < 1.0 or has_checkpointed_regions(joint)


def without_checkpointing(joint: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``joint`` with the checkpointed regions' tags removed (parameter views keep theirs).

    The nodes' meta is copied shallowly (the tensors in it are shared, the tags are the copy's own), so the
    original is left as it was for its own partitioning.
    """
    graph = torch.fx.Graph()
    mapping: dict[torch.fx.Node, torch.fx.Node] = {}
    copied = graph.graph_copy(joint.graph, mapping, return_output_node=True)
    if copied is not None:
        outputs, output = copied
        graph.output(outputs).meta = dict(output.meta)
    for node in graph.nodes:
        if node.meta.get("ac_graph_id") == checkpointing.PARAM_VIEWS_REGION:
            continue
        node.meta.pop("recompute", None)
        node.meta["ac_graph_id"] = DEFAULT_REGION
    return torch.fx.GraphModule(joint, graph)
