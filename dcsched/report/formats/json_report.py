"""``json``: the report as one JSON document on stdout and nothing else (``--json``).

A schedule report is :meth:`dcsched.report.compare.Comparison.to_dict` with the input,
the bundles written and each file format's path (under the format's name) on
top; a sweep report is the rows of each graph's curve (``SweepRow.to_dict``).
The schema is in docs/schedule-cli.md, "JSON".
"""

from __future__ import annotations

import json

from rich.console import Console

from dcsched.report.formats.model import Report, ScheduleReport, SweepReport
from dcsched.report.formats.registry import register


def document(report: Report) -> dict:
    """The JSON-able form of ``report``."""
    files = {name: str(path) for name, path in report.files.items()}
    if isinstance(report, SweepReport):
        return {"input": str(report.input), "scope": report.scope,
                "graphs": {name: [row.to_dict() for row in rows] for name, rows in report.curves.items()}, **files}
    assert isinstance(report, ScheduleReport)
    extra = {"input": str(report.input), "outputs": {a: str(p) for a, p in report.outputs.items()}, **files}
    if report.saved is not None:
        extra["activation_memory"] = report.saved.to_json()
    if report.step_memory:
        extra["step_memory"] = {label: memory.to_json() for label, memory in report.step_memory.items()}
    return report.comparison.to_dict(params=report.params, **extra)


@register("json", description="one JSON document on stdout (bytes, ms), nothing else", reports=("schedule", "sweep"))
def write_json(report: Report, console: Console) -> None:
    out = console.file
    out.write(json.dumps(document(report), indent=2) + "\n")
    out.flush()
