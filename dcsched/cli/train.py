"""``dcsched train``: a training script, every compiled module trained ZeRO-3 sharded with a dcsched schedule."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import typer
from rich.table import Table

from dcsched.bundle.saved_memory import SavedActivations
from dcsched.train.options import ScriptOptions, TrainOptions
from dcsched.units import format_bytes, format_ms
from dcsched.cli.app import SCRIPT, SCRIPT_ARGS, app, console, err_console, safe_text
from dcsched.cli.options import named_from_options, option, parse_options

if TYPE_CHECKING:  # torch, imported only when the command runs
    from dcsched.train.script import TrainResult

#: A compile shorter than this shows no progress display (seconds).
PROGRESS_DELAY_S = 1.0


def _with_error(text: str, simulated: float | None, measured: float | None) -> str:
    if simulated is None or not measured:
        return text
    return f"{text} ({100.0 * (simulated - measured) / measured:+.1f}%)"


def render(result: TrainResult) -> None:
    """Per compiled graph: measured median step time and peak memory beside the simulator's, for the schedule."""
    ranks = "1 process" if result.world_size == 1 else f"{result.world_size} ranks (rank 0 shown)"
    plan = "" if result.plan_file is None else (
        f", plan {'reused from' if result.plan_file['reused'] else 'stored in'} {safe_text(result.plan_file['path'])}")
    console.print(f"[bold]dcsched train[/] {safe_text(result.script)}: algo {safe_text(result.algo)}, {ranks}{plan}",
                  highlight=False)
    table = Table(title_justify="left")
    for column in ("graph", "steps", "time", "simulated", "peak memory", "simulated"):
        table.add_column(column, justify="left" if column == "graph" else "right")
    for g in result.graphs:
        table.add_row(f"{safe_text(g.module)} {g.graph}", str(g.steps), format_ms(g.measured_ms),
                      _with_error(format_ms(g.simulated_ms), g.simulated_ms, g.measured_ms),
                      format_bytes(g.measured_peak_bytes),
                      _with_error(format_bytes(g.simulated_peak_bytes), g.simulated_peak_bytes,
                                  g.measured_peak_bytes))
    console.print(table)
    console.print("measured on this rank: median time of the steps after the first (perf_counter), peak live tensor "
                  "bytes of the first step (memory tracker); simulated: dcsched.simulate of the schedule (its error "
                  "against the measured figure)", highlight=False)
    if result.step_memory:
        from dcsched.report.formats.table import print_step_memory
        print_step_memory(result.step_memory, console)
    for label, saved in result.activation_memory.items():
        line = SavedActivations(saved["saved_bytes"], saved["without_checkpointing_bytes"]).describe()
        console.print(f"{safe_text(label)}: {line}", highlight=False)
    if result.compute == "inductor":
        console.print("peak memory n/a: inductor's kernels allocate outside the memory tracker's sight (--compute "
                      "eager measures it); the time of the first step, which compiles, is left out", highlight=False)
    if result.caveat:
        console.print(f"[yellow]caveat[/]: {safe_text(result.caveat)}", highlight=False)
    if result.losses:
        console.print(f"losses: first {result.losses[0]:.6g}, last {result.losses[-1]:.6g} "
                      f"({len(result.losses)} steps)", highlight=False)


class _CompileProgress:
    """A transient spinner on stderr for compiles that take longer than :data:`PROGRESS_DELAY_S`."""

    def __init__(self) -> None:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                 console=err_console, transient=True)

    @contextlib.contextmanager
    def __call__(self, what: str):
        task = self.progress.add_task(f"compiling {safe_text(what)}", total=None)
        timer = threading.Timer(PROGRESS_DELAY_S, self.progress.start)
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
            timer.join()
            self.progress.stop()
            self.progress.remove_task(task)


@app.command()
def train(
    script: Path = SCRIPT,
    script_args: Optional[List[str]] = SCRIPT_ARGS,
    algo: str = option(TrainOptions, "algo", "--algo"),
    memory_budget: Optional[str] = option(TrainOptions, "memory_budget", "--memory-budget"),
    budget_scope: Optional[str] = option(TrainOptions, "budget_scope", "--budget-scope"),
    algo_options: List[str] = option(TrainOptions, "algo_options", "--option", "-O", default=[],
                                     help="KEY=VALUE passed to the scheduler, which must take KEY (repeatable; "
                                          "e.g. --algo prefetch-ahead -O k=3)."),
    cost_model: str = option(TrainOptions, "cost_model", "--cost-model"),
    gpu: Optional[str] = option(TrainOptions, "gpu", "--gpu"),
    bandwidth_gbps: Optional[float] = option(TrainOptions, "bandwidth_gbps", "--bandwidth"),
    latency_us: Optional[float] = option(TrainOptions, "latency_us", "--latency"),
    compute: str = option(TrainOptions, "compute", "--compute"),
    plan: Optional[Path] = option(TrainOptions, "plan", "--plan", metavar="FILE"),
    timeout_s: float = option(ScriptOptions, "timeout_s", "--timeout"),
    replicate_below: int = option(ScriptOptions, "replicate_below", "--replicate-below"),
    param_dtype: Optional[str] = option(ScriptOptions, "param_dtype", "--param-dtype"),
    reduce_dtype: Optional[str] = option(ScriptOptions, "reduce_dtype", "--reduce-dtype"),
    output_dtype: Optional[str] = option(ScriptOptions, "output_dtype", "--output-dtype"),
    report: bool = typer.Option(False, "--report", help="On rank 0 after the script: per compiled graph, measured "
                                                        "step time and peak memory beside the simulator's."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout (ms and bytes, the "
                                                       "per-step losses); the script's own output goes to stderr."),
    progress: bool = typer.Option(True, "--progress/--no-progress",
                                  help="Show a progress display on stderr while a compile takes over a second."),
) -> None:
    """Train with a schedule: run a script with every torch.compile'd module sharded ZeRO-3 style over the process group and run through dcsched's scheduled forward and backward graphs.

    The script's own loop, optimizer and loss stay as they are. Run it alone (world size 1) or under torchrun --nproc-per-node W -m dcsched train ... (gloo on the CPU, NCCL on CUDA). A rank that dies or raises makes the others exit with code 1 and one line naming it, within --timeout. Exit code: the script's, 2 for bad input, 1 where a rank failed.

    Example: dcsched train examples/gpt.py --algo overlap --report -- --steps 20
    """  # noqa: E501
    from dcsched.train.script import train_script  # torch, imported only when the command runs

    memory_budget, budget_scope, extra = named_from_options(memory_budget, budget_scope, algo_options)
    options = ScriptOptions(TrainOptions(algo=algo, memory_budget=memory_budget, budget_scope=budget_scope,
                                         algo_options=parse_options(extra), cost_model=cost_model, gpu=gpu,
                                         bandwidth_gbps=bandwidth_gbps, latency_us=latency_us, compute=compute,
                                         plan=plan),
                            measure=report or as_json, timeout_s=timeout_s, replicate_below=replicate_below,
                            param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=output_dtype)
    options.check()
    show_progress = progress and err_console.is_terminal and _rank_from_env() == 0
    compiling = _CompileProgress() if show_progress else contextlib.nullcontext
    quiet = contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext()
    with quiet:
        result = train_script(script, list(script_args or []), options, compiling=compiling)
    if result.rank == 0:
        if as_json:
            console.print_json(json.dumps(result.to_json()))
        elif report:
            render(result)
    if result.exit_code:
        raise SystemExit(result.exit_code)


def _rank_from_env() -> int:
    import os
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0
