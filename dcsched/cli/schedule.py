"""``dcsched schedule``: reorder a bundle's graphs, show what it buys, write the result.

The work happens in :mod:`dcsched.report` (schedulers + simulator); this module
parses options, checks where outputs go, writes them and renders.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from ..errors import DcschedError
from ..outputs import check_outputs
from ..units import format_bytes, format_ms, parse_budget
from .app import app, console, err_console, fail, safe_text

if TYPE_CHECKING:  # the modules themselves import torch, so only when a command runs
    from .. import bundle as bundle_io
    from ..report import Comparison, GraphComparison
    from ..simulate import SimResult

SPARK_BLOCKS = " ▁▂▃▄▅▆▇█"
SPARK_WIDTH = 60


# ---------------------------------------------------------------------------
# Options -> plan
# ---------------------------------------------------------------------------

def resolve_algorithms(algo: str) -> list[str]:
    """``'all'`` = every registered scheduler; else a comma-separated list of names."""
    from .. import schedulers
    if algo == "all":
        return schedulers.available()
    names = [name.strip() for name in algo.split(",") if name.strip()]
    if not names:
        raise DcschedError("--algo needs a scheduler name or 'all'")
    for name in names:
        schedulers.get(name)
    return list(dict.fromkeys(names))


def _option_value(text: str):
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def scheduler_options(algorithms: list[str], memory_budget: str | None, budget_scope: str | None,
                      extra: list[str]) -> dict[str, dict]:
    """Per algorithm, the given options it accepts; an option no selected algorithm takes is an error."""
    from .. import schedulers
    given: dict[str, object] = {}
    if memory_budget is not None:
        given["memory_budget"] = parse_budget(memory_budget)
    if budget_scope is not None:
        given["budget_scope"] = budget_scope
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise DcschedError(f"--option {item!r}: expected KEY=VALUE, e.g. --option k=3")
        given[key.strip().replace("-", "_")] = _option_value(value.strip())
    per_algo = {algo: {k: v for k, v in given.items() if k in schedulers.get(algo).options} for algo in algorithms}
    for key in given:
        if not any(key in opts for opts in per_algo.values()):
            takers = sorted(a for a in schedulers.available() if key in schedulers.get(a).options)
            raise DcschedError(f"no selected scheduler takes option '{key}' "
                               f"({'taken by: ' + ', '.join(takers) if takers else 'no scheduler takes it'})")
    return per_algo


def output_paths(source: Path, algorithms: list[str], output: Path | None) -> dict[str, Path]:
    """Where each algorithm's bundle goes.

    Without ``output``: ``<input stem>.<algo>.pt`` beside the input. With one
    algorithm, ``output`` itself; with several, ``<output stem>.<algo><suffix>``.
    """
    paths = {}
    for algo in algorithms:
        if output is None:
            paths[algo] = source.with_name(f"{source.stem}.{algo}.pt")
        elif len(algorithms) == 1:
            paths[algo] = output
        else:
            paths[algo] = output.with_name(f"{output.stem}.{algo}{output.suffix or '.pt'}")
    return paths


def check_plot_target(plot: Path) -> None:
    """``--plot``: matplotlib is there and can write the suffix's format (before any work is done)."""
    from ..plot import check_plot_format
    check_plot_format(plot)


def scheduled_bundle(bundle: bundle_io.Bundle, comparison: Comparison, algo: str, source: Path) -> bundle_io.Bundle:
    """``bundle`` with every graph in ``algo``'s order (same nodes, edges and meta)."""
    from ..nxview import to_fx
    graphs = {}
    for name, graph in bundle.graphs.items():
        new_graph = to_fx(graph, comparison.graphs[name].orders[algo])
        new_graph.lint()
        graphs[name] = new_graph
    result = bundle.with_graphs(**graphs)
    result.provenance["schedule"] = {"algorithm": algo, "input": source.name}
    return result


# ---------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------

def sparkline(result: SimResult, width: int, scale: float, end_ms: float) -> str:
    """Memory over simulated time in ``width`` cells; each cell shows the highest level it saw."""
    times, levels, _ = result.memory_timeline()
    if end_ms <= 0:  # no time at all: spread the nodes evenly instead
        times = [i * (1.0 / max(1, len(levels) - 1)) for i in range(len(levels))]
        end_ms = 1.0
    cells = [-1.0] * width
    level = 0
    sample = 0
    for cell in range(width):
        lo, hi = cell * end_ms / width, (cell + 1) * end_ms / width
        if lo >= result_end(times):
            break
        best = level
        while sample < len(times) and times[sample] < hi:
            level = levels[sample]
            best = max(best, level)
            sample += 1
        cells[cell] = best
    chars = []
    for value in cells:
        if value < 0:
            chars.append(" ")
        else:
            steps = len(SPARK_BLOCKS) - 1
            chars.append(SPARK_BLOCKS[max(1, min(steps, math.ceil(value / scale * steps)))] if scale > 0
                         else SPARK_BLOCKS[1])
    return "".join(chars)


def result_end(times: list[float]) -> float:
    return times[-1] if times else 0.0


def _change(before: float, after: float) -> str:
    if before == 0:
        return "" if after == 0 else " (new)"
    pct = round(100.0 * (after - before) / before, 1)
    return f" ({pct:+.1f}%)" if pct != 0 else " (=)"


def _pct(value: float) -> str:
    return f"{value:.1f}%"


def graph_table(name: str, cmp: GraphComparison) -> Table:
    c = cmp.compiled
    bounds = c.bounds
    table = Table(title=f"[bold]{safe_text(name)}[/]: {len(c)} nodes, {c.num_allgathers} all-gathers, "
                        f"{c.num_reduces} reduce-grads", title_justify="left",
                  caption=f"compute {format_ms(c.compute_ms)}, communication {format_ms(c.comm_ms)}; "
                          f"lower bound max(compute, comm) {format_ms(bounds.simple)}, "
                          f"tighter bound {format_ms(bounds.tight)}",
                  caption_justify="left")
    table.add_column("figure", no_wrap=True)
    table.add_column("before", justify="right", overflow="fold")
    for algo in cmp.after:
        table.add_column(algo, justify="right", overflow="fold")
    b = cmp.before
    rows = [
        ("peak memory", format_bytes(b.peak_bytes),
         [format_bytes(r.peak_bytes) + _change(b.peak_bytes, r.peak_bytes) for r in cmp.after.values()]),
        ("  at node", safe_text(b.peak_node or "-"), [safe_text(r.peak_node or "-") for r in cmp.after.values()]),
        ("gathered peak", format_bytes(b.gathered_peak_bytes),
         [format_bytes(r.gathered_peak_bytes) + _change(b.gathered_peak_bytes, r.gathered_peak_bytes)
          for r in cmp.after.values()]),
        ("  at node", safe_text(b.gathered_peak_node or "-"),
         [safe_text(r.gathered_peak_node or "-") for r in cmp.after.values()]),
        ("step time", format_ms(b.step_ms),
         [format_ms(r.step_ms) + _change(b.step_ms, r.step_ms) for r in cmp.after.values()]),
        ("exposed comm", format_ms(b.exposed_comm_ms), [format_ms(r.exposed_comm_ms) for r in cmp.after.values()]),
        ("overlap", _pct(b.overlap_pct), [_pct(r.overlap_pct) for r in cmp.after.values()]),
        ("scheduler time", "-", [format_ms(cmp.scheduler_s[a] * 1000.0) for a in cmp.after]),
    ]
    for label, before, after in rows:
        table.add_row(label, before, *after)
    return table


def render_sparklines(cmp: GraphComparison) -> None:
    runs = [("before", cmp.before), *cmp.after.items()]
    scale = max(r.peak_bytes for _, r in runs)
    end = max(r.step_ms for _, r in runs)
    width = max(20, min(SPARK_WIDTH, console.width - 40))
    label_width = max(len(label) for label, _ in runs)
    console.print(f"memory over time (0 .. {format_ms(end)}, full block = {format_bytes(scale)})",
                  highlight=False)
    for label, result in runs:
        console.print(f"  {label:<{label_width}} [cyan]{sparkline(result, width, scale, end)}[/] "
                      f"peak {format_bytes(result.peak_bytes)}", highlight=False)


def params_table(name: str, cmp: GraphComparison, algo: str, names: dict[int, str]) -> Table:
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


def apply_default_budget(bundle: bundle_io.Bundle, options: dict[str, dict], *, explicit: bool) -> None:
    """Give the schedulers that take a memory budget the bundle's default when none was asked for.

    The default is the target device's memory recorded in the bundle minus a
    margin (:func:`dcsched.sweep.default_budget`); without a recorded device
    the budget stays missing and those schedulers say ``--memory-budget`` is needed.
    """
    if explicit:
        return
    from .. import schedulers
    from ..sweep import DEFAULT_MARGIN, default_budget
    budget = default_budget(bundle)
    for algo, opts in options.items():
        if budget is not None and "memory_budget" in schedulers.get(algo).options:
            opts["memory_budget"] = budget
            err_console.print(
                f"[dim]{algo}: memory budget {format_bytes(budget)} (the target device's "
                f"{format_bytes(bundle.provenance['target_memory_bytes'])} recorded in the bundle, less "
                f"{DEFAULT_MARGIN:.0%}); set one with --memory-budget[/]", highlight=False)


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
                      format_ms(row.step_ms), format_ms(row.exposed_comm_ms), _pct(row.overlap_pct))
    return table


def run_sweep(path: Path, scope: str, *, as_json: bool, plot: Path | None) -> None:
    """``--sweep``: the overlap scheduler's trade-off curve per graph; prints it, plots it, writes no bundle."""
    from .. import bundle as bundle_io
    from ..sweep import sweep

    bundle = bundle_io.load(path)
    curves = {}
    for name, graph in bundle.graphs.items():
        err_console.print(f"[dim]{safe_text(name)}: sweeping memory budgets with overlap[/]", highlight=False)
        curves[name] = sweep(graph, scope=scope, name=name)
    if plot is not None:
        from ..plot import plot_sweep
        plot_sweep(plot, curves, title=path.name)
        err_console.print(f"[dim]wrote {safe_text(plot)}[/]", highlight=False)
    if as_json:
        document = {"input": str(path), "scope": scope,
                    "graphs": {name: [row.to_dict() for row in rows] for name, rows in curves.items()}}
        if plot is not None:
            document["plot"] = str(plot)
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
        return
    for name, rows in curves.items():
        console.print(sweep_table(name, rows))
        console.print()


# ---------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------

@app.command()
def schedule(
    path: Path = typer.Argument(..., help="Graph bundle to reorder (graph.pt)."),
    algo: str = typer.Option("fast-free", "--algo", "-a",
                             help="Scheduler name, a comma-separated list, or 'all' for every registered one "
                                  "(fast-free, simple-prefetch, list, overlap, none, ...; an unknown name lists "
                                  "them all)."),
    output: Path | None = typer.Option(None, "--output", "-o",
                                       help="Output bundle. Default: <input stem>.<algo>.pt beside the input; "
                                            "with several algorithms, <output stem>.<algo>.pt."),
    force: bool = typer.Option(False, "--force", help="Replace output files that exist already, the input "
                                                       "bundle included (refused otherwise)."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON (bytes, ms) on stdout, "
                                                       "nothing else."),
    trace: Path | None = typer.Option(None, "--trace", help="Write a Chrome/Perfetto trace of the simulated "
                                                            "timelines (JSON)."),
    plot: Path | None = typer.Option(None, "--plot", help="Draw memory over time to an image (png/svg/pdf; "
                                                          "needs the 'plot' extra: matplotlib)."),
    params: bool = typer.Option(False, "--params", help="List, per parameter, where it is gathered and freed "
                                                        "and how long it stays."),
    assume_zero: bool = typer.Option(False, "--assume-zero", help="Count missing device_time (ms) / tensor_size "
                                                                  "(bytes) as 0 instead of refusing the graph."),
    memory_budget: str | None = typer.Option(None, "--memory-budget",
                                             help="Memory budget for the schedulers that take one, in bytes with an "
                                                  "optional SI/IEC suffix (6GiB, 1.5GB) or 'unlimited'."),
    budget_scope: str | None = typer.Option(None, "--budget-scope",
                                            help="What the memory budget caps, for the schedulers that take it: "
                                                 "'all' (all tensors, the default) or 'gathered' (gathered "
                                                 "parameters)."),
    option: list[str] = typer.Option([], "--option", "-O",
                                     help="KEY=VALUE passed to the selected schedulers that take KEY "
                                          "(repeatable; e.g. -O k=3)."),
    sweep_budgets: bool = typer.Option(False, "--sweep",
                                       help="With --algo overlap: print the trade-off curve (budget, peak, step "
                                            "time, overlap) from the smallest workable budget to unlimited, and "
                                            "plot step time against budget with --plot. Writes no bundle."),
) -> None:
    """Reorder the bundle's graphs with a scheduler, simulate before and after, write the reordered bundle.

    Memory is simulated in bytes and step time in ms; see docs/schedule-cli.md.
    """
    algorithms = resolve_algorithms(algo)
    options = scheduler_options(algorithms, memory_budget, budget_scope, option)
    if sweep_budgets:
        if algorithms != ["overlap"]:
            raise DcschedError("--sweep traces the overlap scheduler's memory/time trade-off: use --algo overlap")
        if memory_budget is not None:
            raise DcschedError("--sweep chooses its own budgets, from the smallest workable to unlimited: "
                               "drop --memory-budget")
        files = {"--plot": plot} if plot is not None else {}
    else:
        outputs = output_paths(path, algorithms, output)
        files = {(f"-o ({a})" if len(outputs) > 1 else "-o"): p for a, p in outputs.items()}
        files.update({flag: p for flag, p in (("--trace", trace), ("--plot", plot)) if p is not None})
    check_outputs(files, inputs=[path], force=force)  # every output, before any work or any write
    if plot is not None:
        check_plot_target(plot)
    if sweep_budgets:
        from ..schedulers.overlap import DEFAULT_SCOPE
        run_sweep(path, budget_scope or DEFAULT_SCOPE, as_json=as_json, plot=plot)
        return
    from .. import bundle as bundle_io
    from ..report import compare_bundle
    bundle = bundle_io.load(path)
    apply_default_budget(bundle, options, explicit=memory_budget is not None)

    def progress(message: str) -> None:
        err_console.print(f"[dim]{safe_text(message)}[/]", highlight=False)

    # With 'all', a scheduler that cannot run with the options given (one that needs a memory budget, say)
    # is left out with a note rather than stopping the comparison of the others.
    comparison = compare_bundle(bundle, algorithms, assume_zero=assume_zero, progress=progress, options=options,
                                skip_failing=algo == "all")
    for algo_name, reason in comparison.skipped.items():
        err_console.print(f"[yellow]{algo_name}: skipped: {safe_text(reason)}[/]", highlight=False)
    outputs = {a: p for a, p in outputs.items() if a in comparison.algorithms}
    for name, cmp in comparison.graphs.items():
        if cmp.compiled.missing:
            counts = ", ".join(f"{len(v)} without {k}" for k, v in cmp.compiled.missing.items())
            err_console.print(f"[yellow]{safe_text(name)}: {counts}, counted as 0 (--assume-zero)[/]", highlight=False)
        if cmp.compiled.unsized_inputs:
            err_console.print(f"[yellow]{safe_text(name)}: {len(cmp.compiled.unsized_inputs)} inputs with no size "
                              "(no tensor_size, no shape), counted as 0 bytes[/]", highlight=False)

    for algo_name, out in outputs.items():
        bundle_io.save(scheduled_bundle(bundle, comparison, algo_name, path), out)
        progress(f"wrote {out}")
    if trace is not None:
        from ..trace import write_trace
        write_trace(trace, [(f"{name} / {label}", result)
                            for name, cmp in comparison.graphs.items()
                            for label, result in [("before", cmp.before), *cmp.after.items()]])
        progress(f"wrote {trace}")
    if plot is not None:
        from ..plot import plot_memory
        plot_memory(plot, {name: [("before", cmp.before), *cmp.after.items()]
                           for name, cmp in comparison.graphs.items()}, title=path.name)
        progress(f"wrote {plot}")

    if as_json:
        extra = {"input": str(path), "outputs": {a: str(p) for a, p in outputs.items()}}
        if trace is not None:
            extra["trace"] = str(trace)
        if plot is not None:
            extra["plot"] = str(plot)
        sys.stdout.write(json.dumps(comparison.to_dict(params=params, **extra), indent=2) + "\n")
        sys.stdout.flush()
        return
    names = {p.ds_id: p.name for p in bundle.params}
    for name, cmp in comparison.graphs.items():
        console.print(graph_table(name, cmp))
        render_sparklines(cmp)
        if params:
            for algo_name in cmp.after:
                console.print(params_table(name, cmp, algo_name, names))
        console.print()
    for algo_name, out in outputs.items():
        console.print(f"wrote {safe_text(out)} ({algo_name})", highlight=False)
