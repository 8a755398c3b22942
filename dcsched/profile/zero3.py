"""Insert ZeRO-3 ops into captured forward/backward graphs, where DeepCompile inserts them.

Every trainable parameter is treated as sharded. For each parameter placeholder
that has readers:

* ``allgather_ds_param_{placeholder}_{ds_id}`` right after the placeholder
  (args ``(placeholder, graph_id, ds_id)``, kwargs ``{"dtype": ...}``), and
  right after it ``wait_allgather_ds_param__{placeholder}_{ds_id}`` (two
  underscores), which every former reader of the parameter now reads. A graph
  output that returned the parameter keeps returning the placeholder (the
  shard), as the backward re-gathers it.
* If the parameter's only reader is a cast to a narrower dtype (autocast,
  bf16), the cast is folded into the all-gather's ``dtype``.
* The parameter's *real uses* are found through views (ops whose result
  aliases their input) before anything is inserted; after each use comes
  ``release_ds_param_{placeholder}_{use}_{ds_id}`` with args
  ``(use, graph_id, ds_id, n_users)``, ``n_users`` being the number of uses.
  The use's readers are rewired to the release (it passes its input through),
  so the release is ordered after the use. A use that returns a tuple is
  released after its first ``getitem``.
* In the backward graph, ``reduce_ds_param_{param}`` right after each
  parameter's gradient, ``{param}`` being the parameter's forward placeholder
  name (as DeepCompile names it); the graph output reads the reduce node.
* Finally all placeholders move to the head of the graph.

The functions return new graphs; the ones given are modified in place on the
way (they are the caller's copies).

>>> import torch, torch.fx
>>> g = torch.fx.Graph()
>>> w, x = g.placeholder("primals_1"), g.placeholder("primals_2")
>>> t = g.create_node("call_function", torch.ops.aten.t.default, (w,), name="t")
>>> mm = g.create_node("call_function", torch.ops.aten.mm.default, (x, t), name="mm")
>>> _ = g.output((mm, w))
>>> g = add_gather_and_release(g, [ParamNode("primals_1", 0, torch.float32)], graph_id=0)
>>> [n.name for n in g.nodes]  # doctest: +NORMALIZE_WHITESPACE
['primals_1', 'primals_2', 'allgather_ds_param_primals_1_0', 'wait_allgather_ds_param__primals_1_0', 't',
 'mm', 'release_ds_param_primals_1_mm_0', 'output']
"""

from __future__ import annotations

import dataclasses
import operator
from collections import defaultdict

import torch
import torch.fx

from dcsched.runtime import ops
from dcsched.graph.roles import is_aliasing


@dataclasses.dataclass(frozen=True)
class ParamNode:
    """A parameter placeholder of a graph: its node name, ds_id and the full parameter's dtype."""

    name: str
    ds_id: int
    dtype: torch.dtype


def _insert_after(graph: torch.fx.Graph, node: torch.fx.Node, target, extra_args, kwargs, name: str) -> torch.fx.Node:
    """A call to ``target(node, *extra_args, **kwargs)`` placed right after ``node``, which takes over its readers."""
    readers = list(node.users)
    with graph.inserting_after(node):
        new = graph.create_node("call_function", target, (node, *extra_args), dict(kwargs), name=name)
    for reader in readers:
        reader.replace_input_with(node, new)
    return new


def _output_node(graph: torch.fx.Graph) -> torch.fx.Node:
    for node in reversed(graph.nodes):
        if node.op == "output":
            return node
    raise ValueError("graph has no output node")


def real_uses(graph: torch.fx.Graph) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """For each node, the nodes that read its value other than through views (graph output excluded).

    A reader that only makes a view (or returns an alias) forwards the question
    to its own real uses. A node reading a value twice counts twice, as in
    DeepSpeed's ``get_real_uses``.
    """
    uses: dict[torch.fx.Node, list[torch.fx.Node]] = defaultdict(list)

    def record(value: torch.fx.Node, reader: torch.fx.Node) -> None:
        if reader.op == "output":
            return
        if is_aliasing(reader):
            uses[value].extend(uses[reader])
        else:
            uses[value].append(reader)

    for reader in reversed(graph.nodes):
        torch.fx.node.map_arg(reader.args, lambda v, reader=reader: record(v, reader))
        torch.fx.node.map_arg(reader.kwargs, lambda v, reader=reader: record(v, reader))
    return uses


def narrowing_cast_dtype(node: torch.fx.Node) -> torch.dtype | None:
    """The dtype ``node`` casts to, if it is a plain dtype cast (as autocast emits), else None."""
    if node.op != "call_function":
        return None
    if node.target is torch.ops.prims.convert_element_type.default:
        return node.args[1]
    if node.target is torch.ops.aten._to_copy.default and set(node.kwargs) == {"dtype"}:
        return node.kwargs["dtype"]
    return None


def _with_dtype(val, dtype):
    if isinstance(val, torch.Tensor) and dtype is not None and val.dtype != dtype:
        return val.to(dtype)
    return val


def move_placeholders_to_head(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of ``graph`` with every placeholder first (in their order), the other nodes after them in order."""
    nodes = list(graph.nodes)
    ordered = [n for n in nodes if n.op == "placeholder"] + [n for n in nodes if n.op != "placeholder"]
    new = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in ordered:
        env[node] = new.node_copy(node, lambda n: env[n])
    new.lint()
    return new


def add_gather_and_release(graph: torch.fx.Graph, params: list[ParamNode], graph_id: int) -> torch.fx.Graph:
    """All-gather, wait and releases for each parameter in ``params`` (processed in that order)."""
    by_name = {n.name: n for n in graph.nodes}
    uses_of = real_uses(graph)
    output = _output_node(graph)
    for param in params:
        placeholder = by_name[param.name]
        if not placeholder.users:
            continue
        dtype = param.dtype
        cast = None
        if len([u for u in placeholder.users if u.op != "output"]) == 1:
            first_reader = next(iter(placeholder.users))
            cast_dtype = narrowing_cast_dtype(first_reader)
            if cast_dtype is not None and cast_dtype.itemsize < dtype.itemsize:
                cast, dtype = first_reader, cast_dtype
        ds_id = param.ds_id
        gather = _insert_after(graph, placeholder, ops.allgather_param, (graph_id, ds_id), {"dtype": dtype},
                               f"allgather_ds_param_{placeholder.target}_{ds_id}")
        gather.meta.update(ds_id=ds_id, val=_with_dtype(placeholder.meta.get("val"), dtype))
        # The graph output keeps the shard (the placeholder), not the gathered copy.
        output.replace_input_with(gather, placeholder)
        wait = _insert_after(graph, gather, ops.wait_allgather, (graph_id, ds_id), {},
                             f"wait_allgather_ds_param__{placeholder.target}_{ds_id}")
        wait.meta.update(ds_id=ds_id, val=gather.meta.get("val"))

        if cast is not None:
            uses = uses_of[cast]
            for reader in list(cast.users):
                reader.replace_input_with(cast, wait)
            graph.erase_node(cast)
        else:
            uses = uses_of[placeholder]
            if not uses:
                # Only returned by the graph: return the gathered value then.
                output.replace_input_with(placeholder, wait)

        for use in uses:
            # A release takes a tensor: after a tuple-returning use, release
            # after the first getitem of it instead.
            after = next((r for r in use.users if r.op == "call_function" and r.target is operator.getitem), use)
            release = _insert_after(graph, after, ops.release_param, (graph_id, ds_id, len(uses)), {},
                                    f"release_ds_param_{placeholder.target}_{after.name}_{ds_id}")
            release.meta.update(ds_id=ds_id, val=after.meta.get("val"))
    return move_placeholders_to_head(graph)


def add_reduces(graph: torch.fx.Graph, grads: list[tuple[str, int, str]], graph_id: int) -> torch.fx.Graph:
    """``reduce_ds_param_{param}`` right after each gradient: ``grads`` lists (param name, ds_id, gradient node name).

    Gradient nodes are named, not looked up in the output, because a gradient
    that is also a real use of a parameter is read by the output through its
    release: the reduce still goes right after the gradient itself.
    """
    by_name = {n.name: n for n in graph.nodes}
    for param_name, ds_id, grad_name in grads:
        grad = by_name[grad_name]
        reduce = _insert_after(graph, grad, ops.reduce_grad, (graph_id, ds_id), {}, f"reduce_ds_param_{param_name}")
        reduce.meta.update(ds_id=ds_id, val=grad.meta.get("val"))
    return move_placeholders_to_head(graph)


def insert_forward(graph: torch.fx.Graph, params: list[ParamNode], graph_id: int = 0) -> torch.fx.Graph:
    """The forward graph with its parameters gathered and released (``params`` in placeholder order)."""
    return add_gather_and_release(graph, params, graph_id)


def insert_backward(graph: torch.fx.Graph, params: list[ParamNode], grad_index: dict[str, int],
                    graph_id: int = 1) -> torch.fx.Graph:
    """The backward graph with gathers/releases for the parameters it reads and a reduce per gradient.

    ``params`` are all parameters in forward placeholder order; the backward
    reads those saved for it under the same placeholder names. ``grad_index``
    maps a parameter's placeholder name to the backward output holding its
    gradient.
    """
    by_name = {p.name: p for p in params}
    in_backward = [by_name[n.name] for n in graph.nodes if n.op == "placeholder" and n.name in by_name]
    outputs = _output_node(graph).args[0]
    grads = [(p.name, p.ds_id, outputs[grad_index[p.name]].name) for p in params
             if p.name in grad_index and isinstance(outputs[grad_index[p.name]], torch.fx.Node)]
    graph = add_gather_and_release(graph, in_backward, graph_id)
    return add_reduces(graph, grads, graph_id)
