"""Lower bounds of ``dcsched.bounds``: valid for every order, and exact on hand-built graphs.

``budget_bound(compiled, B)`` claims that no order whose gathered memory stays
within ``B`` bytes has a shorter simulated step. The property tests check that
claim on random ZeRO-3-like graphs against random topological orders and
``overlap``'s orders (each measured against its own gathered peak as ``B``);
the hand-built graph checks the arithmetic of the proof's two cases.
"""

from __future__ import annotations

import math
import random

import torch
from hypothesis import given, settings, strategies as st

from dcsched.bounds import budget_bound, through_comm_bound
from dcsched.nxview import to_networkx
from dcsched.schedulers import get
from dcsched.schedulers.overlap import Overlap
from dcsched.simulate import compile_view
from dcsched.synthetic import random_graph

from strategies import arbitrary_dags, random_topological_order
from test_simulate import G

EPS = 1e-9
aten = torch.ops.aten


def conv_norm_conv(t_time: float = 2.0):
    """pre, then u reads W_u, then norm reads a small t, then v reads W_v (gathers 100 B, t 10 B).

    Compute: pre 20 ms (long enough to hide every gather before it), u 3 ms, norm 1 ms, v 3 ms
    (27 ms in all); W gathers 5 ms each.
    """
    b = G()
    x = b.node("pre", aten.relu.default, (b.input("x", 40),), 20.0, 40)
    wu, t, wv = b.input("wu", 10), b.input("t", 1), b.input("wv", 10)
    _, wait_u = b.gather(wu, 0, 5.0, 100)
    _, wait_t = b.gather(t, 1, t_time, 10)
    _, wait_v = b.gather(wv, 2, 5.0, 100)
    u = b.mm("u", x, wait_u, 3.0, 40)
    rel_u = b.release(u, wu, 0, 1)
    norm = b.mm("norm", rel_u, wait_t, 1.0, 40)
    rel_t = b.release(norm, t, 1, 1)
    v = b.mm("v", rel_t, wait_v, 3.0, 40)
    rel_v = b.release(v, wv, 2, 1)
    return b.output(rel_v)


def test_budget_bound_two_cases():
    c = compile_view(conv_norm_conv())
    assert c.compute_ms == 27.0
    # B = 200: W_u and W_v fill it, so t (2 ms) waits until u ends, or W_v (5 ms) does: the gap
    # between u and v is at least 2 ms (norm waits for t, v for norm: nothing fills it).
    assert budget_bound(c, 200) == 29.0
    # With t slower than W_v, the gap is W_v's 5 ms.
    assert budget_bound(compile_view(conv_norm_conv(t_time=6.0)), 200) == 27.0 + 5.0 - 1.0
    # With room for t beside both, nothing is forced.
    assert budget_bound(c, 210) == 27.0
    assert budget_bound(c, math.inf) == 27.0


def test_budget_bound_head():
    # Without pre, v cannot start before W_u, t and W_v have run one at a time (12 ms), and only u
    # and norm (4 ms) can run before it: 8 ms idle on top of 7 ms of compute, whatever the budget.
    b = G()
    x = b.input("x", 40)
    w = b.input("w", 10)
    _, wait = b.gather(w, 0, 5.0, 100)
    y = b.mm("y", x, wait, 3.0, 40)
    c = compile_view(b.output(b.release(y, w, 0, 1)))
    assert budget_bound(c, 100) == 3.0 + 5.0


def test_budget_bound_holds_for_every_order_of_the_hand_built_graph():
    graph = conv_norm_conv()
    view = to_networkx(graph)
    c = compile_view(view)
    rng = random.Random(0)
    for _ in range(300):
        result = c.simulate(random_topological_order(view, rng), detail=False)
        assert result.step_ms >= budget_bound(c, result.gathered_peak_bytes) - EPS


graphs = st.builds(lambda seed, kind, n_params: random_graph(seed, kind=kind, n_params=n_params),
                   st.integers(0, 10**6), st.sampled_from(["forward", "backward"]), st.integers(1, 10))


@settings(max_examples=40, deadline=None)
@given(graph=graphs, seed=st.integers(0, 2**31))
def test_budget_bound_never_exceeds_a_real_order(graph, seed):
    view = to_networkx(graph)
    c = compile_view(view, assume_zero=True)
    rng = random.Random(seed)
    orders = [random_topological_order(view, rng) for _ in range(4)]
    orders += [get(name)(view) for name in ("fast-free", "simple-prefetch")]
    for order in orders:
        result = c.simulate(order, detail=False)
        assert result.step_ms >= budget_bound(c, result.gathered_peak_bytes) - EPS
        # And the budget-free bounds hold too.
        assert result.step_ms >= through_comm_bound(c) - EPS
    for extra in (0.0, 0.5):
        scheduler = Overlap(view)
        budget = int(scheduler.min_budget() * (1 + extra))
        order, result = scheduler.plan(budget)
        assert result.step_ms >= budget_bound(c, result.gathered_peak_bytes) - EPS


def random_chain(seed: int):
    """ResNet-like blocks: a large gather -> conv, small gathers -> norm, sometimes a skip conv
    reading its own gathered weight beside them, or plain compute beside the chain; random costs."""
    rng = random.Random(seed)
    b = G()
    prev = b.input("x", 40)
    ds = iter(range(10**6))
    for i in range(rng.randint(2, 6)):
        block_in = prev
        w = b.input(f"w{i}", 10)
        d_w = next(ds)
        _, wait_w = b.gather(w, d_w, rng.uniform(1, 6), rng.randint(60, 100))
        conv = b.mm(f"conv{i}", prev, wait_w, rng.uniform(0.5, 6), 40)
        out = b.release(conv, w, d_w, 1)
        if rng.random() < 0.3:  # compute beside the chain, which can fill a gap
            out = b.mm(f"side{i}", out, out, rng.uniform(0.1, 2), 40)
        for j in range(rng.randint(1, 2)):  # a norm's weight (and bias)
            t = b.input(f"t{i}_{j}", 1)
            d_t = next(ds)
            _, wait_t = b.gather(t, d_t, rng.uniform(0.5, 3), rng.randint(1, 20))
            out = b.release(b.mm(f"norm{i}_{j}", out, wait_t, rng.uniform(0.1, 1), 40), t, d_t, 1)
        if rng.random() < 0.5:  # a skip conv with its own weight, added back
            s = b.input(f"s{i}", 5)
            d_s = next(ds)
            _, wait_s = b.gather(s, d_s, rng.uniform(0.5, 4), rng.randint(5, 50))
            skip = b.mm(f"skip{i}", block_in, wait_s, rng.uniform(0.2, 4), 40)
            skip = b.release(skip, s, d_s, 1)
            out = b.node(f"add{i}", aten.add.Tensor, (out, skip), rng.uniform(0.05, 0.5), 40)
        prev = out
    return b.output(prev)


def test_budget_bound_on_random_chains_is_valid_and_binds():
    binding = 0
    for seed in range(60):
        view = to_networkx(random_chain(seed))
        c = compile_view(view, assume_zero=True)
        scheduler = Overlap(view)
        rng = random.Random(seed)
        tight_budgets = [scheduler.min_budget(), 2 * scheduler.largest_gather]
        orders = [random_topological_order(view, rng) for _ in range(20)]
        orders += [scheduler.plan(max(b, scheduler.min_budget()))[0] for b in tight_budgets]
        orders += [get("fast-free")(view)]
        for order in orders:
            result = c.simulate(order, detail=False)
            bound = budget_bound(c, result.gathered_peak_bytes)
            assert result.step_ms >= bound - EPS, (seed, order)
            binding += bound > c.compute_ms + EPS
    assert binding >= 20  # the bound is not vacuous on these graphs


@settings(max_examples=60, deadline=None)
@given(graph=arbitrary_dags(), seed=st.integers(0, 2**31))
def test_budget_bound_holds_with_zero3_ops_wired_anywhere(graph, seed):
    view = to_networkx(graph)
    c = compile_view(view)
    rng = random.Random(seed)
    for _ in range(5):
        result = c.simulate(random_topological_order(view, rng), detail=False)
        assert result.step_ms >= budget_bound(c, result.gathered_peak_bytes) - EPS
