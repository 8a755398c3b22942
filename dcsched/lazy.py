"""Public names that load on first use: a package's ``__getattr__`` and ``__dir__`` from a table.

``import dcsched`` and the command line's ``--help`` must not pay for torch, so
a package lists its public names with the module that defines each, and the
module is imported when a name is first asked for. A subpackage or module of
the package is an attribute too, once imported.

>>> import types
>>> namespace = {}
>>> getattr_, dir_ = lazy_names("dcsched", {"format_bytes": "units"}, namespace)
>>> getattr_("format_bytes")(2048), "format_bytes" in namespace, "format_bytes" in dir_()
('2.00 KiB', True, True)
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Callable


def lazy_names(package: str, table: dict[str, str], namespace: dict,
               before: Callable[[], object] | None = None) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """A module-level ``__getattr__`` and ``__dir__`` for ``package``.

    Parameters
    ----------
    package : str
        The package's ``__name__``.
    table : dict of str to str
        Public name -> the module (relative to ``package``) that defines it.
    namespace : dict
        The package's ``globals()``: a name, once loaded, is stored there so the lookup runs once.
    before : callable, optional
        Called before the first module of ``table`` is imported (the root package registers its torch ops).

    Returns
    -------
    (__getattr__, __dir__)

    Raises
    ------
    AttributeError
        From ``__getattr__``, for a name that is neither in ``table`` nor a module of ``package``.
    """

    def __getattr__(name: str):
        if name not in table:
            if name.startswith("_") or importlib.util.find_spec(f"{package}.{name}") is None:
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            return importlib.import_module(f"{package}.{name}")
        if before is not None:
            before()
        value = getattr(importlib.import_module(f"{package}.{table[name]}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
