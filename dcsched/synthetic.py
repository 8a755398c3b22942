"""Synthetic ZeRO-3 graphs shaped the way DeepCompile builds them, for tests and benchmarks.

Two builders, both deterministic for a given seed (they use only
``random.Random(seed)``):

- :func:`random_graph`: a random forward- or backward-style DAG with a few
  parameters; random costs; shared parameters (several uses, several
  releases), multi-output ops read through ``getitem``, view ops, and on
  request dependencies passed only through kwargs.
- :func:`layered_stack`: a transformer-like stack of any depth (forward and
  backward graphs), for benchmarks.
- :func:`moe_graph`: a random Mixtral-like stack (router, many parallel
  same-size experts per layer), forward or backward.

Every graph follows DeepCompile's insertion rules (see
``../shared/reference/README.md``): all placeholders first, then for each
used parameter ``allgather_ds_param_{ph}_{ds_id}`` and right after it
``wait_allgather_ds_param__{ph}_{ds_id}``; every real use (seen through views)
reads the wait and is followed by ``release_ds_param_{ph}_{use}_{ds_id}``
passing the use's output through (after the first ``getitem`` for a
multi-output use) with ``n_users`` = the number of uses; in backward graphs,
``reduce_ds_param_{param}`` right after each gradient, and the output reads
the reduce node. Node meta: ``device_time`` (ms) and ``tensor_size`` (bytes).

The graphs are for scheduling: shapes are not tracked and the graphs are not
meant to be run.

>>> g = random_graph(3)
>>> g2 = random_graph(3)
>>> [n.name for n in g.nodes] == [n.name for n in g2.nodes]
True
>>> pair = layered_stack(2)
>>> sum(1 for n in pair.forward.nodes if n.name.startswith("allgather_ds_param"))
35
"""

from __future__ import annotations

import dataclasses
import operator
import random

import torch
import torch.fx

from . import ops

aten = torch.ops.aten


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


class _Builder:
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

    def param(self, name: str, ds_id: int) -> torch.fx.Node:
        node = self.placeholder(name)
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
        for name, rels in self.releases.items():
            for rel in rels:
                rel.args = rel.args[:3] + (len(rels),)
        self.graph.output(tuple(outputs))
        return self.graph


# ---------------------------------------------------------------------------
# Random DAGs
# ---------------------------------------------------------------------------

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
    """
    if kind not in ("forward", "backward"):
        raise ValueError("kind must be 'forward' or 'backward'")
    rng = random.Random(seed)
    n_params = n_params if n_params is not None else rng.randint(1, 10)
    n_ops = n_ops if n_ops is not None else rng.randint(n_params + 1, 4 * n_params + 8)
    b = _Builder(rng, namespace, graph_id=0 if kind == "forward" else 1, tie_prone=tie_prone)
    backward = kind == "backward"

    names = [f"primals_{i + 1}" for i in range(n_params)]
    ds_ids = rng.sample(range(4 * n_params + 4), n_params)
    n_inputs = rng.randint(1, 3)
    params, inputs = [], []
    slots = ["p"] * n_params + ["i"] * n_inputs
    if backward:
        slots.append("i")  # a tangent
    rng.shuffle(slots)
    pi = ii = 0
    for slot in slots:
        if slot == "p":
            params.append(b.param(names[pi], ds_ids[pi]))
            pi += 1
        else:
            label = "tangents" if backward and ii == 0 else ("saved" if backward else "input")
            inputs.append(b.placeholder(f"{label}_{ii + 1}"))
            ii += 1

    # Which parameters are used in the body (all of them in forward), with a
    # gradient (backward), gathered (those used).
    used = list(names) if not backward else [p for p in names if rng.random() < 0.8]
    with_grad = [p for p in names if rng.random() < 0.9] if backward else []
    gathered_order = [p for p in names if p in used]
    for name in gathered_order:
        b.gather(name)

    live = list(inputs)
    uses_left = {p: (rng.choice((1, 1, 1, 2, 3))) for p in used}
    pending_grads: dict[str, list[torch.fx.Node]] = {p: [] for p in with_grad}
    reduces: dict[str, torch.fx.Node] = {}
    params_to_use = list(used)
    rng.shuffle(params_to_use)
    saved_outputs: list[torch.fx.Node] = []

    def pick():
        # Prefer recent values, so the graph is deep rather than flat.
        k = min(len(live) - 1, int(rng.expovariate(0.35)))
        return live[-1 - k]

    def second_input(node_args: list, kwargs: dict):
        other = pick()
        if kwargs_deps and rng.random() < 0.35:
            kwargs["other"] = other
        else:
            node_args.append(other)

    steps = 0
    while steps < n_ops or any(uses_left.values()):
        steps += 1
        if steps > 10 * (n_ops + 10):
            break
        candidates = [p for p in used if uses_left[p] > 0]
        roll = rng.random()
        if candidates and (roll < 0.45 or steps >= n_ops):
            name = rng.choice(candidates)
            uses_left[name] -= 1
            w = b.waits[name]
            shape_kind = rng.random()
            if shape_kind < 0.35:
                wt = b.op(aten.t.default, (w,), time=0.0, size=0)  # a view: not a use
                value = b.use(aten.mm.default, (pick(), wt), [name])
            elif shape_kind < 0.5 and len([p for p in candidates if p != name]) > 0:
                other = rng.choice([p for p in candidates if p != name])
                uses_left[other] -= 1
                value = b.use(aten.addmm.default, (b.waits[other], pick(), w), [other, name])
            elif shape_kind < 0.65:
                value, tup = b.use(aten.native_layer_norm.default, (pick(), [8], w, None, 1e-5), [name],
                                   getitem=True)
                for k in (1, 2):
                    if rng.random() < 0.5:
                        item = b.op(operator.getitem, (tup, k), time=0.0)
                        saved_outputs.append(item)
            else:
                args = [w]
                kwargs: dict = {}
                second_input(args, kwargs)
                value = b.use(aten.mul.Tensor, args, [name], kwargs)
            live.append(value)
        elif roll < 0.6 and len(live) >= 1:
            live.append(b.op(rng.choice(_VIEWS), (pick(),), time=0.0, size=0))
        elif roll < 0.7:
            tup = b.op(aten.split.Tensor, (pick(), 4, 1))
            live.append(b.op(operator.getitem, (tup, 0), time=0.0))
            if rng.random() < 0.5:
                live.append(b.op(operator.getitem, (tup, 1), time=0.0))
        elif roll < 0.85:
            args = [pick()]
            kwargs = {}
            second_input(args, kwargs)
            live.append(b.op(rng.choice(_BINARY), args, kwargs))
        else:
            live.append(b.op(rng.choice(_UNARY), (pick(),)))
        if backward and with_grad and rng.random() < 0.35:
            name = rng.choice(with_grad)
            if name not in reduces:
                part = b.op(aten.mm.default, (pick(), pick()))
                pending_grads[name].append(part)
                if len(pending_grads[name]) >= rng.choice((1, 1, 2)):
                    grad = pending_grads[name][0]
                    for extra in pending_grads[name][1:]:
                        grad = b.op(aten.add.Tensor, (grad, extra))
                    reduces[name] = b.grad_reduce(grad, name, name)

    if backward:
        for name in with_grad:
            if name not in reduces:
                grads = pending_grads[name] or [b.op(aten.sum.dim_IntList, (pick(), [0]))]
                grad = grads[0]
                for extra in grads[1:]:
                    grad = b.op(aten.add.Tensor, (grad, extra))
                reduces[name] = b.grad_reduce(grad, name, name)
        outputs = [reduces.get(p) for p in names] + [None] * n_inputs + [pick()]
    else:
        loss = b.op(aten.sum.default, (live[-1],))
        saved = rng.sample(live, min(len(live), rng.randint(0, 4)))
        outputs = [loss] + saved + saved_outputs
    return b.finish(outputs)


# ---------------------------------------------------------------------------
# Layered transformer-like stacks
# ---------------------------------------------------------------------------

_LAYER_PARAMS = ("ln1_w", "ln1_b", "q_w", "q_b", "k_w", "k_b", "v_w", "v_b", "o_w", "o_b",
                 "ln2_w", "ln2_b", "fc1_w", "fc1_b", "fc2_w", "fc2_b")


def layered_stack(n_layers: int, *, seed: int = 0, namespace: str = "dcsched", tied: bool = True) -> GraphPair:
    """Forward and backward graphs of a GPT-like stack of ``n_layers`` layers.

    Embedding (its weight tied to the LM head, a shared parameter, unless
    ``tied`` is False: then the head has its own weight ``lm_head``), per layer a
    layer norm, q/k/v projections, attention, an output projection, a second
    layer norm and a two-layer MLP (16 parameters per layer), a final layer norm
    and a loss. About 91 forward and 104 backward nodes per layer. Costs:
    all-gathers take ``bytes / 10^6`` ms and waits 0 ms (as dcsched's profiler
    models them); compute nodes random (seeded).
    """
    rng = random.Random(seed)
    param_names = ["wte"] + [f"layers_{i}_{p}" for i in range(n_layers) for p in _LAYER_PARAMS] + ["lnf_w", "lnf_b"]
    head = "wte" if tied else "lm_head"
    if not tied:
        param_names.append(head)
    ds_of = {p: i for i, p in enumerate(param_names)}
    ph_name = {p: f"primals_{i + 1}" for i, p in enumerate(param_names)}
    size_of = {p: (4096 if p.endswith("_b") else 65536 if "fc" in p else 16384) for p in param_names}
    size_of["wte"] = size_of[head] = 262144

    # Forward
    f = _Builder(rng, namespace, graph_id=0, tie_prone=False)
    for p in param_names:
        f.param(ph_name[p], ds_of[p])
    ids = f.placeholder(f"primals_{len(param_names) + 1}")
    for p in param_names:
        f.gather(ph_name[p], size_of[p])
    w = {p: f.waits[ph_name[p]] for p in param_names}
    pn = ph_name
    saved: list[torch.fx.Node] = []

    def linear(x, layer, name):
        wt = f.op(aten.t.default, (w[f"{layer}_{name}_w"],), time=0.0, size=0)
        return f.use(aten.addmm.default, (w[f"{layer}_{name}_b"], x, wt),
                     [pn[f"{layer}_{name}_b"], pn[f"{layer}_{name}_w"]])

    def layer_norm(x, wname, bname):
        value, tup = f.use(aten.native_layer_norm.default, (x, [8], w[wname], w[bname], 1e-5),
                           [pn[bname], pn[wname]], getitem=True)
        saved.append(f.op(operator.getitem, (tup, 1), time=0.0))
        saved.append(f.op(operator.getitem, (tup, 2), time=0.0))
        return value

    x = f.use(aten.embedding.default, (w["wte"], ids), [pn["wte"]])
    for i in range(n_layers):
        layer = f"layers_{i}"
        saved.append(x)
        h = layer_norm(x, f"{layer}_ln1_w", f"{layer}_ln1_b")
        q, k, v = (linear(h, layer, n) for n in ("q", "k", "v"))
        kt = f.op(aten.t.default, (k,), time=0.0, size=0)
        scores = f.op(aten.mm.default, (q, kt))
        attn = f.op(aten._softmax.default, (scores, -1, False))
        ctx = f.op(aten.mm.default, (attn, v))
        saved.extend((q, k, v, attn, ctx))
        x = f.op(aten.add.Tensor, (x, linear(ctx, layer, "o")))
        saved.append(x)
        h2 = layer_norm(x, f"{layer}_ln2_w", f"{layer}_ln2_b")
        a = linear(h2, layer, "fc1")
        g = f.op(aten.gelu.default, (a,))
        saved.extend((a, g))
        x = f.op(aten.add.Tensor, (x, linear(g, layer, "fc2")))
    h = layer_norm(x, "lnf_w", "lnf_b")
    wte_t = f.op(aten.t.default, (w[head],), time=0.0, size=0)
    logits = f.use(aten.mm.default, (h, wte_t), [pn[head]])
    loss = f.op(aten.sum.default, (logits,))
    forward = f.finish([loss, h] + saved)

    # Backward: reversed, each weight read once more for the input gradient.
    bw = _Builder(rng, namespace, graph_id=1, tie_prone=False)
    for p in param_names:
        bw.param(ph_name[p], ds_of[p])
    acts = [bw.placeholder(f"saved_{k}") for k in range(8)]
    tangent = bw.placeholder("tangents_1")
    for p in param_names:
        bw.gather(ph_name[p], size_of[p])
    wb = {p: bw.waits[ph_name[p]] for p in param_names}
    grads: dict[str, torch.fx.Node] = {}

    def act():
        return acts[rng.randrange(len(acts))]

    def reduce(p, grad):
        grads[p] = bw.grad_reduce(grad, pn[p], p)

    def linear_bw(g, layer, name):
        wname, bname = f"{layer}_{name}_w", f"{layer}_{name}_b"
        gx = bw.use(aten.mm.default, (g, wb[wname]), [pn[wname]])
        gt = bw.op(aten.t.default, (g,), time=0.0, size=0)
        reduce(wname, bw.op(aten.mm.default, (gt, act())))
        reduce(bname, bw.op(aten.sum.dim_IntList, (g, [0], True)))
        return gx

    def layer_norm_bw(g, wname, bname):
        value, tup = bw.use(aten.native_layer_norm_backward.default,
                            (g, act(), [8], act(), act(), wb[wname], wb[bname], [True, True, True]),
                            [pn[bname], pn[wname]], getitem=True)
        reduce(wname, bw.op(operator.getitem, (tup, 1), time=0.0))
        reduce(bname, bw.op(operator.getitem, (tup, 2), time=0.0))
        return value

    wte_t = bw.op(aten.t.default, (tangent,), time=0.0, size=0)
    wte_part = bw.op(aten.mm.default, (wte_t, act()))
    g = bw.use(aten.mm.default, (tangent, wb[head]), [pn[head]])
    g = layer_norm_bw(g, "lnf_w", "lnf_b")
    for i in reversed(range(n_layers)):
        layer = f"layers_{i}"
        gm = linear_bw(g, layer, "fc2")
        gm = bw.op(aten.gelu_backward.default, (gm, act()))
        gm = linear_bw(gm, layer, "fc1")
        gm = layer_norm_bw(gm, f"{layer}_ln2_w", f"{layer}_ln2_b")
        g = bw.op(aten.add.Tensor, (g, gm))
        ga = linear_bw(g, layer, "o")
        gv = bw.op(aten.mm.default, (act(), ga))
        gs = bw.op(aten._softmax_backward_data.default, (bw.op(aten.mm.default, (ga, act())), act(), -1,
                                                         torch.float32))
        gq = bw.op(aten.mm.default, (gs, act()))
        gk = bw.op(aten.mm.default, (gs, act()))
        gh = linear_bw(gq, layer, "q")
        gh = bw.op(aten.add.Tensor, (gh, linear_bw(gk, layer, "k")))
        gh = bw.op(aten.add.Tensor, (gh, linear_bw(gv, layer, "v")))
        gh = layer_norm_bw(gh, f"{layer}_ln1_w", f"{layer}_ln1_b")
        g = bw.op(aten.add.Tensor, (g, gh))
    emb = bw.op(aten.embedding_dense_backward.default, (g, act(), 50257, -1, False))
    if tied:
        reduce("wte", bw.op(aten.add.Tensor, (emb, wte_part)))
    else:
        reduce("wte", emb)
        reduce(head, wte_part)
    backward = bw.finish([grads[p] for p in param_names] + [None])
    return GraphPair(forward, backward)


# ---------------------------------------------------------------------------
# Mixture-of-experts stacks
# ---------------------------------------------------------------------------


def moe_graph(seed: int, *, kind: str = "forward", n_layers: int | None = None, n_experts: int | None = None,
              namespace: str = "dcsched", tie_prone: bool = True) -> torch.fx.Graph:
    """A random Mixtral-like stack: per layer attention, a router and ``n_experts`` parallel experts.

    Each expert is a SwiGLU MLP (three weights), all experts of a layer the
    same size: many same-size all-gathers that the experts can use in any
    order, beside a small router weight and norm weights. Sizes and costs are
    drawn from ``seed`` (``tie_prone`` as in :func:`random_graph`).

    >>> g = moe_graph(0, n_layers=2, n_experts=4)
    >>> sum(1 for n in g.nodes if n.name.startswith("allgather_ds_param"))
    38
    """
    if kind not in ("forward", "backward"):
        raise ValueError("kind must be 'forward' or 'backward'")
    rng = random.Random(seed)
    n_layers = n_layers if n_layers is not None else rng.randint(1, 3)
    n_experts = n_experts if n_experts is not None else rng.randint(2, 8)
    per_layer = ["attn_norm", "q", "k", "v", "o", "ffn_norm", "router"] + \
        [f"e{e}_{w}" for e in range(n_experts) for w in ("w1", "w3", "w2")]
    params = [f"l{i}_{p}" for i in range(n_layers) for p in per_layer]
    size = {}
    for i in range(n_layers):
        attn, expert = rng.choice((4096, 16384)), rng.choice((4096, 16384, 65536))
        for p in per_layer:
            size[f"l{i}_{p}"] = 1024 if "norm" in p or p == "router" else expert if p.startswith("e") else attn
    b = _Builder(rng, namespace, graph_id=0 if kind == "forward" else 1, tie_prone=tie_prone)
    ph = {p: f"primals_{k + 1}" for k, p in enumerate(params)}
    for k, p in enumerate(params):
        b.param(ph[p], k)
    acts = [b.placeholder(f"{'saved' if kind == 'backward' else 'input'}_{k}") for k in range(3)]
    for p in params:
        b.gather(ph[p], size[p])
    w = {p: b.waits[ph[p]] for p in params}

    def use(target, args, p):
        return b.use(target, args, [ph[p]])

    def reduce(p, grad):
        return b.grad_reduce(grad, ph[p], p)

    mm, mul, add = aten.mm.default, aten.mul.Tensor, aten.add.Tensor
    if kind == "forward":
        x, saved = acts[0], []
        for i in range(n_layers):
            h = use(mul, (x, w[f"l{i}_attn_norm"]), f"l{i}_attn_norm")
            q, k, v = (use(mm, (h, w[f"l{i}_{n}"]), f"l{i}_{n}") for n in "qkv")
            ctx = b.op(mm, (b.op(aten._softmax.default, (b.op(mm, (q, k)), -1, False)), v))
            x = b.op(add, (x, use(mm, (ctx, w[f"l{i}_o"]), f"l{i}_o")))
            h2 = use(mul, (x, w[f"l{i}_ffn_norm"]), f"l{i}_ffn_norm")
            probs = b.op(aten._softmax.default, (use(mm, (h2, w[f"l{i}_router"]), f"l{i}_router"), -1, False))
            top = b.op(aten.topk.default, (probs, 2))
            gates, idx = b.op(operator.getitem, (top, 0), time=0.0), b.op(operator.getitem, (top, 1), time=0.0)
            out = None
            for e in range(n_experts):
                xe = b.op(aten.index_select.default, (h2, 0, idx))
                gate = b.op(aten.silu.default, (use(mm, (xe, w[f"l{i}_e{e}_w1"]), f"l{i}_e{e}_w1"),))
                y = use(mm, (b.op(mul, (gate, use(mm, (xe, w[f"l{i}_e{e}_w3"]), f"l{i}_e{e}_w3"))),
                             w[f"l{i}_e{e}_w2"]), f"l{i}_e{e}_w2")
                y = b.op(mul, (y, gates))
                out = y if out is None else b.op(add, (out, y))
                saved.append(xe)
            x = b.op(add, (x, out))
            saved.extend((h, h2, probs))
        return b.finish([b.op(aten.sum.default, (x,))] + saved)

    g, grads = acts[0], []

    def act():
        return acts[rng.randrange(len(acts))]

    for i in reversed(range(n_layers)):
        gh2 = None
        for e in range(n_experts):
            gy = b.op(mul, (g, act()))
            gm = use(mm, (gy, w[f"l{i}_e{e}_w2"]), f"l{i}_e{e}_w2")
            grads.append(reduce(f"l{i}_e{e}_w2", b.op(mm, (act(), gy))))
            parts = []
            for n in ("w1", "w3"):
                ga = b.op(mul, (gm, act()))
                parts.append(use(mm, (ga, w[f"l{i}_e{e}_{n}"]), f"l{i}_e{e}_{n}"))
                grads.append(reduce(f"l{i}_e{e}_{n}", b.op(mm, (act(), ga))))
            ge = b.op(aten.index_add.default, (act(), 0, act(), b.op(add, tuple(parts))))
            gh2 = ge if gh2 is None else b.op(add, (gh2, ge))
        glog = b.op(mm, (g, act()))
        gh2 = b.op(add, (gh2, use(mm, (glog, w[f"l{i}_router"]), f"l{i}_router")))
        grads.append(reduce(f"l{i}_router", b.op(mm, (act(), glog))))
        for norm, inner in (("ffn_norm", None), ("attn_norm", "attn")):
            if inner:  # attention: o, then q, k and v, from the gradient after the MLP
                ga = use(mm, (g, w[f"l{i}_o"]), f"l{i}_o")
                grads.append(reduce(f"l{i}_o", b.op(mm, (act(), g))))
                gh2 = None
                for n in "qkv":
                    gn = b.op(mul, (ga, act()))
                    part = use(mm, (gn, w[f"l{i}_{n}"]), f"l{i}_{n}")
                    grads.append(reduce(f"l{i}_{n}", b.op(mm, (act(), gn))))
                    gh2 = part if gh2 is None else b.op(add, (gh2, part))
            gx = use(mul, (gh2, w[f"l{i}_{norm}"]), f"l{i}_{norm}")
            grads.append(reduce(f"l{i}_{norm}", b.op(aten.sum.dim_IntList, (b.op(mul, (gh2, act())), [0]))))
            g = b.op(add, (g, gx))
    return b.finish(grads + [None])


def graph_digest(graph: torch.fx.Graph) -> str:
    """A fingerprint of what the schedulers see: names, ops, inputs, costs (comm namespaces alike).

    Golden data stores it, so a changed generator or bundle cannot pass for the recorded one.

    >>> graph_digest(random_graph(0)) == graph_digest(random_graph(0, namespace="dc"))
    True
    """
    import hashlib

    from .nxview import input_nodes
    from .roles import qualified_name

    h = hashlib.sha256()
    for node in graph.nodes:
        target = qualified_name(node.target) if node.op == "call_function" else str(node.target)
        if target.startswith("dc."):
            target = "dcsched." + target[3:]
        ins = ",".join(n.name for n in input_nodes(node))
        h.update(f"{node.name}|{node.op}|{target}|{ins}|{node.meta.get('device_time')!r}|"
                 f"{node.meta.get('tensor_size')!r}\n".encode())
    return h.hexdigest()[:20]
