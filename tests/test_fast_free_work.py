"""fast-free's work and memory grow linearly with the graph: counted, not timed.

Each candidate's path is built about once (the nodes its paths hold add up to O(N), not O(N^2): caching
tie losers whose paths the winner invalidates made a tied 1,100-layer stack take 45 s instead of 0.7 s),
and the all-gather sets it keeps per node take O(N) bytes (plain ints took O(N x all-gathers)).
"""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, strategies as st

from dcsched.graph.form import GraphForm
from dcsched.schedulers.fast_free.gather_sets import pack, packed_count, unpack
from dcsched.schedulers.fast_free.scheduler import FastFreeRun, fast_free_indices
from dcsched.synthetic.stacking import stack_copies
from dcsched.synthetic import layered_stack, moe_graph


class CountingRun(FastFreeRun):
    """fast-free, counting the nodes of every path it builds."""

    built = 0

    def _make_task(self, ag):
        task = super()._make_task(ag)
        self.built += len(task.path)
        return task


def path_nodes_built(graph) -> tuple[int, int]:
    form = GraphForm(graph)
    run = CountingRun(form)
    assert run.run() == fast_free_indices(form)  # counting changes nothing
    return run.built, len(form)


@pytest.mark.parametrize("tied", [True, False])
def test_layered_stacks_build_linear_paths(tied):
    # Tied embeddings: every candidate's path holds all the compute not yet run, so a tie loser's path
    # is invalidated by the winner's run; building it anyway was quadratic (24x N at 40 layers, 72x at 120).
    for n_layers in (40, 120):
        built, n = path_nodes_built(layered_stack(n_layers, tied=tied).forward)
        assert built <= 2 * n, (n_layers, built, n)


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_parallel_branches_build_linear_paths(kind):
    # Experts and stacked copies lose ties round after round on disjoint paths, which stay cached.
    built, n = path_nodes_built(moe_graph(0, kind=kind, n_layers=8, n_experts=16))
    assert built <= 2 * n
    built, n = path_nodes_built(stack_copies(getattr(layered_stack(2, tied=False), kind), 6))
    assert built <= 2 * n


@given(st.lists(st.integers(0, 6000), max_size=40), st.integers(0, 3000))
def test_packed_sets_round_trip(bits, prefix):
    value = (1 << prefix) - 1
    for b in bits:
        value |= 1 << b
    packed = pack(value)
    assert unpack(packed) == value
    assert packed_count(packed) == value.bit_count()


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_stored_sets_grow_linearly(tied, kind):
    # A dense run from bit 0, an all-gather's own high bit, a tied embedding's bit far above the rest:
    # each stored in full as a plain int, the sets' bytes per node grew with the depth.
    per_node = []
    for n_layers in (30, 240):
        run = FastFreeRun(GraphForm(getattr(layered_stack(n_layers, tied=tied), kind)))
        stored = [packed[2] for packed in (*run.anc.values(), *run.release_mask.values())]
        per_node.append(sum(map(sys.getsizeof, stored)) / len(run.g))
    assert per_node[1] <= 1.1 * per_node[0], per_node
