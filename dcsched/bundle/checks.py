"""What a bundle may hold, checked before anything is built from it: no name or value becomes code.

A loaded graph becomes a ``torch.fx.GraphModule`` whose Python source FX
generates from node names, placeholder and ``get_attr`` targets and constant
names; an op target is called. So every one of them is checked here, at load:

* names and placeholder targets are plain identifiers (no keyword, no
  ``__dunder__``), ``get_attr`` targets dotted paths of them naming a stored
  constant, constant names no attribute a ``GraphModule`` has (``forward``,
  ``graph``, ...);
* ops are looked up only when the dispatcher's table of registered ops lists
  them (``aten::mm`` for ``aten.mm.default``), through names that are
  identifiers without a leading ``__``; the result must be a ``torch`` op
  overload, and none may write to its inputs in place (its order against the
  other readers of that storage would not be kept by a scheduler);
* dtypes, layouts and memory formats come from tables of torch's own values,
  never by looking a stored name up as an attribute;
* arguments nest at most :data:`MAX_DEPTH` deep and hold at most
  :data:`MAX_ITEMS` values per node, so a file of a few kilobytes cannot
  expand (through shared references) into work without end; and a graph's
  nodes together at most :func:`arguments_allowance` values (one node's
  :data:`MAX_ITEMS` plus :data:`ITEMS_PER_NODE` per node), so nodes sharing
  one large argument template (stored once) cannot expand either.

Each check raises ``ValueError`` with the reason; the loader adds the path.

>>> check_identifier("primals_1", "node name")
>>> check_identifier("x=(__import__('os'),1)[1]", "placeholder target")
Traceback (most recent call last):
...
ValueError: placeholder target "x=(__import__('os'),1)[1]" is not a plain identifier
>>> LAYOUTS["strided"], MEMORY_FORMATS["channels_last"], DTYPES["float32"]
(torch.strided, torch.channels_last, torch.float32)
"""

from __future__ import annotations

import keyword
from typing import Any

import torch
import torch.fx

#: Deepest nesting of lists, tuples and dicts in one node's arguments.
MAX_DEPTH = 32
#: Most values (containers and leaves) in one node's arguments.
MAX_ITEMS = 100_000
#: Values a graph's nodes' arguments may hold per node on average, beyond one node's :data:`MAX_ITEMS`.
#: Captured graphs use 9-12 per node (20 with their meta: the sample and benchmark graphs, measured),
#: so 64 leaves room for unusual ops while a graph expands to no more than its node count implies.
ITEMS_PER_NODE = 64
#: Longest name a bundle may use.
MAX_NAME = 256


class TooManyValues(ValueError):
    """Arguments holding more values than allowed (:func:`check_arguments`)."""


def arguments_allowance(nodes: int) -> int:
    """The most values the arguments of a graph of ``nodes`` nodes may hold in all (each node's expanded).

    One node may hold :data:`MAX_ITEMS` (an output node lists every saved tensor); the rest
    :data:`ITEMS_PER_NODE` each on average. The work of building the graph (FX copies every node's
    arguments) is then proportional to its node count, however the file shares them.

    >>> arguments_allowance(2000)
    228000
    """
    return MAX_ITEMS + ITEMS_PER_NODE * nodes


def check_total_arguments(total: int | None, nodes: int, where: str) -> None:
    """Refuse a graph whose nodes' arguments hold more than :func:`arguments_allowance` values in all.

    ``total`` None: more than allowed, counting stopped there.

    >>> try:
    ...     check_total_arguments(2000 * 104_000, 2000, "graph 'forward'")
    ... except ValueError as exc:
    ...     print(str(exc)[:80])
    graph 'forward': its nodes' arguments hold 208000000 values in all, more than th
    """
    allowance = arguments_allowance(nodes)
    if total is None or total > allowance:
        held = f"hold {total} values in all, more than" if total is not None else "hold more than"
        raise ValueError(f"{where}: its nodes' arguments {held} the {allowance} allowed for {nodes} nodes "
                         f"({MAX_ITEMS} + {ITEMS_PER_NODE} per node)")


def _table(kind: type) -> dict[str, Any]:
    """torch's own values of ``kind`` by their name (``torch.float32`` under ``'float32'``)."""
    return {str(value).removeprefix("torch."): value for value in vars(torch).values() if isinstance(value, kind)}


DTYPES: dict[str, torch.dtype] = _table(torch.dtype)
LAYOUTS: dict[str, torch.layout] = _table(torch.layout)
MEMORY_FORMATS: dict[str, torch.memory_format] = _table(torch.memory_format)


def from_table(table: dict[str, Any], name: Any, what: str):
    """``table[name]``, or ValueError naming ``what`` (a dtype, a layout, a memory format)."""
    if not isinstance(name, str) or name not in table:
        raise ValueError(f"unknown {what} {name!r}")
    return table[name]


def check_identifier(name: Any, what: str) -> None:
    """Refuse anything but a plain identifier: no keyword, no ``__dunder__``, at most :data:`MAX_NAME` long."""
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) or len(name) > MAX_NAME \
            or (name.startswith("__") and name.endswith("__")):
        raise ValueError(f"{what} {repr(name)[:80]} is not a plain identifier")


def check_constant_name(name: Any) -> None:
    """A stored constant's name: an identifier that is no attribute of a ``GraphModule`` (``forward``, ...)."""
    check_identifier(name, "constant name")
    if hasattr(torch.fx.GraphModule, name):
        raise ValueError(f"constant name {name!r} would replace the graph module's own attribute of that name")


def check_get_attr_target(target: Any, constants: set[str]) -> None:
    """A ``get_attr`` target: a dotted path of identifiers whose first part is a stored constant."""
    if not isinstance(target, str):
        raise ValueError(f"get_attr target {target!r} is not a name")
    for part in target.split("."):
        check_identifier(part, "get_attr target part")
    if target.split(".")[0] not in constants:
        raise ValueError(f"get_attr target {target!r} names no constant the bundle holds")


def check_op_name(part: str, name: str) -> None:
    """A part of a qualified op name: an identifier not starting with two underscores (``__class__``)."""
    if not part.isidentifier() or part.startswith("__"):
        raise ValueError(f"'{name}' is not an op name")


_REGISTERED: set[str] = set()


def check_registered_op(namespace: str, op_name: str, overload: str, name: str) -> None:
    """Refuse an op the dispatcher's table of registered ops does not list (``aten::mm`` for
    ``aten.mm.default``), so that only a registered op is ever looked up. The table is read again on a miss:
    an op library (DeepSpeed's ``dc``) may register after the first look."""
    key = f"{namespace}::{op_name}" + ("" if overload == "default" else f".{overload}")
    if key not in _REGISTERED:
        _REGISTERED.update(torch._C._dispatch_get_all_op_names())
        if key not in _REGISTERED:
            raise ValueError(f"unknown op '{name}' (not in torch {torch.__version__})")


def check_op(target: Any, name: str) -> None:
    """A resolved call target: a torch op overload that does not write to its inputs in place."""
    if not isinstance(target, torch._ops.OpOverload):
        raise ValueError(f"'{name}' is not an op")
    if target._schema.is_mutable:
        raise ValueError(f"'{name}' writes to its input in place; dcsched refuses mutating ops (a scheduler would "
                         "not keep their order against the other readers of that tensor)")


def check_arguments(value: Any, where: str, max_items: int = MAX_ITEMS) -> int:
    """Refuse arguments nested deeper than :data:`MAX_DEPTH` or holding more than ``max_items`` values
    (:class:`TooManyValues`); returns how many values (containers and leaves) they hold.

    >>> nested = [1]
    >>> for _ in range(60):
    ...     nested = [nested, nested]    # 2**60 values when walked, a few hundred bytes when stored
    >>> check_arguments(nested, "node x")
    Traceback (most recent call last):
    ...
    ValueError: node x: arguments nest deeper than 32 levels
    """
    stack = [(value, 0)]
    items = 0
    while stack:
        current, depth = stack.pop()
        items += 1
        if items > max_items:
            raise TooManyValues(f"{where}: arguments hold more than {max_items} values")
        if isinstance(current, (list, tuple, dict)):
            if depth >= MAX_DEPTH:
                raise ValueError(f"{where}: arguments nest deeper than {MAX_DEPTH} levels")
            children = current.values() if isinstance(current, dict) else current
            stack.extend((child, depth + 1) for child in children)
    return items


#: The integer arguments of the ZeRO-3 ops (after the tensor), by op name.
COMM_INTS = {"allgather_param": ("graph_id", "id"), "wait_allgather": ("graph_id", "id"),
              "release_param": ("graph_id", "id", "n_users"), "reduce_grad": ("graph_id", "id")}


def check_comm_arguments(op_name: str, args: tuple, kwargs: dict, where: str) -> None:
    """A ZeRO-3 op's ids (and a release's ``n_users``): present, and integers (``bool`` is not one).

    >>> check_comm_arguments("allgather_param", ("shard", 0, "zero"), {}, "node ag")
    Traceback (most recent call last):
    ...
    ValueError: node ag: allgather_param's id is 'zero', not an integer
    """
    names = COMM_INTS.get(op_name, ())
    for position, name in enumerate(names, start=1):
        value = args[position] if len(args) > position else kwargs.get(name)
        if value is None:
            raise ValueError(f"{where}: {op_name} has no {name} argument")
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: {op_name}'s {name} is {value!r}, not an integer")
        if value < 0:
            raise ValueError(f"{where}: {op_name}'s {name} is negative ({value})")


def check_output_spec(spec: Any, where: str) -> None:
    """A node's recorded output (``meta['out']``): ``{"shape": [ints >= 0], "dtype": name}``, lists of them, None.

    >>> check_output_spec({"shape": [float("nan")], "dtype": "float32"}, "node mm")
    Traceback (most recent call last):
    ...
    ValueError: node mm: output shape [nan] is not a list of non-negative integers
    """
    if spec is None:
        return
    if isinstance(spec, list):
        for part in spec:
            check_output_spec(part, where)
        return
    if not isinstance(spec, dict) or set(spec) != {"shape", "dtype"}:
        raise ValueError(f"{where}: output description {spec!r:.80} is not a shape and a dtype")
    shape = spec["shape"]
    if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                              for s in shape):
        raise ValueError(f"{where}: output shape {shape!r:.80} is not a list of non-negative integers")
    from_table(DTYPES, spec["dtype"], "dtype")
