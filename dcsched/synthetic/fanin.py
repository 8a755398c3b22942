"""Wide fan-in graphs: one compute node reading many gathered parameters, then a long chain of releases.

A concatenation of many experts' outputs or a loss over many heads reads many
parameters at once; DeepCompile then follows that one use with one release per
parameter, each passing the previous one's value on, so the graph holds a node
of in-degree ``n`` and a release chain of length ``n``. The family stresses the
schedulers' per-step work: any step that looks at every pending wait or release
makes the whole schedule quadratic in ``n``.
"""

from __future__ import annotations

import random

import torch
import torch.fx

from dcsched.synthetic.builder import GraphBuilder

aten = torch.ops.aten


def fanin_graph(n_params: int, *, kind: str = "forward", seed: int = 0, groups: int = 1,
                distinct_sizes: bool = False, namespace: str = "dcsched", tie_prone: bool = False) -> torch.fx.Graph:
    """``n_params`` parameters read by ``groups`` concatenations, each followed by its chain of releases.

    Forward (``kind='forward'``): placeholders (parameters, one input), every
    parameter's all-gather and wait, then per group one ``aten.cat`` reading
    the group's waits (and, from the second group on, the previous group's
    result: the groups run one after another), followed by one release per
    parameter of the group in a chain; the output reads the last release.
    With one group and ``n`` parameters that is ``4n + 3`` nodes.

    Backward (``kind='backward'``): the same uses, then per parameter its
    gradient (a ``mul`` of the cat's result and a tangent) and its
    ``reduce_grad``; the output reads the reduces.

    Parameter sizes are drawn from ``seed``: one of three sizes each (many
    parameters of one size, as experts are; an all-gather's time follows its
    size, so they tie), or with ``distinct_sizes`` every one its own. Other
    times are drawn from ``seed`` (``tie_prone`` as in
    :func:`dcsched.synthetic.random_graph`: a few values, ties common).

    Parameters
    ----------
    n_params : int
        The parameters (at least 1).
    kind : {'forward', 'backward'}
    seed : int
    distinct_sizes : bool
    groups : int
        How many concatenations the parameters are split among (1 to ``n_params``), in order.
    namespace : {'dcsched', 'dc'}
        The communication ops' namespace.
    tie_prone : bool

    Returns
    -------
    torch.fx.Graph
        The graph, its nodes carrying ``device_time`` (ms) and ``tensor_size`` (bytes).

    Raises
    ------
    ValueError
        For a ``kind``, ``n_params`` or ``groups`` outside the ranges above.

    Examples
    --------
    >>> g = fanin_graph(5)
    >>> len(g.nodes), max(len(n.all_input_nodes) for n in g.nodes)
    (23, 5)
    >>> b = fanin_graph(3, kind="backward", groups=2)
    >>> sum(1 for n in b.nodes if n.name.startswith("reduce_ds_param"))
    3
    """
    if kind not in ("forward", "backward"):
        raise ValueError("kind must be 'forward' or 'backward'")
    if n_params < 1:
        raise ValueError("n_params must be at least 1")
    if not 1 <= groups <= n_params:
        raise ValueError("groups must be between 1 and n_params")
    rng = random.Random(seed)
    backward = kind == "backward"
    b = GraphBuilder(rng, namespace, graph_id=1 if backward else 0, tie_prone=tie_prone)
    names = [f"primals_{i + 1}" for i in range(n_params)]
    sizes = rng.sample(range(4096, 4096 + 64 * 16 * n_params, 64), n_params) if distinct_sizes else \
        [rng.choice((4096, 16384, 65536)) for _ in names]
    for i, name in enumerate(names):
        b.param(name, i, sizes[i])
    x = b.placeholder("tangents_1" if backward else "input_1")
    for name in names:
        b.gather(name, b.full_bytes[name])
    bounds = [n_params * g // groups for g in range(groups + 1)]
    value, outputs = x, []
    for lo, hi in zip(bounds, bounds[1:]):
        members = names[lo:hi]
        reads = [b.waits[p] for p in members] + ([] if value is x else [value])
        value = b.use(aten.cat.default, ([*reads],), members)
        if backward:
            for p in members:
                outputs.append(b.grad_reduce(b.op(aten.mul.Tensor, (value, x)), p, p))
    return b.finish([value] + outputs if backward else [value])
