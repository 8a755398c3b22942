"""Last uses of values, with DeepSpeed DeepCompile's ``get_last_uses`` semantics.

DeepCompile decides when a gathered parameter can be freed from the *last use*
of every value. The rule, applied on the networkx view (:mod:`dcsched.graph.nxview`):
visit the nodes from last to first; for each visited node ``u``, visit the
values it reads (args, then kwargs, in reading order). For such a value ``n``:

- if ``n`` has no last use yet, it becomes ``u``; but when ``u`` is an
  aliasing op (a view, an in-place op, ``wait_allgather``: the view's
  ``aliasing`` attribute), it becomes ``u``'s own last use (or ``u`` if ``u``
  has none), because reading an alias keeps the source alive;
- if ``n`` already has a last use ``L`` and ``u`` is aliasing, ``u``'s own last
  use (or ``u``) replaces ``L`` when it stands later in the input order.

Like DeepSpeed 0.19.8 (and unlike its schedulers) this reads kwargs too.
A value nobody reads has no last use.

>>> import torch, torch.fx
>>> from dcsched.graph.nxview import to_networkx
>>> g = torch.fx.Graph()
>>> x = g.placeholder("x")
>>> t = g.create_node("call_function", torch.ops.aten.t.default, (x,), name="t")
>>> y = g.create_node("call_function", torch.ops.aten.relu.default, (x,), name="y")
>>> z = g.create_node("call_function", torch.ops.aten.relu.default, (t,), name="z")
>>> _ = g.output((y,))
>>> last_uses(to_networkx(g))["x"]      # read last through the view t, by z
'z'
>>> last_uses_by_user(to_networkx(g))["z"]
['t', 'x']
"""

from __future__ import annotations

from typing import Sequence

import networkx as nx

from dcsched.graph.form import GraphForm


def last_use_indices(preds: Sequence[Sequence[int]], aliasing: Sequence[bool]) -> tuple[list, dict]:
    """The rule on an indexed graph whose index is the input order.

    Returns ``(last_use, by_user)``: ``last_use[i]`` is the index of node
    ``i``'s last use (or None) and ``by_user[u]`` lists, in DeepSpeed's order,
    the nodes whose last use ``u`` is.
    """
    n = len(preds)
    last_use: list[int | None] = [None] * n
    by_user: dict[int, list[int]] = {}
    for u in range(n - 1, -1, -1):
        if aliasing[u]:
            # Reading through an alias extends the source's life to the alias's last use.
            stand_in = last_use[u]
            if stand_in is None:
                stand_in = u
            for v in preds[u]:
                known = last_use[v]
                if known is None:
                    last_use[v] = stand_in
                    by_user.setdefault(stand_in, []).append(v)
                elif stand_in > known:
                    last_use[v] = stand_in
                    by_user.setdefault(stand_in, []).append(v)
                    by_user[known].remove(v)
        else:
            for v in preds[u]:
                if last_use[v] is None:
                    last_use[v] = u
                    by_user.setdefault(u, []).append(v)
    return last_use, by_user


def _indexed(view: nx.DiGraph):
    form = GraphForm(view)
    return form.names, form.preds, form.aliasing


def last_uses(view: nx.DiGraph) -> dict[str, str]:
    """``{value: its last use}`` for every node that has a reader."""
    names, preds, aliasing = _indexed(view)
    last_use, _ = last_use_indices(preds, aliasing)
    return {names[i]: names[u] for i, u in enumerate(last_use) if u is not None}


def last_uses_by_user(view: nx.DiGraph) -> dict[str, list[str]]:
    """``{user: the values whose last use it is}``, in DeepSpeed's order (users with none omitted)."""
    names, preds, aliasing = _indexed(view)
    _, by_user = last_use_indices(preds, aliasing)
    return {names[u]: [names[v] for v in values] for u, values in sorted(by_user.items()) if values}
