"""The golden corpus of ``tests/golden/orders.json`` (recorded by ``tools/record_golden.py``)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from dcsched.bundle import core as bundle
from dcsched.synthetic import layered_stack, random_graph

GOLDEN = Path(__file__).parent / "golden"


@functools.lru_cache(maxsize=None)
def records() -> tuple[dict, ...]:
    return tuple(json.loads((GOLDEN / "orders.json").read_text())["graphs"])


@functools.lru_cache(maxsize=None)
def prefetch_records() -> tuple[dict, ...]:
    """DeepSpeed's prefetch pass over its fast-free order, per corpus graph and budget (``prefetch.json``)."""
    return tuple(json.loads((GOLDEN / "prefetch.json").read_text())["graphs"])


@functools.lru_cache(maxsize=None)
def _bundle(path: str):
    return bundle.load(GOLDEN / path)


def build(entry: dict, namespace: str = "dcsched"):
    """The FX graph a corpus entry describes (the same recipe as the recorder's); built once, do not modify."""
    return _build(json.dumps(entry, sort_keys=True), namespace)


@functools.lru_cache(maxsize=None)
def _build(key: str, namespace: str):
    entry = json.loads(key)
    if entry["source"] == "random":
        return random_graph(entry["seed"], kind=entry["kind"], n_params=entry.get("n_params"),
                            n_ops=entry.get("n_ops"), kwargs_deps=entry.get("kwargs_deps", False),
                            namespace=namespace)
    if entry["source"] == "layered":
        return getattr(layered_stack(entry["n_layers"], namespace=namespace), entry["kind"])
    if entry["source"] == "bundle":
        return getattr(_bundle(entry["file"]), entry["kind"])
    raise ValueError(f"unknown corpus source {entry['source']!r}")
