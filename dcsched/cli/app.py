"""The typer application and the one place errors become exit codes.

Command modules (``show``, ``profile``, ``schedule``, ``replay``, ``train``) attach
themselves to :data:`app`; they only parse options, call the functional core
and render its results.

The library's errors name Python parameters (:class:`~dcsched.errors.OptionError`'s
``option``, a suggested ```force=True```); :func:`in_flags` is the one place
they become the flags of the running command.
"""

from __future__ import annotations

import re
import sys

import typer
from rich.console import Console

from dcsched.errors import DcschedError, OptionError, ResultMismatch
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
        message = in_flags(exc, _command_of(sys.argv[1:] if argv is None else argv))
        err_console.print(f"[bold red]dcsched: error:[/] {safe_text(message)}", highlight=False, soft_wrap=True)
        return exc.exit_code
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except (KeyboardInterrupt, typer.Abort):
        err_console.print("interrupted")
        return 130
    return code if isinstance(code, int) else 0


# ---------------------------------------------------------------------------
# Library errors name Python parameters; the command line names its flags
# ---------------------------------------------------------------------------

#: Library parameters that a command's option sets under another name.
PARAMETER_ALIASES = {"overwrite": "force"}

#: ```name=value``` (a parameter with the value to give it) or ```name``` (the parameter alone) in a library
#: message: in backticks, so that text quoted from elsewhere, such as ``device='meta'`` in a torch error, is left
#: alone.
_ASSIGNMENT = re.compile(r"`([a-z][a-z0-9_]*)(?:=(True|'[^']*'|\d[\w.]*))?`")


def _command_of(argv: list[str]) -> str | None:
    """The command ``argv`` runs (its first word that is not an option)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def flags() -> dict[str, dict[str, str]]:
    """Per command, its options' Python parameter names -> their long flags (``cost_model`` -> ``--cost-model``)."""
    group = typer.main.get_command(app)
    table: dict[str, dict[str, str]] = {}
    for name, command in getattr(group, "commands", {}).items():
        table[name] = {}
        for param in command.params:
            opts = [opt for opt in param.opts if opt.startswith("-")]  # an option, not an argument
            if opts:
                table[name][param.name] = next((opt for opt in opts if opt.startswith("--")), opts[0])
    return table


def flag_of(parameter: str, command: str | None, table: dict[str, dict[str, str]] | None = None) -> str | None:
    """The flag that sets library parameter ``parameter``: the running ``command``'s, else another command's
    (``dcsched profile --meta``); None where no command has one."""
    table = flags() if table is None else table
    parameter = PARAMETER_ALIASES.get(parameter, parameter)
    own = table.get(command or "", {})
    if parameter in own:
        return own[parameter]
    for other, params in table.items():
        if parameter in params:
            return f"dcsched {other} {params[parameter]}"
    return None


def in_flags(exc: DcschedError, command: str | None) -> str:
    """``exc``'s message for the command line: the parameter an :class:`~dcsched.errors.OptionError` names, and
    every ```parameter=value``` the message suggests, as the flags of ``command`` (the one place they are
    translated).

    >>> from dcsched.errors import OptionError
    >>> in_flags(OptionError("world_size", "must be at least 1"), "profile")
    '--world-size must be at least 1'
    >>> in_flags(DcschedError("out.pt: exists already (pass `force=True` to replace it)"), "schedule")
    'out.pt: exists already (pass --force to replace it)'
    >>> in_flags(DcschedError("`memory_budget` 1 B is too small (`budget_scope='all'`); pass `memory_budget=9`"),
    ...          "schedule")
    '--memory-budget 1 B is too small (--budget-scope all); pass --memory-budget 9'
    """
    table = flags()
    text = str(exc)
    if isinstance(exc, OptionError):
        text = f"{flag_of(exc.option, command, table) or exc.option} {exc.problem}"

    def replace(match: re.Match) -> str:
        flag = flag_of(match.group(1), command, table)
        if flag is None:
            return match.group(0)
        value = match.group(2)
        return flag if value in (None, "True") else f"{flag} {value.strip(chr(39))}"

    return _ASSIGNMENT.sub(replace, text)


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
