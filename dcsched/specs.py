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

from .bundle import dtype_from_name

Spec = tuple[tuple[int, ...], torch.dtype]


def _specs(value) -> list[Spec]:
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
        return _specs(node.meta["val"])
    return _specs(node.meta.get("out"))


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
