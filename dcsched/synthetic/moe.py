"""Random Mixtral-like stacks: attention, a router and many parallel same-size experts per layer."""

from __future__ import annotations

import operator
import random

import torch
import torch.fx

from dcsched.synthetic.builder import GraphBuilder

aten = torch.ops.aten
_MM, _MUL, _ADD = aten.mm.default, aten.mul.Tensor, aten.add.Tensor


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
    stack = _MoeStack(GraphBuilder(rng, namespace, graph_id=0 if kind == "forward" else 1, tie_prone=tie_prone),
                      n_layers, n_experts, kind)
    return stack.forward() if kind == "forward" else stack.backward()


class _MoeStack:
    """The parameters (drawn sizes), placeholders and gathers of one stack; ``forward``/``backward`` add the body."""

    def __init__(self, b: GraphBuilder, n_layers: int, n_experts: int, kind: str):
        rng = b.rng
        self.b, self.n_layers, self.n_experts = b, n_layers, n_experts
        per_layer = ["attn_norm", "q", "k", "v", "o", "ffn_norm", "router"] + \
            [f"e{e}_{w}" for e in range(n_experts) for w in ("w1", "w3", "w2")]
        params = [f"l{i}_{p}" for i in range(n_layers) for p in per_layer]
        size = {}
        for i in range(n_layers):
            attn, expert = rng.choice((4096, 16384)), rng.choice((4096, 16384, 65536))
            for p in per_layer:
                size[f"l{i}_{p}"] = 1024 if "norm" in p or p == "router" else expert if p.startswith("e") else attn
        self.ph = {p: f"primals_{k + 1}" for k, p in enumerate(params)}
        for k, p in enumerate(params):
            b.param(self.ph[p], k, size[p])
        self.acts = [b.placeholder(f"{'saved' if kind == 'backward' else 'input'}_{k}") for k in range(3)]
        for p in params:
            b.gather(self.ph[p], size[p])
        self.w = {p: b.waits[self.ph[p]] for p in params}

    def use(self, target, args, p):
        return self.b.use(target, args, [self.ph[p]])

    def reduce(self, p, grad):
        return self.b.grad_reduce(grad, self.ph[p], p)

    def act(self):
        return self.acts[self.b.rng.randrange(len(self.acts))]

    # -- forward -------------------------------------------------------------
    def forward(self) -> torch.fx.Graph:
        b, w, use = self.b, self.w, self.use
        x, saved = self.acts[0], list[torch.fx.Node]()
        for i in range(self.n_layers):
            h = use(_MUL, (x, w[f"l{i}_attn_norm"]), f"l{i}_attn_norm")
            q, k, v = (use(_MM, (h, w[f"l{i}_{n}"]), f"l{i}_{n}") for n in "qkv")
            ctx = b.op(_MM, (b.op(aten._softmax.default, (b.op(_MM, (q, k)), -1, False)), v))
            x = b.op(_ADD, (x, use(_MM, (ctx, w[f"l{i}_o"]), f"l{i}_o")))
            h2 = use(_MUL, (x, w[f"l{i}_ffn_norm"]), f"l{i}_ffn_norm")
            probs = b.op(aten._softmax.default, (use(_MM, (h2, w[f"l{i}_router"]), f"l{i}_router"), -1, False))
            x = b.op(_ADD, (x, self.experts_forward(i, h2, probs, saved)))
            saved.extend((h, h2, probs))
        return b.finish([b.op(aten.sum.default, (x,))] + saved)

    def experts_forward(self, i: int, h2, probs, saved: list) -> torch.fx.Node:
        """Top-2 routing, then every expert's SwiGLU on its selected rows, gated and summed."""
        b, w, use = self.b, self.w, self.use
        top = b.op(aten.topk.default, (probs, 2))
        gates, idx = b.op(operator.getitem, (top, 0), time=0.0), b.op(operator.getitem, (top, 1), time=0.0)
        out = None
        for e in range(self.n_experts):
            xe = b.op(aten.index_select.default, (h2, 0, idx))
            gate = b.op(aten.silu.default, (use(_MM, (xe, w[f"l{i}_e{e}_w1"]), f"l{i}_e{e}_w1"),))
            y = use(_MM, (b.op(_MUL, (gate, use(_MM, (xe, w[f"l{i}_e{e}_w3"]), f"l{i}_e{e}_w3"))),
                          w[f"l{i}_e{e}_w2"]), f"l{i}_e{e}_w2")
            y = b.op(_MUL, (y, gates))
            out = y if out is None else b.op(_ADD, (out, y))
            saved.append(xe)
        return out

    # -- backward ------------------------------------------------------------
    def backward(self) -> torch.fx.Graph:
        g, grads = self.acts[0], list[torch.fx.Node]()
        for i in reversed(range(self.n_layers)):
            gh2 = self.experts_backward(i, g, grads)
            g = self.attention_backward(i, g, gh2, grads)
        return self.b.finish(grads + [None])

    def experts_backward(self, i: int, g, grads: list) -> torch.fx.Node:
        """The experts' and the router's gradients; returns the gradient of the MLP's input."""
        b, w, use, act = self.b, self.w, self.use, self.act
        gh2 = None
        for e in range(self.n_experts):
            gy = b.op(_MUL, (g, act()))
            gm = use(_MM, (gy, w[f"l{i}_e{e}_w2"]), f"l{i}_e{e}_w2")
            grads.append(self.reduce(f"l{i}_e{e}_w2", b.op(_MM, (act(), gy))))
            parts = []
            for n in ("w1", "w3"):
                ga = b.op(_MUL, (gm, act()))
                parts.append(use(_MM, (ga, w[f"l{i}_e{e}_{n}"]), f"l{i}_e{e}_{n}"))
                grads.append(self.reduce(f"l{i}_e{e}_{n}", b.op(_MM, (act(), ga))))
            ge = b.op(aten.index_add.default, (act(), 0, act(), b.op(_ADD, tuple(parts))))
            gh2 = ge if gh2 is None else b.op(_ADD, (gh2, ge))
        glog = b.op(_MM, (g, act()))
        gh2 = b.op(_ADD, (gh2, use(_MM, (glog, w[f"l{i}_router"]), f"l{i}_router")))
        grads.append(self.reduce(f"l{i}_router", b.op(_MM, (act(), glog))))
        return gh2

    def attention_backward(self, i: int, g, gh2, grads: list) -> torch.fx.Node:
        """The two norms' and the attention weights' gradients; returns the layer input's gradient."""
        b, w, use, act = self.b, self.w, self.use, self.act
        for norm, inner in (("ffn_norm", None), ("attn_norm", "attn")):
            if inner:  # attention: o, then q, k and v, from the gradient after the MLP
                ga = use(_MM, (g, w[f"l{i}_o"]), f"l{i}_o")
                grads.append(self.reduce(f"l{i}_o", b.op(_MM, (act(), g))))
                gh2 = None
                for n in "qkv":
                    gn = b.op(_MUL, (ga, act()))
                    part = use(_MM, (gn, w[f"l{i}_{n}"]), f"l{i}_{n}")
                    grads.append(self.reduce(f"l{i}_{n}", b.op(_MM, (act(), gn))))
                    gh2 = part if gh2 is None else b.op(_ADD, (gh2, part))
            gx = use(_MUL, (gh2, w[f"l{i}_{norm}"]), f"l{i}_{norm}")
            grads.append(self.reduce(f"l{i}_{norm}", b.op(aten.sum.dim_IntList, (b.op(_MUL, (gh2, act())), [0]))))
            g = b.op(_ADD, (g, gx))
        return g
