"""``none``: the input order, unchanged (the baseline every report compares with)."""

from __future__ import annotations

import networkx as nx

from dcsched.schedulers.registry import register


@register("none", description="the input order, unchanged")
def input_order(view: nx.DiGraph) -> list[str]:
    return sorted(view.nodes, key=lambda name: view.nodes[name]["position"])
