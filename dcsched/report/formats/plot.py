"""``plot``: an image of memory over simulated time, or of a sweep's step time against budget (``--plot PATH``).

Needs matplotlib (the ``plot`` extra); :func:`check` refuses, before any work,
a missing matplotlib and a suffix it cannot write. The drawing is
:mod:`dcsched.report.plot_memory`'s.
"""

from __future__ import annotations

from pathlib import Path

from dcsched.report.formats.model import Report, SweepReport
from dcsched.report.formats.registry import register


def check(path: Path) -> None:
    from dcsched.report.plot_memory import check_plot_format
    check_plot_format(path)


@register("plot", description="memory over time (png/svg/pdf; needs matplotlib)", to_file=True,
          reports=("schedule", "sweep"), check=check)
def write_plot(report: Report, path: Path) -> None:
    if isinstance(report, SweepReport):
        from dcsched.report.plot_memory import plot_sweep
        plot_sweep(path, report.curves, title=Path(report.input).name)
        return
    from dcsched.report.plot_memory import plot_memory
    plot_memory(path, {name: [("before", cmp.before), *cmp.after.items()]
                       for name, cmp in report.comparison.graphs.items()}, title=Path(report.input).name)
