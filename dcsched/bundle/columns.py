"""A graph as columns: the node table of a version-2 or 3 bundle, checked in vectorised passes.

One :class:`GraphColumns` holds a graph as per-node arrays and a few small
tables of distinct values, laid out as :mod:`dcsched.bundle.column_format`
describes. This module builds them (:func:`encode_nodes`, :func:`encode_fx`),
reads and writes them as a file's parts (:meth:`GraphColumns.from_parts`,
:meth:`GraphColumns.tensors`, :meth:`GraphColumns.tables`) and reorders the
nodes without FX (:meth:`GraphColumns.permuted`).

:meth:`GraphColumns.check` (:mod:`dcsched.bundle.column_checks`) refuses
everything version 1's loader refuses, per distinct value or per column;
:meth:`GraphColumns.form`, :meth:`GraphColumns.to_fx` and the other views
(:mod:`dcsched.bundle.column_views`) read the checked columns. The class is
split over those modules by job, as the project keeps a module to about 600
lines.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Sequence

import torch
import torch.fx

from dcsched import safeparse
from dcsched.bundle.column_checks import CheckedColumns
from dcsched.bundle.column_format import (OP_CODE, COLUMN_DTYPES, HAS_SIZE, HAS_TIME, META_KEYS, PER_NODE, TIME_IS_INT,
                                          encode_template)
from dcsched.bundle.column_views import ColumnViews
from dcsched.bundle.graph_encoding import encode_graph


@contextlib.contextmanager
def one_thread():
    """Run torch's element-wise passes on one thread: on a busy machine, waking the intra-op pool for arrays
    of 10^5 to 10^6 values costs more than the work itself (60 ms against 1 ms per pass, measured)."""
    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads > 1:
            torch.set_num_threads(threads)


# ---------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------

def encode_nodes(nodes: list[dict], graph_id: int | None = None) -> "GraphColumns":
    """Columns of a graph in version 1's node form (:func:`dcsched.bundle.graph_encoding.encode_graph`).

    Nothing is checked here (that is :meth:`GraphColumns.check`'s work, at load): a reference to a name
    the graph lacks is stored as node number ``len(nodes)``, which no loader accepts.
    """
    n = len(nodes)
    names = [str(node.get("name")) for node in nodes]
    index: dict[str, int] = {}
    for i, name in enumerate(names):
        index.setdefault(name, i)
    strings: dict[str, int] = {}
    templates: dict[str, int] = {}
    metas: dict[str, int] = {}
    op, target, args, meta = [], [], [], []
    inputs: list[int] = []
    offsets = [0]
    ints: list[int] = []
    int_offsets = [0]
    times: list[float] = []
    sizes: list[int] = []
    figures: list[int] = []
    for node in nodes:
        op.append(OP_CODE.get(str(node.get("op")), 255))
        target.append(strings.setdefault(str(node.get("target", node.get("name"))), len(strings)))
        local: dict = {}
        order: list = []
        node_ints: list[int] = []
        tpl = encode_template([node.get("args", {"$tuple": []}), node.get("kwargs", {"$dict": []})], local, order,
                        node_ints)
        ints.extend(node_ints)
        int_offsets.append(len(ints))
        key = json.dumps(tpl, separators=(",", ":"), allow_nan=False)
        args.append(templates.setdefault(key, len(templates)))
        inputs.extend(index.get(name, n) if isinstance(name, str) else n for name in order)
        offsets.append(len(inputs))
        node_meta = dict(node.get("meta") or {})
        time, size = node_meta.pop("device_time", None), node_meta.pop("tensor_size", None)
        flags = 0
        if time is not None:
            if isinstance(time, bool) or not isinstance(time, (int, float)):
                raise ValueError(f"node {node.get('name')}: device_time {time!r} is not a number")
            flags |= HAS_TIME | (TIME_IS_INT if isinstance(time, int) and not isinstance(time, bool) else 0)
        if size is not None:
            flags |= HAS_SIZE
            if isinstance(size, float) and size.is_integer():
                size = int(size)
            if isinstance(size, bool) or not isinstance(size, int):
                raise ValueError(f"node {node.get('name')}: tensor_size {size!r} is not a whole number of bytes")
        times.append(0.0 if time is None else float(time))
        sizes.append(0 if size is None else size)
        figures.append(flags)
        rest = {k: node_meta[k] for k in META_KEYS if k in node_meta}
        meta.append(metas.setdefault(json.dumps(rest, separators=(",", ":"), allow_nan=False), len(metas)))
    return GraphColumns(
        names=names,
        op=torch.tensor(op, dtype=torch.uint8), target=torch.tensor(target, dtype=torch.int32),
        args=torch.tensor(args, dtype=torch.int32), meta=torch.tensor(meta, dtype=torch.int32),
        inputs=torch.tensor(inputs, dtype=torch.int32), input_offsets=torch.tensor(offsets, dtype=torch.int64),
        ints=torch.tensor(ints, dtype=torch.int64), int_offsets=torch.tensor(int_offsets, dtype=torch.int64),
        device_time=torch.tensor(times, dtype=torch.float64), tensor_size=torch.tensor(sizes, dtype=torch.int64),
        figures=torch.tensor(figures, dtype=torch.uint8),
        strings=list(strings), templates=[safeparse.loads(t, what="an argument template") for t in templates],
        metas=[safeparse.loads(m, what="a node's meta") for m in metas], graph_id=graph_id)


def encode_fx(graph: torch.fx.Graph, graph_id: int | None = None) -> "GraphColumns":
    """Columns of an FX graph (through version 1's node encoding, so both versions store the same)."""
    return encode_nodes(encode_graph(graph), graph_id)


# ---------------------------------------------------------------------------
# The columns
# ---------------------------------------------------------------------------

class GraphColumns(CheckedColumns, ColumnViews):
    """One graph as columns (see the module docstring). Built by :func:`encode_nodes` or read from a file;
    a read one must pass :meth:`check` before anything else is asked of it."""

    # -- the file's parts ----------------------------------------------------
    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The per-node arrays as safetensors tensors (names joined by NUL bytes, UTF-8)."""
        blob = "\0".join(self.names).encode("utf-8")
        found = {f"{prefix}names": torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob
                 else torch.zeros(0, dtype=torch.uint8)}
        for key in (*PER_NODE, "inputs", "input_offsets", "ints", "int_offsets"):
            found[prefix + key] = getattr(self, key).contiguous()
        return found

    def tables(self) -> dict:
        """The JSON part: graph id, node count and the tables of distinct values."""
        return {"graph_id": self.graph_id, "nodes": len(self.names), "strings": self.strings,
                "templates": self.templates, "metas": self.metas}

    @classmethod
    def from_parts(cls, tables: Any, tensors: dict[str, torch.Tensor], prefix: str, where: str) -> "GraphColumns":
        """Columns from a file's JSON tables and tensors, their types and lengths checked (ValueError)."""
        if not isinstance(tables, dict):
            raise ValueError(f"{where} is not a table")
        n = tables.get("nodes")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{where}: node count {n!r} is not a number")
        for key in ("strings", "templates", "metas"):
            if not isinstance(tables.get(key), list):
                raise ValueError(f"{where}: '{key}' is not a list")
        if not all(isinstance(s, str) for s in tables["strings"]):
            raise ValueError(f"{where}: the string table holds something other than strings")
        graph_id = tables.get("graph_id")
        if graph_id is not None and (isinstance(graph_id, bool) or not isinstance(graph_id, int)):
            raise ValueError(f"{where}: graph_id {graph_id!r} is not an integer")
        arrays = {}
        for key, dtype in COLUMN_DTYPES.items():
            tensor = tensors.get(prefix + key)
            if tensor is None:
                raise ValueError(f"{where}: no '{prefix}{key}' column")
            if tensor.dtype != dtype or tensor.dim() != 1:
                raise ValueError(f"{where}: column '{key}' is {tensor.dtype} of {tensor.dim()} dimensions, "
                                 f"not a vector of {dtype}")
            arrays[key] = tensor
        for key in PER_NODE:
            if len(arrays[key]) != n:
                raise ValueError(f"{where}: column '{key}' holds {len(arrays[key])} values for {n} nodes")
        for key in ("input_offsets", "int_offsets"):
            if len(arrays[key]) != n + 1:
                raise ValueError(f"{where}: column '{key}' holds {len(arrays[key])} values for {n} nodes "
                                 f"(needs {n + 1})")
        try:
            names = bytes(arrays.pop("names").numpy()).decode("utf-8").split("\0") if n else []
        except UnicodeDecodeError:
            raise ValueError(f"{where}: node names are not UTF-8") from None
        if len(names) != n:
            raise ValueError(f"{where}: {len(names)} node names for {n} nodes")
        return cls(names=names, strings=tables["strings"], templates=tables["templates"], metas=tables["metas"],
                   graph_id=graph_id, **arrays)

    def permuted(self, order: Sequence[int]) -> "GraphColumns":
        """The same graph with its nodes in ``order`` (node numbers; a topological order of all of them)."""
        perm = torch.as_tensor(list(order), dtype=torch.long)
        n = len(self.names)
        if len(perm) != n or (n and (len(torch.unique(perm)) != n or int(perm.min()) < 0 or int(perm.max()) >= n)):
            raise ValueError("order is not a permutation of the graph's nodes")
        new_of_old = torch.empty(n, dtype=torch.long)
        new_of_old[perm] = torch.arange(n)
        inputs, input_offsets = _permute_csr(self.inputs, self.input_offsets, perm)
        ints, int_offsets = _permute_csr(self.ints, self.int_offsets, perm)
        names = self.names
        result = GraphColumns(
            names=[names[i] for i in perm.tolist()], op=self.op[perm], target=self.target[perm],
            args=self.args[perm], meta=self.meta[perm],
            inputs=new_of_old[inputs.long()].to(torch.int32), input_offsets=input_offsets,
            ints=ints, int_offsets=int_offsets,
            device_time=self.device_time[perm], tensor_size=self.tensor_size[perm], figures=self.figures[perm],
            strings=self.strings, templates=self.templates, metas=self.metas, graph_id=self.graph_id)
        result._decoded, result._targets = self._decoded, self._targets
        if self._comm is not None:
            nodes = new_of_old[torch.tensor(self._comm["nodes"], dtype=torch.long)]
            rank = torch.argsort(nodes)
            result._comm = {"nodes": nodes[rank].tolist(),
                            **{k: [self._comm[k][i] for i in rank.tolist()] for k in ("graph_id", "id", "n_users")}}
        return result

    def in_first_use_order(self) -> "GraphColumns":
        """These columns with the tables of distinct values (targets' strings, argument templates, metas) in the
        order the nodes first use them, as :func:`encode_nodes` numbers them: a graph reordered by
        :meth:`permuted` is stored as encoding it afresh would store it. ``self`` where they are in that order
        already (an encoded or loaded graph)."""
        renumbered = {}
        for column, table in (("target", "strings"), ("args", "templates"), ("meta", "metas")):
            codes = getattr(self, column).tolist()
            first: dict[int, int] = {}
            for code in codes:
                first.setdefault(code, len(first))
            if list(first) != list(range(len(getattr(self, table)))):
                values = getattr(self, table)
                renumbered[column] = torch.tensor([first[c] for c in codes], dtype=getattr(self, column).dtype)
                renumbered[table] = [values[c] for c in first]
        if not renumbered:
            return self
        parts = {key: getattr(self, key) for key in (*PER_NODE, "names", "inputs", "input_offsets", "ints",
                                                      "int_offsets", "strings", "templates", "metas", "graph_id")}
        return GraphColumns(**{**parts, **renumbered})


def _permute_csr(values: torch.Tensor, offsets: torch.Tensor, perm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A CSR column (``values`` split by ``offsets``) with its rows in ``perm``'s order, without a Python loop."""
    counts = (offsets[1:] - offsets[:-1])[perm]
    new_offsets = torch.zeros(len(perm) + 1, dtype=torch.long)
    torch.cumsum(counts, 0, out=new_offsets[1:])
    starts = offsets[:-1][perm]
    gather = torch.arange(int(new_offsets[-1])) - torch.repeat_interleave(new_offsets[:-1] - starts, counts)
    return values[gather], new_offsets
