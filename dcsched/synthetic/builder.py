"""The node emitter every synthetic generator uses: DeepCompile's insertion rules, seeded costs."""

from __future__ import annotations

import dataclasses
import operator
import random

import torch
import torch.fx

from dcsched.runtime import ops

#: The ranks a stack's parameter shards are cut for (:meth:`GraphBuilder.param`): the sample bundles' world.
SHARD_WORLD = 8


def _comm_ops(namespace: str):
    if namespace == ops.DEEPSPEED_NAMESPACE:
        ops.ensure_deepspeed_ops()
    ns = getattr(torch.ops, namespace)
    return (ns.allgather_param.default, ns.wait_allgather.default, ns.release_param.default,
            ns.reduce_grad.default)


@dataclasses.dataclass
class GraphPair:
    """A forward graph and its backward graph."""

    forward: torch.fx.Graph
    backward: torch.fx.Graph


class GraphBuilder:
    """Emits nodes in DeepCompile's final order: placeholders, gathers, body."""

    def __init__(self, rng: random.Random, namespace: str, graph_id: int, tie_prone: bool = True):
        self.rng = rng
        self.graph = torch.fx.Graph()
        self.graph_id = graph_id
        self.tie_prone = tie_prone
        self.allgather, self.wait, self.release, self.reduce = _comm_ops(namespace)
        self.waits: dict[str, torch.fx.Node] = {}
        self.param_ph: dict[str, torch.fx.Node] = {}
        self.ds_id: dict[str, int] = {}
        self.releases: dict[str, list[torch.fx.Node]] = {}
        #: each parameter's gathered bytes, where :meth:`param` was told them
        self.full_bytes: dict[str, int] = {}

    # -- costs -------------------------------------------------------------
    def _time(self, low: float, high: float) -> float:
        if self.tie_prone and self.rng.random() < 0.3:
            return self.rng.choice((0.0, 0.25, 0.5, 1.0))
        return round(self.rng.uniform(low, high), 4)

    def _size(self) -> int:
        return self.rng.choice((0, 256, 1024, 4096, 16384)) if self.tie_prone else \
            self.rng.randrange(64, 1 << 20, 64)

    def _meta(self, node, time, size):
        node.meta["device_time"] = time
        node.meta["tensor_size"] = size
        return node

    # -- nodes -------------------------------------------------------------
    def placeholder(self, name: str) -> torch.fx.Node:
        node = self.graph.placeholder(name)
        return self._meta(node, 0.0, self._size())

    def param(self, name: str, ds_id: int, full_bytes: int | None = None) -> torch.fx.Node:
        """A parameter's shard placeholder; with ``full_bytes`` (the gathered parameter's), the shard holds
        its rank's part of them at :data:`SHARD_WORLD` ranks, as a captured graph's does (otherwise its size
        is drawn like any placeholder's, unrelated to the parameter's)."""
        node = self.placeholder(name)  # drawn even where replaced, so every later draw is what it was
        if full_bytes is not None:
            node.meta["tensor_size"] = -(-full_bytes // SHARD_WORLD)
            self.full_bytes[name] = full_bytes
        self.param_ph[name] = node
        self.ds_id[name] = ds_id
        return node

    def gather(self, name: str, nbytes: int | None = None) -> None:
        """The all-gather and wait of a parameter (call right after all placeholders)."""
        ph, ds_id = self.param_ph[name], self.ds_id[name]
        nbytes = nbytes if nbytes is not None else self.rng.choice((1024, 4096, 4096, 16384, 65536))
        ag = self.graph.create_node("call_function", self.allgather, (ph, self.graph_id, ds_id),
                                    {"dtype": None}, name=f"allgather_ds_param_{ph.target}_{ds_id}")
        # Layered stacks model the gather time from its bytes, as dcsched's profiler does.
        self._meta(ag, self._time(0.05, 1.0) if self.tie_prone else nbytes / 1e6, nbytes)
        wait = self.graph.create_node("call_function", self.wait, (ag, self.graph_id, ds_id),
                                      name=f"wait_allgather_ds_param__{ph.target}_{ds_id}")
        # As dcsched's profiler models them, waits cost nothing in the layered stacks.
        self._meta(wait, self._time(0.0, 0.01) if self.tie_prone else 0.0, nbytes)
        self.waits[name] = wait
        self.releases[name] = []

    def op(self, target, args, kwargs=None, *, time=None, size=None) -> torch.fx.Node:
        node = self.graph.create_node("call_function", target, tuple(args), kwargs or {})
        return self._meta(node, self._time(0.01, 2.0) if time is None else time,
                          self._size() if size is None else size)

    def use(self, target, args, params: list[str], kwargs=None, getitem: bool = False):
        """A real use of ``params``; returns the value its readers read (after the releases).

        With ``getitem``, the use returns a tuple: the releases follow ``getitem(use, 0)``
        and the result is ``(released item 0, use)`` so other items can be read.
        """
        node = self.op(target, args, kwargs)
        anchor = self.op(operator.getitem, (node, 0), time=0.0) if getitem else node
        value = anchor
        # DeepCompile inserts each release right after the use and moves the
        # use's readers onto it, so the last parameter's release comes first.
        for name in reversed(params):
            ph, ds_id = self.param_ph[name], self.ds_id[name]
            rel = self.graph.create_node(
                "call_function", self.release, (value, self.graph_id, ds_id, 0),
                name=f"release_ds_param_{ph.target}_{node.name}_{ds_id}")
            self._meta(rel, self._time(0.0, 0.005), 0)
            self.releases[name].append(rel)
            value = rel
        return (value, node) if getitem else value

    def grad_reduce(self, grad: torch.fx.Node, ph: str, param_name: str) -> torch.fx.Node:
        """The reduce of ``grad``, the gradient of parameter ``ph``: of the parameter's size, where it is
        known (a reduce bucket's flat input holds its members' gradients)."""
        if ph in self.full_bytes:
            grad.meta["tensor_size"] = self.full_bytes[ph]
        node = self.graph.create_node("call_function", self.reduce, (grad, self.graph_id, self.ds_id[ph]),
                                      name=f"reduce_ds_param_{param_name}")
        return self._meta(node, self._time(0.01, 0.5), 0)

    def finish(self, outputs) -> torch.fx.Graph:
        # DeepCompile gathers only the parameters the graph reads.
        for name, wait in list(self.waits.items()):
            if not wait.users:
                ag = wait.args[0]
                self.graph.erase_node(wait)
                self.graph.erase_node(ag)
                del self.waits[name]
        for rels in self.releases.values():
            for rel in rels:
                rel.args = rel.args[:3] + (len(rels),)
        self.graph.output(tuple(outputs))
        return self.graph
