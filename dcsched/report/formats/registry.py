"""Report formats by name. A format is one module that registers one function.

A format renders a report (:mod:`dcsched.report.formats.model`) to stdout or to a
file. ``write(report, target)`` gets a rich :class:`~rich.console.Console`
(print on it; ``console.file`` for raw text) when ``to_file`` is false, the
output's :class:`~pathlib.Path` when it is true (write it atomically:
:func:`dcsched.outputs.write_atomic`). ``reports`` names the report kinds it
renders (``'schedule'``, ``'sweep'``); ``check(path)``, when given, runs before
any work is done and refuses what the format cannot write.

The built-in formats are imported the first time they are asked for, so
``dcsched --help`` stays fast:

>>> "table" in available() and "sweep" in available()
True
>>> from rich.console import Console
>>> from dcsched.report.formats.model import SweepReport
>>> @register("rows-demo", description="demo only", reports=("sweep",))
... def _demo(report, console):
...     console.print(f"{len(report.curves)} graphs", highlight=False)
>>> get("rows-demo")(SweepReport("g.pt", "all", {"forward": []}), Console(width=40))
1 graphs
>>> _ = unregister("rows-demo")
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Callable

from dcsched.errors import DcschedError
from dcsched.report.formats.model import Report

#: ``write(report, target)``: each format takes the report kinds it lists (``reports``), so its first parameter is
#: narrower than :data:`Report`; the registry checks the kind before calling (:meth:`ReportFormat.require`).
Writer = Callable[..., None]

#: Built-in format -> its module in this package, imported on first use.
BUILTIN = {"table": "table", "json": "json_report", "trace": "trace", "plot": "plot", "sweep": "sweep"}


@dataclasses.dataclass(frozen=True)
class ReportFormat:
    name: str
    write: Writer
    description: str
    #: True: ``write(report, path)`` writes a file; False: ``write(report, console)`` prints
    to_file: bool = False
    #: report kinds it renders (:attr:`ScheduleReport.kind`, :attr:`SweepReport.kind`)
    reports: tuple[str, ...] = ("schedule",)
    #: ``check(path)`` before any work: raise :class:`DcschedError` for what it cannot write
    check: Callable[[Path], None] | None = None

    def require(self, kind: str) -> None:
        """Raise :class:`DcschedError` unless this format renders reports of ``kind``."""
        if kind not in self.reports:
            raise DcschedError(f"the {self.name} format does not render a {kind} report "
                               f"(it renders: {', '.join(self.reports)})")

    def __call__(self, report: Report, target) -> None:
        self.require(report.kind)
        self.write(report, target)


_REGISTRY: dict[str, ReportFormat] = {}


def register(name: str, *, description: str, to_file: bool = False, reports: tuple[str, ...] = ("schedule",),
             check: Callable[[Path], None] | None = None) -> Callable[[Writer], Writer]:
    """Decorator: make ``write(report, target)`` available as format ``name``."""

    def decorate(write: Writer) -> Writer:
        if name in _REGISTRY and _REGISTRY[name].write is not write:
            raise ValueError(f"report format {name!r} is registered twice")
        _REGISTRY[name] = ReportFormat(name, write, description, to_file, tuple(reports), check)
        return write

    return decorate


def unregister(name: str) -> ReportFormat:
    return _REGISTRY.pop(name)


def get(name: str) -> ReportFormat:
    """The format ``name``, importing its module if it is a built-in one not loaded yet."""
    if name not in _REGISTRY and name in BUILTIN:
        importlib.import_module(f"{__package__}.{BUILTIN[name]}")
    try:
        return _REGISTRY[name]
    except KeyError:
        raise DcschedError(f"unknown report format '{name}' (available: {', '.join(available())})") from None


def available() -> list[str]:
    """Every format's name, the built-in ones first (without importing them)."""
    return list(dict.fromkeys([*BUILTIN, *_REGISTRY]))
