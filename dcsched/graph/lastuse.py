"""Last uses of values, with DeepSpeed DeepCompile's ``get_last_uses`` semantics.

DeepCompile decides when a gathered parameter can be freed from the *last use*
of every value. The rule, applied to a graph in its input order (node numbers, each node's inputs):
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

>>> last_use, by_user = last_use_indices([[], [0], [0], [1]], [False, True, False, False])
>>> last_use  # x (0) read last through the view t (1), by z (3); y (2) and z unread
[3, 3, None, None]
>>> by_user  # the values whose last use each user is (y's moved to z)
{3: [1, 0], 2: []}
"""

from __future__ import annotations

from typing import Sequence




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
