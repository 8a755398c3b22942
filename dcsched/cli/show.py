"""``dcsched show``: what a bundle holds."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from dcsched.bundle.saved_memory import SavedActivations
from dcsched.units import format_bytes, format_ms
from dcsched.cli.app import app, console, safe_text
from dcsched.cli.options import OPTIMIZER_HELP


@app.command()
def show(
    path: Path = typer.Argument(..., help="Graph bundle to summarise (graph.pt)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON (bytes and ms)."),
    params: bool = typer.Option(True, "--params/--no-params", help="List every parameter with its size."),
    optimizer: str | None = typer.Option(None, "--optimizer", help=OPTIMIZER_HELP),
) -> None:
    """Summarise a bundle: graphs, nodes by role, parameters, compute and communication time, plans.

    Per graph its stored communication plan: buckets (fused collectives) and their members, and the
    parameters by residency (sharded/kept/replicated). Also says how the figures were obtained (measured or
    modelled, device, world size).
    """
    from dcsched.bundle import core as bundle_io  # torch, imported only when a command runs
    from dcsched.bundle.summary import summarize
    from dcsched.sim.step_memory import bundle_step_memory
    bundle = bundle_io.load(path)
    summary = summarize(bundle)
    memory = bundle_step_memory(bundle, optimizer)
    summary["step_memory"] = memory.to_json() if memory is not None else None
    if as_json:
        console.print_json(json.dumps(summary))
        return
    console.print(f"[bold]{safe_text(path)}[/]")
    table = Table(title="Graphs", title_justify="left")
    for column in ("graph", "id", "nodes", "compute", "gather/wait/release/reduce", "compute time", "comm time"):
        table.add_column(column, justify="right" if column not in ("graph",) else "left")
    for name, g in summary["graphs"].items():
        r = g["roles"]
        table.add_row(safe_text(name), str(g["graph_id"]), str(g["nodes"]), str(r["compute"]),
                      f"{r['allgather']}/{r['wait']}/{r['release']}/{r['reduce']}",
                      format_ms(g["compute_ms"]), format_ms(g["comm_ms"]))
    console.print(table)
    # A table of its own: the graphs table fills an 80-column terminal already.
    plans = Table(title="Communication plans", title_justify="left")
    for column in ("graph", "buckets", "members", "sharded", "kept", "replicated"):
        plans.add_column(column, justify="right" if column != "graph" else "left")
    for name, g in summary["graphs"].items():
        plan = g["plan"]
        plans.add_row(safe_text(name), str(plan["buckets"]), str(plan["members"]),
                      *(str(plan["residency"][r]) for r in ("sharded", "kept", "replicated")))
    console.print(plans)
    if any(g["unprofiled"] for g in summary["graphs"].values()):
        console.print("[yellow]some nodes have no device_time (unprofiled)[/]")
    if params:
        ptable = Table(title=f"Parameters ({len(summary['params'])}, {format_bytes(summary['param_bytes'])})",
                       title_justify="left")
        for column in ("ds_id", "name", "shape", "dtype", "size"):
            ptable.add_column(column, justify="right" if column in ("ds_id", "size") else "left")
        for p in summary["params"]:
            ptable.add_row(str(p["ds_id"]), safe_text(p["name"]), "x".join(map(str, p["shape"])) or "scalar",
                           safe_text(p["dtype"]),
                           format_bytes(p["bytes"]))
        console.print(ptable)
    prov = summary["provenance"]
    if prov:
        ptable = Table(title="How the figures were obtained", title_justify="left", show_header=False)
        ptable.add_column("key")
        ptable.add_column("value")
        for key, value in prov.items():
            ptable.add_row(safe_text(key), safe_text(json.dumps(value) if not isinstance(value, str) else value))
        console.print(ptable)
    else:
        console.print("[yellow]no provenance recorded[/]")
    if summary["activation_memory"] is not None:
        saved = summary["activation_memory"]
        console.print(SavedActivations(saved["saved_bytes"], saved["without_checkpointing_bytes"]).describe(),
                      highlight=False)
    if memory is not None:
        from dcsched.report.formats.table import step_memory_table
        console.print(step_memory_table({"as planned": memory}))
