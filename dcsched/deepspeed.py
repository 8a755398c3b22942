"""Drop-in replacements for DeepSpeed DeepCompile's schedulers (``deepspeed.compile.list_schedule``).

Same signatures, same results (DeepSpeed 0.19.8's orders with no memory
budget), much faster, and no recursion limit::

    import dcsched.deepspeed
    import deepspeed.compile.passes.zero3_compile as z3
    z3.fast_free_schedule = dcsched.deepspeed.fast_free_schedule

(DeepCompile's passes import the function by name, so patch the module that
calls it, as above, rather than ``deepspeed.compile.list_schedule``.)

Each function takes the FX graph with DeepSpeed's ``torch.ops.dc.*`` ops (or
dcsched's) and ``node.meta['device_time']`` (ms) / ``['tensor_size']``
(bytes), and returns a new ``torch.fx.Graph`` holding the same nodes in the
new order; the input graph is left untouched. Missing costs count as 0.

>>> from dcsched.synthetic import random_graph
>>> g = random_graph(0, namespace="dc")
>>> new = fast_free_schedule(g, 0, 0, False)
>>> sorted(n.name for n in new.nodes) == sorted(n.name for n in g.nodes)
True
"""

from __future__ import annotations

import warnings

import torch.fx

from .reorder import schedule


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
