"""torch's own values by name: dtypes, layouts and memory formats, looked up in tables, never as attributes.

A bundle stores a dtype as its name (``'float32'``); what reads one back takes it from these tables, so a
stored name never becomes an attribute lookup on ``torch``.

>>> LAYOUTS["strided"], MEMORY_FORMATS["channels_last"], DTYPES["float32"]
(torch.strided, torch.channels_last, torch.float32)
>>> dtype_from_name("bfloat16")
torch.bfloat16
>>> dtype_from_name("os.system")
Traceback (most recent call last):
...
ValueError: unknown dtype 'os.system'
"""

from __future__ import annotations

from typing import Any

import torch


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


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype named ``name`` (``'float32'``), or ValueError."""
    return from_table(DTYPES, name, "dtype")
