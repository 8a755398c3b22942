"""The format of a graph's columns: what each column and table holds, and how node arguments are stored.

A version-2 or 3 bundle stores each graph as per-node arrays (``torch``
tensors, stored as they are in the bundle's safetensors file) and a few small
tables of distinct values (JSON):

``names``          node names, in graph (topological) order
``op``             uint8: 0 placeholder, 1 call_function, 2 get_attr, 3 output (:data:`OPS`)
``target``         int32: index into ``strings`` (qualified op name, placeholder or get_attr target, ``output``)
``args``           int32: index into ``templates``, each ``[args, kwargs]`` in version 1's tagged encoding
                   with every node reference written ``{"$node": k}``: the node's k-th input, every integer
                   ``{"$int": j}``: the node's j-th (``ints``), a non-finite float ``{"$float": "-inf"}``
``inputs``,        int32 / int64: CSR of each node's distinct inputs in reading order (args, then kwargs):
``input_offsets``  node ``v`` reads ``inputs[input_offsets[v]:input_offsets[v + 1]]`` (node numbers)
``meta``           int32: index into ``metas``, the distinct node meta dicts (``out``, ``ds_id``, ``time_source``)
``device_time``    float64 ms, ``tensor_size`` int64 bytes, ``figures`` uint8 flags
                   (:data:`HAS_TIME`, :data:`HAS_SIZE`, :data:`TIME_IS_INT`)

A node's ``args`` and ``kwargs`` are stored as a template that every node calling alike shares:
:func:`encode_template` writes one from version 1's node form, :func:`decode_template` reads one back with
slots (:class:`InputSlot`, :class:`IntSlot`) for the node's own inputs and integers, and :func:`fill_template` (FX) and
:func:`named_template` (version 1's node form) fill them in.

:class:`ColumnStore` holds one graph's arrays and tables;
:class:`~dcsched.bundle.columns.GraphColumns` builds on it with the file's
parts, the checks (:mod:`dcsched.bundle.column_checks`) and the views
(:mod:`dcsched.bundle.column_views`). Split from :mod:`dcsched.bundle.columns`,
as the project keeps a module to one job and about 600 lines.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dcsched.bundle.arguments import decode_argument

#: Node kinds by their code in the ``op`` column.
OPS = ("placeholder", "call_function", "get_attr", "output")
OP_CODE = {op: code for code, op in enumerate(OPS)}
PLACEHOLDER_OP, CALL_OP, GET_ATTR_OP, OUTPUT_OP = range(4)
#: Bits of the ``figures`` column.
HAS_TIME, HAS_SIZE, TIME_IS_INT = 1, 2, 4
ALL_FIGURE_BITS = HAS_TIME | HAS_SIZE | TIME_IS_INT
#: Node meta kept beside the figures (the figures have columns of their own).
META_KEYS = ("out", "ds_id", "time_source")
#: The per-node columns: name -> dtype (``inputs`` and ``input_offsets`` are not per node).
COLUMN_DTYPES = {"op": torch.uint8, "target": torch.int32, "args": torch.int32, "meta": torch.int32,
                 "device_time": torch.float64, "tensor_size": torch.int64, "figures": torch.uint8,
                 "inputs": torch.int32, "input_offsets": torch.int64, "ints": torch.int64,
                 "int_offsets": torch.int64, "names": torch.uint8}
PER_NODE = ("op", "target", "args", "meta", "device_time", "tensor_size", "figures")


class ColumnStore:
    """One graph's columns and tables (see the module docstring), and what :meth:`check` works out from them
    (the decoded templates, the resolved targets, the ZeRO-3 ops' integer arguments)."""

    def __init__(self, *, names: list[str], op, target, args, meta, inputs, input_offsets, ints, int_offsets,
                 device_time,
                 tensor_size, figures, strings: list, templates: list, metas: list, graph_id=None):
        self.names = names
        self.op, self.target, self.args, self.meta = op, target, args, meta
        self.inputs, self.input_offsets = inputs, input_offsets
        self.ints, self.int_offsets = ints, int_offsets
        self.device_time, self.tensor_size, self.figures = device_time, tensor_size, figures
        self.strings, self.templates, self.metas = strings, templates, metas
        self.graph_id = graph_id
        self._decoded: list = []  # templates as Python values with InputSlot references (after check)
        self._targets: dict = {}  # (op, target) code -> resolved target (after check)
        self._comm: dict = {}  # the ZeRO-3 ops' integer arguments (after check)

    def __len__(self) -> int:
        return len(self.names)

    def _figures_of(self, i: int) -> dict:
        flags = int(self.figures[i])
        found = {}
        if flags & HAS_TIME:
            time = float(self.device_time[i])
            found["device_time"] = int(time) if flags & TIME_IS_INT and math.isfinite(time) else time
        if flags & HAS_SIZE:
            found["tensor_size"] = int(self.tensor_size[i])
        return found


# ---------------------------------------------------------------------------
# Argument templates
# ---------------------------------------------------------------------------

_INT64 = (-2**63, 2**63)


def encode_template(value: Any, local: dict, order: list, ints: list) -> Any:
    """Version 1's encoding with ``{"$node": name}`` replaced by ``{"$node": k}`` (the node's k-th distinct
    input) and each integer by ``{"$int": j}`` (the node's j-th integer)."""
    if isinstance(value, list):
        return [encode_template(v, local, order, ints) for v in value]
    if isinstance(value, dict):
        if len(value) == 1 and "$node" in value:
            name = value["$node"]
            if name not in local:
                local[name] = len(order)
                order.append(name)
            return {"$node": local[name]}
        if len(value) == 1 and ("$dtype" in value or "$device" in value or "$layout" in value
                                or "$memory_format" in value):
            return value
        return {k: encode_template(v, local, order, ints) for k, v in value.items()}
    if type(value) is int and _INT64[0] <= value < _INT64[1]:
        ints.append(value)
        return {"$int": len(ints) - 1}
    if type(value) is float and not math.isfinite(value):  # JSON has no inf or nan (-inf: attention masks)
        return {"$float": repr(value)}
    return value


class InputSlot:
    """A node reference inside a decoded template: the node's ``k``-th input."""

    __slots__ = ("k",)

    def __init__(self, k: int):
        self.k = k

    def __repr__(self) -> str:
        return f"<input {self.k}>"


class IntSlot(InputSlot):
    """An integer inside a decoded template: the node's ``k``-th integer."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"<integer {self.k}>"


def _index(payload: Any, what: str) -> int:
    if isinstance(payload, bool) or not isinstance(payload, int) or payload < 0 or payload >= 2**31:
        raise ValueError(f"{what} {payload!r:.40} is not a number of the node's")
    return payload


def _decode_value(value: Any, nodes: list, ints: list) -> Any:
    """``value`` decoded (:func:`dcsched.bundle.arguments.decode_argument`), ``$node`` and ``$int`` as slots,
    their numbers appended to ``nodes`` and ``ints``."""

    def node(payload: Any) -> InputSlot:
        nodes.append(_index(payload, "node reference"))
        return InputSlot(payload)

    def integer(payload: Any) -> IntSlot:
        ints.append(_index(payload, "integer reference"))
        return IntSlot(payload)

    return decode_argument(value, node, integer, non_finite=True)


def decode_template(tpl: Any) -> tuple[tuple, int, int]:
    """``[args, kwargs]`` as Python values (references as slots), how many distinct inputs and how many
    integers it refers to. ValueError for a malformed template, inputs not numbered 0, 1, ... by first
    use, integers not numbered 0, 1, ... in reading order."""
    if not isinstance(tpl, list) or len(tpl) != 2:
        raise ValueError(f"malformed arguments {tpl!r:.80}")
    nodes: list[int] = []
    ints: list[int] = []
    args = _decode_value(tpl[0], nodes, ints)
    kwargs = _decode_value(tpl[1], nodes, ints)
    if not isinstance(args, tuple) or not isinstance(kwargs, dict):
        raise ValueError("malformed args or kwargs")
    seen = -1
    for k in nodes:
        if k > seen + 1:
            raise ValueError(f"input #{k} referred to before input #{seen + 1}")
        seen = max(seen, k)
    if ints != list(range(len(ints))):
        raise ValueError("integers are not numbered in reading order")
    return (args, kwargs), seen + 1, len(ints)


def fill_template(value: Any, env: tuple[list, list]) -> Any:
    kind = type(value)
    if kind is InputSlot:
        return env[0][value.k]
    if kind is IntSlot:
        return env[1][value.k]
    if kind is tuple:
        return tuple(fill_template(v, env) for v in value)
    if kind is list:
        return [fill_template(v, env) for v in value]
    if kind is dict:
        return {k: fill_template(v, env) for k, v in value.items()}
    if kind is slice:
        return slice(fill_template(value.start, env), fill_template(value.stop, env), fill_template(value.step, env))
    return value


def named_template(value: Any, env: tuple[list, list]) -> Any:
    """A template with ``{"$node": k}`` back to ``{"$node": name}`` and ``{"$int": j}`` to the integer."""
    if isinstance(value, list):
        return [named_template(v, env) for v in value]
    if isinstance(value, dict):
        if len(value) == 1 and "$node" in value:
            return {"$node": env[0][value["$node"]]}
        if len(value) == 1 and "$int" in value:
            return env[1][value["$int"]]
        if len(value) == 1 and "$float" in value:
            return float(value["$float"])
        return {k: named_template(v, env) for k, v in value.items()}
    return value
