"""A graph as columns: the node table of a version-2 bundle, checked in vectorised passes.

One :class:`GraphColumns` holds a graph as per-node arrays (``torch`` tensors,
stored as they are in the bundle's safetensors file) and a few small tables of
distinct values (JSON):

``names``          node names, in graph (topological) order
``op``             uint8: 0 placeholder, 1 call_function, 2 get_attr, 3 output (:data:`OPS`)
``target``         int32: index into ``strings`` (qualified op name, placeholder or get_attr target, ``output``)
``args``           int32: index into ``templates``, each ``[args, kwargs]`` in version 1's tagged encoding
                   with every node reference written ``{"$node": k}``: the node's k-th input, every integer
                   ``{"$int": j}``: the node's j-th (``ints``), a non-finite float ``{"$float": "-inf"}``
``inputs``,        int32 / int64: CSR of each node's distinct inputs in reading order (args, then kwargs):
``input_offsets``  node ``v`` reads ``inputs[input_offsets[v]:input_offsets[v + 1]]`` (node numbers)
``meta``           int32: index into ``metas``, the distinct node meta dicts (``out``, ``ds_id``, ``time_source``)
``device_time``    float64 ms, ``tensor_size`` int64 bytes, ``figures`` uint8 flags
                   (:data:`HAS_TIME`, :data:`HAS_SIZE`, :data:`TIME_IS_INT`)

:meth:`GraphColumns.check` refuses everything version 1's loader refuses
(names that are no plain identifiers, ops outside the allow-list, mutating
ops, dangling or forward references, deep nesting, absurd figures), per
distinct value or per column, never per node in Python where a tensor
operation does. :meth:`GraphColumns.form` gives the
:class:`~dcsched.graph.form.GraphForm` the schedulers and the simulator use,
straight from the columns; :meth:`GraphColumns.to_fx` builds the FX graph
(replay, training, writing FX back); :meth:`GraphColumns.permuted` reorders
the nodes without FX.
"""

from __future__ import annotations

import contextlib
import json
import keyword
import math
import types
from typing import Any, Sequence

import networkx as nx
import torch
import torch.fx

from dcsched.bundle import checks as loadchecks
from dcsched.bundle.arguments import decode_argument

#: Node kinds by their code in the ``op`` column.
OPS = ("placeholder", "call_function", "get_attr", "output")
_OP_CODE = {op: code for code, op in enumerate(OPS)}
PLACEHOLDER_OP, CALL_OP, GET_ATTR_OP, OUTPUT_OP = range(4)
#: Bits of the ``figures`` column.
HAS_TIME, HAS_SIZE, TIME_IS_INT = 1, 2, 4
_ALL_FIGURE_BITS = HAS_TIME | HAS_SIZE | TIME_IS_INT
#: Node meta kept beside the figures (the figures have columns of their own).
META_KEYS = ("out", "ds_id", "time_source")
#: The per-node columns: name -> dtype (``inputs`` and ``input_offsets`` are not per node).
COLUMN_DTYPES = {"op": torch.uint8, "target": torch.int32, "args": torch.int32, "meta": torch.int32,
                 "device_time": torch.float64, "tensor_size": torch.int64, "figures": torch.uint8,
                 "inputs": torch.int32, "input_offsets": torch.int64, "ints": torch.int64,
                 "int_offsets": torch.int64, "names": torch.uint8}
PER_NODE = ("op", "target", "args", "meta", "device_time", "tensor_size", "figures")


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


def _illegal_fx_names() -> set[str]:
    """Names FX would change when generating code (builtins, keywords): refused like v1 refused them."""
    found = getattr(torch.fx.graph, "_illegal_names", None)
    if found is None:
        import builtins
        found = set(dir(builtins)) | set(keyword.kwlist)
    return set(found)


# ---------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------

_INT64 = (-2**63, 2**63)


def _template(value: Any, local: dict, order: list, ints: list) -> Any:
    """Version 1's encoding with ``{"$node": name}`` replaced by ``{"$node": k}`` (the node's k-th distinct
    input) and each integer by ``{"$int": j}`` (the node's j-th integer)."""
    if isinstance(value, list):
        return [_template(v, local, order, ints) for v in value]
    if isinstance(value, dict):
        if len(value) == 1 and "$node" in value:
            name = value["$node"]
            if name not in local:
                local[name] = len(order)
                order.append(name)
            return {"$node": local[name]}
        if len(value) == 1 and ("$dtype" in value or "$device" in value or "$layout" in value
                                or "$memory_format" in value):
            return value
        return {k: _template(v, local, order, ints) for k, v in value.items()}
    if type(value) is int and _INT64[0] <= value < _INT64[1]:
        ints.append(value)
        return {"$int": len(ints) - 1}
    if type(value) is float and not math.isfinite(value):  # JSON has no inf or nan (-inf: attention masks)
        return {"$float": repr(value)}
    return value


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
        op.append(_OP_CODE.get(str(node.get("op")), 255))
        target.append(strings.setdefault(str(node.get("target", node.get("name"))), len(strings)))
        local: dict = {}
        order: list = []
        node_ints: list[int] = []
        tpl = _template([node.get("args", {"$tuple": []}), node.get("kwargs", {"$dict": []})], local, order,
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
        strings=list(strings), templates=[json.loads(t) for t in templates],
        metas=[json.loads(m) for m in metas], graph_id=graph_id)


def encode_fx(graph: torch.fx.Graph, graph_id: int | None = None) -> "GraphColumns":
    """Columns of an FX graph (through version 1's node encoding, so both versions store the same)."""
    from dcsched.bundle.graph_encoding import encode_graph
    return encode_nodes(encode_graph(graph), graph_id)


# ---------------------------------------------------------------------------
# The columns
# ---------------------------------------------------------------------------

class GraphColumns:
    """One graph as columns (see the module docstring). Built by :func:`encode_nodes` or read from a file;
    a read one must pass :meth:`check` before anything else is asked of it."""

    def __init__(self, *, names: list[str], op, target, args, meta, inputs, input_offsets, ints, int_offsets,
                 device_time,
                 tensor_size, figures, strings: list, templates: list, metas: list, graph_id=None):
        self.names = names
        self.op, self.target, self.args, self.meta = op, target, args, meta
        self.inputs, self.input_offsets = inputs, input_offsets
        self.ints, self.int_offsets = ints, int_offsets
        self.device_time, self.tensor_size, self.figures = device_time, tensor_size, figures
        self.strings, self.templates, self.metas = strings, templates, metas
        self.graph_id = graph_id
        self._decoded: list = []  # templates as Python values with _Slot references (after check)
        self._targets: dict = {}  # (op, target) code -> resolved target (after check)
        self._comm: dict = {}  # the ZeRO-3 ops' integer arguments (after check)

    def __len__(self) -> int:
        return len(self.names)

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

    # -- checks --------------------------------------------------------------
    def check(self, graph_name: str, constants: set[str]) -> None:
        """Refuse what version 1's loader refuses (ValueError naming the node), in vectorised passes."""
        from dcsched.bundle.graph_encoding import check_figures, resolve_target
        where = f"graph '{graph_name}'"
        n = len(self.names)
        names = self.names
        if not all(map(str.isidentifier, names)) or any(keyword.iskeyword(s) for s in set(names)) or \
                (n and max(map(len, names)) > loadchecks.MAX_NAME) or \
                any(s.startswith("__") and s.endswith("__") for s in names):
            bad = next(s for s in names if _not_identifier(s))
            loadchecks.check_identifier(bad, f"{where}: node name")
        if len(set(names)) != n:
            raise ValueError(f"{where} holds two nodes of one name")
        illegal = _illegal_fx_names().intersection(names)
        # FX spells node names in ASCII: it renames 'À' (a Python identifier), which version 1 refused when
        # building the graph and version 2 builds only when asked (replay), past the loader's errors.
        if not "".join(names).isascii():
            illegal.update(s for s in names if not s.isascii())
        if illegal:
            raise ValueError(f"node name {min(illegal)!r} is not a valid FX node name")
        op, target, args, meta = self.op.long(), self.target.long(), self.args.long(), self.meta.long()
        self._in_range(op, len(OPS), "node kind", where)
        self._in_range(target, len(self.strings), "target", where)
        self._in_range(args, len(self.templates), "argument template", where)
        self._in_range(meta, len(self.metas), "meta entry", where)
        # Templates, each once: tags, depth, how many distinct inputs and integers each refers to.
        decoded, node_slots, int_slots = [], [], []
        # JSON shares nothing, so a template's size is the file's: beyond the usual limit, a template may refer
        # to every node once (an output node lists every tensor the forward saves), two values each.
        max_items = loadchecks.MAX_ITEMS + 2 * n
        for i, tpl in enumerate(self.templates):
            try:
                loadchecks.check_arguments(tpl, "", max_items)
                value, nodes_used, ints_used = _decode_template(tpl)
            except (ValueError, TypeError, KeyError, RuntimeError, AttributeError) as exc:
                user = self._first(args, i)
                node = f"{where}: node {names[user]}" if user is not None else f"{where}: an argument template"
                text = str(exc).removeprefix(": ") if isinstance(exc, ValueError) else f"malformed arguments ({exc})"
                raise ValueError(f"{node}: {text}") from None
            decoded.append(value)
            node_slots.append(nodes_used)
            int_slots.append(ints_used)
        self._check_counts(self.int_offsets, len(self.ints), args, torch.tensor(int_slots, dtype=torch.long),
                           "integers", where)
        self._check_inputs(args, torch.tensor(node_slots, dtype=torch.long), where)
        # Targets, once per distinct (kind, target).
        code = target * 4 + op
        resolved: dict[int, Any] = {}
        for c in torch.unique(code).tolist():
            kind, text = OPS[c % 4], self.strings[c // 4]
            try:
                if kind == "call_function":
                    resolved[c] = resolve_target(text)
                else:
                    if kind == "placeholder":
                        loadchecks.check_identifier(text, "placeholder target")
                    elif kind == "get_attr":
                        loadchecks.check_get_attr_target(text, constants)
                    resolved[c] = text
            except ValueError as exc:
                raise ValueError(f"node {names[self._found(code, c)]}: {exc}") from None
        self._decoded, self._targets = decoded, resolved
        self._comm = self._comm_ids(code, args, where)
        # Meta entries, once each.
        for i, entry in enumerate(self.metas):
            try:
                if not isinstance(entry, dict) or not set(entry) <= set(META_KEYS):
                    raise ValueError(f": meta {entry!r:.80} holds other keys than {', '.join(META_KEYS)}")
                loadchecks.check_arguments(entry, "")
                loadchecks.check_output_spec(entry.get("out"), "")
            except ValueError as exc:
                user = self._first(meta, i)
                node = f"{where}: node {names[user]}" if user is not None else f"{where}: a meta entry"
                raise ValueError(f"{node}{exc}") from None
        self._check_figures(where, check_figures)
        outputs = int((op == OUTPUT_OP).sum())
        if outputs > 1:
            raise ValueError(f"{where} has {outputs} output nodes (at most one)")

    def _comm_ids(self, code: torch.Tensor, args: torch.Tensor, where: str) -> dict:
        """The ZeRO-3 ops' integer arguments (graph_id, id, n_users) as columns over the comm nodes, checked:
        present, integers, not negative. Worked out once per distinct (op, template), gathered per node."""
        comm = {c: t._opname for c, t in self._targets.items() if isinstance(t, torch._ops.OpOverload)
                and t.namespace in ("dcsched", "dc") and t._opname in loadchecks.COMM_INTS}
        found: dict[str, list] = {"nodes": [], "graph_id": [], "id": [], "n_users": []}
        if not comm:
            return found
        width = len(self.templates)
        is_comm = torch.isin(code, torch.tensor(list(comm), dtype=torch.long))
        nodes = torch.nonzero(is_comm).flatten()
        pairs, inverse = torch.unique(code[nodes] * width + args[nodes], return_inverse=True)
        fields = ("graph_id", "id", "n_users")
        slot: dict[str, list] = {f: [] for f in fields}
        literal: dict[str, list] = {f: [] for f in fields}
        for pair in pairs.tolist():
            c, tpl = divmod(pair, width)
            a, kw = self._decoded[tpl]
            opname = comm[c]
            stand_in = tuple(0 if type(v) is _Int else v for v in a)
            stand_kw = {k: 0 if type(v) is _Int else v for k, v in kw.items()}
            try:
                loadchecks.check_comm_arguments(opname, stand_in, stand_kw, "")
            except ValueError as exc:
                raise ValueError(f"node {self.names[self._found(code * width + args, pair)]}{exc}") from None
            for position, name in enumerate(fields, start=1):
                value = a[position] if len(a) > position else kw.get(name)
                if name not in loadchecks.COMM_INTS[opname]:
                    value = None
                slot[name].append(value.k if type(value) is _Int else -1)
                literal[name].append(value if isinstance(value, int) else -1)
        starts = self.int_offsets[nodes]
        for name in fields:
            pos = torch.tensor(slot[name], dtype=torch.long)[inverse]
            lit = torch.tensor(literal[name], dtype=torch.long)[inverse]
            from_ints = pos >= 0
            values = torch.where(from_ints, self.ints[(starts + pos.clamp(min=0)).clamp(max=max(len(self.ints) - 1, 0))]
                                 if len(self.ints) else lit, lit)
            negative = from_ints & (values < 0)
            if bool(negative.any()):
                k = int(torch.nonzero(negative)[0])
                v = int(nodes[k])
                opname = comm[int(code[v])]
                raise ValueError(f"node {self.names[v]}: {opname}'s {name} is negative ({int(values[k])})")
            found[name] = values.tolist()
        found["nodes"] = nodes.tolist()
        return found

    @staticmethod
    def _first(column: torch.Tensor, value: int) -> int | None:
        hits = torch.nonzero(column == value)
        return int(hits[0]) if len(hits) else None

    @classmethod
    def _found(cls, column: torch.Tensor, value: int) -> int:
        """The first position of ``value``, taken from ``column`` itself (so always there)."""
        first = cls._first(column, value)
        assert first is not None
        return first

    def _in_range(self, column: torch.Tensor, limit: int, what: str, where: str) -> None:
        bad = (column < 0) | (column >= limit)
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise ValueError(f"{where}: node {self.names[i]}: {what} #{int(column[i])} is not in the bundle's "
                             f"table of {limit}")

    def _check_counts(self, offsets: torch.Tensor, total: int, args: torch.Tensor, slots: torch.Tensor,
                      what: str, where: str) -> torch.Tensor:
        """CSR ``offsets`` partition a column of ``total`` values, as many per node as its template uses."""
        if int(offsets[0]) != 0 or int(offsets[-1]) != total or bool((offsets[1:] < offsets[:-1]).any()):
            raise ValueError(f"{where}: the {what} offsets do not partition the {what} column")
        counts = offsets[1:] - offsets[:-1]
        wrong = counts != slots[args] if len(args) else torch.zeros(0, dtype=torch.bool)
        if bool(wrong.any()):
            i = int(torch.nonzero(wrong)[0])
            raise ValueError(f"{where}: node {self.names[i]} lists {int(counts[i])} {what}, its arguments refer "
                             f"to {int(slots[args[i]])}")
        return counts

    def _check_inputs(self, args: torch.Tensor, slots: torch.Tensor, where: str) -> None:
        """Every node's inputs: as many as its template refers to, distinct, each an earlier node."""
        names, n = self.names, len(self.names)
        inputs = self.inputs.long()
        counts = self._check_counts(self.input_offsets, len(inputs), args, slots, "inputs", where)
        reader = torch.repeat_interleave(torch.arange(n), counts)
        dangling = (inputs < 0) | (inputs >= n)
        if bool(dangling.any()):
            k = int(torch.nonzero(dangling)[0])
            raise ValueError(f"{where}: node {names[int(reader[k])]} refers to node #{int(inputs[k])}, "
                             "which is not in the graph")
        later = inputs >= reader
        if bool(later.any()):
            deps = nx.DiGraph()
            deps.add_edges_from(zip(inputs.tolist(), reader.tolist()))
            try:
                cycle = nx.find_cycle(deps)
            except nx.NetworkXNoCycle:
                k = int(torch.nonzero(later)[0])
                raise ValueError(f"{where}: node {names[int(reader[k])]} reads {names[int(inputs[k])]}, which "
                                 "comes after it (nodes must be stored in a topological order)") from None
            path = " -> ".join([names[edge[0]] for edge in cycle] + [names[cycle[0][0]]])
            raise ValueError(f"{where} has a cycle: {path}")
        if len(inputs) > 1:
            pairs = reader * (n + 1) + inputs
            if len(torch.unique(pairs)) != len(pairs):
                raise ValueError(f"{where}: a node lists one input twice")

    def _check_figures(self, where: str, check_figures) -> None:
        flags = self.figures
        if bool((flags & ~_ALL_FIGURE_BITS).any()):
            raise ValueError(f"{where}: unknown figure flags")
        from dcsched.bundle.graph_encoding import MAX_BYTES, MAX_NODE_MS
        has_time = (flags & HAS_TIME) != 0
        has_size = (flags & HAS_SIZE) != 0
        t, s = self.device_time, self.tensor_size
        bad = (has_time & ~(torch.isfinite(t) & (t >= 0) & (t <= MAX_NODE_MS))) | \
              (has_size & ((s < 0) | (s > MAX_BYTES)))
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            check_figures(self._figures_of(i), f"{where}: node {self.names[i]}")

    def _figures_of(self, i: int) -> dict:
        flags = int(self.figures[i])
        found = {}
        if flags & HAS_TIME:
            time = float(self.device_time[i])
            found["device_time"] = int(time) if flags & TIME_IS_INT and math.isfinite(time) else time
        if flags & HAS_SIZE:
            found["tensor_size"] = int(self.tensor_size[i])
        return found

    # -- views of the checked columns ------------------------------------------
    def figure_lists(self) -> tuple[list, list]:
        """``device_time`` and ``tensor_size`` per node as Python values, None where missing."""
        times, sizes = self.device_time.tolist(), self.tensor_size.tolist()
        odd = torch.nonzero(self.figures != (HAS_TIME | HAS_SIZE)).flatten().tolist()
        for i in odd:
            figures = self._figures_of(i)
            times[i] = figures.get("device_time")
            sizes[i] = figures.get("tensor_size")
        return times, sizes

    def input_lists(self) -> list[tuple[int, ...]]:
        """Each node's inputs (node numbers), in reading order."""
        inputs, offsets = self.inputs.tolist(), self.input_offsets.tolist()
        return [tuple(inputs[a:b]) for a, b in zip(offsets, offsets[1:])]

    def _codes(self) -> torch.Tensor:
        return self.target.long() * 4 + self.op.long()

    def collectives(self, opnames: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Of the checked columns, the nodes running one of the ZeRO-3 ops ``opnames`` (dcsched's or dc's):
        their numbers (ascending), which of ``opnames`` each runs (its position) and each one's ``id``
        (its ds_id); read from what :meth:`check` worked out, no pass over the nodes in Python."""
        nodes = torch.tensor(self._comm["nodes"], dtype=torch.long)
        ids = torch.tensor(self._comm["id"], dtype=torch.long)
        which = torch.full((len(nodes),), -1, dtype=torch.long)
        codes = self._codes()[nodes]
        for c, target in self._targets.items():
            name = getattr(target, "_opname", "")
            if name in opnames and getattr(target, "namespace", None) in ("dcsched", "dc"):
                which[codes == c] = list(opnames).index(name)
        keep = which >= 0
        return nodes[keep], which[keep], ids[keep]

    def form(self, label: str = "graph"):
        """The graph's :class:`~dcsched.graph.form.GraphForm`, from the columns alone (no FX, no networkx)."""
        from dcsched.graph.form import GraphForm
        from dcsched.graph.roles import is_aliasing, is_random, is_view_like, role_of
        from dcsched.graph.specs import _specs, nbytes
        names, n = self.names, len(self.names)
        code = self._codes()
        code_list = code.tolist()
        info = {}
        for c, target in self._targets.items():
            kind = OPS[c % 4]
            stand_in = types.SimpleNamespace(op=kind, target=target, args=(), kwargs={})
            role = role_of(stand_in)
            seeded = isinstance(target, torch._ops.OpOverload) and \
                torch.Tag.nondeterministic_seeded in target.tags
            qualified = self.strings[c // 4] if kind == "call_function" else ""
            info[c] = (role.value, qualified, is_aliasing(stand_in), is_view_like(stand_in), seeded)
        per_node = [info[c] for c in code_list]
        columns = types.SimpleNamespace(
            role=[i[0] for i in per_node], target=[i[1] for i in per_node],
            aliasing=[i[2] for i in per_node], view_like=[i[3] for i in per_node],
            ds_id=[None] * n, n_users=[None] * n)
        columns.device_time, columns.tensor_size = self.figure_lists()
        preds = self.input_lists()
        comm = self._comm
        ds_id, n_users = columns.ds_id, columns.n_users
        for v, d in zip(comm["nodes"], comm["id"]):
            ds_id[v] = d
        release = {c for c, t in self._targets.items() if getattr(t, "_opname", None) == "release_param"
                   and t.namespace in ("dcsched", "dc")}
        for v, u in zip(comm["nodes"], comm["n_users"]):
            if code_list[v] in release:
                n_users[v] = u
        # Inputs (sizes derived from their recorded output where none is given), the output, random ops.
        special = [c for c, i in info.items() if i[4] or c % 4 != CALL_OP]
        output = None
        random_nodes = []
        if special:
            args_list = self.args.tolist()
            meta_list = self.meta.tolist()
            for v in torch.nonzero(torch.isin(code, torch.tensor(special, dtype=torch.long))).flatten().tolist():
                c = code_list[v]
                kind = c % 4
                if kind == OUTPUT_OP:
                    output = names[v]
                elif kind in (PLACEHOLDER_OP, GET_ATTR_OP):
                    columns.tensor_size[v] = self._input_size(v, columns.tensor_size[v], meta_list, _specs, nbytes)
                elif info[c][4]:
                    a, kw = self._decoded[args_list[v]]
                    if is_random(types.SimpleNamespace(op="call_function", target=self._targets[c], args=a,
                                                       kwargs=kw)):
                        random_nodes.append(v)
        # Random ops keep their input order: each reads the one before (dcsched.graph.nxview).
        order_only = []
        for earlier, later in zip(random_nodes, random_nodes[1:]):
            if earlier not in preds[later]:
                preds[later] += (earlier,)
                order_only.append((names[earlier], names[later]))
        return GraphForm.from_columns(names, columns, preds, output, order_only, label=label)

    def _input_size(self, v: int, recorded, meta_list, _specs, nbytes):
        """:func:`dcsched.graph.specs.input_size` from the columns."""
        if recorded:
            return recorded
        if v in self._gathered():
            return None
        out = self.metas[meta_list[v]].get("out")
        if out is None:
            return None
        return sum(nbytes(shape, dtype) for shape, dtype in _specs(out))

    def _gathered(self) -> set[int]:
        """Nodes an all-gather reads (parameter shards)."""
        gathers = [c for c, t in self._targets.items() if getattr(t, "_opname", None) == "allgather_param"
                   and t.namespace in ("dcsched", "dc")]
        readers = torch.isin(self._codes(), torch.tensor(gathers, dtype=torch.long))
        counts = self.input_offsets[1:] - self.input_offsets[:-1]
        return set(self.inputs[torch.repeat_interleave(readers, counts)].tolist())

    def _node_values(self):
        """Per node: (kind code, template, meta index, inputs, integers) as Python lists."""
        inputs, offsets = self.inputs.tolist(), self.input_offsets.tolist()
        ints, int_offsets = self.ints.tolist(), self.int_offsets.tolist()
        return (self._codes().tolist(), self.args.tolist(), self.meta.tolist(),
                [inputs[a:b] for a, b in zip(offsets, offsets[1:])],
                [ints[a:b] for a, b in zip(int_offsets, int_offsets[1:])])

    def to_fx(self) -> torch.fx.Graph:
        """The FX graph (names, targets, args, meta) of the checked columns."""
        graph = torch.fx.Graph()
        nodes: list[torch.fx.Node] = []
        code, args, meta, inputs, ints = self._node_values()
        times, sizes = self.figure_lists()
        flags = self.figures.tolist()
        for v, name in enumerate(self.names):
            a, kw = self._decoded[args[v]]
            if inputs[v] or ints[v]:
                env = ([nodes[r] for r in inputs[v]], ints[v])
                a, kw = _fill(a, env), _fill(kw, env)
            node = graph.create_node(OPS[code[v] % 4], self._targets[code[v]], a, kw, name=name)
            if node.name != name:
                raise ValueError(f"node name {name!r} is not a valid FX node name")
            if flags[v] & HAS_TIME:
                node.meta["device_time"] = times[v]
            if flags[v] & HAS_SIZE:
                node.meta["tensor_size"] = sizes[v]
            node.meta.update(self.metas[meta[v]])
            nodes.append(node)
        graph.lint()
        return graph

    def to_nodes(self) -> list[dict]:
        """Version 1's node form (what :func:`dcsched.bundle.graph_encoding.encode_graph` gives) of these columns."""
        out = []
        code, args, meta, inputs, ints = self._node_values()
        times, sizes = self.figure_lists()
        flags = self.figures.tolist()
        names = self.names
        for v, name in enumerate(names):
            a, kw = _named(self.templates[args[v]], ([names[r] for r in inputs[v]], ints[v]))
            node_meta = {}
            if flags[v] & HAS_TIME:
                node_meta["device_time"] = times[v]
            if flags[v] & HAS_SIZE:
                node_meta["tensor_size"] = sizes[v]
            node_meta.update(self.metas[meta[v]])
            out.append({"name": name, "op": OPS[code[v] % 4], "target": self.strings[code[v] // 4],
                        "args": a, "kwargs": kw, "meta": node_meta})
        return out

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


def _permute_csr(values: torch.Tensor, offsets: torch.Tensor, perm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A CSR column (``values`` split by ``offsets``) with its rows in ``perm``'s order, without a Python loop."""
    counts = (offsets[1:] - offsets[:-1])[perm]
    new_offsets = torch.zeros(len(perm) + 1, dtype=torch.long)
    torch.cumsum(counts, 0, out=new_offsets[1:])
    starts = offsets[:-1][perm]
    gather = torch.arange(int(new_offsets[-1])) - torch.repeat_interleave(new_offsets[:-1] - starts, counts)
    return values[gather], new_offsets


def _not_identifier(name: str) -> bool:
    try:
        loadchecks.check_identifier(name, "")
        return False
    except ValueError:
        return True


class _Slot:
    """A node reference inside a decoded template: the node's ``k``-th input."""

    __slots__ = ("k",)

    def __init__(self, k: int):
        self.k = k

    def __repr__(self) -> str:
        return f"<input {self.k}>"


class _Int(_Slot):
    """An integer inside a decoded template: the node's ``k``-th integer."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"<integer {self.k}>"


def _index(payload: Any, what: str) -> int:
    if isinstance(payload, bool) or not isinstance(payload, int) or payload < 0 or payload >= 2**31:
        raise ValueError(f"{what} {payload!r:.40} is not a number of the node's")
    return payload


def _decode_value(value: Any, nodes: list, ints: list) -> Any:
    """``value`` decoded (:func:`dcsched.bundle.arguments.decode_argument`), ``$node`` and ``$int`` as slots,
    their numbers appended to ``nodes`` and ``ints``."""

    def node(payload: Any) -> _Slot:
        nodes.append(_index(payload, "node reference"))
        return _Slot(payload)

    def integer(payload: Any) -> _Int:
        ints.append(_index(payload, "integer reference"))
        return _Int(payload)

    return decode_argument(value, node, integer, non_finite=True)


def _decode_template(tpl: Any) -> tuple[tuple, int, int]:
    """``[args, kwargs]`` as Python values (references as slots), how many distinct inputs and how many
    integers it refers to. ValueError for a malformed template, inputs not numbered 0, 1, ... by first
    use, integers not numbered 0, 1, ... in reading order."""
    if not isinstance(tpl, list) or len(tpl) != 2:
        raise ValueError(f"malformed arguments {tpl!r:.80}")
    nodes: list[int] = []
    ints: list[int] = []
    args = _decode_value(tpl[0], nodes, ints)
    kwargs = _decode_value(tpl[1], nodes, ints)
    if not isinstance(args, tuple) or not isinstance(kwargs, dict):
        raise ValueError("malformed args or kwargs")
    seen = -1
    for k in nodes:
        if k > seen + 1:
            raise ValueError(f"input #{k} referred to before input #{seen + 1}")
        seen = max(seen, k)
    if ints != list(range(len(ints))):
        raise ValueError("integers are not numbered in reading order")
    return (args, kwargs), seen + 1, len(ints)


def _fill(value: Any, env: tuple[list, list]) -> Any:
    kind = type(value)
    if kind is _Slot:
        return env[0][value.k]
    if kind is _Int:
        return env[1][value.k]
    if kind is tuple:
        return tuple(_fill(v, env) for v in value)
    if kind is list:
        return [_fill(v, env) for v in value]
    if kind is dict:
        return {k: _fill(v, env) for k, v in value.items()}
    if kind is slice:
        return slice(_fill(value.start, env), _fill(value.stop, env), _fill(value.step, env))
    return value


def _named(value: Any, env: tuple[list, list]) -> Any:
    """A template with ``{"$node": k}`` back to ``{"$node": name}`` and ``{"$int": j}`` to the integer."""
    if isinstance(value, list):
        return [_named(v, env) for v in value]
    if isinstance(value, dict):
        if len(value) == 1 and "$node" in value:
            return {"$node": env[0][value["$node"]]}
        if len(value) == 1 and "$int" in value:
            return env[1][value["$int"]]
        if len(value) == 1 and "$float" in value:
            return float(value["$float"])
        return {k: _named(v, env) for k, v in value.items()}
    return value
