"""Inputs whose tensor_size is 0 (as DeepSpeed 0.19.8 records on every placeholder) are sized from their value."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.fx.passes.shape_prop import TensorMetadata

import dcsched
from dcsched.graph.nxview import copy_graph
from dcsched.report.compare import compare_bundle
from dcsched.sim.simulate import CompiledGraph
from dcsched.graph.specs import input_size, node_specs

SAMPLE = Path(__file__).resolve().parent.parent / "sample_graphs" / "gpt.pt"
pytestmark = pytest.mark.skipif(not SAMPLE.exists(), reason="no sample_graphs/gpt.pt")


def _deepspeed_style(graph: torch.fx.Graph, value: str) -> torch.fx.Graph:
    """A copy of ``graph`` whose inputs record tensor_size 0 and carry their value as DeepSpeed's graphs do.

    ``value``: 'val' (a meta tensor), 'tensor_meta' (FX shape propagation's record) or 'none'.
    """
    copy = copy_graph(graph)
    for node in copy.nodes:
        if node.op != "placeholder":
            continue
        specs = node_specs(node)
        node.meta.pop("out", None)
        node.meta["tensor_size"] = 0
        if value == "val":
            node.meta["val"] = torch.empty(specs[0][0], dtype=specs[0][1], device="meta")
        elif value == "tensor_meta":
            node.meta["tensor_meta"] = TensorMetadata(torch.Size(specs[0][0]), specs[0][1], False, (), None, False,
                                                      {})
    return copy


@pytest.fixture(scope="module")
def gpt():
    return dcsched.load(SAMPLE)


def _shards(graph: torch.fx.Graph) -> list[str]:
    return [n.name for n in graph.nodes if n.op == "placeholder"
            and any(u.target == dcsched.runtime.ops.allgather_param for u in n.users)]


@pytest.mark.parametrize("value", ["val", "tensor_meta"])
def test_sizes_from_values_give_the_real_peak(gpt, value):
    for graph in (gpt.forward, gpt.backward):
        derived = _deepspeed_style(graph, value)
        # Parameter shards stay unsized (their value has the whole parameter's shape): the real sizes are
        # those of every other input, and the shards' 0 (they add the same constant to every order).
        shards = _shards(graph)
        real_graph = copy_graph(graph)
        for node in real_graph.nodes:
            if node.name in shards:
                node.meta["tensor_size"] = 0
        real = dcsched.simulate(real_graph, detail=False)
        assert CompiledGraph(derived).unsized_inputs == shards
        assert dcsched.simulate(derived, detail=False).peak_bytes == real.peak_bytes
        assert dcsched.simulate(dcsched.to_networkx(derived), detail=False).peak_bytes == real.peak_bytes
        sizes = {n.name: n.meta["tensor_size"] for n in graph.nodes if n.op == "placeholder" and n.name not in shards}
        assert {n.name: input_size(n) for n in derived.nodes
                if n.op == "placeholder" and n.name not in shards} == sizes
        assert sum(sizes.values()) > 0


def test_inputs_without_any_size_are_counted(gpt):
    bare = _deepspeed_style(gpt.backward, "none")
    inputs = [n.name for n in bare.nodes if n.op == "placeholder"]
    compiled = CompiledGraph(bare)
    assert compiled.unsized_inputs == inputs
    real = dcsched.simulate(gpt.backward, detail=False).peak_bytes
    assert dcsched.simulate(bare, detail=False).peak_bytes < real  # the saved activations weigh nothing
    data = compare_bundle(gpt.with_graphs(backward=bare), ["list"]).to_dict()
    assert data["graphs"]["backward"]["unsized_inputs"] == len(inputs)
    assert data["graphs"]["forward"]["unsized_inputs"] == 0


def test_a_symbolic_or_non_tensor_input_is_zero_not_unsized():
    x = torch.fx.Graph().placeholder("n")
    x.meta.update(tensor_size=0, val=7)  # an int input (a SymInt's value)
    assert input_size(x) == 0
