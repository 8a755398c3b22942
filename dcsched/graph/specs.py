"""What a node outputs, from its recorded metadata: (shape, dtype) of each tensor, and their bytes.

A captured node records its output as ``meta['val']`` (fake tensors) or, once
loaded from a bundle, ``meta['out']`` (``{"shape": [...], "dtype": "float32"}``,
possibly nested in lists for multi-output ops).

>>> import torch, torch.fx
>>> graph = torch.fx.Graph()
>>> node = graph.placeholder("x")
>>> node.meta["out"] = {"shape": [2, 3], "dtype": "bfloat16"}
>>> node_specs(node), node_bytes(node), sharded_bytes(node, 4)
([((2, 3), torch.bfloat16)], 12, 4)
"""

from __future__ import annotations

import math

import torch
import torch.fx

from dcsched.graph.roles import Role, role_of
from dcsched.graph.torch_values import dtype_from_name

Spec = tuple[tuple[int, ...], torch.dtype]


def value_specs(value) -> list[Spec]:
    """(shape, dtype) of every tensor in a node's ``meta['val']`` or ``meta['out']``."""
    found: list[Spec] = []

    def walk(v):
        if isinstance(v, torch.Tensor):
            found.append((tuple(int(s) for s in v.shape), v.dtype))
        elif isinstance(v, dict) and "shape" in v and "dtype" in v:
            dtype = v["dtype"] if isinstance(v["dtype"], torch.dtype) else dtype_from_name(v["dtype"])
            found.append((tuple(int(s) for s in v["shape"]), dtype))
        elif isinstance(v, (list, tuple)):
            for item in v:
                walk(item)

    walk(value)
    return found


def node_specs(node: torch.fx.Node) -> list[Spec]:
    """(shape, dtype) of every tensor ``node`` outputs, in output order."""
    if "val" in node.meta and node.meta["val"] is not None:
        return value_specs(node.meta["val"])
    return value_specs(node.meta.get("out"))


def _tensor_meta_specs(meta) -> list[Spec]:
    """(shape, dtype) of every ``TensorMetadata`` in ``meta['tensor_meta']`` (FX shape propagation's record)."""
    if hasattr(meta, "shape") and hasattr(meta, "dtype"):
        return [(tuple(int(s) for s in meta.shape), meta.dtype)]
    if isinstance(meta, (list, tuple)):
        return [spec for item in meta for spec in _tensor_meta_specs(item)]
    return []


def input_size(node: torch.fx.Node) -> int | None:
    """Bytes of a graph input: its ``tensor_size`` if positive, else shape x itemsize of what it holds.

    DeepSpeed 0.19.8 records ``tensor_size = 0`` on every placeholder, so a 0
    or missing figure is derived from ``meta['val']`` (a fake or meta tensor),
    ``meta['tensor_meta']`` or ``meta['out']``. None when none of these says
    anything (the input has no size at all); a non-tensor value (a SymInt) is 0.
    A parameter shard (an input an all-gather reads) is never derived: its
    value's shape is the whole parameter's, the shard 1/W of it, and W is not
    in the graph; without a positive ``tensor_size`` it has no size.

    >>> import torch, torch.fx
    >>> x = torch.fx.Graph().placeholder("x")
    >>> x.meta.update(tensor_size=0, val=torch.empty(4, 8, device="meta"))
    >>> input_size(x)
    128
    >>> del x.meta["val"]; input_size(x) is None
    True
    """
    recorded = node.meta.get("tensor_size")
    if recorded:
        return recorded
    if any(role_of(user) is Role.ALLGATHER for user in node.users):
        return None
    try:
        if node.meta.get("val") is not None or node.meta.get("out") is not None:
            return node_bytes(node)
        if node.meta.get("tensor_meta") is not None:
            return sum(nbytes(shape, dtype) for shape, dtype in _tensor_meta_specs(node.meta["tensor_meta"]))
    except (TypeError, ValueError, RuntimeError):  # a symbolic dimension without a value
        return None
    return None


def nbytes(shape, dtype: torch.dtype) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * dtype.itemsize


def node_bytes(node: torch.fx.Node) -> int:
    """Bytes of everything ``node`` outputs."""
    return sum(nbytes(shape, dtype) for shape, dtype in node_specs(node))


def sharded_bytes(node: torch.fx.Node, world_size: int) -> int:
    """Bytes of one rank's ZeRO-3 shard of each of ``node``'s outputs (``ceil(numel/W) * itemsize``)."""
    return sum(shard_numel(math.prod(shape), world_size) * dtype.itemsize for shape, dtype in node_specs(node))


def shard_numel(numel: int, world_size: int) -> int:
    """Elements of one rank's shard: ``ceil(numel / W)`` (ZeRO-3 pads the last shard).

    >>> shard_numel(21, 2)
    11
    """
    return math.ceil(numel / world_size)


def recorded_bytes(node: torch.fx.Node) -> int:
    """The bytes of a node's output as the bundle records them: its profiled ``tensor_size``, else
    :func:`node_bytes` of its recorded shapes (0 if neither)."""
    size = node.meta.get("tensor_size")
    if isinstance(size, (int, float)):
        return int(size)
    return node_bytes(node)


def flat_nodes(args) -> list[torch.fx.Node]:
    """The nodes in a node's (nested) arguments, in order."""
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(args, found.append)
    return found
