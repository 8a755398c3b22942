"""GPT-like layered stacks of any depth, forward and backward, for benchmarks."""

from __future__ import annotations

import dataclasses
import operator
import random

import torch
import torch.fx

from dcsched.synthetic.builder import GraphBuilder, GraphPair

aten = torch.ops.aten

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

    >>> pair = layered_stack(1, tied=False)
    >>> sum(1 for n in pair.backward.nodes if n.name.startswith("reduce_ds_param"))
    20
    """
    rng = random.Random(seed)
    params = _StackParams.of(n_layers, tied)
    forward = _StackForward(GraphBuilder(rng, namespace, graph_id=0, tie_prone=False), params).build()
    backward = _StackBackward(GraphBuilder(rng, namespace, graph_id=1, tie_prone=False), params).build()
    return GraphPair(forward, backward)


@dataclasses.dataclass(frozen=True)
class _StackParams:
    """The stack's parameters: names in ds-id order, placeholder names, sizes, the LM head's weight."""

    n_layers: int
    tied: bool
    names: list[str]
    head: str
    placeholder: dict[str, str]
    size: dict[str, int]

    @classmethod
    def of(cls, n_layers: int, tied: bool) -> _StackParams:
        names = ["wte"] + [f"layers_{i}_{p}" for i in range(n_layers) for p in _LAYER_PARAMS] + ["lnf_w", "lnf_b"]
        head = "wte" if tied else "lm_head"
        if not tied:
            names.append(head)
        size = {p: (4096 if p.endswith("_b") else 65536 if "fc" in p else 16384) for p in names}
        size["wte"] = size[head] = 262144
        return cls(n_layers, tied, names, head, {p: f"primals_{i + 1}" for i, p in enumerate(names)}, size)

    def declare(self, b: GraphBuilder) -> None:
        """The parameter placeholders, in ds-id order (call before the other placeholders' gathers)."""
        for ds_id, p in enumerate(self.names):
            b.param(self.placeholder[p], ds_id, self.size[p])

    def gather_all(self, b: GraphBuilder) -> dict[str, torch.fx.Node]:
        """Gathers every parameter; returns each one's wait node by parameter name."""
        for p in self.names:
            b.gather(self.placeholder[p], self.size[p])
        return {p: b.waits[self.placeholder[p]] for p in self.names}


class _StackForward:
    def __init__(self, b: GraphBuilder, params: _StackParams):
        self.b, self.p = b, params
        self.saved: list[torch.fx.Node] = []

    def linear(self, x, layer, name):
        pn, weight, bias = self.p.placeholder, f"{layer}_{name}_w", f"{layer}_{name}_b"
        wt = self.b.op(aten.t.default, (self.w[weight],), time=0.0, size=0)
        return self.b.use(aten.addmm.default, (self.w[bias], x, wt), [pn[bias], pn[weight]])

    def layer_norm(self, x, wname, bname):
        pn = self.p.placeholder
        value, tup = self.b.use(aten.native_layer_norm.default, (x, [8], self.w[wname], self.w[bname], 1e-5),
                                [pn[bname], pn[wname]], getitem=True)
        self.saved.append(self.b.op(operator.getitem, (tup, 1), time=0.0))
        self.saved.append(self.b.op(operator.getitem, (tup, 2), time=0.0))
        return value

    def layer(self, x, layer):
        f, saved = self.b, self.saved
        saved.append(x)
        h = self.layer_norm(x, f"{layer}_ln1_w", f"{layer}_ln1_b")
        q, k, v = (self.linear(h, layer, n) for n in ("q", "k", "v"))
        kt = f.op(aten.t.default, (k,), time=0.0, size=0)
        attn = f.op(aten._softmax.default, (f.op(aten.mm.default, (q, kt)), -1, False))
        ctx = f.op(aten.mm.default, (attn, v))
        saved.extend((q, k, v, attn, ctx))
        x = f.op(aten.add.Tensor, (x, self.linear(ctx, layer, "o")))
        saved.append(x)
        a = self.linear(self.layer_norm(x, f"{layer}_ln2_w", f"{layer}_ln2_b"), layer, "fc1")
        g = f.op(aten.gelu.default, (a,))
        saved.extend((a, g))
        return f.op(aten.add.Tensor, (x, self.linear(g, layer, "fc2")))

    def build(self) -> torch.fx.Graph:
        f, p = self.b, self.p
        p.declare(f)
        ids = f.placeholder(f"primals_{len(p.names) + 1}")
        self.w = p.gather_all(f)
        x = f.use(aten.embedding.default, (self.w["wte"], ids), [p.placeholder["wte"]])
        for i in range(p.n_layers):
            x = self.layer(x, f"layers_{i}")
        h = self.layer_norm(x, "lnf_w", "lnf_b")
        head_t = f.op(aten.t.default, (self.w[p.head],), time=0.0, size=0)
        logits = f.use(aten.mm.default, (h, head_t), [p.placeholder[p.head]])
        return f.finish([f.op(aten.sum.default, (logits,)), h] + self.saved)


class _StackBackward:
    """Reversed layers, each weight read once more for the input gradient; saved activations drawn at random."""

    def __init__(self, b: GraphBuilder, params: _StackParams):
        self.b, self.p = b, params
        self.grads: dict[str, torch.fx.Node] = {}

    def act(self):
        return self.acts[self.b.rng.randrange(len(self.acts))]

    def reduce(self, p, grad):
        self.grads[p] = self.b.grad_reduce(grad, self.p.placeholder[p], p)

    def linear_bw(self, g, layer, name):
        bw, pn = self.b, self.p.placeholder
        wname, bname = f"{layer}_{name}_w", f"{layer}_{name}_b"
        gx = bw.use(aten.mm.default, (g, self.w[wname]), [pn[wname]])
        gt = bw.op(aten.t.default, (g,), time=0.0, size=0)
        self.reduce(wname, bw.op(aten.mm.default, (gt, self.act())))
        self.reduce(bname, bw.op(aten.sum.dim_IntList, (g, [0], True)))
        return gx

    def layer_norm_bw(self, g, wname, bname):
        bw, pn, act = self.b, self.p.placeholder, self.act
        value, tup = bw.use(aten.native_layer_norm_backward.default,
                            (g, act(), [8], act(), act(), self.w[wname], self.w[bname], [True, True, True]),
                            [pn[bname], pn[wname]], getitem=True)
        self.reduce(wname, bw.op(operator.getitem, (tup, 1), time=0.0))
        self.reduce(bname, bw.op(operator.getitem, (tup, 2), time=0.0))
        return value

    def layer(self, g, layer):
        bw, act = self.b, self.act
        gm = self.linear_bw(g, layer, "fc2")
        gm = bw.op(aten.gelu_backward.default, (gm, act()))
        gm = self.linear_bw(gm, layer, "fc1")
        gm = self.layer_norm_bw(gm, f"{layer}_ln2_w", f"{layer}_ln2_b")
        g = bw.op(aten.add.Tensor, (g, gm))
        ga = self.linear_bw(g, layer, "o")
        gv = bw.op(aten.mm.default, (act(), ga))
        gs = bw.op(aten._softmax_backward_data.default, (bw.op(aten.mm.default, (ga, act())), act(), -1,
                                                         torch.float32))
        gq = bw.op(aten.mm.default, (gs, act()))
        gk = bw.op(aten.mm.default, (gs, act()))
        gh = self.linear_bw(gq, layer, "q")
        gh = bw.op(aten.add.Tensor, (gh, self.linear_bw(gk, layer, "k")))
        gh = bw.op(aten.add.Tensor, (gh, self.linear_bw(gv, layer, "v")))
        gh = self.layer_norm_bw(gh, f"{layer}_ln1_w", f"{layer}_ln1_b")
        return bw.op(aten.add.Tensor, (g, gh))

    def build(self) -> torch.fx.Graph:
        bw, p = self.b, self.p
        p.declare(bw)
        self.acts = [bw.placeholder(f"saved_{k}") for k in range(8)]
        tangent = bw.placeholder("tangents_1")
        self.w = p.gather_all(bw)
        head_t = bw.op(aten.t.default, (tangent,), time=0.0, size=0)
        head_part = bw.op(aten.mm.default, (head_t, self.act()))
        g = bw.use(aten.mm.default, (tangent, self.w[p.head]), [p.placeholder[p.head]])
        g = self.layer_norm_bw(g, "lnf_w", "lnf_b")
        for i in reversed(range(p.n_layers)):
            g = self.layer(g, f"layers_{i}")
        emb = bw.op(aten.embedding_dense_backward.default, (g, self.act(), 50257, -1, False))
        if p.tied:
            self.reduce("wte", bw.op(aten.add.Tensor, (emb, head_part)))
        else:
            self.reduce("wte", emb)
            self.reduce(p.head, head_part)
        return bw.finish([self.grads[name] for name in p.names] + [None])
