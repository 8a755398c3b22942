"""What a bundle may hold, checked before anything is built from it: no name or value becomes code.

A loaded graph becomes a ``torch.fx.GraphModule`` whose Python source FX
generates from node names, placeholder and ``get_attr`` targets and constant
names; an op target is called. So every one of them is checked here, at load:

* names and placeholder targets are plain identifiers (no keyword, no
  ``__dunder__``), ``get_attr`` targets dotted paths of them naming a stored
  constant, constant names no attribute a ``GraphModule`` has (``forward``,
  ``graph``, ...);
* ops are looked up only when the dispatcher's table of registered ops lists
  them (``aten::mm`` for ``aten.mm.default``) and the list of side-effect-free
  ops holds them (:mod:`dcsched.bundle.op_allowlist`), through names that are
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
  one large argument template (stored once) cannot expand either;
* numbers the runtime and the simulator act on are believable: a shape's
  dimensions and bytes at most :data:`MAX_BYTES` (:func:`check_shape`), a
  ZeRO-3 op's ``id`` a parameter of the bundle's table and its ``graph_id``
  its own graph's (:func:`check_comm_arguments`, :func:`check_graph_ids`,
  :func:`check_param_ids`).

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
import math
from typing import Any, Collection, Mapping, Sequence

import torch
import torch.fx

from dcsched import collectives
from dcsched.graph.torch_values import DTYPES as DTYPES
from dcsched.graph.torch_values import LAYOUTS as LAYOUTS
from dcsched.graph.torch_values import MEMORY_FORMATS as MEMORY_FORMATS
from dcsched.graph.torch_values import from_table as from_table

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
#: Largest tensor a bundle may describe, in bytes (1 PiB), and so its largest dimension: beyond it a number
#: is a corruption or a typo, not a measurement.
MAX_BYTES = 2**50
#: Largest graph id, parameter id (ds_id) and use count: dcsched numbers graphs 0 (forward) and 1 (backward)
#: and parameters 0 to P-1, and every runtime table keyed by them fits 31 bits.
MAX_ID = 2**31 - 1


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


def comm_ints(op_name: str) -> tuple[str, ...] | None:
    """The integer arguments (after the tensor) of a ZeRO-3 op, from its row of :mod:`dcsched.collectives`;
    None for an op of no collective kind.

    >>> comm_ints("release_param"), comm_ints("mm")
    (('graph_id', 'id', 'n_users'), None)
    """
    kind = collectives.find(op_name)
    return kind.ints if kind is not None else None


def check_comm_arguments(op_name: str, args: tuple, kwargs: dict, where: str, *, graph_id: int | None = None,
                         ds_ids: Collection[int] | None = None) -> None:
    """A ZeRO-3 op's ids (and a release's ``n_users``): present, integers (``bool`` is not one), not negative;
    ``graph_id`` at most :data:`MAX_ID` and, given the op's graph's ``graph_id``, that one; ``id``, given the
    parameter table's ``ds_ids``, one of them (else at most :data:`MAX_ID`); ``n_users`` at most :data:`MAX_ID`.

    >>> check_comm_arguments("allgather_param", ("shard", 0, "zero"), {}, "node ag")
    Traceback (most recent call last):
    ...
    ValueError: node ag: allgather_param's id is 'zero', not an integer
    >>> check_comm_arguments("allgather_param", ("shard", 0, 2**62), {}, "node ag", graph_id=0,
    ...                      ds_ids={0, 1})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: node ag: allgather_param's id 4611686018427387904 names no parameter of the bundle's table ...
    >>> check_comm_arguments("reduce_grad", ("grad", 2**70, 0), {}, "node r")
    Traceback (most recent call last):
    ...
    ValueError: node r: reduce_grad's graph_id 1180591620717411303424 is over the largest graph id (2147483647)
    """
    names = comm_ints(op_name) or ()
    for position, name in enumerate(names, start=1):
        value = args[position] if len(args) > position else kwargs.get(name)
        if value is None:
            raise ValueError(f"{where}: {op_name} has no {name} argument")
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: {op_name}'s {name} is {value!r:.80}, not an integer")
        if value < 0:
            raise ValueError(f"{where}: {op_name}'s {name} is negative ({value})")
        if name == "id" and ds_ids is not None:
            if value not in ds_ids:
                raise ValueError(f"{where}: {op_name}'s id {value} names no parameter of the bundle's table "
                                 f"({_ids_text(ds_ids)})")
        elif value > MAX_ID:
            what = "graph id" if name == "graph_id" else ("parameter id" if name == "id" else "use count")
            raise ValueError(f"{where}: {op_name}'s {name} {value} is over the largest {what} ({MAX_ID})")
        if name == "graph_id" and graph_id is not None and value != graph_id:
            raise ValueError(f"{where}: {op_name}'s graph_id {value} is not its graph's ({graph_id})")


def _ids_text(ds_ids: Collection[int]) -> str:
    if not ds_ids:
        return "no parameters"
    return f"{len(ds_ids)} parameters, ds_ids {min(ds_ids)} to {max(ds_ids)}"


def check_graph_ids(graph_ids: Mapping[str, Any]) -> dict[str, int | None]:
    """The graphs' ``graph_id`` (``args[1]`` of their ZeRO-3 ops): each an integer from 0 to :data:`MAX_ID` or
    None (unset), no two graphs with one.

    >>> check_graph_ids({"forward": 0, "backward": 1})
    {'forward': 0, 'backward': 1}
    >>> check_graph_ids({"forward": 0, "backward": 0})
    Traceback (most recent call last):
    ...
    ValueError: graphs 'forward' and 'backward' both have graph_id 0
    """
    seen: dict[int, str] = {}
    for name, value in graph_ids.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_ID:
            raise ValueError(f"graph '{name}': graph_id {value!r:.80} is not a graph id (an integer from 0 to "
                             f"{MAX_ID})")
        if value in seen:
            raise ValueError(f"graphs '{seen[value]}' and '{name}' both have graph_id {value}")
        seen[value] = name
    return dict(graph_ids)


def check_param_ids(ds_ids: Sequence[Any], names: Sequence[Any]) -> None:
    """The parameter table's ds_ids: integers from 0 to :data:`MAX_ID` (not ``true``, not ``"3"``), no two
    parameters with one; ``names[k]`` names parameter ``k`` in messages.

    >>> check_param_ids([0, 1, 1], ["a", "b", "c"])
    Traceback (most recent call last):
    ...
    ValueError: parameters 'b' and 'c' both have ds_id 1
    """
    seen: dict[int, Any] = {}
    for ds_id, name in zip(ds_ids, names):
        if isinstance(ds_id, bool) or not isinstance(ds_id, int) or not 0 <= ds_id <= MAX_ID:
            raise ValueError(f"parameter {name!r:.80}: ds_id {ds_id!r:.80} is not a parameter id (an integer from 0 "
                             f"to {MAX_ID})")
        if ds_id in seen:
            raise ValueError(f"parameters {seen[ds_id]!r:.80} and {name!r:.80} both have ds_id {ds_id}")
        seen[ds_id] = name


def check_count(value: Any, what: str) -> int:
    """A count stored in a bundle: an integer from 0 to :data:`MAX_ID` (not ``true``, not ``"3"``).

    >>> check_count(2, "num_user_outputs")
    2
    >>> check_count("٣", "num_user_outputs")
    Traceback (most recent call last):
    ...
    ValueError: num_user_outputs '٣' is not a count
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_ID:
        raise ValueError(f"{what} {value!r:.80} is not a count")
    return value


def check_shape(shape: Any, dtype: torch.dtype, what: str) -> tuple[int, ...]:
    """A tensor's shape as a tuple: a list of integers, none negative, none over :data:`MAX_BYTES`, holding at
    most :data:`MAX_BYTES` bytes of ``dtype``; else ValueError starting with ``what`` (``"parameter 'w': shape"``).

    >>> check_shape([2, 3], torch.float32, "input 'x': shape")
    (2, 3)
    >>> check_shape([0, 2**70], torch.float32, "node mm: output shape")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: node mm: output shape [0, 1180591620717411303424] has a dimension of 1.18059e+21, over ...
    """
    if not isinstance(shape, (list, tuple)) or not all(isinstance(s, int) and not isinstance(s, bool) for s in shape):
        raise ValueError(f"{what} {_shape_text(shape)} is not a list of integers")
    if any(s < 0 for s in shape):
        raise ValueError(f"{what} {_shape_text(shape)} has a negative dimension")
    largest = max(shape, default=0)
    if largest > MAX_BYTES:
        raise ValueError(f"{what} {_shape_text(shape)} has a dimension of {largest:.6g}, over the largest believable "
                         f"({MAX_BYTES:.6g})")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > MAX_BYTES:
        raise ValueError(f"{what} {_shape_text(shape)} holds {nbytes:.6g} bytes, over the largest believable "
                         f"({MAX_BYTES:.6g})")
    return tuple(shape)


def _shape_text(shape: Any) -> str:
    text = repr(list(shape)) if isinstance(shape, tuple) else repr(shape)
    return text if len(text) <= 120 else text[:117] + "..."


def check_output_spec(spec: Any, where: str) -> None:
    """A node's recorded output (``meta['out']``): ``{"shape": [ints >= 0], "dtype": name}``, lists of them, None;
    each shape believable (:func:`check_shape`).

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
        raise ValueError(f"{where}: output shape {_shape_text(shape)} is not a list of non-negative integers")
    check_shape(shape, from_table(DTYPES, spec["dtype"], "dtype"), f"{where}: output shape")
