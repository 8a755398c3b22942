"""The load-time checks of a graph's columns: everything version 1's loader refuses, in vectorised passes.

:meth:`CheckedColumns.check` refuses names that are no plain identifiers, ops
outside the allow-list, mutating ops, dangling or forward references, deep
nesting and absurd figures, per distinct value or per column, never per node in
Python where a tensor operation does; on the way it works out what the views
(:mod:`dcsched.bundle.column_views`) read: the decoded templates, the resolved
targets and the ZeRO-3 ops' integer arguments.

Split from :mod:`dcsched.bundle.columns`, as the project keeps a module to one
job and about 600 lines; :class:`~dcsched.bundle.columns.GraphColumns` inherits
these checks.
"""

from __future__ import annotations

import keyword
from typing import Any, Collection

import networkx as nx
import torch
import torch.fx

from dcsched import collectives
from dcsched.bundle import checks as loadchecks
from dcsched.bundle.column_format import (ALL_FIGURE_BITS, HAS_SIZE, HAS_TIME, META_KEYS, OPS, OUTPUT_OP, ColumnStore,
                                          decode_template, IntSlot)
from dcsched.bundle.graph_encoding import MAX_BYTES, MAX_NODE_MS, check_figures, resolve_target


def _illegal_fx_names() -> set[str]:
    """Names FX would change when generating code (builtins, keywords): refused like v1 refused them."""
    found = getattr(torch.fx.graph, "_illegal_names", None)
    if found is None:
        import builtins
        found = set(dir(builtins)) | set(keyword.kwlist)
    return set(found)


class CheckedColumns(ColumnStore):
    """The columns' checks (see the module docstring); a read graph must pass :meth:`check` before anything
    else is asked of it."""

    def check(self, graph_name: str, constants: set[str], ds_ids: Collection[int] | None = None) -> None:
        """Refuse what version 1's loader refuses (ValueError naming the node), in vectorised passes.

        ``ds_ids``: the parameter table's, which every ZeRO-3 op's ``id`` must name (None: not checked); the
        ops' ``graph_id`` must be the graph's own (:attr:`graph_id`, where set).
        """
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
        sizes = []
        for i, tpl in enumerate(self.templates):
            try:
                sizes.append(loadchecks.check_arguments(tpl, "", max_items))
                value, nodes_used, ints_used = decode_template(tpl)
            except (ValueError, TypeError, KeyError, RuntimeError, AttributeError) as exc:
                user = self._first(args, i)
                node = f"{where}: node {names[user]}" if user is not None else f"{where}: an argument template"
                text = str(exc).removeprefix(": ") if isinstance(exc, ValueError) else f"malformed arguments ({exc})"
                raise ValueError(f"{node}: {text}") from None
            decoded.append(value)
            node_slots.append(nodes_used)
            int_slots.append(ints_used)
        # Every node expands its template: the graph's total is counted per template, times its uses.
        total = int(torch.tensor(sizes, dtype=torch.long)[args].sum()) if n else 0
        loadchecks.check_total_arguments(total, n, where)
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
        self._comm = self._comm_ids(code, args, where, ds_ids)
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

    def _comm_ids(self, code: torch.Tensor, args: torch.Tensor, where: str, ds_ids: Collection[int] | None) -> dict:
        """The ZeRO-3 ops' integer arguments (graph_id, id, n_users) as columns over the comm nodes, checked:
        present, integers, not negative, the graph's own graph_id, an id of the parameter table (``ds_ids``),
        all at most :data:`~dcsched.bundle.checks.MAX_ID`. Worked out once per distinct (op, template),
        gathered per node, checked per column."""
        comm = {c: t._opname for c, t in self._targets.items() if isinstance(t, torch._ops.OpOverload)
                and t.namespace in collectives.NAMESPACES and collectives.find(t._opname) is not None}
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
            stand_in = tuple(0 if type(v) is IntSlot else v for v in a)
            stand_kw = {k: 0 if type(v) is IntSlot else v for k, v in kw.items()}
            try:
                loadchecks.check_comm_arguments(opname, stand_in, stand_kw, "")
            except ValueError as exc:
                raise ValueError(f"node {self.names[self._found(code * width + args, pair)]}{exc}") from None
            for position, name in enumerate(fields, start=1):
                value = a[position] if len(a) > position else kw.get(name)
                if name not in collectives.by_op(opname).ints:
                    value = None
                slot[name].append(value.k if type(value) is IntSlot else -1)
                literal[name].append(value if isinstance(value, int) else -1)
        starts = self.int_offsets[nodes]
        columns: dict[str, torch.Tensor] = {}
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
            columns[name] = torch.where(from_ints | (lit >= 0), values, -1)  # -1: the op has no such argument
        self._check_comm_columns(nodes, code, columns, comm, ds_ids)
        found.update({name: columns[name].tolist() for name in fields})
        found["nodes"] = nodes.tolist()
        return found

    def _check_comm_columns(self, nodes: torch.Tensor, code: torch.Tensor, columns: dict[str, torch.Tensor],
                            comm: dict[int, str], ds_ids: Collection[int] | None) -> None:
        """Refuse a comm node whose graph_id is not its graph's (or past belief), whose id names no parameter
        of ``ds_ids`` or whose n_users is past belief: found per column, worded by
        :func:`~dcsched.bundle.checks.check_comm_arguments` for the first such node (as version 1 words it)."""
        graph_ids, ids, users = columns["graph_id"], columns["id"], columns["n_users"]
        bad = (graph_ids > loadchecks.MAX_ID) | (users > loadchecks.MAX_ID)
        if self.graph_id is not None:
            bad |= graph_ids != self.graph_id
        if ds_ids is None:
            bad |= ids > loadchecks.MAX_ID
        else:
            bad |= ~torch.isin(ids, torch.tensor(sorted(ds_ids), dtype=torch.long))
        if not bool(bad.any()):
            return
        k = int(torch.nonzero(bad)[0])
        v = int(nodes[k])
        values = tuple(int(columns[name][k]) for name in ("graph_id", "id", "n_users"))
        loadchecks.check_comm_arguments(comm[int(code[v])], (None, *values), {}, f"node {self.names[v]}",
                                        graph_id=self.graph_id, ds_ids=ds_ids)
        raise AssertionError("a comm node refused by the columns passes check_comm_arguments")  # pragma: no cover

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
        if bool((flags & ~ALL_FIGURE_BITS).any()):
            raise ValueError(f"{where}: unknown figure flags")
        has_time = (flags & HAS_TIME) != 0
        has_size = (flags & HAS_SIZE) != 0
        t, s = self.device_time, self.tensor_size
        bad = (has_time & ~(torch.isfinite(t) & (t >= 0) & (t <= MAX_NODE_MS))) | \
              (has_size & ((s < 0) | (s > MAX_BYTES)))
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            check_figures(self._figures_of(i), f"{where}: node {self.names[i]}")


def _not_identifier(name: str) -> bool:
    try:
        loadchecks.check_identifier(name, "")
        return False
    except ValueError:
        return True
