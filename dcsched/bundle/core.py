"""The graph bundle: one versioned file holding a captured training step.

A bundle (``graph.pt`` by convention) holds the forward and backward FX graphs
of one training step with their ZeRO-3 ops and profiled costs, the parameter
table, how the forward's outputs feed the backward, the step's non-parameter
inputs, and how every figure was obtained (provenance).

On disk, version 3 (what :func:`save` writes) is one safetensors file: the
graphs as columns, the tables as JSON, constants and inputs as tensors, no
pickle (:mod:`dcsched.bundle.fileio`, :mod:`dcsched.bundle.columns`), and each
graph's communication plan (:mod:`dcsched.bundle.plans`). Version 2, the same
file without plans, still loads (with none).
Version 1, still read (:mod:`dcsched.bundle.legacy`), is a ``torch.save`` of
plain data only (dicts, lists, tuples, str, int, float, bool, None and
tensors), read back with ``torch.load(weights_only=True)``: loading never
executes code from the file.
Call targets are stored as qualified names (``'aten.mm.default'``) and resolved
only from an allow-list of namespaces (aten, prims, operator, dcsched, dc):
:mod:`dcsched.bundle.graph_encoding` turns a graph into plain data and back.
The schema is documented in ``docs/bundle-format.md``.

This module holds the :class:`Bundle` (with :class:`ParamInfo` and
:class:`InputInfo`), its tables read back, and the file: :func:`load`,
:func:`save` (atomic), version 1's plain data (:func:`to_data`,
:func:`from_data`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.fx

from dcsched.bundle import checks as loadchecks, saved_memory
from dcsched.bundle.graph_encoding import dtype_name, decode_graph, encode_graph

from dcsched.errors import BundleError, DcschedError
from dcsched.graph.torch_values import dtype_from_name
from dcsched.plan import Plan

FORMAT = "dcsched-bundle"
#: Bump when the on-disk schema changes; readers refuse newer versions. Versions 3 (with plans) and 2 are
#: safetensors files (:mod:`dcsched.bundle.fileio`), version 1 a torch file of plain data
#: (:mod:`dcsched.bundle.legacy`).
BUNDLE_VERSION = 3
#: The version :func:`to_data`'s plain data (a torch file's content) has.
V1 = 1


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """A trainable parameter, sharded ZeRO-3 style. ``shape``/``dtype`` are the full parameter's."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    ds_id: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class InputInfo:
    """A non-parameter input of the step (batch, targets, buffers).

    ``value`` holds the tensor itself when it was small enough to keep;
    otherwise ``low``/``high`` bound its values (inclusive), so replay can make
    valid ones, e.g. token ids below the vocabulary size.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    value: torch.Tensor | None = None
    low: float | None = None
    high: float | None = None


@dataclasses.dataclass
class Bundle:
    """One captured training step. See the module docstring and ``docs/bundle-format.md``.

    ``forward_placeholders[i]`` says what the forward graph's i-th placeholder
    is: ``{"kind": "param", "ds_id": d}`` or ``{"kind": "input", "index": k}``
    (into ``inputs``). The forward graph outputs ``num_user_outputs`` user
    outputs (the loss first) followed by the tensors saved for the backward.
    ``backward_placeholders[j]`` is ``{"kind": "saved", "index": i}`` (the
    forward's i-th output) or ``{"kind": "tangent", "index": k}`` (the gradient
    fed for the k-th user output). The backward's i-th output is the gradient
    of the forward's i-th placeholder: for a parameter, the ``reduce_grad``
    node's output (this rank's shard); None where there is none.

    A bundle loaded from a version-2 file holds its graphs as columns
    (:class:`dcsched.bundle.columns.GraphColumns`): :meth:`form` reads them
    directly, ``forward`` / ``backward`` / ``graphs`` build the FX graphs on
    first access, :meth:`reordered` permutes the columns and :func:`save`
    writes them back as they are.

    Examples
    --------
    >>> from dcsched import replay
    >>> bundle = replay.example_bundle()
    >>> bundle.graph_names, [p.shape for p in bundle.params]
    (['forward', 'backward'], [(7, 4), (7,), (3, 7)])
    """

    forward: torch.fx.Graph
    backward: torch.fx.Graph | None
    params: list[ParamInfo]
    inputs: list[InputInfo]
    forward_placeholders: list[dict]
    backward_placeholders: list[dict]
    num_user_outputs: int = 1
    graph_ids: dict[str, int | None] = dataclasses.field(default_factory=lambda: {"forward": 0, "backward": 1})
    constants: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    provenance: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: The communication plan by graph name (:class:`dcsched.plan.Plan`: buckets and residency; the order is
    #: the graph's own node order, or empty). A graph without one: every collective alone, every parameter
    #: sharded. Saved from version 3 on; :meth:`with_graphs` drops a replaced graph's, :meth:`reordered` keeps.
    plans: dict[str, Plan] = dataclasses.field(default_factory=dict)

    def __repr__(self) -> str:  # without building FX graphs from columns
        graphs = ", ".join(f"{name}: {type(self.__dict__.get(f'_graph_{name}')).__name__}" for name in self.graph_names)
        return (f"Bundle(graphs={{{graphs}}}, params={len(self.params)}, inputs={len(self.inputs)}, "
                f"constants={list(self.constants)}, provenance={self.provenance!r:.200})")

    @property
    def graph_names(self) -> list[str]:
        """The graphs' names, forward first (without building any FX graph)."""
        return ["forward"] + (["backward"] if self.__dict__.get("_graph_backward") is not None else [])

    @property
    def graphs(self) -> dict[str, torch.fx.Graph]:
        """The graphs by name, forward first; a bundle without backward has one. Builds the FX graphs of a
        loaded version-2 bundle (:meth:`form` does not)."""
        return {name: getattr(self, name) for name in self.graph_names}

    def columns(self, name: str):
        """Graph ``name`` as :class:`~dcsched.bundle.columns.GraphColumns`, what a file stores (encoded from the
        FX graph where the bundle holds one, unchecked: loading checks, as for version 1)."""
        from dcsched.bundle.columns import GraphColumns, encode_fx
        stored = self.__dict__.get(f"_graph_{name}")
        if isinstance(stored, GraphColumns):
            return stored
        return encode_fx(getattr(self, name), self.graph_ids.get(name))

    def form(self, name: str):
        """Graph ``name``'s :class:`~dcsched.graph.form.GraphForm` (what the schedulers and the simulator
        read): straight from the columns of a loaded version-2 bundle, no FX graph and no networkx view."""
        from dcsched.bundle.columns import GraphColumns, one_thread
        from dcsched.graph.form import GraphForm, paused_gc
        stored = self.__dict__.get(f"_graph_{name}")
        with paused_gc(), one_thread():
            if isinstance(stored, GraphColumns):
                return stored.form(label=f"graph '{name}'")
            return GraphForm(getattr(self, name), label=f"graph '{name}'")

    def with_graphs(self, **graphs) -> "Bundle":
        """A copy with some graphs replaced (e.g. ``with_graphs(forward=g)``); the others are not built.

        A replaced graph's plan is dropped (its nodes may have changed); the others' are kept.
        """
        unknown = set(graphs) - {"forward", "backward"}
        if unknown:
            raise TypeError(f"a bundle has no graph {', '.join(sorted(unknown))}")
        new = copy.copy(self)
        for name, graph in graphs.items():
            setattr(new, name, graph)
        new.provenance = dict(self.provenance)
        new.plans = {name: plan for name, plan in self.plans.items() if name not in graphs}
        return new

    def reordered(self, orders: dict[str, list[str]], plans: dict[str, Plan] | None = None) -> "Bundle":
        """A copy with graph ``name``'s nodes in ``orders[name]`` (node names, a topological order): the
        columns permuted where the graph is stored as columns, else the FX graph rebuilt.

        Plans are kept (the same nodes), in the new order; ``plans`` sets graph ``name``'s to ``plans[name]``
        (its buckets and residency, what a scheduler chose for that order), e.g.
        ``bundle.reordered(orders, plans={name: plan})``. A given plan's order, unless empty, must be the
        graph's new order (ValueError).

        Examples
        --------
        >>> from dcsched import replay
        >>> from dcsched.plan import Plan
        >>> bundle = replay.example_bundle()
        >>> order = [n.name for n in bundle.forward.nodes]
        >>> moved = bundle.reordered({"forward": order}, plans={"forward": Plan(order, residency={0: "kept"})})
        >>> moved.plans["forward"].residency_of(0), bundle.plans
        ('kept', {})
        """
        unknown = sorted(set(plans or {}) - set(self.graph_names))
        if unknown:
            raise ValueError(f"a plan given for graph {unknown[0]!r}, which the bundle lacks")
        result = self._permuted(orders)
        kept = {**self.plans, **(plans or {})}
        for name, plan in kept.items():
            current = tuple(orders[name]) if name in orders else tuple(result._node_names(name))
            if name in (plans or {}) and plan.order and tuple(plan.order) != current:
                raise ValueError(f"the plan given for graph '{name}' has another order than the graph's")
            result.plans[name] = plan.with_order(current)
        return result

    def _node_names(self, name: str) -> list[str]:
        """Graph ``name``'s node names in order, without building an FX graph from columns."""
        from dcsched.bundle.columns import GraphColumns
        stored = self.__dict__.get(f"_graph_{name}")
        return stored.names if isinstance(stored, GraphColumns) else [n.name for n in getattr(self, name).nodes]

    def _permuted(self, orders: dict[str, list[str]]) -> "Bundle":
        """A copy with the graphs in ``orders`` reordered (their plans dropped: :meth:`reordered` sets them)."""
        from dcsched.bundle.columns import GraphColumns, one_thread
        from dcsched.graph.nxview import to_fx
        graphs = {}
        for name, order in orders.items():
            stored = self.__dict__.get(f"_graph_{name}")
            if isinstance(stored, GraphColumns):
                index = {n: i for i, n in enumerate(stored.names)}
                with one_thread():
                    graphs[name] = stored.permuted([index[n] for n in order])
            else:
                graph = to_fx(getattr(self, name), order)
                graph.lint()
                graphs[name] = graph
        return self.with_graphs(**graphs)

    def param_by_ds_id(self) -> dict[int, ParamInfo]:
        return {p.ds_id: p for p in self.params}


def _lazy_graph(name: str) -> property:
    """``Bundle.forward`` / ``.backward``: an FX graph, built on first access from stored columns."""
    key = f"_graph_{name}"

    def get(self):
        stored = self.__dict__.get(key)
        if stored is not None and not isinstance(stored, torch.fx.Graph):
            stored = self.__dict__[key] = stored.to_fx()
        return stored

    def put(self, value) -> None:
        self.__dict__[key] = value

    return property(get, put, doc=f"The {name} FX graph (built from the stored columns on first access).")


Bundle.forward = _lazy_graph("forward")
Bundle.backward = _lazy_graph("backward")


# ---------------------------------------------------------------------------
# The bundle's tables, read back
# ---------------------------------------------------------------------------

def _shape(entry: dict, dtype: torch.dtype, what: str) -> tuple[int, ...]:
    """A parameter's or input's shape, refusing negative, non-integer or unbelievably large ones."""
    return loadchecks.check_shape(entry["shape"], dtype, f"{what}: shape")


def _param(p: dict) -> ParamInfo:
    dtype = dtype_from_name(p["dtype"])
    loadchecks.check_param_ids([p["ds_id"]], [p["name"]])
    return ParamInfo(p["name"], _shape(p, dtype, f"parameter {p['name']!r}"), dtype, p["ds_id"])


def params_table(entries: Any) -> list[ParamInfo]:
    """The parameter table read back (each entry :func:`_param`), no two parameters with one ds_id."""
    if not isinstance(entries, list):
        raise ValueError("the bundle's params is not a list")
    params = [_param(p) for p in entries]
    loadchecks.check_param_ids([p.ds_id for p in params], [p.name for p in params])
    return params


def _input(i: dict) -> InputInfo:
    dtype = dtype_from_name(i["dtype"])
    what = f"input {i['name']!r}"
    value, low, high = i.get("value"), i.get("low"), i.get("high")
    if value is not None and not isinstance(value, torch.Tensor):
        raise ValueError(f"{what}: its stored value is a {type(value).__name__}, not a tensor")
    for bound in (low, high):
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float))
                                  or not math.isfinite(bound)):
            raise ValueError(f"{what}: range bound {bound!r} is not a finite number")
    if low is not None and high is not None and low > high:
        raise ValueError(f"{what}: its range [{low}, {high}] is empty (low above high)")
    return InputInfo(i["name"], _shape(i, dtype, what), dtype, value, low, high)


def _constants(stored: Any) -> dict[str, torch.Tensor]:
    """The constants table: plain-identifier names (no graph module attribute) to tensors."""
    if not isinstance(stored, dict):
        raise ValueError("the constants table is not a mapping")
    for name, value in stored.items():
        loadchecks.check_constant_name(name)
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"constant {name!r} is a {type(value).__name__}, not a tensor")
    return dict(stored)


# ---------------------------------------------------------------------------
# The file
# ---------------------------------------------------------------------------

def to_data(bundle: Bundle) -> dict:
    """The plain-data form of a bundle, as stored on disk."""
    graphs = {name: {"graph_id": bundle.graph_ids.get(name), "nodes": encode_graph(graph)}
              for name, graph in bundle.graphs.items()}
    return {
        "format": FORMAT,
        "version": V1,
        "graphs": graphs,
        "params": [{"name": p.name, "shape": list(p.shape), "dtype": dtype_name(p.dtype), "ds_id": p.ds_id}
                   for p in bundle.params],
        "inputs": [{"name": i.name, "shape": list(i.shape), "dtype": dtype_name(i.dtype),
                    "value": i.value, "low": i.low, "high": i.high} for i in bundle.inputs],
        "forward_placeholders": [dict(p) for p in bundle.forward_placeholders],
        "backward_placeholders": [dict(p) for p in bundle.backward_placeholders],
        "num_user_outputs": bundle.num_user_outputs,
        "constants": dict(bundle.constants),
        "provenance": dict(bundle.provenance),
    }


def from_data(data: Any, path=None) -> Bundle:
    """Check and rebuild a bundle from its plain-data form (see :func:`to_data`)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise BundleError(path, "not a dcsched graph bundle (no 'dcsched-bundle' header)")
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise BundleError(path, f"bundle version {version!r} is not a version number (1 or more)")
    if version > BUNDLE_VERSION:
        raise BundleError(path, f"bundle version {version} was written by a newer dcsched "
                                f"(this one reads up to version {BUNDLE_VERSION}); upgrade dcsched")
    if version != V1:
        raise BundleError(path, f"bundle version {version} is a safetensors file, not a torch file")
    try:
        for part in ("provenance", "forward_placeholders", "backward_placeholders", "inputs", "params"):
            loadchecks.check_arguments(data.get(part), f"the bundle's {part}")
        if isinstance(data.get("provenance"), dict):
            saved_memory.from_provenance(data["provenance"])  # its byte counts in bounds
        constants = _constants(data.get("constants", {}))
        params = params_table(data["params"])
        ds_ids = {p.ds_id for p in params}
        if not isinstance(data["graphs"], dict) or not all(isinstance(e, dict) for e in data["graphs"].values()):
            raise ValueError("the bundle's graphs are not a table of graphs")
        graph_ids = loadchecks.check_graph_ids({name: entry.get("graph_id") for name, entry in data["graphs"].items()})
        graphs = {name: decode_graph(entry["nodes"], name, set(constants), graph_id=graph_ids[name], ds_ids=ds_ids)
                  for name, entry in data["graphs"].items()}
        if "forward" not in graphs:
            raise ValueError("bundle has no forward graph")
        inputs = [_input(i) for i in data.get("inputs", [])]
        return Bundle(
            forward=graphs["forward"],
            backward=graphs.get("backward"),
            params=params,
            inputs=inputs,
            forward_placeholders=list(data.get("forward_placeholders", [])),
            backward_placeholders=list(data.get("backward_placeholders", [])),
            num_user_outputs=loadchecks.check_count(data.get("num_user_outputs", 1), "num_user_outputs"),
            graph_ids=graph_ids,
            constants=constants,
            provenance=dict(data.get("provenance", {})),
        )
    except BundleError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as exc:
        detail = str(exc) if not isinstance(exc, KeyError) else f"missing field {exc}"
        raise BundleError(path, detail) from None


def load(path: str | os.PathLike) -> Bundle:
    """Read a bundle, version 2 (safetensors) or 1 (a torch file of plain data); never executes code from it.

    A version-2 bundle's FX graphs are built on first access (:attr:`Bundle.forward`);
    :meth:`Bundle.form` reads the columns directly.

    Parameters
    ----------
    path : str or os.PathLike
        The bundle file.

    Returns
    -------
    Bundle

    Raises
    ------
    BundleError
        A missing or unreadable file, or one that does not hold a valid bundle (every check of
        ``docs/bundle-format.md``: names that are not identifiers, ops outside the allow-list, dangling
        references, figures out of range, ...); the message says which.

    Examples
    --------
    >>> import os, tempfile
    >>> from dcsched import replay
    >>> with tempfile.TemporaryDirectory() as d:
    ...     path = save(replay.example_bundle(), os.path.join(d, "graph.pt"))
    ...     [p.name for p in load(path).params]
    ['fc1.weight', 'fc1.bias', 'fc2.weight']
    """
    from dcsched.bundle import fileio, legacy
    path = Path(path)
    if not path.is_file():
        raise BundleError(path, "no such file" if not path.exists() else "not a file")
    head = legacy.read_head(path)
    if fileio.is_v2(head):
        return fileio.read(path)
    return legacy.load_v1(path, head)


def save(bundle: Bundle, path: str | os.PathLike, *, overwrite: bool = True) -> Path:
    """Write ``bundle`` to ``path`` atomically as a version-2 bundle (:func:`dcsched.outputs.write_atomic`).

    Parameters
    ----------
    bundle : Bundle
    path : str or os.PathLike
        The file to write (written beside it, then renamed into place).
    overwrite : bool
        Replace an existing file. Without it an existing file is an error, also one that appears while the
        bundle is written (the rename never replaces it).

    Returns
    -------
    Path
        ``path``.

    Raises
    ------
    BundleError
        ``path`` exists and ``overwrite`` is False.

    Examples
    --------
    See :func:`load`.
    """
    from dcsched.bundle import fileio
    path = Path(path)
    if not overwrite and path.exists():
        raise BundleError(path, "exists already (pass `overwrite=True` to replace it)")
    fileio.write(bundle, path, overwrite=overwrite)
    return path


def check_replayable(bundle: Bundle) -> None:
    """Raise :class:`DcschedError` for a bundle planned without data (captured with ``meta=True``): nothing to run."""
    if bundle.provenance.get("planned"):
        raise DcschedError("this bundle was planned without data (`meta=True`): it holds shapes, no weights or input "
                           "values, so it can be scheduled but not replayed; capture the script again without it to "
                           "replay it")
