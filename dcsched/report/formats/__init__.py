"""The report formats of ``dcsched schedule`` (table, JSON, trace, plot, sweep), one module each.

:mod:`dcsched.report.formats.registry` holds the contract and the names;
:mod:`dcsched.report.formats.model` what a format is given. Importing this package
loads neither torch nor any format: each is imported when first asked for
(:func:`get`). See docs/schedule-cli.md, "How to add a report format".
"""

from dcsched.report.formats.model import Report, ScheduleReport, SweepReport
from dcsched.report.formats.registry import ReportFormat, available, get, register, unregister

__all__ = ["Report", "ReportFormat", "ScheduleReport", "SweepReport", "available", "get", "register", "unregister"]
