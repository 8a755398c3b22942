"""fast-free builds each candidate's path about once: the nodes its paths hold add up to O(N), not O(N^2).

Not a timing: the count of path nodes built is what made a tied 1,100-layer stack take 45 s instead of
0.7 s when tie losers whose paths the winner invalidates were cached anyway.
"""

from __future__ import annotations

import pytest

from dcsched.graphform import GraphForm
from dcsched.schedulers.fast_free import FastFreeRun, fast_free_indices
from dcsched.stacking import stack_copies
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
