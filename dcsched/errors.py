"""Errors a user can fix. The CLI prints them as one line and exits with code 2.

Every error dcsched raises for bad input is a :class:`DcschedError`; the
subclasses say which stage refused and let a caller catch one kind::

    DcschedError
    ├── OptionError        an option's value (names the parameter, not a CLI flag)
    ├── BundleError        a bundle file that cannot be read or holds no valid graph
    ├── GraphError         a graph a scheduler, the simulator or replay cannot work with
    │   └── ScheduleError  a scheduler that cannot order the graph it was given
    ├── BudgetError        a memory budget no order of the graph fits in
    ├── OutputError        a place dcsched may not or cannot write
    └── (stage errors defined beside their stage: CaptureError, ScriptError,
         RankMismatch, ShardingError, TrainError, CheckpointError)

:class:`ResultMismatch` is not a user error: two orders computed different
results (exit code 1).

>>> issubclass(BudgetError, DcschedError), BudgetError.exit_code
(True, 2)
"""

from __future__ import annotations


class DcschedError(Exception):
    """Bad input or an impossible request; the message says what to fix."""

    exit_code = 2


class OptionError(DcschedError, ValueError):
    """An option with a value dcsched cannot use; the message names the option's Python parameter.

    ``problem`` reads on from the name (``OptionError("iters", "must be at least 1")`` says
    ``iters must be at least 1``). The command line translates parameter names into its flags
    (``memory_budget`` -> ``--memory-budget``) when it prints one (:mod:`dcsched.cli.app`).

    >>> str(OptionError("world_size", "must be at least 1"))
    'world_size must be at least 1'
    """

    def __init__(self, option: str, problem: str):
        self.option = option
        self.problem = problem
        super().__init__(f"{option} {problem}")


class BundleError(DcschedError):
    """A graph bundle that cannot be read or does not hold a valid graph."""

    def __init__(self, path, problem: str):
        self.path = str(path) if path is not None else None
        self.problem = problem
        super().__init__(f"{self.path}: {problem}" if self.path else problem)


class GraphError(DcschedError):
    """A graph that a scheduler, the simulator or replay cannot work with."""


class ScheduleError(GraphError):
    """A scheduler that cannot order the graph it was given (a cycle, a missing input, an unknown name)."""


class BudgetError(DcschedError):
    """A memory budget that no order of the graph fits in; the message names the parameter (```memory_budget```).

    A budget that cannot be read at all is an :class:`OptionError`.
    """


class OutputError(DcschedError):
    """A path dcsched may not write (an input, an existing file without ``force``) or cannot."""


class ResultMismatch(Exception):
    """Two orders of one graph computed different results (exit code 1)."""

    exit_code = 1


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of ``exc``'s message (its type's name where it has none), cut at ``limit`` characters.

    >>> first_line(ValueError("bad shape\\nand more")), first_line(KeyError())
    ('bad shape', 'KeyError')
    """
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:limit]
