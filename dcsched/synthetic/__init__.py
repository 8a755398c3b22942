"""Synthetic ZeRO-3 graphs shaped the way DeepCompile builds them, for tests and benchmarks.

Four generators, each deterministic for a given seed (they use only
``random.Random(seed)``):

- :func:`random_graph`: a random forward- or backward-style DAG with a few
  parameters; random costs; shared parameters (several uses, several
  releases), multi-output ops read through ``getitem``, view ops, and on
  request dependencies passed only through kwargs.
- :func:`layered_stack`: a transformer-like stack of any depth (forward and
  backward graphs), for benchmarks.
- :func:`moe_graph`: a random Mixtral-like stack (router, many parallel
  same-size experts per layer), forward or backward.
- :func:`fanin_graph`: a wide fan-in: one concatenation reading N gathered
  parameters, then a chain of N releases (forward or backward).

Every graph follows DeepCompile's insertion rules (see
``../shared/reference/README.md``): all placeholders first, then for each
used parameter ``allgather_ds_param_{ph}_{ds_id}`` and right after it
``wait_allgather_ds_param__{ph}_{ds_id}``; every real use (seen through views)
reads the wait and is followed by ``release_ds_param_{ph}_{use}_{ds_id}``
passing the use's output through (after the first ``getitem`` for a
multi-output use) with ``n_users`` = the number of uses; in backward graphs,
``reduce_ds_param_{param}`` right after each gradient, and the output reads
the reduce node. Node meta: ``device_time`` (ms) and ``tensor_size`` (bytes).

The graphs are for scheduling: shapes are not tracked and the graphs are not
meant to be run. One module per generator; :mod:`.builder` emits the nodes
for all of them, :func:`graph_digest` fingerprints a graph for golden data.

>>> g = random_graph(3)
>>> g2 = random_graph(3)
>>> [n.name for n in g.nodes] == [n.name for n in g2.nodes]
True
>>> pair = layered_stack(2)
>>> sum(1 for n in pair.forward.nodes if n.name.startswith("allgather_ds_param"))
35
"""

from __future__ import annotations

from dcsched.synthetic.builder import GraphBuilder, GraphPair
from dcsched.synthetic.digest import graph_digest
from dcsched.synthetic.fanin import fanin_graph
from dcsched.synthetic.moe import moe_graph
from dcsched.synthetic.random_dag import random_graph
from dcsched.synthetic.stacks import layered_stack

__all__ = ["GraphBuilder", "GraphPair", "fanin_graph", "graph_digest", "layered_stack", "moe_graph",
           "random_graph"]
