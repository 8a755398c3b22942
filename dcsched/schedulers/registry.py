"""Schedulers by name. A scheduler is one module that registers one pure function.

A scheduler takes the networkx view of a graph (:mod:`dcsched.graph.nxview`) and
keyword options, and returns the vertices (node names) in the order to run
them: a topological order holding every vertex exactly once. One registered
with ``takes_form=True`` also takes the graph's
:class:`~dcsched.graph.form.GraphForm` instead of the view, so
:func:`dcsched.schedule` can skip building the view.

>>> import networkx as nx
>>> @register("reverse-demo", description="demo only")
... def _demo(view: nx.DiGraph) -> list[str]:
...     return list(nx.topological_sort(view))
>>> "reverse-demo" in available()
True
>>> _ = unregister("reverse-demo")
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

import networkx as nx

from dcsched.errors import DcschedError
from dcsched.graph.form import GraphForm, output_last

Scheduler = Callable[..., list]


@dataclasses.dataclass(frozen=True)
class SchedulerInfo:
    name: str
    func: Scheduler
    description: str
    #: keyword options the function accepts (besides the view)
    options: tuple[str, ...]
    #: whether the function also takes a :class:`~dcsched.graph.form.GraphForm` for the view
    takes_form: bool = False

    def __call__(self, view: "nx.DiGraph | GraphForm", **options) -> list:
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise DcschedError(f"scheduler '{self.name}' takes no option {', '.join(unknown)} "
                               f"(it takes: {', '.join(self.options) or 'none'})")
        # Every scheduler's order ends with the output, whatever its rule ranks there (graphform.output_last).
        return output_last(view, self.func(view, **options))


_REGISTRY: dict[str, SchedulerInfo] = {}


def register(name: str, *, description: str, takes_form: bool = False) -> Callable[[Scheduler], Scheduler]:
    """Decorator: make ``func(view, **options) -> order`` available as ``name``."""

    def decorate(func: Scheduler) -> Scheduler:
        if name in _REGISTRY and _REGISTRY[name].func is not func:
            raise ValueError(f"scheduler {name!r} is registered twice")
        params = list(inspect.signature(func).parameters.values())[1:]
        options = tuple(p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
        _REGISTRY[name] = SchedulerInfo(name, func, description, options, takes_form)
        return func

    return decorate


def unregister(name: str) -> SchedulerInfo:
    return _REGISTRY.pop(name)


def get(name: str) -> SchedulerInfo:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise DcschedError(f"unknown scheduler '{name}' (available: {', '.join(available())})") from None


def available() -> list[str]:
    return list(_REGISTRY)
