"""The report formats of ``dcsched schedule`` (table, JSON, trace, plot, sweep), one module each.

:mod:`dcsched.formats.registry` holds the contract and the names;
:mod:`dcsched.formats.model` what a format is given. Importing this package
loads neither torch nor any format: each is imported when first asked for
(:func:`get`). See docs/schedule-cli.md, "How to add a report format".
"""

from .model import Report, ScheduleReport, SweepReport
from .registry import ReportFormat, available, get, register, unregister

__all__ = ["Report", "ReportFormat", "ScheduleReport", "SweepReport", "available", "get", "register", "unregister"]
