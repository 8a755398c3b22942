"""Small hand-built bundles for tests: DeepCompile-style names and ops, no capture needed."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.fx

from dcsched.runtime import ops
from dcsched.bundle.core import Bundle, InputInfo, ParamInfo

aten = torch.ops.aten


def _node(graph, target, args, name, *, kwargs=None, time=0.1, size=64):
    node = graph.create_node("call_function", target, tuple(args), kwargs or {}, name=name)
    node.meta.update(device_time=time, tensor_size=size)
    return node


def linear_forward(n_params: int = 2) -> torch.fx.Graph:
    """x -> mm(w0) -> relu -> mm(w1) ... -> sum, with each weight gathered, waited and released.

    Every weight is 4x4 float32 (64 bytes); the input x is 2x4.
    """
    g = torch.fx.Graph()
    params = [g.placeholder(f"primals_{i + 1}") for i in range(n_params)]
    x = g.placeholder(f"primals_{n_params + 1}")
    for p in (*params, x):
        p.meta.update(tensor_size=64 if p is not x else 32)
    waits = []
    for i, p in enumerate(params):
        ag = _node(g, ops.allgather_param, (p, 0, i), f"allgather_ds_param_{p.name}_{i}",
                   kwargs={"dtype": torch.float32}, time=1.0, size=64)
        waits.append(_node(g, ops.wait_allgather, (ag, 0, i), f"wait_allgather_ds_param__{p.name}_{i}", time=0.0,
                           size=0))
    h = x
    for i, (p, w) in enumerate(zip(params, waits)):
        mm = _node(g, aten.mm.default, (h, w), f"mm_{i}", size=32)
        rel = _node(g, ops.release_param, (mm, 0, i, 1), f"release_ds_param_{p.name}_mm_{i}_{i}", time=0.0, size=0)
        h = _node(g, aten.relu.default, (rel,), f"relu_{i}", size=32)
    loss = _node(g, aten.sum.default, (h,), "sum_1", size=4)
    g.output((loss, *params, x))
    return g


def linear_bundle(n_params: int = 2) -> Bundle:
    forward = linear_forward(n_params)
    return Bundle(
        forward=forward,
        backward=None,
        params=[ParamInfo(f"layers.{i}.weight", (4, 4), torch.float32, i) for i in range(n_params)],
        inputs=[InputInfo("x", (2, 4), torch.float32, torch.randn(2, 4, generator=torch.Generator().manual_seed(0)))],
        forward_placeholders=[{"kind": "param", "ds_id": i} for i in range(n_params)] + [{"kind": "input", "index": 0}],
        backward_placeholders=[],
        provenance={"device_time": "hand-written", "tensor_size": "hand-written"},
    )


def save_v1(bundle: Bundle, path) -> Path:
    """Write ``bundle`` as a version-1 torch file (the plain-data form dcsched still reads), atomically."""
    from dcsched.bundle.core import to_data
    from dcsched.outputs import write_atomic
    path = Path(path)
    data = to_data(bundle)
    write_atomic(path, lambda handle: torch.save(data, handle), overwrite=True)
    return path


def column_nodes(views) -> list[dict]:
    """Version 1's node form (what :func:`dcsched.bundle.graph_encoding.encode_graph` gives) of a graph's
    :class:`~dcsched.bundle.column_views.ColumnViews`: what a version-2 file holds, node by node."""
    from dcsched.bundle.column_format import HAS_SIZE, HAS_TIME, OPS, named_template
    out = []
    code, args, meta, inputs, ints = views._node_values()
    times, sizes = views.figure_lists()
    flags = views.figures.tolist()
    names = views.names
    for v, name in enumerate(names):
        a, kw = named_template(views.templates[args[v]], ([names[r] for r in inputs[v]], ints[v]))
        node_meta = {}
        if flags[v] & HAS_TIME:
            node_meta["device_time"] = times[v]
        if flags[v] & HAS_SIZE:
            node_meta["tensor_size"] = sizes[v]
        node_meta.update(views.metas[meta[v]])
        out.append({"name": name, "op": OPS[code[v] % 4], "target": views.strings[code[v] // 4],
                    "args": a, "kwargs": kw, "meta": node_meta})
    return out
