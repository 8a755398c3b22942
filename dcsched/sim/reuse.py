"""Work done once per object within a scope: compiled views and other figures derived from a bundle's graphs.

Figuring a whole step's memory before and under each algorithm
(:func:`dcsched.sim.step_memory.compared_step_memory`) compiles the same FX
graphs (:func:`dcsched.sim.simulate.compile_view`) and derives the same saved
storages from them again and again. Within :func:`reusing`, :func:`compiled`
and :func:`once` keep each result per object (and options) and hand the same
one back; outside it they compute afresh, as before. The objects must not
change within the scope (nothing here mutates a graph, a bundle or a compiled
view), and a kept result holds its object, so an id is never reused while kept.

>>> from dcsched import replay
>>> forward = replay.example_bundle().forward
>>> with reusing():
...     compiled(forward) is compiled(forward), compiled(forward) is compiled(forward, assume_zero=True)
(True, False)
>>> compiled(forward) is compiled(forward)  # outside the scope: compiled afresh
False
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Hashable, Iterator, TypeVar

from dcsched.sim.collectives import DEFAULT_LATENCY_MS

T = TypeVar("T")

_KEPT: contextvars.ContextVar[dict | None] = contextvars.ContextVar("dcsched_reused", default=None)


@contextlib.contextmanager
def reusing() -> Iterator[None]:
    """Within: :func:`compiled` and :func:`once` keep their results (an enclosing scope's, where nested)."""
    if _KEPT.get() is not None:
        yield
        return
    token = _KEPT.set({})
    try:
        yield
    finally:
        _KEPT.reset(token)


def once(what: str, owner: Any, make: Callable[[], T], *options: Hashable) -> T:
    """``make()``, kept per (``what``, ``owner``, ``options``) within :func:`reusing`; computed afresh outside."""
    kept = _KEPT.get()
    if kept is None:
        return make()
    key = (what, id(owner), options)
    hit = kept.get(key)
    if hit is None or hit[0] is not owner:
        hit = kept[key] = (owner, make())
    return hit[1]


def compiled(view, *, assume_zero: bool = False, comm_latency_ms: float = DEFAULT_LATENCY_MS):
    """:func:`dcsched.sim.simulate.compile_view` of ``view``, kept within :func:`reusing` (read it, never change
    it: callers share it)."""
    from dcsched.sim.simulate import compile_view
    return once("compiled", view, lambda: compile_view(view, assume_zero=assume_zero, comm_latency_ms=comm_latency_ms),
                assume_zero, comm_latency_ms)
