"""Lower bounds of ``dcsched.sim.bounds``: valid for every order, and exact on hand-built graphs.

``budget_bound(compiled, B)`` claims that no order whose gathered memory stays
within ``B`` bytes has a shorter simulated step. The property tests check that
claim on random ZeRO-3-like graphs against random topological orders and
``overlap``'s orders (each measured against its own gathered peak as ``B``);
the hand-built graph checks the arithmetic of the proof's two cases.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dcsched.sim.bounds import budget_bound, ends_bound, max_selection, through_comm_bound, tight_bound
from dcsched.graph.form import PLACEHOLDER
from dcsched.graph.nxview import to_networkx
from dcsched.schedulers.overlap.scheduler import Overlap
from dcsched.sim.simulate import compile_view
from dcsched.synthetic import random_graph
from scheduling import scheduled

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
    orders += [scheduled(name, view) for name in ("fast-free", "simple-prefetch")]
    for order in orders:
        result = c.simulate(order, detail=False)
        assert result.step_ms >= budget_bound(c, result.gathered_peak_bytes) - EPS
        # And the budget-free bounds hold too.
        assert result.step_ms >= through_comm_bound(c) - EPS
        assert result.step_ms >= ends_bound(c) - EPS
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
        orders += [scheduled("fast-free", view)]
        ends = ends_bound(c)
        for order in orders:
            result = c.simulate(order, detail=False)
            bound = budget_bound(c, result.gathered_peak_bytes)
            assert result.step_ms >= bound - EPS, (seed, order)
            assert result.step_ms >= ends - EPS, (seed, order)
            binding += bound > c.compute_ms + EPS
    assert binding >= 20  # the bound is not vacuous on these graphs


@settings(max_examples=60, deadline=None)
@given(graph=arbitrary_dags(), seed=st.integers(0, 2**31))
def test_budget_bound_holds_with_zero3_ops_wired_anywhere(graph, seed):
    view = to_networkx(graph)
    c = compile_view(view)
    rng = random.Random(seed)
    ends = ends_bound(c)
    for _ in range(5):
        result = c.simulate(random_topological_order(view, rng), detail=False)
        assert result.step_ms >= budget_bound(c, result.gathered_peak_bytes) - EPS
        assert result.step_ms >= ends - EPS


# ---------------------------------------------------------------------------
# ends_bound: the start and the end of the step (issue 11, item 4)
# ---------------------------------------------------------------------------

def every_order(c, cap: int = 100_000) -> list[list[int]] | None:
    """Every topological order of ``c`` (node numbers; placeholders first, in input order); None past ``cap``."""
    n = len(c)
    missing = [len(set(c.preds[i])) for i in range(n)]
    placed = [False] * n
    order: list[int] = []
    found: list[list[int]] = []

    def place(i, step):
        placed[i] = step > 0
        for s in set(c.succs[i]):
            missing[s] -= step

    def extend():
        if len(order) == n:
            found.append(list(order))
            return
        for i in range(n):
            if not placed[i] and not missing[i] and len(found) <= cap:
                place(i, 1)
                order.append(i)
                extend()
                order.pop()
                place(i, -1)

    for i in c.topo:
        if c.kind[i] == PLACEHOLDER:
            place(i, 1)
            order.append(i)
    extend()
    return found if len(found) <= cap else None


def best_step(c) -> float:
    """The shortest simulated step over every order of ``c``."""
    orders = every_order(c)
    assert orders is not None, "graph too large to enumerate"
    return min(c.simulate(order, detail=False, check=False).step_ms for order in orders)


def tied_tail():
    """The end of a backward graph: an LM head H, a layer W, an embedding E; H and E reduce 3 ms each.

    dh (H's weight gradient, 4 ms) needs no parameter, so it can run after de; then H's reduce
    ends last. Or it runs before de, and E's does: either way one 3 ms reduce follows all the
    compute that can come after it.
    """
    b = G(graph_id=1)
    h, g = b.input("h", 40), b.input("g", 40)
    wh, ww, _we = b.input("wh", 10), b.input("ww", 10), b.input("we", 10)
    _, wait_h = b.gather(wh, 0, 1.0, 100)
    dx_head = b.mm("dx_head", g, wait_h, 2.0, 40)
    rel_h = b.release(dx_head, wh, 0, 1)
    red_h = b.reduce(b.mm("dh", g, h, 4.0, 100), "wh", 0, 3.0, 100)
    _, wait_w = b.gather(ww, 1, 1.0, 100)
    rel_w = b.release(b.mm("dx", rel_h, wait_w, 2.0, 40), ww, 1, 1)
    red_w = b.reduce(b.mm("dw", rel_h, h, 1.0, 100), "ww", 1, 1.0, 100)
    red_e = b.reduce(b.mm("de", rel_w, h, 1.0, 100), "we", 2, 3.0, 100)
    return b.output(red_h, red_w, red_e)


def test_ends_bound_pairs_the_two_large_reduces():
    c = compile_view(to_networkx(tied_tail()))
    assert c.compute_ms == 10.0
    assert max(c.bounds.tight, through_comm_bound(c)) == 10.0  # the earlier bounds see no tail
    # Alone, E's reduce can have dh (4 ms of compute, 3 ms of reduce) after it: 10 + 3 - 1.
    # Paired with H's, one of the two is last after whatever can follow both (dw: 1 ms, 1 ms).
    assert ends_bound(c) == 13.0
    assert best_step(c) == 13.0


def conv_head():
    """The start of a ConvNet backward: loss (0.5 ms), fc (1 ms, 1 ms gather), norm (0.5 ms, 1 ms gather),
    conv (3 ms, 5 ms gather), conv's gradient reduced in 2 ms."""
    b = G(graph_id=1)
    g = b.input("g", 40)
    wf, wn, wc = b.input("wf", 10), b.input("wn", 1), b.input("wc", 50)
    loss = b.node("loss", aten.relu.default, (g,), 0.5, 40)
    _, wait_f = b.gather(wf, 0, 1.0, 100)
    _, wait_n = b.gather(wn, 1, 1.0, 10)
    _, wait_c = b.gather(wc, 2, 5.0, 500)
    fc = b.release(b.mm("fc", loss, wait_f, 1.0, 40), wf, 0, 1)
    norm = b.release(b.mm("norm", fc, wait_n, 0.5, 40), wn, 1, 1)
    conv = b.mm("conv", norm, wait_c, 3.0, 40)
    red_c = b.reduce(b.release(conv, wc, 2, 1), "wc", 2, 2.0, 500)
    return b.output(red_c)


def test_ends_bound_adds_head_idle_and_tail():
    c = compile_view(to_networkx(conv_head()))
    assert c.compute_ms == 5.0
    # conv starts once all three gathers (7 ms) ran, and only loss, fc and norm (2 ms) can run
    # before it: 5 ms idle; its reduce follows all the compute: 5 + 5 + 2. The earlier bounds see
    # the critical path (conv's gather, conv, its reduce: 10 ms).
    assert max(c.bounds.tight, through_comm_bound(c)) == 10.0
    assert ends_bound(c) == 12.0
    assert best_step(c) == 12.0


def test_ends_bound_is_exact_on_small_random_graphs():
    """No order of any small random ZeRO-3 graph beats it, and on these the tight bound is the optimum."""
    checked = 0
    for seed in (0, 2, 4, 6, 8, 9, 10):
        for kind in ("forward", "backward"):
            c = compile_view(to_networkx(random_graph(seed, kind=kind, n_params=1 + seed % 2, n_ops=2 + seed % 3)),
                             assume_zero=True)
            if every_order(c, cap=5_000) is None:
                continue
            best = best_step(c)
            assert ends_bound(c) <= best + EPS, (seed, kind)
            assert tight_bound(c) == pytest.approx(best), (seed, kind)
            checked += 1
    assert checked >= 10


def test_max_selection_against_every_subset():
    rng = random.Random(3)
    for _ in range(200):
        bits = rng.randint(1, 5)
        cost = [rng.choice([0.5, 1.0, 2.0, 3.0]) for _ in range(bits)]
        groups = {rng.randrange(1 << bits): rng.choice([0.5, 1.0, 2.5, 4.0]) for _ in range(rng.randint(1, 6))}
        items = list(groups.items())
        best = 0.0
        for chosen in range(1 << len(items)):
            union, gain = 0, 0.0
            for k, (mask, value) in enumerate(items):
                if (chosen >> k) & 1:
                    union, gain = union | mask, gain + value
            best = max(best, gain - sum(cost[b] for b in range(bits) if (union >> b) & 1))
        assert max_selection(groups, cost) == pytest.approx(best)
