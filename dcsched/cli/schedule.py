"""``dcsched schedule``: reorder a bundle's graphs, show what it buys, write the result.

The work happens in :mod:`dcsched.report.compare` (schedulers + simulator) and
:mod:`dcsched.report.sweep`; the output in the report formats of :mod:`dcsched.report.formats`
(table, json, trace, plot, sweep). This module parses options, checks where
outputs go, and dispatches.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from dcsched.report import formats
from dcsched.report.options import ScheduleOptions, Selection
from dcsched.errors import DcschedError
from dcsched.outputs import all_or_none, check_outputs
from dcsched.budget import DEFAULT_MARGIN, DEFAULT_SCOPE, Budget, budget_for, device_memory
from dcsched.units import format_bytes
from dcsched.cli.app import app, console, err_console, in_flags, safe_text
from dcsched.cli.options import OPTIMIZER_HELP, named_from_options, option, parse_options

if TYPE_CHECKING:  # the modules themselves import torch, so only when a command runs
    from dcsched.bundle import core as bundle_io
    from dcsched.report.compare import Comparison


# ---------------------------------------------------------------------------
# Outputs and notes
# ---------------------------------------------------------------------------

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


def note_default_budget(bundle: bundle_io.Bundle, selection: Selection, budget: Budget) -> None:
    """Say on stderr, per selected scheduler that takes a budget, the budget the default rule gave it.

    The rule (:func:`dcsched.budget.budget_for` with no budget given) is the target device's memory recorded
    in the bundle less 10%; with no device recorded, no limit.
    """
    total = device_memory(bundle)
    for algo in selection.budgeted:
        if total is None:
            err_console.print(f"[dim]{algo}: no target device recorded in the bundle: memory budget unlimited; "
                              "set one with --memory-budget[/]", highlight=False)
        else:
            err_console.print(
                f"[dim]{algo}: memory budget {format_bytes(budget.bytes)} (the target device's "
                f"{format_bytes(total)} recorded in the bundle, less "
                f"{DEFAULT_MARGIN:.0%}); set one with --memory-budget[/]", highlight=False)


# ---------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------

@app.command()
def schedule(
    path: Path = typer.Argument(..., help="Graph bundle to reorder (graph.pt)."),
    algo: str = option(ScheduleOptions, "algo", "--algo", "-a"),
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
    assume_zero: bool = option(ScheduleOptions, "assume_zero", "--assume-zero"),
    memory_budget: str | None = option(ScheduleOptions, "memory_budget", "--memory-budget"),
    budget_scope: str | None = option(ScheduleOptions, "budget_scope", "--budget-scope"),
    algo_options: list[str] = option(ScheduleOptions, "algo_options", "--option", "-O", default=[]),
    sweep_budgets: bool = typer.Option(False, "--sweep",
                                       help="With --algo overlap: print the trade-off curve (budget, peak, step "
                                            "time, overlap) from the smallest workable budget to unlimited, and "
                                            "plot step time against budget with --plot. Writes no bundle."),
    optimizer: str | None = typer.Option(None, "--optimizer", help=OPTIMIZER_HELP),
) -> None:
    """Reorder the bundle's graphs with a scheduler, simulate before and after, write the reordered bundle.

    Memory is simulated in bytes and step time in ms; see docs/schedule-cli.md.
    """
    if optimizer is not None:
        from dcsched.bundle.optimizer import named
        named(optimizer)  # an unknown name: one line, before any work
    memory_budget, budget_scope, extra = named_from_options(memory_budget, budget_scope, algo_options)
    options = ScheduleOptions(algo=algo, memory_budget=memory_budget, budget_scope=budget_scope,
                              algo_options=parse_options(extra), assume_zero=assume_zero)
    selection = options.resolve()  # each scheduler looked up once, the budget read once, before any file
    algorithms = selection.names
    report_files = {name: p for name, p in (("trace", trace), ("plot", plot)) if p is not None}
    outputs = _bundles_to_write(path, algorithms, output, sweep_budgets, memory_budget)
    files = {(f"-o ({a})" if len(outputs) > 1 else "-o"): p for a, p in outputs.items()}
    kind = formats.SweepReport.kind if sweep_budgets else formats.ScheduleReport.kind
    stdout_format = "json" if as_json else ("sweep" if sweep_budgets else "table")
    chosen = [formats.get(name) for name in (stdout_format, *report_files)]
    for fmt in chosen:
        fmt.require(kind)
    files.update({f"--{name}": p for name, p in report_files.items()})
    check_outputs(files, inputs=[path], force=force)  # every output, before any work or any write
    for fmt in chosen:
        if fmt.check is not None:
            fmt.check(report_files[fmt.name])
    from dcsched.bundle import core as bundle_io, saved_memory
    from dcsched.report.compare import scheduled_bundle
    bundle = bundle_io.load(path)
    if sweep_budgets:
        from dcsched.report.sweep import sweep_bundle
        scope = selection.scope or DEFAULT_SCOPE
        report: formats.Report = formats.SweepReport(
            path, scope, sweep_bundle(bundle, scope=scope, progress=progress), report_files)
        scheduled: dict = {}
        to_save: dict = {}
    else:
        budget = budget_for(selection.budget, bundle, scope=selection.scope)  # the default rule, where none given
        comparison = run_comparison(bundle, selection, assume_zero=options.assume_zero, budget=budget,
                                    skip_failing=algo == "all")
        if selection.budget is None:  # after the run: a refusal stays the one line on stderr
            note_default_budget(bundle, selection, budget)
        scheduled = {a: p for a, p in outputs.items() if a in comparison.algorithms}
        # Reordered before the step memory builds the input's FX graphs: permuted from the loaded columns,
        # they are saved as they are, not encoded again from FX graphs.
        to_save = {a: scheduled_bundle(bundle, comparison, a, input_name=path.name) for a in scheduled}
        report = formats.ScheduleReport(path, comparison, files=report_files, params=params,
                                        param_names={p.ds_id: p.name for p in bundle.params}, outputs=scheduled,
                                        saved=saved_memory.from_provenance(bundle.provenance),
                                        step_memory=_step_memory(bundle, comparison, optimizer))
    written = []
    with all_or_none(force=force):  # every output, or none where one fails (a full disk under --plot)
        for algo_name, out in scheduled.items():
            bundle_io.save(to_save[algo_name], out)
            written.append(out)
        for name, target in report.files.items():
            formats.get(name)(report, target)
            written.append(target)
    for target in written:
        progress(f"wrote {target}")
    formats.get(stdout_format)(report, console)
    _note_if_planned(bundle)


def _step_memory(bundle, comparison, optimizer: str | None) -> dict:
    """The whole step's memory before and under each algorithm (:func:`dcsched.sim.step_memory.compared_step_memory`),
    or nothing where the bundle's figures do not simulate (``--assume-zero`` graphs)."""
    from dcsched.errors import GraphError
    from dcsched.sim.step_memory import compared_step_memory
    try:
        return compared_step_memory(bundle, comparison, optimizer)
    except GraphError:
        return {}


def _bundles_to_write(path: Path, algorithms: list[str], output: Path | None, sweep_budgets: bool,
                      memory_budget: str | None) -> dict[str, Path]:
    """Each algorithm's output bundle; none under ``--sweep``, whose flags are checked here."""
    if not sweep_budgets:
        return output_paths(path, algorithms, output)
    if algorithms != ["overlap"]:
        raise DcschedError("--sweep traces the overlap scheduler's memory/time trade-off: use --algo overlap")
    if memory_budget is not None:
        raise DcschedError("--sweep chooses its own budgets, from the smallest workable to unlimited: "
                           "drop --memory-budget")
    return {}


def _note_if_planned(bundle) -> None:
    """Say on stderr when the bundle's figures are a cost model's, planned from shapes (``profile --meta``)."""
    if bundle.provenance.get("planned"):
        prov = bundle.provenance
        err_console.print(f"[dim]planned, not measured: the figures are the {prov.get('cost_model')} cost model's "
                          f"for {prov.get('gpu')} at world size {prov.get('world_size')}, from shapes alone "
                          "(dcsched profile --meta)[/]", highlight=False)


def progress(message: str) -> None:
    err_console.print(f"[dim]{safe_text(message)}[/]", highlight=False)


class _Ticker:
    """:func:`progress`, and on a terminal below the last message a transient spinner with the seconds it
    has taken so far, so a scheduler that runs long shows it is running (stderr only: stdout, ``--json``
    included, is untouched; off where stderr is not a terminal)."""

    def __enter__(self) -> "_Ticker":
        self.display = None
        if err_console.is_terminal:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
            self.display = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                    console=err_console, transient=True)
            self.task = self.display.add_task("", total=None)
            self.display.start()
        return self

    def __call__(self, message: str) -> None:
        progress(message)
        if self.display is not None:
            self.display.reset(self.task, description=f"[dim]{safe_text(message)}[/]")

    def __exit__(self, *exc) -> None:
        if self.display is not None:
            self.display.stop()


def run_comparison(bundle: bundle_io.Bundle, selection: Selection, *, assume_zero: bool, budget: Budget,
                   skip_failing: bool) -> Comparison:
    """Schedule and simulate every graph (:func:`dcsched.report.compare.compare_bundle`), saying on stderr what was
    skipped, assumed zero or unsized."""
    from dcsched.report.compare import compare_bundle
    # With 'all', a scheduler that cannot run with the options given (a budget too small for it, say)
    # is left out with a note rather than stopping the comparison of the others.
    with _Ticker() as tick:
        comparison = compare_bundle(bundle, selection.schedulers, assume_zero=assume_zero, progress=tick,
                                    options={name: dict(own) for name, own in selection.options.items()},
                                    skip_failing=skip_failing, budget=budget,
                                    describe=lambda exc: in_flags(exc, "schedule"))
    for algo_name, reason in comparison.skipped.items():
        err_console.print(f"[yellow]{algo_name}: skipped: {safe_text(reason)}[/]", highlight=False)
    for name, cmp in comparison.graphs.items():
        if cmp.compiled.missing:
            counts = ", ".join(f"{len(v)} without {k}" for k, v in cmp.compiled.missing.items())
            err_console.print(f"[yellow]{safe_text(name)}: {counts}, counted as 0 (--assume-zero)[/]", highlight=False)
        if cmp.compiled.unsized_inputs:
            err_console.print(f"[yellow]{safe_text(name)}: {len(cmp.compiled.unsized_inputs)} inputs with no size "
                              "(no tensor_size, no shape), counted as 0 bytes[/]", highlight=False)
    return comparison
