"""``sweep``: ``--sweep``'s trade-off curve per graph on the terminal.

One table per graph: each budget tried (the smallest workable first, unlimited
last), with the all-tensor and gathered peaks, step time, exposed
communication and overlap the overlap scheduler reaches under it.
"""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from dcsched.units import format_bytes, format_ms
from dcsched.report.formats.model import SweepReport
from dcsched.report.formats.registry import register
from dcsched.report.formats.text import pct, safe_text


@register("sweep", description="--sweep's budget / step-time table per graph", reports=("sweep",))
def write_sweep(report: SweepReport, console: Console) -> None:
    for name, rows in report.curves.items():
        console.print(sweep_table(name, rows))
        console.print()


def sweep_table(name: str, rows) -> Table:
    table = Table(title=f"[bold]{safe_text(name)}[/]: overlap at growing memory budgets ({rows[0].scope} scope)",
                  title_justify="left",
                  caption=f"lower bounds: max(compute, comm) {format_ms(rows[0].lower_bound_ms)}, "
                          f"tighter {format_ms(rows[0].tight_lower_bound_ms)}", caption_justify="left")
    for column in ("budget", "peak memory", "gathered peak", "step time", "exposed comm", "overlap"):
        table.add_column(column, justify="right")
    for row in rows:
        budget = "unlimited" if math.isinf(row.budget_bytes) else format_bytes(row.budget_bytes)
        if row.budget_bytes == row.min_budget_bytes:
            budget += " (smallest)"
        table.add_row(budget, format_bytes(row.peak_bytes), format_bytes(row.gathered_peak_bytes),
                      format_ms(row.step_ms), format_ms(row.exposed_comm_ms), pct(row.overlap_pct))
    return table
