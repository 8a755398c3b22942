"""Random ZeRO-3-style DAGs: a few parameters, shared uses, views, multi-output ops, kwargs-only inputs."""

from __future__ import annotations

import operator
import random

import torch
import torch.fx

from dcsched.synthetic.builder import GraphBuilder

aten = torch.ops.aten

_UNARY = (aten.relu.default, aten.gelu.default, aten.neg.default, aten.exp.default)
_VIEWS = (aten.t.default, aten.detach.default)
_BINARY = (aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor)


def random_graph(seed: int, *, kind: str = "forward", n_params: int | None = None,
                 n_ops: int | None = None, kwargs_deps: bool = False, namespace: str = "dcsched",
                 tie_prone: bool = True) -> torch.fx.Graph:
    """A random ZeRO-3-style DAG (``kind`` 'forward' or 'backward').

    ``n_params`` parameters and about ``n_ops`` compute steps (random when
    None). ``kwargs_deps`` passes some inputs through kwargs only (DeepSpeed's
    schedulers miss those). ``tie_prone`` draws costs from a few values so that
    ties, broken by node names, are common.

    >>> g = random_graph(0, kind="backward", n_params=3)
    >>> sorted(n.name for n in g.nodes if n.name.startswith("reduce_ds_param"))[:1]
    ['reduce_ds_param_primals_1']
    """
    if kind not in ("forward", "backward"):
        raise ValueError("kind must be 'forward' or 'backward'")
    rng = random.Random(seed)
    n_params = n_params if n_params is not None else rng.randint(1, 10)
    n_ops = n_ops if n_ops is not None else rng.randint(n_params + 1, 4 * n_params + 8)
    dag = _RandomDag(GraphBuilder(rng, namespace, graph_id=0 if kind == "forward" else 1, tie_prone=tie_prone),
                     backward=kind == "backward", kwargs_deps=kwargs_deps)
    dag.placeholders(n_params)
    dag.body(n_ops)
    return dag.finish()


class _RandomDag:
    """The state one random graph is drawn with; every draw comes from the builder's seeded ``rng``.

    The order of the draws is the generator's contract (golden data stores the
    graphs' digests), so each step below draws exactly what it always drew.
    """

    def __init__(self, builder: GraphBuilder, *, backward: bool, kwargs_deps: bool):
        self.b, self.rng = builder, builder.rng
        self.backward, self.kwargs_deps = backward, kwargs_deps
        self.saved_outputs: list[torch.fx.Node] = []
        self.reduces: dict[str, torch.fx.Node] = {}

    def placeholders(self, n_params: int) -> None:
        """Parameters and inputs (a tangent first in backward graphs) in a random order, then the gathers."""
        b, rng = self.b, self.rng
        self.names = names = [f"primals_{i + 1}" for i in range(n_params)]
        ds_ids = rng.sample(range(4 * n_params + 4), n_params)
        self.n_inputs = rng.randint(1, 3)
        slots = ["p"] * n_params + ["i"] * self.n_inputs
        if self.backward:
            slots.append("i")  # a tangent
        rng.shuffle(slots)
        inputs, pi, ii = [], 0, 0
        for slot in slots:
            if slot == "p":
                b.param(names[pi], ds_ids[pi])
                pi += 1
            else:
                label = "tangents" if self.backward and ii == 0 else ("saved" if self.backward else "input")
                inputs.append(b.placeholder(f"{label}_{ii + 1}"))
                ii += 1
        # Which parameters are used in the body (all of them in forward), with a
        # gradient (backward), gathered (those used).
        self.used = list(names) if not self.backward else [p for p in names if rng.random() < 0.8]
        self.with_grad = [p for p in names if rng.random() < 0.9] if self.backward else []
        for name in [p for p in names if p in self.used]:
            b.gather(name)
        self.live = list(inputs)
        self.uses_left = {p: (rng.choice((1, 1, 1, 2, 3))) for p in self.used}
        self.pending_grads: dict[str, list[torch.fx.Node]] = {p: [] for p in self.with_grad}
        rng.shuffle(list(self.used))  # drawn, unused: kept so the seeded graphs stay what they were

    def pick(self) -> torch.fx.Node:
        # Prefer recent values, so the graph is deep rather than flat.
        k = min(len(self.live) - 1, int(self.rng.expovariate(0.35)))
        return self.live[-1 - k]

    def second_input(self, node_args: list, kwargs: dict) -> None:
        other = self.pick()
        if self.kwargs_deps and self.rng.random() < 0.35:
            kwargs["other"] = other
        else:
            node_args.append(other)

    def body(self, n_ops: int) -> None:
        steps = 0
        while steps < n_ops or any(self.uses_left.values()):
            steps += 1
            if steps > 10 * (n_ops + 10):
                break
            candidates = [p for p in self.used if self.uses_left[p] > 0]
            roll = self.rng.random()
            if candidates and (roll < 0.45 or steps >= n_ops):
                self.live.append(self.use_param(candidates))
            else:
                self.compute(roll)
            if self.backward and self.with_grad and self.rng.random() < 0.35:
                self.grad_part()

    def use_param(self, candidates: list[str]) -> torch.fx.Node:
        """One real use of a parameter: through a view, with a second parameter, a layer norm or a product."""
        b, rng = self.b, self.rng
        name = rng.choice(candidates)
        self.uses_left[name] -= 1
        w = b.waits[name]
        shape_kind = rng.random()
        if shape_kind < 0.35:
            wt = b.op(aten.t.default, (w,), time=0.0, size=0)  # a view: not a use
            return b.use(aten.mm.default, (self.pick(), wt), [name])
        if shape_kind < 0.5 and len([p for p in candidates if p != name]) > 0:
            other = rng.choice([p for p in candidates if p != name])
            self.uses_left[other] -= 1
            return b.use(aten.addmm.default, (b.waits[other], self.pick(), w), [other, name])
        if shape_kind < 0.65:
            value, tup = b.use(aten.native_layer_norm.default, (self.pick(), [8], w, None, 1e-5), [name],
                               getitem=True)
            for k in (1, 2):
                if rng.random() < 0.5:
                    self.saved_outputs.append(b.op(operator.getitem, (tup, k), time=0.0))
            return value
        args: list = [w]
        kwargs: dict = {}
        self.second_input(args, kwargs)
        return b.use(aten.mul.Tensor, args, [name], kwargs)

    def compute(self, roll: float) -> None:
        """A node that uses no parameter: a view, a split read through getitem, a binary or a unary op."""
        b, rng, live = self.b, self.rng, self.live
        if roll < 0.6 and len(live) >= 1:
            live.append(b.op(rng.choice(_VIEWS), (self.pick(),), time=0.0, size=0))
        elif roll < 0.7:
            tup = b.op(aten.split.Tensor, (self.pick(), 4, 1))
            live.append(b.op(operator.getitem, (tup, 0), time=0.0))
            if rng.random() < 0.5:
                live.append(b.op(operator.getitem, (tup, 1), time=0.0))
        elif roll < 0.85:
            args = [self.pick()]
            kwargs: dict = {}
            self.second_input(args, kwargs)
            live.append(b.op(rng.choice(_BINARY), args, kwargs))
        else:
            live.append(b.op(rng.choice(_UNARY), (self.pick(),)))

    def grad_part(self) -> None:
        """Backward: a part of some parameter's gradient; reduced once it has all its parts."""
        name = self.rng.choice(self.with_grad)
        if name in self.reduces:
            return
        parts = self.pending_grads[name]
        parts.append(self.b.op(aten.mm.default, (self.pick(), self.pick())))
        if len(parts) >= self.rng.choice((1, 1, 2)):
            self.reduce(name, parts)

    def reduce(self, name: str, parts: list[torch.fx.Node]) -> None:
        grad = parts[0]
        for extra in parts[1:]:
            grad = self.b.op(aten.add.Tensor, (grad, extra))
        self.reduces[name] = self.b.grad_reduce(grad, name, name)

    def finish(self) -> torch.fx.Graph:
        b, rng = self.b, self.rng
        if self.backward:
            for name in self.with_grad:
                if name not in self.reduces:
                    self.reduce(name, self.pending_grads[name] or [b.op(aten.sum.dim_IntList, (self.pick(), [0]))])
            outputs = [self.reduces.get(p) for p in self.names] + [None] * self.n_inputs + [self.pick()]
        else:
            loss = b.op(aten.sum.default, (self.live[-1],))
            saved = rng.sample(self.live, min(len(self.live), rng.randint(0, 4)))
            outputs = [loss] + saved + self.saved_outputs
        return b.finish(outputs)
