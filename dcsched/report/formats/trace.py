"""``trace``: a Chrome / Perfetto trace of every simulated order (``--trace PATH``).

One process per graph and order ("forward / before", "forward / fast-free",
...); the events are :func:`dcsched.report.chrome_trace.chrome_trace`'s.
"""

from __future__ import annotations

from pathlib import Path

from dcsched.report.formats.model import ScheduleReport
from dcsched.report.formats.registry import register


@register("trace", description="Chrome/Perfetto trace of the simulated timelines (JSON)", to_file=True)
def write_trace(report: ScheduleReport, path: Path) -> None:
    from dcsched.report.chrome_trace import write_trace as write_chrome_trace
    write_chrome_trace(path, [(f"{name} / {label}", result)
                              for name, cmp in report.comparison.graphs.items()
                              for label, result in [("before", cmp.before), *cmp.after.items()]])
