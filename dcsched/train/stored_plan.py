"""``dcsched train --plan FILE``: a job's chosen plan stored once, then reused without profiling or planning.

The first run of a job writes the scheduled bundle (graphs, figures and the
communication plans, :func:`dcsched.save`, atomic) with a *key* in its
provenance: what the plan was made for (:func:`plan_key`). A later run whose
compile captures the same step with the same scheduling options loads FILE
(:func:`dcsched.load`, which runs no code from it), puts the stored order, plans,
figures and way of issuing collectives on its own freshly captured graphs
(:func:`reused`) and runs them: no profile, no scheduler, the same step as the
run that wrote it, bit for bit. A FILE made for anything else is refused in one
line naming what changed (:class:`PlanFileMismatch`).

FILE holds one step: the first compile of the process that reads or writes it
claims it; a later compile of another step (the second graph after a graph
break, other input shapes) is profiled and planned as without ``--plan``.

>>> key = {"world_size": 2, "algo": "overlap-plan", "options": {}, "graphs": {"forward graph": "ab"}}
>>> changed(key, {**key, "world_size": 1})
'the world size differs (the file: 2 ranks, this run: 1 rank)'
>>> changed(key, {**key, "graphs": {"forward graph": "cd"}})
'the captured forward graph differs: the model, its inputs or the dtypes changed'
>>> changed(key, dict(key)) is None
True
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Any, Mapping

from dcsched.bundle.core import Bundle
from dcsched.collective_issue import CollectiveIssue
from dcsched.errors import OptionError
from dcsched.plan import Plan

#: ``provenance[KEY]`` of a stored plan: what it was made for (:func:`plan_key`).
KEY = "train_plan_key"
#: ``provenance[WAYS]``: per graph, whether its all-gathers and its reduce-scatters ran asynchronously.
WAYS = "train_plan_issue"
#: The files this process has read or written a plan in, by resolved path: the key of the step that claimed it.
_claimed: dict[str, dict] = {}


class PlanFileMismatch(OptionError):
    """A plan file made for another job (another model, inputs, world size or scheduling options)."""

    def __init__(self, path: str | os.PathLike, what: str):
        super().__init__("plan", f"{path} holds the plan of another job: {what}; remove it or pass another file")


def plan_key(captured: Bundle, *, world_size: int, algo: str, options: Mapping[str, Any]) -> dict:
    """What a plan is made for: the captured step's fingerprints (figures left out), the world size, the
    scheduler and every option that changes the plan (``options``: plain data by name)."""
    from dcsched.runtime.consensus import step_fingerprints
    return {"world_size": int(world_size), "algo": str(algo), "options": dict(options),
            "graphs": {part: digest.hex() for part, digest in step_fingerprints(captured).items()}}


def changed(stored: Any, current: Mapping[str, Any]) -> str | None:
    """What differs between a stored key and this run's, in words; None where they match."""
    if not isinstance(stored, dict):
        return "it holds no key of a plan dcsched train stored"
    if stored.get("world_size") != current["world_size"]:
        return (f"the world size differs (the file: {_ranks(stored.get('world_size'))}, this run: "
                f"{_ranks(current['world_size'])})")
    if stored.get("algo") != current["algo"]:
        return f"the scheduler differs (the file: {stored.get('algo')!r}, this run: {current['algo']!r})"
    options: dict = _table(stored.get("options"))
    for name in sorted(set(options) | set(current["options"])):
        if options.get(name) != current["options"].get(name):
            return (f"the option {name} differs (the file: {options.get(name)!r}, this run: "
                    f"{current['options'].get(name)!r})")
    graphs: dict = _table(stored.get("graphs"))
    for part in list(current["graphs"]) + sorted(set(graphs) - set(current["graphs"])):
        if graphs.get(part) != current["graphs"].get(part):
            return f"the captured {part} differs: the model, its inputs or the dtypes changed"
    return None


def _table(value: Any) -> dict:
    """``value`` where it is a table (read from a file: anything else counts as empty)."""
    return value if isinstance(value, dict) else {}


def _ranks(count: Any) -> str:
    return f"{count} rank{'s' if count != 1 else ''}" if isinstance(count, int) else repr(count)


def file_digest(path: str | os.PathLike) -> bytes:
    """A digest of FILE's bytes (of ``absent`` where there is none): what the ranks compare before reading it."""
    path = Path(path)
    if not path.exists():
        return hashlib.sha256(b"absent").digest()
    digest = hashlib.sha256()
    try:
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    except OSError as exc:
        raise OptionError("plan", f"{path} cannot be read: {exc.strerror or exc}") from None
    return digest.digest()


def read(path: str | os.PathLike, key: Mapping[str, Any], group=None) -> Bundle | None:
    """The plan stored in ``path`` for the step ``key`` describes; None where there is none to reuse.

    Under a process group every rank reads the same bytes first (:func:`dcsched.runtime.consensus.check_same`:
    a rank that sees another file stops every rank with one line). The first step of the process to claim
    ``path`` is refused where the file was made for another job; a later one (another step of the same job)
    gets None and is planned.

    Raises
    ------
    PlanFileMismatch
        FILE was made for another job (the message says what changed).
    BundleError
        FILE is no bundle (:func:`dcsched.load`'s one line).
    """
    from dcsched.bundle.core import load
    from dcsched.runtime.consensus import check_same
    check_same({"plan file": file_digest(path)}, "read", group=group)
    resolved = str(Path(path).resolve())
    first = resolved not in _claimed
    if not Path(path).exists():
        return None
    stored = load(path)
    what = changed(stored.provenance.get(KEY), key)
    if what is not None:
        if first:
            raise PlanFileMismatch(path, what)
        return None
    _claimed[resolved] = dict(key)
    return stored


def forget_claims() -> None:
    """Forget which steps claimed which files: the next compile is a job's first again (a new training run)."""
    _claimed.clear()


def may_write(path: str | os.PathLike) -> bool:
    """Whether this step may store its plan in ``path``: no earlier step of this process claimed it."""
    return str(Path(path).resolve()) not in _claimed


def write(path: str | os.PathLike, scheduled: Bundle, key: Mapping[str, Any],
          ways: Mapping[str, CollectiveIssue], *, rank: int) -> None:
    """Store ``scheduled`` (its graphs, figures and plans) in ``path`` with ``key`` and ``ways``; rank 0 writes
    (atomically: :func:`dcsched.save`), every rank claims the file."""
    from dcsched.bundle.core import save
    _claimed[str(Path(path).resolve())] = dict(key)
    if rank != 0:
        return
    stored = scheduled.with_graphs()
    stored.provenance = {**scheduled.provenance, KEY: dict(key),
                         WAYS: {name: [way.async_gather, way.async_reduce] for name, way in ways.items()}}
    save(stored, path)


def reused(captured: Bundle, stored: Bundle, world_size: int, fastest: CollectiveIssue,
           path: str | os.PathLike = "") -> tuple[Bundle, dict[str, CollectiveIssue]]:
    """``captured`` (this run's graphs, equal to the stored ones node for node) with the stored figures, order
    and plans, and the way each graph issues its collectives as stored (:func:`write`).

    Raises
    ------
    PlanFileMismatch
        A file whose key matches but whose graphs, order or plans do not fit the captured step (a file not
        written by :func:`write`).
    """
    from dcsched.profile.measure import with_sizes
    bundle = with_sizes(captured, world_size)
    for name in set(bundle.graph_names) | set(stored.graph_names):
        if name not in stored.graph_names or name not in bundle.graph_names or \
                sorted(n.name for n in bundle.graphs[name].nodes) != sorted(n.name for n in stored.graphs[name].nodes):
            raise PlanFileMismatch(path, f"its {name} graph does not match its key (not written by dcsched train)")
    for name, graph in bundle.graphs.items():
        figures = {node.name: node.meta for node in stored.graphs[name].nodes}
        for node in graph.nodes:
            for field in ("device_time", "time_source"):
                if field in figures[node.name]:
                    node.meta[field] = figures[node.name][field]
    bundle.provenance = {name: value for name, value in stored.provenance.items() if name not in (KEY, WAYS)}
    plans: dict[str, Plan] = dict(stored.plans)
    try:
        scheduled = bundle.reordered({name: [node.name for node in stored.graphs[name].nodes]
                                      for name in stored.graph_names}, plans=plans)
        from dcsched.runtime.commplan import comm_plan
        comm_plan(scheduled.plans, scheduled.graph_ids)  # the buckets and residency name this step's collectives
    except (ValueError, KeyError) as exc:
        raise PlanFileMismatch(path, f"its order or plans do not fit the step ({exc})") from None
    stored_ways: dict = _table(stored.provenance.get(WAYS))
    ways = {}
    for name in scheduled.graph_names:
        flags = stored_ways.get(name)
        ways[name] = fastest if not (isinstance(flags, list) and len(flags) == 2 and all(
            isinstance(flag, bool) for flag in flags)) else dataclasses.replace(
            fastest, async_gather=flags[0], async_reduce=flags[1])
    return scheduled, ways
