"""Drop-in replacements for DeepSpeed DeepCompile's schedulers (``deepspeed.compile.list_schedule``).

Same signatures, same results (DeepSpeed 0.19.8's orders with no memory
budget, except that the output node always comes last: DeepSpeed's
``simple_prefetch`` may place it before a chain nothing reads, and the graph
would return before that chain runs; see docs/schedulers.md), much faster, and
no recursion limit::

    import dcsched.deepspeed
    import deepspeed.compile.passes.zero3_compile as z3
    z3.fast_free_schedule = dcsched.deepspeed.fast_free_schedule

(DeepCompile's passes import the function by name, so patch the module that
calls it, as above, rather than ``deepspeed.compile.list_schedule``.)

Each function takes the FX graph with DeepSpeed's ``torch.ops.dc.*`` ops (or
dcsched's) and ``node.meta['device_time']`` (ms) / ``['tensor_size']``
(bytes), and returns a new ``torch.fx.Graph`` holding the same nodes in the
new order; the input graph is left untouched. Missing costs count as 0.

For running DeepSpeed's own schedulers beside dcsched's (the golden recorder
``tools/record_golden.py`` and ``benchmarks/bench_schedule.py`` do):
:func:`to_deepspeed_graph` turns a graph with dcsched's ops into one with
DeepSpeed's, and :func:`reference_list_schedule` imports DeepSpeed 0.19.8's
scheduler module where it is installed.

>>> from dcsched.synthetic import random_graph
>>> g = random_graph(0, namespace="dc")
>>> new = fast_free_schedule(g, 0, 0, False)
>>> sorted(n.name for n in new.nodes) == sorted(n.name for n in g.nodes)
True
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.fx

from dcsched.runtime import ops
from dcsched.reorder import schedule
from dcsched.graph.roles import COMM_ROLES, role_of


def _reordered(graph: torch.fx.Graph, algo: str) -> torch.fx.Graph:
    new_graph = schedule(graph, algo)
    new_graph.lint()
    return new_graph


def fast_free_schedule(graph: torch.fx.Graph, available_mem: int, output_size: int, debug_log: bool,
                       *, scheduler_budget=None) -> torch.fx.Graph:
    """DeepSpeed's ``fast_free_schedule``: dcsched's ``fast-free`` order.

    ``available_mem``, ``output_size`` and ``debug_log`` are accepted for
    compatibility and not read (DeepSpeed reads none of them either).
    DeepSpeed 0.19.8's optional ``scheduler_budget`` is not supported: with one,
    a warning says so and the unbudgeted order is returned.
    """
    if scheduler_budget is not None:
        warnings.warn("dcsched.deepspeed.fast_free_schedule ignores scheduler_budget: it returns the order "
                      "DeepSpeed gives with no budget", RuntimeWarning, stacklevel=2)
    return _reordered(graph, "fast-free")


def simple_prefetch(graph: torch.fx.Graph, available_mem: int, output_size: int,
                    debug_log: bool) -> torch.fx.Graph:
    """DeepSpeed's ``simple_prefetch``: dcsched's ``simple-prefetch`` order (the other arguments are not read)."""
    return _reordered(graph, "simple-prefetch")


def list_schedule(graph: torch.fx.Graph) -> torch.fx.Graph:
    """DeepSpeed's ``list_schedule`` (which fails on every graph), as intended: dcsched's ``list`` order."""
    return _reordered(graph, "list")


def to_deepspeed_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of ``graph`` with DeepSpeed's ``torch.ops.dc.*`` ZeRO-3 ops and every cost present (missing: 0).

    >>> from dcsched.synthetic import random_graph
    >>> ds = to_deepspeed_graph(random_graph(0))
    >>> sorted({str(n.target) for n in ds.nodes if n.name.startswith("allgather")})
    ['dc.allgather_param.default']
    """
    ops.ensure_deepspeed_ops()
    new = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    for node in graph.nodes:
        copy = new.node_copy(node, lambda n: env[n.name])
        if role_of(node) in COMM_ROLES:
            op_name = node.target.name().split("::")[1].split(".")[0]  # 'dcsched::allgather_param' -> ...
            copy.target = getattr(torch.ops.dc, op_name).default
        for key in ("device_time", "tensor_size"):
            value = node.meta.get(key)
            copy.meta[key] = 0 if value is None else value
        env[node.name] = copy
    return new


def reference_list_schedule():
    """DeepSpeed 0.19.8's ``(deepspeed.compile.list_schedule, deepspeed.compile.util)``, ready to call.

    Only for comparing against DeepSpeed (golden orders, benchmarks): its
    extension is not built, every aten op is touched so its aliasing table is
    complete (as in a long-lived process), and the recursion limit is raised
    for its recursive search. Raises ``ImportError`` without DeepSpeed and
    ``RuntimeError`` for another version.
    """
    ops.ensure_deepspeed_ops()  # stand-in torch.ops.dc.* with DeepSpeed's schemas
    import deepspeed
    import deepspeed.compile.util as ds_util
    from deepspeed.compile import list_schedule as ds_list_schedule

    if deepspeed.__version__ != "0.19.8":
        raise RuntimeError(f"need deepspeed 0.19.8, found {deepspeed.__version__}")
    ds_util.dc_handle = object()  # DeepSpeed must not build its extension
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, name = qualified.partition("::")
        if namespace == "aten":
            try:
                getattr(torch.ops.aten, name.split(".")[0])
            except (AttributeError, RuntimeError):
                pass
    ds_util.get_no_copy_ops.cache_clear()
    sys.setrecursionlimit(1_000_000)
    return ds_list_schedule, ds_util
