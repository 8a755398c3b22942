"""``dcsched replay``: run a bundle's step for real, measure it, check it against its baseline.

The work happens in :mod:`dcsched.replay` (and :mod:`dcsched.runtime.distributed` under
torchrun); this module parses options, sets up the process group when launched
by torchrun, and renders the report (rank 0 only).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.table import Table

from dcsched.units import format_bytes, format_ms
from dcsched.cli.app import app, console, safe_text

if TYPE_CHECKING:  # torch, imported only when the command runs
    from dcsched.replay import ReplayReport


def _with_error(text: str, error: float | None) -> str:
    return text if error is None else f"{text} ({error:+.1f}%)"


def render(report: ReplayReport) -> None:
    """Print the report: one column per order, measured and simulated figures in rows."""
    first = report.orders[0].measured
    processes = "1 process" if report.world_size == 1 else f"{report.world_size} ranks (worst rank shown)"
    console.print(f"[bold]dcsched replay[/] on {safe_text(report.device)}, {processes}, "
                  f"{first.iters} timed steps after "
                  f"{first.warmup} warm-up, seed {report.seed}", highlight=False)
    for order in report.orders:
        if order.path:
            console.print(f"  {safe_text(order.label)}: {safe_text(order.path)}", highlight=False)
    table = Table(title_justify="left")
    table.add_column("per training step")
    for order in report.orders:
        table.add_column(safe_text(order.label), justify="right")
    rows: dict[str, list[str]] = {"peak memory, measured": [], "peak memory, simulated (error)": [],
                                  "step time, measured": [], "step time, simulated (error)": [],
                                  "forward / backward, measured": []}
    for order in report.orders:
        m, sim, err = order.measured, order.simulated or {}, order.errors()
        spread = "" if m.spread_percent is None else f" ±{m.spread_percent / 2:.0f}%"
        rows["peak memory, measured"].append(format_bytes(m.peak_bytes))
        rows["peak memory, simulated (error)"].append(_with_error(format_bytes(sim.get("peak_bytes")),
                                                                  err["peak_bytes"]))
        rows["step time, measured"].append(format_ms(m.step_ms) + spread)
        rows["step time, simulated (error)"].append(_with_error(format_ms(sim.get("step_ms")), err["step_ms"]))
        rows["forward / backward, measured"].append(f"{format_ms(m.forward_ms)} / {format_ms(m.backward_ms)}")
    for name, cells in rows.items():
        table.add_row(name, *cells)
    console.print(table)
    if report.comparison is not None:
        c = report.comparison
        how = "bit for bit" if c.exact else f"within tolerance ({c.tolerance})"
        console.print(f"[green]results match[/] {how}: {c.outputs} outputs (loss and gradients), "
                      f"largest difference {c.max_abs_error:.3g} ({safe_text(c.worst_output)})", highlight=False)
    else:
        console.print("results not compared (no --baseline)")
    console.print(f"measured: time by {first.timer} (median of forward + backward; ± half the range), "
                  f"memory by {first.memory_source}; {format_bytes(first.resident_bytes)} resident before "
                  "the step", highlight=False)
    for note in dict.fromkeys(order.simulator_note for order in report.orders):
        console.print(f"simulated: {safe_text(note)}", highlight=False)
    for caveat in dict.fromkeys(order.caveat for order in report.orders if order.caveat):
        console.print(f"[yellow]caveat[/]: {safe_text(caveat)}", highlight=False)


@app.command()
def replay(
    path: Path = typer.Argument(..., help="Bundle to run, e.g. the scheduled graph.sched.pt."),
    baseline: Optional[Path] = typer.Option(None, "--baseline", help="The original bundle: run it too and check "
                                            "both compute the same loss, outputs and gradients."),
    device: str = typer.Option("auto", "--device", help="auto (CUDA when there is a GPU), cpu, cuda or cuda:N."),
    iters: int = typer.Option(5, "--iters", min=1, help="Timed steps; the report gives their median and spread."),
    warmup: int = typer.Option(1, "--warmup", min=0, help="Untimed steps before measuring."),
    seed: int = typer.Option(0, "--seed", help="Seed for the parameters and inputs (same on every rank)."),
    exact: Optional[bool] = typer.Option(None, "--exact/--tolerant", help="Ask for bit-for-bit equal results "
                                         "(default on the CPU) or equality within tolerance (default on a GPU)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON (bytes and ms)."),
    timeout: Optional[float] = typer.Option(None, "--timeout", min=0.001, help="Seconds the whole replay may "
                                            "take; past them it stops with one line (exit code 2). Default: each "
                                            "step within 10,000 x the bundle's recorded device time, at least "
                                            "60 s."),
) -> None:
    """Run a bundle's training step for real, measure it, and check it computes what --baseline computes.

    Measured peak memory (bytes of live tensors) and step time (ms) stand next to the simulator's, for
    the bundle and its baseline; differing results are exit code 1.

    Before anything runs, every node's output is checked against the bundle's figures (shapes, dtypes,
    tensor_size) and the step's simulated peak (x1.5) against the free memory; a step past its time bound
    (or --timeout) stops with one line, exit code 2.

    Under [bold]torchrun --nproc-per-node W -m dcsched replay ...[/] the parameters are sharded over W
    ranks (gloo on CPU, NCCL on CUDA); only rank 0 prints."""
    from dcsched.bundle import core as bundle_io
    from dcsched.runtime import distributed
    from dcsched.replay import replay_orders, resolve_device
    candidate = bundle_io.load(path)
    reference = bundle_io.load(baseline) if baseline is not None else None
    target = resolve_device(device)
    launch = None
    if distributed.launched():
        launch = distributed.init(target.type)
        target = launch.device
    try:
        report = replay_orders(candidate, reference, device=target, seed=seed, iters=iters, warmup=warmup,
                               exact=exact, bounded=True, timeout=timeout,
                               paths=(str(baseline) if baseline else None, str(path)))
    except BaseException:
        if launch is not None:
            distributed.shutdown(together=False)
        raise
    if launch is not None:
        distributed.shutdown()
    if launch is not None and launch.rank != 0:
        return
    if as_json:
        console.print_json(json.dumps(report.to_dict()))
        return
    render(report)
