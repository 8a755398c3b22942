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
