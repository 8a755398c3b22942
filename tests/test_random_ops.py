"""Random ops keep their stream: a reordered graph with dropout computes what the original did.

Each random op (dropout, rand_like, ...) draws the next numbers of the one global generator, so
swapping two of them swaps their numbers. The networkx view chains them with order-only edges
(dcsched.graph.nxview); these tests check the identification, that the chain costs no simulated memory,
and that captured dropout models replay bit for bit under every scheduler.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.fx

import dcsched
from dcsched import replay as rp
from dcsched.graph.nxview import to_networkx
from dcsched.graph.roles import is_random
from dcsched import reorder
from dcsched.sim.simulate import compile_view
from scheduling import scheduled as order_of

from bundles import _node
from dropout_models import DROPOUT_MODELS, captured, distinct, scheduled

aten = torch.ops.aten
ROOT = Path(__file__).resolve().parents[1]


def test_random_ops_are_known_by_their_schema_tag_and_arguments():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    q = g.placeholder("q")
    random = [g.call_function(target, args) for target, args in (
        (aten.native_dropout.default, (x, 0.1, True)), (aten.rand_like.default, (x,)),
        (aten.randn.default, ([2, 3],)), (aten.bernoulli.p, (x, 0.5)), (aten.randint.default, (10, [4])),
        (aten.uniform_.default, (x,)))]
    drawing_nothing = [
        g.call_function(aten.native_dropout.default, (x, 0.1, False)),  # eval mode
        g.call_function(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q)),  # dropout_p 0
        g.call_function(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q), {"dropout_p": 0.0}),
        g.call_function(aten.relu.default, (x,)), x]
    attention_dropout = g.call_function(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q, 0.1))
    assert all(is_random(n) for n in random + [attention_dropout])
    assert not any(is_random(n) for n in drawing_nothing)


def _two_branches(random_target, *extra):
    """x -> relu -> rand0 -> sum and x -> neg -> rand1 -> sum: two random ops nothing orders."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta.update(tensor_size=64)
    a = _node(g, aten.relu.default, (x,), "relu", size=1000)
    r0 = _node(g, random_target, (a, *extra), "rand0", size=1000)
    s0 = _node(g, aten.sum.default, (r0,), "sum0", size=4)
    b = _node(g, aten.neg.default, (x,), "neg", size=2000)
    r1 = _node(g, random_target, (b, *extra), "rand1", size=2000)
    s1 = _node(g, aten.sum.default, (r1,), "sum1", size=4)
    g.output((_node(g, aten.add.Tensor, (s0, s1), "add", size=4),))
    return g


@pytest.mark.parametrize("target, extra", [(aten.rand_like.default, ()), (aten.bernoulli.p, (0.5,))])
def test_view_chains_random_ops_with_an_order_only_edge_that_holds_no_memory(target, extra):
    graph = _two_branches(target, *extra)
    view = to_networkx(graph)
    assert view.graph["order_only_edges"] == [("rand0", "rand1")]
    assert view.edges["rand0", "rand1"]["order_only"]
    assert list(view.pred["rand1"]) == ["neg", "rand0"]  # data inputs first
    # rand0 dies after sum0, before rand1 runs: neg + rand1 + sum0 = 4004 bytes at rand1 (the
    # order-only edge, were it a read, would keep rand0's 1000 bytes alive until then).
    order = [n.name for n in graph.nodes]
    assert compile_view(view).simulate(order).peak_bytes == 2000 + 2000 + 4
    assert all(o.index("rand0") < o.index("rand1") for o in (reorder.order(graph, algo) for algo in
                                                            ("list", "simple-prefetch", "fast-free")))


def test_graphs_without_random_ops_get_no_edges():
    # The sample bundles' attention kernels are tagged random but run with dropout_p = 0.
    for path in sorted((ROOT / "tests" / "golden" / "bundles").glob("*.pt")):
        bundle = dcsched.load(path)
        for graph in (bundle.forward, bundle.backward):
            assert to_networkx(graph).graph["order_only_edges"] == [], path.name


@pytest.mark.parametrize("name", sorted(DROPOUT_MODELS))
def test_dropout_models_replay_bit_for_bit_under_every_scheduler(name):
    bundle = captured(name)
    random_ops = [n.name for n in bundle.forward.nodes if is_random(n)]
    assert len(random_ops) >= (7 if name == "t5" else 4)
    # The backward reuses the forward's masks: it draws nothing, so only the forward's order matters.
    assert not any(is_random(n) for n in bundle.backward.nodes)
    schedules = scheduled(bundle)
    for algo, reordered in schedules.items():
        assert [n.name for n in reordered.forward.nodes if n.name in set(random_ops)] == random_ops, algo
    base = rp.replay(bundle, iters=0, check_memory=False).results
    moved = distinct(schedules, bundle)
    assert len(moved) >= 2  # the schedulers did reorder the graphs, differently
    for algo, reordered in moved.items():
        assert rp.compare(base, rp.replay(reordered, iters=0, check_memory=False).results).exact, algo
    if name == "t5":  # and without the chain, fast-free would swap the decoder's dropouts before the encoder's
        view = to_networkx(bundle.forward)
        view.remove_edges_from(view.graph["order_only_edges"])
        order = order_of("fast-free", view)
        assert [n for n in order if n in set(random_ops)] != random_ops
