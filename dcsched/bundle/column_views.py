"""Views of a graph's checked columns: its graph form, its FX graph, its figures.

:meth:`ColumnViews.form` gives the :class:`~dcsched.graph.form.GraphForm` the
schedulers and the simulator use, straight from the columns (no FX, no
networkx); :meth:`ColumnViews.to_fx` builds the FX graph (replay, training,
writing FX back);
:meth:`ColumnViews.collectives` finds the ZeRO-3 ops. Each reads what
:meth:`~dcsched.bundle.column_checks.CheckedColumns.check` worked out.

Split from :mod:`dcsched.bundle.columns`, as the project keeps a module to one
job and about 600 lines; :class:`~dcsched.bundle.columns.GraphColumns` inherits
these views.
"""

from __future__ import annotations

import types
from typing import Sequence

import torch
import torch.fx

from dcsched import collectives
from dcsched.bundle.column_format import (CALL_OP, GET_ATTR_OP, HAS_SIZE, HAS_TIME, OPS, OUTPUT_OP, PLACEHOLDER_OP,
                                          ColumnStore, fill_template)


class ColumnViews(ColumnStore):
    """What the checked columns are read as (see the module docstring)."""

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
            if name in opnames and getattr(target, "namespace", None) in collectives.NAMESPACES:
                which[codes == c] = list(opnames).index(name)
        keep = which >= 0
        return nodes[keep], which[keep], ids[keep]

    def form(self, label: str = "graph"):
        """The graph's :class:`~dcsched.graph.form.GraphForm`, from the columns alone (no FX, no networkx)."""
        from dcsched.graph.form import GraphForm
        from dcsched.graph.roles import is_aliasing, is_random, is_view_like, role_of
        from dcsched.graph.specs import value_specs, nbytes
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
        release = self._codes_of_role("release")
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
                    columns.tensor_size[v] = self._input_size(v, columns.tensor_size[v], meta_list, value_specs, nbytes)
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

    def _input_size(self, v: int, recorded, meta_list, value_specs, nbytes):
        """:func:`dcsched.graph.specs.input_size` from the columns."""
        if recorded:
            return recorded
        if v in self._gathered():
            return None
        out = self.metas[meta_list[v]].get("out")
        if out is None:
            return None
        return sum(nbytes(shape, dtype) for shape, dtype in value_specs(out))

    def _codes_of_role(self, role: str) -> set[int]:
        """Target codes of the ops whose collective kind has role ``role`` (:mod:`dcsched.collectives`)."""
        found = set()
        for c, t in self._targets.items():
            kind = collectives.find(getattr(t, "_opname", ""))
            if kind is not None and kind.role == role and getattr(t, "namespace", None) in collectives.NAMESPACES:
                found.add(c)
        return found

    def _gathered(self) -> set[int]:
        """Nodes an all-gather reads (parameter shards)."""
        gathers = sorted(self._codes_of_role("allgather"))
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
                a, kw = fill_template(a, env), fill_template(kw, env)
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
