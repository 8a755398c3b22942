"""Tiny captured models with dropout on (T5-style and GPT), and their orders under every scheduler.

Captured once per test session (a capture compiles the model: seconds).
"""

from __future__ import annotations

import functools
import math

import dcsched
from dcsched.examples import build
from dcsched.schedulers import available

TINY = dict(n_layers=1, d_model=16, n_heads=2, vocab=32, seq=8, batch=2)
#: model name -> options beyond TINY (T5's dropout is on by default, 0.1)
DROPOUT_MODELS = {"t5": {}, "gpt": {"dropout": 0.1}}


@functools.lru_cache(maxsize=None)
def captured(name: str) -> dcsched.Bundle:
    """The tiny ``name`` model with dropout on, captured in training mode."""
    model, inputs, loss_fn = build(name, **TINY, **DROPOUT_MODELS[name])
    return dcsched.capture(model.train(), inputs, loss_fn=loss_fn)


def scheduled(bundle: dcsched.Bundle) -> dict[str, dcsched.Bundle]:
    """``bundle`` with both graphs reordered by every registered scheduler (overlap: unlimited memory)."""
    options = {"overlap": {"memory_budget": math.inf}}
    return {algo: bundle.with_graphs(forward=dcsched.schedule(bundle.forward, algo, **options.get(algo, {})),
                                     backward=dcsched.schedule(bundle.backward, algo, **options.get(algo, {})))
            for algo in available()}


def orders(bundle: dcsched.Bundle) -> tuple[tuple[str, ...], ...]:
    """The node names of the forward and of the backward graph, in order."""
    return tuple(tuple(n.name for n in graph.nodes) for graph in (bundle.forward, bundle.backward))


def distinct(schedules: dict[str, dcsched.Bundle], baseline: dcsched.Bundle) -> dict[str, dcsched.Bundle]:
    """The schedules whose orders differ from the baseline's and from every earlier one's (replaying
    the same orders twice proves nothing new)."""
    seen = {orders(baseline)}
    kept = {}
    for algo, bundle in schedules.items():
        if orders(bundle) not in seen:
            seen.add(orders(bundle))
            kept[algo] = bundle
    return kept
