"""Stop a replay that runs past its bounds: one line on stderr and exit code 2, from a thread of its own.

One aten kernel cannot be interrupted from Python (a signal waits for it to return), so a replay past its
time or memory bound is ended by a watchdog thread that prints the reason and ends the process
(``os._exit(2)``): nothing is written by replay, so nothing is left half-written. Under ``torchrun`` every
rank runs its own watchdog on the same figures, so a rank waiting on a stopped peer stops too.

Phases: :meth:`Watchdog.phase` arms a deadline for one piece of the replay (preparing a step, running
one): ``steps`` times ``step_s``; with ``total_s`` (``--timeout``) one deadline covers the whole replay
instead. Memory: with ``memory_limit`` the watchdog also stops the process when the memory it holds
beyond what it held when the watch started (CPU: resident set size; CUDA: allocated bytes) passes the
limit.

>>> stops = []
>>> with Watchdog(step_s=5.0, on_stop=stops.append, poll_s=0.01) as watch:
...     with watch.phase("a quick step"):
...         pass
>>> stops
[]
>>> import time
>>> with Watchdog(step_s=0.05, on_stop=stops.append, poll_s=0.01) as watch:
...     with watch.phase("a slow step"):
...         time.sleep(0.3)
>>> stops
['replay stopped: a slow step ran past its bound of 0.05 s']
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Callable, Iterator

import torch

from dcsched.units import format_bytes

#: How often the watchdog looks at the clock and the memory (seconds).
POLL_S = 0.05


def _exit_with(message: str) -> None:
    """The default stop: the one-line error the CLI prints, then the process ends (exit code 2)."""
    try:
        sys.stderr.write(f"dcsched: error: {message}\n")
        sys.stderr.flush()
    finally:
        os._exit(2)


def resident_bytes() -> int | None:
    """This process's resident set size in bytes (Linux ``/proc/self/statm``; None elsewhere)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class Watchdog:
    """A thread that stops the replay past its deadline or memory limit (see the module docstring).

    ``step_s``: seconds one step (or one step's preparation) may take (None: no deadline).
    ``on_stop(message)`` is called once, from the watchdog's thread (default: print the line, exit 2).
    ``total_s``: one deadline for everything from :meth:`__enter__` on; phases then arm none of their own.
    ``memory_limit``: bytes the process may hold beyond what it held at :meth:`__enter__`;
    ``device``: where to measure them (CUDA: allocated bytes; otherwise the resident set).
    ``how``: how the bounds were set, appended to the stop message.
    """

    def __init__(self, *, step_s: float | None = None, total_s: float | None = None, memory_limit: int | None = None,
                 device: torch.device | None = None, on_stop: Callable[[str], None] = _exit_with,
                 poll_s: float = POLL_S, how: str = "") -> None:
        self.step_s, self.total_s, self.memory_limit, self.device = step_s, total_s, memory_limit, device
        self.on_stop, self.poll_s, self.how = on_stop, poll_s, how
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._what = ""
        self._bound = 0.0
        self._done = False
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._base = 0

    def _memory(self) -> int | None:
        if self.device is not None and self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return resident_bytes()

    def __enter__(self) -> "Watchdog":
        self._base = self._memory() or 0
        if self.total_s is not None:
            self._arm("the replay", self.total_s)
        self._thread = threading.Thread(target=self._watch, name="dcsched-replay-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._done = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _arm(self, what: str, seconds: float | None) -> None:
        with self._cond:
            self._what, self._bound = what, seconds or 0.0
            self._deadline = None if seconds is None else time.monotonic() + seconds
            self._cond.notify_all()

    @contextlib.contextmanager
    def phase(self, what: str, steps: int = 1) -> Iterator[None]:
        """Run the block within ``steps`` x ``step_s`` seconds; under ``total_s``, the replay's deadline rules."""
        if self.total_s is not None:
            yield
            return
        self._arm(what, None if self.step_s is None else max(steps, 1) * self.step_s)
        try:
            yield
        finally:
            self._arm("", None)

    def _stop(self, message: str) -> None:
        self._stopped = True
        self.on_stop(message + (f" ({self.how})" if self.how else ""))

    def _watch(self) -> None:
        with self._cond:
            while not self._done and not self._stopped:
                self._cond.wait(self.poll_s)
                if self._done:
                    return
                if self._deadline is not None and time.monotonic() > self._deadline:
                    self._stop(f"replay stopped: {self._what} ran past its bound of {self._bound:.3g} s")
                    return
                if self.memory_limit is not None:
                    held = self._memory()
                    if held is not None and held - self._base > self.memory_limit:
                        self._stop(f"replay stopped: it holds {format_bytes(held - self._base)} more than when it "
                                   f"started, past its bound of {format_bytes(self.memory_limit)}")
                        return


class Unwatched:
    """No watchdog: phases run without a deadline (the Python API's default)."""

    @contextlib.contextmanager
    def phase(self, what: str, steps: int = 1) -> Iterator[None]:
        yield
