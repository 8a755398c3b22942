"""A fingerprint of a graph as the schedulers see it (golden data stores it)."""

from __future__ import annotations

import torch.fx


def graph_digest(graph: torch.fx.Graph) -> str:
    """A fingerprint of what the schedulers see: names, ops, inputs, costs (comm namespaces alike).

    Golden data stores it, so a changed generator or bundle cannot pass for the recorded one.

    >>> from dcsched.synthetic import random_graph
    >>> graph_digest(random_graph(0)) == graph_digest(random_graph(0, namespace="dc"))
    True
    """
    import hashlib

    from dcsched.graph.nxview import input_nodes
    from dcsched.graph.roles import qualified_name

    h = hashlib.sha256()
    for node in graph.nodes:
        target = qualified_name(node.target) if node.op == "call_function" else str(node.target)
        if target.startswith("dc."):
            target = "dcsched." + target[3:]
        ins = ",".join(n.name for n in input_nodes(node))
        h.update(f"{node.name}|{node.op}|{target}|{ins}|{node.meta.get('device_time')!r}|"
                 f"{node.meta.get('tensor_size')!r}\n".encode())
    return h.hexdigest()[:20]
