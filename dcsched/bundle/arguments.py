"""A node's arguments read back from the tagged encoding both bundle versions store.

Plain JSON values stand for themselves; ``{"$tag": payload}`` stands for what
JSON lacks: ``$tuple``, ``$dict`` (any keys, in order), ``$dtype``,
``$device``, ``$layout``, ``$memory_format``, ``$slice``, and ``$node``, a
reference to another node. Each version says what a reference becomes (an FX
node in version 1, an input slot in version 2); version 2 adds ``$int`` (an
integer kept in a column) and ``$float`` (``inf``, ``-inf``, ``nan``, which
JSON cannot hold). Every other tag, and every malformed payload, is a
``ValueError``: nothing here evaluates a string.

>>> decode_argument({"$tuple": [1, {"$node": "x"}, {"$dtype": "float32"}]}, node=str.upper)
(1, 'X', torch.float32)
>>> decode_argument({"$eval": "1+1"}, node=str)
Traceback (most recent call last):
...
ValueError: unknown argument tag '$eval'
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from dcsched.bundle import checks as loadchecks

#: What a ``$float`` payload may be.
NON_FINITE = ("inf", "-inf", "nan")


def decode_argument(value: Any, node: Callable[[Any], Any], integer: Callable[[Any], Any] | None = None, *,
                    non_finite: bool = False) -> Any:
    """``value`` decoded: ``node(payload)`` for each ``$node``, ``integer(payload)`` for each ``$int``.

    Parameters
    ----------
    value : Any
        The stored value (JSON-like).
    node : callable
        What a ``$node`` payload becomes (it may also record or check the payload).
    integer : callable, optional
        What an ``$int`` payload becomes; without one, ``$int`` is an unknown tag.
    non_finite : bool
        Accept ``$float`` (``inf``, ``-inf``, ``nan``).

    Returns
    -------
    Any
        Lists, tuples, dicts, dtypes, devices, layouts, memory formats, slices and what ``node``
        and ``integer`` return.

    Raises
    ------
    ValueError
        An unknown tag or a malformed payload.

    Examples
    --------
    See the module docstring.
    """

    def decode(value: Any) -> Any:
        if isinstance(value, list):
            return [decode(v) for v in value]
        if not isinstance(value, dict):
            return value
        if len(value) != 1:
            raise ValueError(f"malformed argument {value!r:.80}")
        (tag, payload), = value.items()
        if tag == "$node":
            return node(payload)
        if tag == "$int" and integer is not None:
            return integer(payload)
        if tag == "$float" and non_finite:
            if payload not in NON_FINITE:
                raise ValueError(f"malformed float {payload!r:.40}")
            return float(payload)
        if tag == "$tuple":
            if not isinstance(payload, list):
                raise ValueError(f"malformed tuple {payload!r:.80}")
            return tuple(decode(v) for v in payload)
        if tag == "$dict":
            if not isinstance(payload, list) or not all(isinstance(p, list) and len(p) == 2
                                                        and isinstance(p[0], str) for p in payload):
                raise ValueError(f"malformed dict {payload!r:.80}")
            return {k: decode(v) for k, v in payload}
        if tag == "$dtype":
            return loadchecks.from_table(loadchecks.DTYPES, payload, "dtype")
        if tag == "$device":
            if not isinstance(payload, str):
                raise ValueError(f"malformed device {payload!r:.80}")
            return torch.device(payload)
        if tag == "$layout":
            return loadchecks.from_table(loadchecks.LAYOUTS, payload, "layout")
        if tag == "$memory_format":
            return loadchecks.from_table(loadchecks.MEMORY_FORMATS, payload, "memory format")
        if tag == "$slice":
            if not isinstance(payload, list) or len(payload) != 3:
                raise ValueError(f"malformed slice {payload!r:.80}")
            return slice(*(decode(v) for v in payload))
        raise ValueError(f"unknown argument tag {tag!r:.40}")

    return decode(value)
