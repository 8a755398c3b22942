"""The ``table`` format's layout for narrow terminals: one row per order, the figures as columns.

When the figures-by-algorithm table is wider than the terminal (``--algo all``
in 80 or 160 columns), each order (``before`` and every algorithm) becomes a
row instead; the figures are packed into as few tables as fit the width, each
starting with the order's name, and long node names are shortened
(:func:`short_node`; the full names are in ``--json``).

>>> short_node("allgather_ds_param_primals_53_51"), short_node("_log_softmax")
('ag:primals_53_51', '_log_softmax')
>>> short_node("convolution_backward_default_with_a_long_name_12", width=18)
'convolut…g_name_12'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from dcsched.units import format_bytes, format_ms
from dcsched.report.formats.text import change, pct, printable, safe_text

if TYPE_CHECKING:
    from dcsched.report.compare import GraphComparison
    from dcsched.sim.simulate import SimResult

#: Widest node name shown in a row; longer ones are shortened.
NODE_WIDTH = 18
#: DeepCompile's node-name prefixes and their short forms, tried in this order.
PREFIXES = (("wait_allgather_ds_param__", "w:"), ("allgather_ds_param_", "ag:"), ("release_ds_param_", "rel:"),
            ("reduce_ds_param_", "rg:"))

#: A cell: (before, this order's result, its scheduler seconds or None for before) -> text
Cell = Callable[["SimResult", "SimResult", "float | None"], str]


def short_node(name: str, width: int = NODE_WIDTH) -> str:
    """``name`` in at most ``width`` characters: a DeepCompile prefix abbreviated, then the middle elided."""
    if len(name) <= width:
        return name
    for long, short in PREFIXES:
        if name.startswith(long):
            name = short + name[len(long):]
            break
    if len(name) <= width:
        return name
    head = (width - 1) // 2
    return name[:head] + "…" + name[len(name) - (width - 1 - head):]


def _with_change(value: Callable[["SimResult"], float], show: Callable[[float], str]) -> Cell:
    return lambda b, r, s: show(value(r)) + ("" if s is None else change(value(b), value(r)))


def _node(value: Callable[["SimResult"], str | None]) -> Cell:
    return lambda b, r, s: safe_text(short_node(printable(value(r) or "-")))


#: Column groups, kept together in one table: (header, justify, cell) each.
GROUPS: tuple[tuple[tuple[str, str, Cell], ...], ...] = (
    (("peak memory", "right", _with_change(lambda r: r.peak_bytes, format_bytes)),
     ("at node", "left", _node(lambda r: r.peak_node))),
    (("gathered peak", "right", _with_change(lambda r: r.gathered_peak_bytes, format_bytes)),
     ("at node", "left", _node(lambda r: r.gathered_peak_node))),
    (("step time", "right", _with_change(lambda r: r.step_ms, format_ms)),),
    (("exposed comm", "right", lambda b, r, s: format_ms(r.exposed_comm_ms)),),
    (("overlap", "right", lambda b, r, s: pct(r.overlap_pct)),),
    (("collectives", "right", lambda b, r, s: str(r.collectives)),),
    (("scheduler time", "right", lambda b, r, s: "-" if s is None else format_ms(s * 1000.0)),),
)


def fits(console: Console, table: Table) -> bool:
    """Whether ``table`` is drawn in ``console``'s width without wrapping a cell."""
    unbounded = console.options.update(width=10**6, max_width=10**6)
    return Measurement.get(console, unbounded, table).maximum <= console.width


def orders_table(cmp: GraphComparison, columns) -> Table:
    table = Table()
    table.add_column("order", no_wrap=True)
    for header, justify, _ in columns:
        table.add_column(header, justify=justify, no_wrap=True)
    b = cmp.before
    for label, result, seconds in [("before", b, None),
                                   *((a, r, cmp.scheduler_s[a]) for a, r in cmp.after.items())]:
        table.add_row(label, *(cell(b, result, seconds) for _, _, cell in columns))
    return table


def order_tables(cmp: GraphComparison, console: Console, title: str, caption: str) -> list[Table]:
    """The orders as rows, the column groups packed into as few tables as fit ``console``'s width."""
    packed: list[list] = [[]]
    for group in GROUPS:
        trial = packed[-1] + list(group)
        if packed[-1] and not fits(console, orders_table(cmp, trial)):
            packed.append(list(group))
        else:
            packed[-1] = trial
    tables = [orders_table(cmp, columns) for columns in packed]
    tables[0].title, tables[0].title_justify = title, "left"
    tables[-1].caption, tables[-1].caption_justify = caption, "left"
    return tables


def legend(cmp: GraphComparison) -> str | None:
    """The line that says how the rows shortened ``cmp``'s node names; None when none was."""
    names = {printable(name) for r in (cmp.before, *cmp.after.values())
             for name in (r.peak_node, r.gathered_peak_node) if name}
    shortened = [name for name in names if len(name) > NODE_WIDTH]
    if not shortened:
        return None
    parts = [f"{short} {long}" for long, short in PREFIXES if any(name.startswith(long) for name in shortened)]
    if any("…" in short_node(name) for name in shortened):
        parts.append("… elided")
    return f"node names shortened ({', '.join(parts)}); full names with --json"
