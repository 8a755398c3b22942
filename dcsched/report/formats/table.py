"""``table``: the default report on the terminal.

Per graph, a table of the figures (rows) before and after each algorithm
(columns), the lower bounds under it, a sparkline of memory over simulated
time per order, with ``--params`` a table of each parameter's lifetime; then
the bundles written.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from dcsched.units import format_bytes, format_ms
from dcsched.report.formats import rows
from dcsched.report.formats.model import ScheduleReport
from dcsched.report.formats.registry import register
from dcsched.report.formats.text import change, pct, safe_text

if TYPE_CHECKING:
    from dcsched.report.compare import GraphComparison
    from dcsched.sim.step_memory import StepMemory
    from dcsched.sim.simulate import SimResult

SPARK_BLOCKS = " ▁▂▃▄▅▆▇█"
SPARK_WIDTH = 60


@register("table", description="figures per graph before and after each algorithm, memory sparklines, "
                                "--params lifetimes (the default)")
def write_table(report: ScheduleReport, console: Console) -> None:
    for name, cmp in report.comparison.graphs.items():
        print_figures(name, cmp, console)
        render_sparklines(cmp, console)
        if report.params:
            for algo in cmp.after:
                console.print(params_table(name, cmp, algo, report.param_names))
        console.print()
    if report.saved is not None:
        console.print(report.saved.describe(), highlight=False)
    if report.step_memory:
        print_step_memory(report.step_memory, console)
    for algo, out in report.outputs.items():
        console.print(f"wrote {safe_text(out)} ({algo})", highlight=False)


def print_figures(name: str, cmp: GraphComparison, console: Console) -> None:
    """The figures table; where it is wider than the terminal, the orders as rows (:mod:`.rows`)."""
    table = graph_table(name, cmp)
    if rows.fits(console, table):
        console.print(table)
        return
    for part in rows.order_tables(cmp, console, title(name, cmp), caption(cmp)):
        console.print(part)
    note = rows.legend(cmp)
    if note:
        console.print(f"[dim]{safe_text(note)}[/]", highlight=False)


def title(name: str, cmp: GraphComparison) -> str:
    c = cmp.compiled
    return f"[bold]{safe_text(name)}[/]: {len(c)} nodes, {c.num_allgathers} all-gathers, {c.num_reduces} reduce-grads"


def caption(cmp: GraphComparison) -> str:
    c = cmp.compiled
    return (f"compute {format_ms(c.compute_ms)}, communication {format_ms(c.comm_ms)}; "
            f"lower bound max(compute, comm) {format_ms(c.bounds.simple)}, tighter bound {format_ms(c.bounds.tight)}")


def graph_table(name: str, cmp: GraphComparison) -> Table:
    """The figures (rows) before and after each algorithm (columns)."""
    table = Table(title=title(name, cmp), title_justify="left", caption=caption(cmp), caption_justify="left")
    table.add_column("figure", no_wrap=True)
    table.add_column("before", justify="right", overflow="fold")
    for algo in cmp.after:
        table.add_column(algo, justify="right", overflow="fold")
    b = cmp.before
    after = cmp.after.values()
    rows = [
        ("peak memory", format_bytes(b.peak_bytes),
         [format_bytes(r.peak_bytes) + change(b.peak_bytes, r.peak_bytes) for r in after]),
        ("  at node", safe_text(b.peak_node or "-"), [safe_text(r.peak_node or "-") for r in after]),
        ("gathered peak", format_bytes(b.gathered_peak_bytes),
         [format_bytes(r.gathered_peak_bytes) + change(b.gathered_peak_bytes, r.gathered_peak_bytes) for r in after]),
        ("  at node", safe_text(b.gathered_peak_node or "-"), [safe_text(r.gathered_peak_node or "-") for r in after]),
        ("step time", format_ms(b.step_ms), [format_ms(r.step_ms) + change(b.step_ms, r.step_ms) for r in after]),
        ("exposed comm", format_ms(b.exposed_comm_ms), [format_ms(r.exposed_comm_ms) for r in after]),
        ("overlap", pct(b.overlap_pct), [pct(r.overlap_pct) for r in after]),
        ("collectives", str(b.collectives), [str(r.collectives) for r in after]),
        ("scheduler time", "-", [format_ms(cmp.scheduler_s[a] * 1000.0) for a in cmp.after]),
    ]
    for label, before, values in rows:
        table.add_row(label, before, *values)
    return table


def print_step_memory(memories: dict[str, StepMemory], console: Console) -> None:
    """:func:`step_memory_table`, split into tables of as many orders as the terminal's width holds."""
    labels = list(memories)
    start = 0
    while start < len(labels):
        end = len(labels)
        while end > start + 1 and not rows.fits(console, step_memory_table(
                {k: memories[k] for k in labels[start:end]})):
            end -= 1
        console.print(step_memory_table({k: memories[k] for k in labels[start:end]}))
        start = end


def step_memory_table(memories: dict[str, StepMemory]) -> Table:
    """The whole step's peak per rank split by kind (rows), for each order (columns)
    (:mod:`dcsched.sim.step_memory`; ``dcsched show`` prints the same for a bundle's own plans)."""
    from dcsched.sim.step_memory import KINDS
    first = next(iter(memories.values()))
    optimizer = first.optimizer or "none known (pass --optimizer)"
    table = Table(title="Whole-step memory per rank", title_justify="left", caption_justify="left",
                  caption=f"optimizer: {safe_text(optimizer)}")
    table.add_column("kind", no_wrap=True)
    for label in memories:
        table.add_column(safe_text(label), justify="right", overflow="fold")
    for kind in KINDS:
        table.add_row(kind.replace("_", " "), *(format_bytes(m.parts[kind]) for m in memories.values()))
    table.add_row("[bold]peak[/]", *(f"[bold]{format_bytes(m.peak_bytes)}[/]" for m in memories.values()))
    table.add_row("  in", *(m.phase for m in memories.values()))
    if first.cuda is not None:
        table.add_row("CUDA allocated", *(format_bytes(m.cuda.allocated_bytes) if m.cuda else "-"
                                          for m in memories.values()))
        table.add_row("CUDA reserved", *(format_bytes(m.cuda.reserved_bytes) if m.cuda else "-"
                                         for m in memories.values()))
    return table


def sparkline(result: SimResult, width: int, scale: float, end_ms: float) -> str:
    """Memory over simulated time in ``width`` cells; each cell shows the highest level it saw."""
    times, levels, _ = result.memory_timeline()
    if end_ms <= 0:  # no time at all: spread the nodes evenly instead
        times = [i * (1.0 / max(1, len(levels) - 1)) for i in range(len(levels))]
        end_ms = 1.0
    last = times[-1] if times else 0.0
    cells = [-1.0] * width
    level = 0
    sample = 0
    for cell in range(width):
        lo, hi = cell * end_ms / width, (cell + 1) * end_ms / width
        if lo >= last:
            break
        best = level
        while sample < len(times) and times[sample] < hi:
            level = levels[sample]
            best = max(best, level)
            sample += 1
        cells[cell] = best
    steps = len(SPARK_BLOCKS) - 1
    return "".join(" " if value < 0 else
                   SPARK_BLOCKS[max(1, min(steps, math.ceil(value / scale * steps)))] if scale > 0 else SPARK_BLOCKS[1]
                   for value in cells)


def render_sparklines(cmp: GraphComparison, console: Console) -> None:
    runs = [("before", cmp.before), *cmp.after.items()]
    scale = max(r.peak_bytes for _, r in runs)
    end = max(r.step_ms for _, r in runs)
    width = max(20, min(SPARK_WIDTH, console.width - 40))
    label_width = max(len(label) for label, _ in runs)
    console.print(f"memory over time (0 .. {format_ms(end)}, full block = {format_bytes(scale)})", highlight=False)
    for label, result in runs:
        console.print(f"  {label:<{label_width}} [cyan]{sparkline(result, width, scale, end)}[/] "
                      f"peak {format_bytes(result.peak_bytes)}", highlight=False)


def params_table(name: str, cmp: GraphComparison, algo: str, names: dict) -> Table:
    result = cmp.after[algo]
    before = {p.gather_node: p for p in cmp.before.params}
    table = Table(title=f"{safe_text(name)} / {algo}: gathered parameters", title_justify="left")
    for column in ("ds_id", "parameter", "size", "gathered at (#position)", "freed at (#position)", "held (nodes)",
                   "held", "before"):
        numeric = column in ("ds_id", "size", "held (nodes)", "held", "before")
        table.add_column(column, justify="right" if numeric else "left", overflow="fold")
    for p in result.params:
        old = before.get(p.gather_node)
        table.add_row(
            str(p.ds_id), safe_text(names.get(p.ds_id, "?")), format_bytes(p.size_bytes),
            f"{safe_text(p.gather_node)} (#{p.gather_index})",
            f"{safe_text(p.free_node)} (#{p.free_index})" if p.free_node else "never",
            str(p.held_nodes), format_ms(p.held_ms), format_ms(old.held_ms) if old else "-")
    return table
