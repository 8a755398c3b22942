"""Errors a user can fix. The CLI prints them as one line and exits with code 2."""

from __future__ import annotations


class DcschedError(Exception):
    """Bad input or an impossible request; the message says what to fix."""

    exit_code = 2


class BundleError(DcschedError):
    """A graph bundle that cannot be read or does not hold a valid graph."""

    def __init__(self, path, problem: str):
        self.path = str(path) if path is not None else None
        self.problem = problem
        super().__init__(f"{self.path}: {problem}" if self.path else problem)


class GraphError(DcschedError):
    """A graph that a scheduler, the simulator or replay cannot work with."""


class ResultMismatch(Exception):
    """Two orders of one graph computed different results (exit code 1)."""

    exit_code = 1


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of ``exc``'s message (its type's name where it has none), cut at ``limit`` characters.

    >>> first_line(ValueError("bad shape\\nand more")), first_line(KeyError())
    ('bad shape', 'KeyError')
    """
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:limit]
