"""``dcsched convert``: rewrite a bundle (a version-1 torch file, or an older safetensors one) in the current
format."""

from __future__ import annotations

from pathlib import Path

import typer

from dcsched.outputs import check_outputs
from dcsched.cli.app import app, err_console, safe_text


@app.command()
def convert(
    source: Path = typer.Argument(..., help="Bundle to convert (version 1, 2 or 3)."),
    output: Path = typer.Argument(..., help="Where the current (version-3) bundle goes (a safetensors file)."),
    force: bool = typer.Option(False, "--force", help="Replace OUTPUT if it exists already (refused otherwise; "
                                                       "OUTPUT may then be SOURCE itself)."),
) -> None:
    """Rewrite a bundle in the current format (version 3: one safetensors file, no pickle, with its plans).

    Loads SOURCE with every check a command applies, then writes OUTPUT atomically (a temporary file renamed
    into place), so OUTPUT is either the whole new bundle or untouched.
    """
    check_outputs({"OUTPUT": output}, inputs=[source], force=force)  # before any work
    from dcsched.bundle import core as bundle_io
    bundle = bundle_io.load(source)
    bundle_io.save(bundle, output, overwrite=force)
    err_console.print(f"[dim]wrote {safe_text(output)} (bundle version {bundle_io.BUNDLE_VERSION})[/]",
                      highlight=False)
