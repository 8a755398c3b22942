"""The simulator on hand-built graphs whose figures are worked out by hand (in the comments),
plus invariants on random ZeRO-3-like graphs and random valid orders."""

from __future__ import annotations

import random

import pytest
import torch
import torch.fx
from hypothesis import given, settings
from hypothesis import strategies as st

import dcsched
from dcsched.runtime import ops
from dcsched.errors import GraphError
from dcsched.graph.nxview import to_networkx
from dcsched.sim.simulate import CompiledGraph, simulate

import oracle
from strategies import random_topological_order

aten = torch.ops.aten


class G:
    """Builds DeepCompile-style graphs: names as DeepCompile writes them, costs in meta."""

    def __init__(self, graph_id: int = 0, namespace=None):
        self.g = torch.fx.Graph()
        self.graph_id = graph_id
        self.ops = namespace or ops

    def node(self, name, target, args, time, size):
        node = self.g.create_node("call_function", target, tuple(args), {}, name=name)
        node.meta.update(device_time=time, tensor_size=size)
        return node

    def input(self, name, size):
        node = self.g.placeholder(name)
        node.meta["tensor_size"] = size
        return node

    def gather(self, shard, ds_id, time, size):
        ag = self.node(f"allgather_ds_param_{shard.name}_{ds_id}", self.ops.allgather_param,
                       (shard, self.graph_id, ds_id), time, size)
        wait = self.node(f"wait_allgather_ds_param__{shard.name}_{ds_id}", self.ops.wait_allgather,
                         (ag, self.graph_id, ds_id), 0.0, size)
        return ag, wait

    def mm(self, name, a, b, time, size):
        return self.node(name, aten.mm.default, (a, b), time, size)

    def release(self, use, shard, ds_id, n_users):
        return self.node(f"release_ds_param_{shard.name}_{use.name}_{ds_id}", self.ops.release_param,
                         (use, self.graph_id, ds_id, n_users), 0.0, use.meta["tensor_size"])

    def reduce(self, grad, param_name, ds_id, time, size):
        return self.node(f"reduce_ds_param_{param_name}", self.ops.reduce_grad, (grad, self.graph_id, ds_id),
                         time, size)

    def output(self, *values):
        self.g.output(tuple(values))
        return self.g


def two_layer_forward():
    """w0, w1 shards (10 B each), x (40 B); gathers 2 ms / 100 B each; mm 3 ms / 40 B each."""
    b = G()
    w0, w1, x = b.input("w0", 10), b.input("w1", 10), b.input("x", 40)
    ag0, wait0 = b.gather(w0, 0, 2.0, 100)
    ag1, wait1 = b.gather(w1, 1, 2.0, 100)
    mm0 = b.mm("mm0", x, wait0, 3.0, 40)
    rel0 = b.release(mm0, w0, 0, 1)
    mm1 = b.mm("mm1", rel0, wait1, 3.0, 40)
    rel1 = b.release(mm1, w1, 1, 1)
    return b.output(rel1)


def names(graph):
    return [n.name for n in graph.nodes]


# ---------------------------------------------------------------------------
# Hand-worked figures
# ---------------------------------------------------------------------------

def test_forward_input_order_all_gathers_first():
    g = two_layer_forward()
    r = dcsched.simulate(g)
    # Memory: inputs resident 10 + 10 + 40 = 60.
    #   ag0 +100 -> 160 (gathered 100); ag1 +100 -> 260 (gathered 200, the gathered peak)
    #   mm0 +40 -> 300 (the peak); x's last reader is mm0 -> 260
    #   release of w0 (its 1st of n_users=1) frees ag0 -> 160
    #   mm1 +40 -> 200; mm0's storage (read through its release) last read by mm1 -> 160
    #   release of w1 frees ag1 -> 60
    assert r.resident_bytes == 60
    assert (r.peak_bytes, r.peak_node) == (300, "mm0")
    assert (r.gathered_peak_bytes, r.gathered_peak_node) == (200, "allgather_ds_param_w1_1")
    assert r.memory == [60, 60, 60, 160, 160, 260, 260, 300, 260, 200, 160, 60]
    assert r.gathered_memory[names(g).index("mm1")] == 100
    # Time: ag0 runs 0-2; wait0 blocks compute until 2, so the program reaches ag1 only at 2: it runs 2-4;
    # wait1 blocks until 4; mm0 4-7; mm1 7-10. step 10; compute 6; comm 4; exposed 10 - 6 = 4 (all of it);
    # overlap 0 %.
    assert r.step_ms == 10.0
    assert (r.compute_ms, r.comm_ms, r.exposed_comm_ms, r.overlap_pct) == (6.0, 4.0, 4.0, 0.0)
    # Bounds: max(6, 4) = 6; the critical path ag0 (2) -> mm0 (3) -> mm1 (3) = 8, so the tight bound is 8.
    assert r.lower_bound_ms == 6.0
    assert r.tight_lower_bound_ms == 8.0


def test_forward_prefetch_overlaps_half():
    g = two_layer_forward()
    order = ["w0", "w1", "x", "allgather_ds_param_w0_0", "allgather_ds_param_w1_1", "wait_allgather_ds_param__w0_0",
             "mm0", "release_ds_param_w0_mm0_0", "wait_allgather_ds_param__w1_1", "mm1",
             "release_ds_param_w1_mm1_1", "output"]
    r = simulate(g, order)
    # Both gathers issued at 0: ag0 0-2, ag1 2-4. wait0 blocks until 2; mm0 2-5; wait1 finds ag1 done (4);
    # mm1 5-8. step 8 = the tight bound; exposed 8 - 6 = 2; overlap (4 - 2) / 4 = 50 %.
    assert (r.step_ms, r.exposed_comm_ms, r.overlap_pct) == (8.0, 2.0, 50.0)
    assert r.step_ms == r.tight_lower_bound_ms
    # Memory as with the input order: both gathered buffers live during mm0 (60 + 200 + 40 = 300).
    assert (r.peak_bytes, r.gathered_peak_bytes) == (300, 200)


def test_forward_gather_just_in_time():
    g = two_layer_forward()
    order = ["w0", "w1", "x", "allgather_ds_param_w0_0", "wait_allgather_ds_param__w0_0", "mm0",
             "release_ds_param_w0_mm0_0", "allgather_ds_param_w1_1", "wait_allgather_ds_param__w1_1", "mm1",
             "release_ds_param_w1_mm1_1", "output"]
    r = dcsched.simulate(to_networkx(g), order)
    # Memory: 60; ag0 160; mm0 200 (peak); x freed 160; rel0 frees ag0 60; ag1 160; mm1 200; mm0 freed 160;
    # rel1 frees ag1 60. Gathered never above 100.
    assert (r.peak_bytes, r.peak_node) == (200, "mm0")
    assert (r.gathered_peak_bytes, r.gathered_peak_node) == (100, "allgather_ds_param_w0_0")
    # Time: ag0 0-2; mm0 waits, 2-5; ag1 issued at 5 (the program reaches it then), 5-7; mm1 7-10.
    # step 10; exposed 10 - 6 = 4 = all communication; overlap 0 %.
    assert (r.step_ms, r.exposed_comm_ms, r.overlap_pct) == (10.0, 4.0, 0.0)
    lifetimes = {p.ds_id: p for p in r.params}
    assert (lifetimes[1].gather_index, lifetimes[1].free_index) == (7, 10)
    assert (lifetimes[1].issued_ms, lifetimes[1].ready_ms, lifetimes[1].freed_ms) == (5.0, 7.0, 10.0)
    assert lifetimes[1].held_ms == 5.0 and lifetimes[1].held_nodes == 3


def test_compute_without_parameters_hides_communication():
    b = G()
    w0, x = b.input("w0", 10), b.input("x", 40)
    ag0, wait0 = b.gather(w0, 0, 4.0, 100)
    pre = b.node("relu", aten.relu.default, (x,), 5.0, 40)   # needs no parameter
    mm0 = b.mm("mm0", pre, wait0, 3.0, 40)
    rel0 = b.release(mm0, w0, 0, 1)
    g = b.output(rel0)
    # In the input order the wait comes right after its gather: compute idles 0-4, relu 4-9, mm0 9-12.
    r = simulate(g)
    assert (r.step_ms, r.exposed_comm_ms, r.overlap_pct) == (12.0, 4.0, 0.0)
    order = ["w0", "x", "allgather_ds_param_w0_0", "relu", "wait_allgather_ds_param__w0_0", "mm0",
             "release_ds_param_w0_mm0_0", "output"]
    r = simulate(g, order)
    # ag0 0-4 on the comm stream while relu runs 0-5; the wait then finds the gather done: mm0 5-8.
    # step 8 = compute 8; exposed 0; overlap 100 %.
    assert (r.step_ms, r.exposed_comm_ms, r.overlap_pct) == (8.0, 0.0, 100.0)
    # Memory: 50 resident; ag0 150; relu 190; x freed 150; mm0 190 (first reached at relu); relu freed 150.
    assert (r.peak_bytes, r.peak_node) == (190, "relu")
    # Bounds: compute 8 >= comm 4; critical path relu 5 + mm0 3 = 8.
    assert r.lower_bound_ms == 8.0 and r.tight_lower_bound_ms == 8.0


def backward_graph():
    """Weight gradient gw = mm(g, a) reduced; input gradient gx = mm(g, gathered w)."""
    b = G(graph_id=1)
    w, a, g = b.input("w", 10), b.input("a", 30), b.input("tangents_1", 20)
    ag, wait = b.gather(w, 0, 2.0, 100)
    gw = b.mm("gw", g, a, 4.0, 100)
    red = b.reduce(gw, "layer_weight", 0, 3.0, 25)
    gx = b.mm("gx", g, wait, 4.0, 30)
    rel = b.release(gx, w, 0, 1)
    return b.output(red, rel)


def test_backward_reduce_frees_gradient_and_uses_comm_stream():
    g = backward_graph()
    r = simulate(g)
    # Memory: resident 10 + 30 + 20 = 60; ag +100 -> 160; gw +100 -> 260 (peak); a freed -> 230;
    # reduce +25 -> 255, the gradient gw freed at its reduce -> 155; gx +30 -> 185; g freed -> 165;
    # release frees the gathered w -> 65.
    assert (r.peak_bytes, r.peak_node) == (260, "gw")
    assert r.memory == [60, 60, 60, 160, 160, 260, 255, 185, 165, 65]  # while each node runs, before frees
    # Time: ag 0-2; the wait blocks compute until 2; gw 2-6; reduce issued at 6, runs 6-9; gx 6-10.
    # step max(10, 9) = 10; compute 8, comm 5, exposed 2, overlap 3/5 = 60 %.
    assert (r.step_ms, r.compute_ms, r.comm_ms, r.exposed_comm_ms) == (10.0, 8.0, 5.0, 2.0)
    assert r.overlap_pct == pytest.approx(60.0)
    # Bounds: max(8, 5) = 8. Tighter: critical path gw 4 + reduce 3 = 7; first gather 2 + dependent
    # compute gx 4 = 6; comm from 0 (5) + shortest tail (0 after the reduce) = 5. So 8.
    assert r.lower_bound_ms == 8.0 and r.tight_lower_bound_ms == 8.0


def test_backward_better_order_reaches_the_bound():
    g = backward_graph()
    order = ["w", "a", "tangents_1", "allgather_ds_param_w_0", "gw", "reduce_ds_param_layer_weight",
             "wait_allgather_ds_param__w_0", "gx", "release_ds_param_w_gx_0", "output"]
    r = simulate(g, order)
    # ag 0-2 while gw runs 0-4; reduce issued at 4 runs 4-7; the wait finds the gather done; gx 4-8.
    # step 8 = compute: nothing exposed.
    assert (r.step_ms, r.exposed_comm_ms, r.overlap_pct) == (8.0, 0.0, 100.0)
    assert r.peak_bytes == 260


def test_gathered_buffer_freed_at_last_release_whatever_views_remain():
    b = G()
    w, x = b.input("w", 10), b.input("x", 40)
    ag, wait = b.gather(w, 0, 1.0, 100)
    wt = b.node("t", aten.t.default, (wait,), 0.0, 100)         # a view of the gathered parameter
    mm1 = b.mm("mm1", x, wt, 1.0, 40)
    rel1 = b.release(mm1, w, 0, 2)                               # 1st of 2: frees nothing
    mm2 = b.mm("mm2", rel1, wt, 1.0, 40)
    rel2 = b.release(mm2, w, 0, 2)                               # 2nd of 2: frees the buffer
    late = b.node("late", aten.clone.default, (wt,), 1.0, 100)    # still reads the view afterwards
    g = b.output(rel2, late)
    r = simulate(g)
    mem = dict(zip(r.order, r.memory))
    gathered = dict(zip(r.order, r.gathered_memory))
    # 50 resident; ag 150; t is a view: 150; mm1 190, x freed 150; rel1 150 (buffer kept);
    # mm2 190, mm1 freed 150; rel2 150 then frees the 100 B buffer -> 50; late +100 -> 150.
    assert mem["release_ds_param_w_mm1_0"] == 150 and gathered["release_ds_param_w_mm1_0"] == 100
    assert gathered["late"] == 0 and mem["late"] == 150
    lifetime, = r.params
    # gathered at position 2, freed at position 8 (w, x, ag, wait, t, mm1, rel1, mm2, rel2)
    assert (lifetime.free_node, lifetime.held_nodes) == ("release_ds_param_w_mm2_0", 6)


def test_getitems_of_a_multi_output_op_die_separately():
    b = G()
    w, x = b.input("w", 10), b.input("x", 40)
    ag, wait = b.gather(w, 0, 1.0, 100)
    stats = b.node("var_mean", aten.var_mean.correction, (x,), 1.0, 8)   # two outputs, 8 B together
    var = b.node("getitem", __import__("operator").getitem, (stats, 0), 0.0, 4)
    mean = b.node("getitem_1", __import__("operator").getitem, (stats, 1), 0.0, 4)
    use_var = b.node("neg", aten.neg.default, (var,), 1.0, 4)
    mm = b.mm("mm", x, wait, 1.0, 40)
    rel = b.release(mm, w, 0, 1)
    use_mean = b.node("neg_1", aten.neg.default, (mean,), 1.0, 4)  # keeps only mean's 4 B alive until here
    g = b.output(rel, use_var, use_mean)
    r = simulate(g)
    mem = dict(zip(r.order, r.memory))
    # 50; ag 150; var_mean 158; getitems allocate nothing; neg 162, then var (its last reader
    # is neg, the tuple died at getitem_1) freed -> 158; mm 198; x freed -> 158; release frees the
    # gather -> 58; neg_1 +4 -> 62, then mean freed -> 58.
    assert mem["var_mean"] == 158 and mem["getitem_1"] == 158 and mem["neg"] == 162
    assert mem["mm"] == 198 and r.peak_bytes == 198
    assert mem["neg_1"] == 62
    assert r.memory[-1] == 58  # at the output: w 10 + neg 4 + neg_1 4 + mm 40


def group_norm_block(getitem_sizes=(400, 4, 4)):
    """The ConvNet case: a group norm's big output dies after its reader while its small saved
    statistics live to the output (through detaches). w shard 10 B, gathered 100 B; x 400 B."""
    getitem = __import__("operator").getitem
    b = G()
    w, x = b.input("w", 10), b.input("x", 400)
    ag, wait = b.gather(w, 0, 1.0, 100)
    conv = b.mm("convolution", x, wait, 1.0, 400)
    rel = b.release(conv, w, 0, 1)
    norm = b.node("native_group_norm", aten.native_group_norm.default, (rel, None, None, 1, 4, 25, 1, 1e-5),
                  1.0, 408)                                             # out 400 + mean 4 + rstd 4
    out, mean, rstd = (b.node(name, getitem, (norm, k), 0.0, size)
                       for k, (name, size) in enumerate(zip(("getitem", "getitem_1", "getitem_2"), getitem_sizes)))
    saved_mean = b.node("detach", aten.detach.default, (mean,), 0.0, 4)
    saved_rstd = b.node("detach_1", aten.detach.default, (rstd,), 0.0, 4)
    relu = b.node("relu", aten.relu.default, (out,), 1.0, 400)
    relu_1 = b.node("relu_1", aten.relu.default, (relu,), 1.0, 400)
    return b.output(relu_1, saved_mean, saved_rstd)


def test_multi_output_op_frees_each_output_after_its_own_readers():
    r = simulate(group_norm_block())
    mem = dict(zip(r.order, r.memory))
    # resident 410 (w 10 + x 400); ag 510; convolution 910 (the peak), x freed -> 510; the release
    # frees the gathered 100 -> 410; group norm +408 -> 818, convolution's 400 freed -> 418;
    # getitems and detaches allocate nothing; the tuple dies at getitem_2 (its 0 B remainder);
    # relu +400 -> 818, then getitem's 400 freed (its last reader) -> 418; relu_1 818, relu freed
    # -> 418; at the output: w 10 + relu_1 400 + mean 4 + rstd 4 = 418.
    assert mem["convolution"] == 910 and r.peak_bytes == 910 and r.peak_node == "convolution"
    assert mem["native_group_norm"] == 818 and mem["detach_1"] == 418
    assert mem["relu"] == 818 and mem["relu_1"] == 818 and r.memory[-1] == 418
    # (Counting the group norm as one storage kept its 408 B to the end: relu_1 at 1218 B.)


def test_multi_output_op_without_figures_for_its_getitems_lives_as_one_storage():
    # getitem figures that add up to more than the op's own are not trusted: the 408 B of the
    # group norm live as one storage until its last getitem's last reader (the output).
    r = simulate(group_norm_block(getitem_sizes=(400, 400, 400)))
    mem = dict(zip(r.order, r.memory))
    # as above up to relu (818, nothing freed), relu_1 1218, relu freed -> 818.
    assert mem["relu"] == 818 and mem["relu_1"] == 1218 and r.peak_bytes == 1218
    assert r.memory[-1] == 818


def test_unsafe_view_allocates_nothing():
    b = G()
    w, x = b.input("w", 10), b.input("x", 40)
    ag, wait = b.gather(w, 0, 1.0, 100)
    mm = b.mm("mm", x, wait, 1.0, 40)
    rel = b.release(mm, w, 0, 1)
    # AOT autograd reshapes a matmul's result with _unsafe_view: a view whose schema declares no alias.
    unsafe = b.node("_unsafe_view", aten._unsafe_view.default, (rel, [2, 20]), 0.0, 40)
    neg = b.node("neg", aten.neg.default, (unsafe,), 1.0, 40)
    r = simulate(b.output(neg))
    mem = dict(zip(r.order, r.memory))
    # 50; ag 150; mm 190, x freed -> 150; release frees the gather -> 50; _unsafe_view lives in mm's
    # storage: 50; neg +40 -> 90, then mm's storage freed -> 50.
    assert mem["_unsafe_view"] == 50 and mem["neg"] == 90 and r.peak_bytes == 190


def test_memory_series_equals_live_tensor_bytes_of_a_real_run():
    """A small aten graph with a multi-output op, views and _unsafe_view, run for real by an FX
    interpreter that frees each value after its last use (as replay's generated code does), under
    the live-bytes tracker: the simulated memory while each node runs is exact."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dcsched.runtime.memtrack import LiveBytes

    def forward(x, w):
        h = torch.mm(x, w)                                                     # 16x32
        norm, mean, rstd = aten.native_group_norm.default(h.view(16, 32, 1), None, None, 16, 32, 1, 4, 1e-5)
        y = aten._unsafe_view.default(torch.relu(norm), [16, 32])
        return torch.mm(y, w.t()).sum(), mean.detach(), rstd.detach()

    def inputs():
        gen = torch.Generator().manual_seed(0)
        return [torch.randn(16, 8, generator=gen), torch.randn(8, 32, generator=gen)]

    gm = make_fx(forward)(*inputs())
    sizes = {}

    class Record(torch.fx.Interpreter):
        def run_node(self, node):
            value = super().run_node(node)
            flat = value if isinstance(value, (tuple, list)) else (value,)
            sizes[node.name] = sum(v.numel() * v.element_size() for v in flat if isinstance(v, torch.Tensor))
            return value

    Record(gm).run(*inputs())
    for node in gm.graph.nodes:
        node.meta.update(tensor_size=sizes.get(node.name, 0), device_time=0.0)
    measured = {}

    class Trace(torch.fx.Interpreter):
        def run_node(self, node):
            tracker.reset_peak()
            value = super().run_node(node)
            measured[node.name] = tracker.peak      # outputs included, before the frees after the node
            return value

    with LiveBytes() as tracker:
        args = inputs()
        tracker.track(args)
        Trace(gm).boxed_run(args)                   # empties args: inputs die after their last reader
    r = simulate(gm.graph)
    simulated = {name: mem for name, mem in zip(r.order, r.memory) if name in measured}
    assert {n.target for n in gm.graph.nodes} >= {aten.native_group_norm.default, aten._unsafe_view.default}
    assert simulated == measured and len(measured) > 10
    assert r.peak_bytes == max(measured.values())


# ---------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------

def test_missing_costs_name_the_nodes_unless_assume_zero():
    g = two_layer_forward()
    mm0 = next(n for n in g.nodes if n.name == "mm0")
    del mm0.meta["device_time"]
    with pytest.raises(GraphError, match=r"no device_time on 1 node \(mm0\).*assume_zero=True"):
        simulate(g, name="forward")
    r = simulate(g, assume_zero=True)
    assert r.compute_ms == 3.0


def test_negative_cost_is_refused():
    g = two_layer_forward()
    next(n for n in g.nodes if n.name == "mm1").meta["tensor_size"] = -1
    with pytest.raises(GraphError, match=r"negative.*mm1"):
        simulate(g, assume_zero=True)


def test_non_numeric_cost_is_refused():
    g = two_layer_forward()
    next(n for n in g.nodes if n.name == "mm0").meta["device_time"] = "fast"
    with pytest.raises(GraphError, match=r"non-numeric.*mm0 device_time='fast'"):
        simulate(g)


@pytest.mark.parametrize("value", [float("nan"), True, -0.5])
def test_nan_bool_and_negative_figures_are_refused(value):
    # Every other figure is a plain number: the check's fast path must still see the one bad value.
    g = two_layer_forward()
    next(n for n in g.nodes if n.name == "mm1").meta["device_time"] = value
    with pytest.raises(GraphError, match=r"mm1 device_time="):
        simulate(g)


def test_cycle_is_refused():
    view = to_networkx(two_layer_forward())
    view.add_edge("mm1", "mm0")
    with pytest.raises(GraphError, match="cycle"):
        simulate(view)


def test_invalid_order_is_refused():
    g = two_layer_forward()
    order = names(g)
    order[7], order[9] = order[9], order[7]  # mm1 before mm0
    with pytest.raises(GraphError, match="before its input"):
        simulate(g, order)
    with pytest.raises(GraphError):
        simulate(g, order[:-1])


# ---------------------------------------------------------------------------
# Invariants on random ZeRO-3-like graphs and random valid orders
# ---------------------------------------------------------------------------

def random_zero3_graph(seed: int, n_params: int, n_compute: int, backward: bool) -> torch.fx.Graph:
    """A DeepCompile-shaped DAG: gathers at the head, each use of a parameter followed by its release,
    optional gradients reduced."""
    rng = random.Random(seed)
    b = G(graph_id=int(backward))
    shards = [b.input(f"primals_{i}", rng.randint(0, 50)) for i in range(n_params)]
    x = b.input("x", rng.randint(1, 100))
    uses = {i: 0 for i in range(n_params)}
    plan = []
    for _ in range(n_compute):
        param = rng.randrange(n_params) if rng.random() < 0.6 else None
        if param is not None:
            uses[param] += 1
        plan.append(param)
    waits = {}
    for i, shard in enumerate(shards):
        if uses[i]:
            _, waits[i] = b.gather(shard, i, rng.uniform(0, 4), rng.randint(1, 400))
    values = [x]
    sinks = set()
    for k, param in enumerate(plan):
        a = rng.choice(values[-4:])
        args = [a]
        if param is not None:
            args.append(waits[param])
        elif len(values) > 1 and rng.random() < 0.5:
            args.append(rng.choice(values))
        node = b.node(f"op_{k}", aten.add.Tensor, args[:2] if len(args) > 1 else (args[0], 1.0),
                      rng.uniform(0, 3), rng.randint(0, 200))
        for arg in args:
            sinks.discard(arg)
        if param is not None:
            node = b.release(node, shards[param], param, uses[param])
        if backward and rng.random() < 0.2:
            node_r = b.reduce(node, f"p{k}", 1000 + k, rng.uniform(0, 3), rng.randint(0, 50))
            sinks.add(node_r)
        values.append(node)
        sinks.add(node)
    return b.output(*sorted(sinks, key=lambda n: n.name))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), n_params=st.integers(1, 6), n_compute=st.integers(1, 25),
       backward=st.booleans(), order_seed=st.integers(0, 10**6))
def test_invariants_on_random_graphs_and_orders(seed, n_params, n_compute, backward, order_seed):
    g = random_zero3_graph(seed, n_params, n_compute, backward)
    view = to_networkx(g)
    compiled = CompiledGraph(view)
    order = random_topological_order(view, random.Random(order_seed))
    r = compiled.simulate(order)
    eps = 1e-9
    # No order beats the lower bounds; the streams never idle together, so step <= compute + comm.
    assert r.lower_bound_ms <= r.tight_lower_bound_ms + eps
    assert r.tight_lower_bound_ms <= r.step_ms + eps
    assert r.step_ms <= r.compute_ms + r.comm_ms + eps
    assert 0.0 <= r.exposed_comm_ms <= r.comm_ms + eps
    assert 0.0 <= r.overlap_pct <= 100.0
    # Memory: never below the resident shards, peaks are the series' maxima, gathered <= all.
    assert r.peak_bytes == max(r.memory) and r.gathered_peak_bytes == max(r.gathered_memory)
    assert all(gm <= m for gm, m in zip(r.gathered_memory, r.memory))
    shards = sum(view.nodes[v]["tensor_size"] or 0 for v in view
                 if view.nodes[v]["role"] == "placeholder" and v != "x")
    assert min(r.memory) >= shards
    # Every gathered buffer is freed, by its last release, after its gather.
    for p in r.params:
        assert p.free_node is not None and p.free_node.startswith("release_ds_param")
        assert p.free_index > p.gather_index and p.freed_ms >= p.ready_ms >= p.issued_ms
    # Times are consistent per stream.
    assert all(e >= s for s, e in zip(r.start_ms, r.end_ms))
    # The fast path gives the same figures.
    assert compiled.simulate(order, detail=False).figures() == r.figures()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), n_params=st.integers(1, 6), n_compute=st.integers(1, 25),
       backward=st.booleans(), order_seed=st.integers(0, 10**6), fractional=st.booleans())
def test_simulation_equals_the_literal_node_by_node_loop(seed, n_params, n_compute, backward, order_seed,
                                                         fractional):
    """The simulator sums bytes at C speed when every figure is an int and skips nodes that move no
    clock when it records no series; figure for figure it gives what one literal loop gives (fractional
    byte figures take the node-by-node path)."""
    g = random_zero3_graph(seed, n_params, n_compute, backward)
    if fractional:
        for node in g.nodes:
            if node.meta.get("tensor_size"):
                node.meta["tensor_size"] += 0.1
    view = to_networkx(g)
    compiled = CompiledGraph(view)
    assert compiled.integral_sizes is not fractional
    idx = compiled.order_indices(random_topological_order(view, random.Random(order_seed)))
    expected = oracle.simulate_oracle(compiled, idx)
    result, free = compiled.simulate_with_frees(idx, detail="series")
    assert free == expected["free"] == compiled.free_positions(idx)
    assert (result.memory, result.gathered_memory) == (expected["memory"], expected["gathered"])
    assert (result.reach_ms, result.start_ms, result.end_ms) == (expected["reach"], expected["start"], expected["end"])
    assert result.step_ms == expected["step"]
    assert result.peak_bytes == max([compiled.resident_bytes] + expected["memory"])
    assert result.peak_node == compiled.names[idx[expected["memory"].index(max(expected["memory"]))]]
    assert compiled.simulate_with_frees(idx, detail=False)[0].figures() == result.figures()
    clocks = compiled.clocks(idx)
    assert (clocks.step_ms, clocks.reach_ms, clocks.start_ms, clocks.end_ms, clocks.indices) == \
        (result.step_ms, result.reach_ms, result.start_ms, result.end_ms, idx)
