"""The typer application and the one place errors become exit codes.

Command modules (``show``, ``profile``, ``schedule``, ``replay``) attach
themselves to :data:`app`; they only parse options, call the functional core
and render its results.
"""

from __future__ import annotations

import re
import sys

import typer
from rich.console import Console

from dcsched.errors import DcschedError, ResultMismatch
from dcsched.report.formats.text import safe_text  # noqa: F401  (the commands print through it)

app = typer.Typer(
    name="dcsched",
    help="Schedule ZeRO-3 (DeepCompile-style) training graphs: profile a script into a graph bundle, "
         "reorder its all-gathers and releases, simulate memory and overlap, replay it for real, or train with it.\n\n"
         "Figures are stored in bytes and milliseconds; sizes accept SI and IEC suffixes "
         "(GB = 10^9 bytes, GiB = 2^30 bytes).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

#: The script and its arguments, for the commands that run a training script (profile, train).
SCRIPT = typer.Argument(..., help="Training script to run as __main__ (it must call torch.compile on its model).")
SCRIPT_ARGS = typer.Argument(None, help="Arguments for the script, after `--`.", show_default=False)

#: Reports go to stdout; progress and errors to stderr.
console = Console()
err_console = Console(stderr=True)


def fail(message: str, code: int = 2) -> None:
    """Print one error line and exit."""
    err_console.print(f"[bold red]dcsched: error:[/] {safe_text(message)}", highlight=False, soft_wrap=True)
    raise SystemExit(code)


#: The flags of the Python parameters an error may name (:attr:`DcschedError.parameters`).
PARAMETER_FLAGS = {"memory_budget": "--memory-budget", "budget_scope": "--budget-scope"}


def cli_wording(exc: DcschedError) -> str:
    """``exc``'s message with the Python parameters it names written as the command line's flags.

    Parameters
    ----------
    exc : DcschedError
        The error; its ``parameters`` say which names to replace.

    Returns
    -------
    str
        ``name=value`` becomes ``--flag value``, a bare ``name`` becomes ``--flag``.

    Examples
    --------
    >>> from dcsched.errors import BudgetError
    >>> cli_wording(BudgetError("memory_budget 1 B is too small (budget_scope=all); pass memory_budget=9 or more",
    ...                         parameters=("memory_budget", "budget_scope")))
    '--memory-budget 1 B is too small (--budget-scope all); pass --memory-budget 9 or more'
    """
    message = str(exc)
    for name in getattr(exc, "parameters", ()):
        flag = PARAMETER_FLAGS.get(name)
        if flag is not None:
            message = re.sub(rf"\b{name}=", flag + " ", message)
            message = re.sub(rf"\b{name}\b", flag, message)
    return message


def run(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 1 result mismatch, 2 bad input)."""
    # Not standalone: typer's usage errors come here as exceptions and are
    # reported in dcsched's one-line form rather than as typer's boxes.
    try:
        code = app(args=argv, prog_name="dcsched", standalone_mode=False)
    except typer.TyperException as exc:
        return usage_error(exc)
    except ResultMismatch as exc:
        err_console.print(f"[bold red]dcsched: results differ:[/] {safe_text(exc)}", highlight=False, soft_wrap=True)
        return 1
    except DcschedError as exc:
        err_console.print(f"[bold red]dcsched: error:[/] {safe_text(cli_wording(exc))}", highlight=False,
                          soft_wrap=True)
        return exc.exit_code
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except (KeyboardInterrupt, typer.Abort):
        err_console.print("interrupted")
        return 130
    return code if isinstance(code, int) else 0


def usage_error(exc: typer.TyperException) -> int:
    """A command-line usage error (unknown option, value out of range) as one line; exit code 2.

    ``dcsched`` alone still prints the help (typer raises that as a usage error, exit code 2).
    """
    message = exc.format_message()
    if not message.strip():  # the help, already printed by typer
        return exc.exit_code
    if message.lstrip().startswith("Usage:"):
        err_console.print(message, markup=False, highlight=False)
        return exc.exit_code
    command = getattr(getattr(exc, "ctx", None), "command_path", "dcsched")
    line = " ".join(message.split())
    err_console.print(f"[bold red]dcsched: error:[/] {safe_text(line)} (see {safe_text(command)} --help)",
                      highlight=False, soft_wrap=True)
    return exc.exit_code


def main() -> None:
    sys.exit(run())


def _print_version(value: bool) -> None:
    if value:
        from dcsched import __version__
        console.print(f"dcsched {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print dcsched's version and exit."),
) -> None:
    """Keeps typer in multi-command mode and hosts the global options."""
