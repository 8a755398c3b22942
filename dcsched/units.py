"""Sizes and times as people type and read them. Stored figures are bytes and milliseconds.

A memory budget is read by :meth:`dcsched.budget.Budget.parse` (a size from
:func:`parse_size`, or 'unlimited').

>>> parse_size("6GiB"), parse_size("1.5GB"), parse_size("512")
(6442450944, 1500000000, 512)
>>> format_bytes(3 * 2**30)
'3.00 GiB'
>>> format_ms(0.25)
'250.0 us'
"""

from __future__ import annotations

import math
import re


_SI = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
       "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_IEC = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
#: Sizes above this are typos, not memory (1 EiB; no device holds a thousandth of it).
MAX_SIZE_BYTES = 2**60
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int | float, *, limit: float = MAX_SIZE_BYTES) -> int:
    """Bytes from ``'6GiB'``, ``'1.5GB'``, ``'800MiB'``, ``'1e9'`` (GB = 10^9, GiB = 2^30).

    Raises ValueError for anything else, a size that is not finite, or one
    over ``limit`` (default :data:`MAX_SIZE_BYTES`, 1 EiB: a device size that large is a typo).
    """
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, (int, float)):
        value = text
    else:
        match = _SIZE.match(text)
        unit = match.group(2).lower() if match else None
        factor = _SI.get(unit) or _IEC.get(unit) if unit is not None else None
        if not match or factor is None:
            raise ValueError(f"not a size: {text!r} (use e.g. 512MiB, 6GiB, 1.5GB, 1000000)")
        value = float(match.group(1)) * factor
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"not a size: {text!r} (a size is a finite number of bytes, 0 or more)")
    if value > limit:
        raise ValueError(f"size {text!r} is over {limit:.0f} bytes: a typo?")
    return int(value)


def format_bytes(n: float | int | None) -> str:
    if n is None:
        return "n/a"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= factor:
            return f"{sign}{n / factor:.2f} {unit}"
    return f"{sign}{int(n)} B"


def format_ms(ms: float | None) -> str:
    if ms is None or (isinstance(ms, float) and math.isnan(ms)):
        return "n/a"
    if abs(ms) >= 1000:
        return f"{ms / 1000:.3f} s"
    if abs(ms) >= 1:
        return f"{ms:.3f} ms"
    return f"{ms * 1000:.1f} us"
