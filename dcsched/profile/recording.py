"""The recording TorchDynamo backend: AOT autograd traces a compiled module into forward and backward graphs.

:class:`RecordingBackend` stands in for a ``torch.compile`` backend: every compilation
of the module is traced by AOT autograd (views and narrowing casts of
parameters marked for recomputation before the joint graph is partitioned, as
DeepCompile does), and the first one whose backward gets compiled, a training
step, is kept in the module's :class:`Recorded`; the graphs still run
(eagerly). :mod:`dcsched.profile.assemble` turns what was recorded into a
bundle.

Split from :mod:`dcsched.profile.capture` (the entry points), as the project
keeps a module to one job and about 600 lines.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch
import torch.fx
import torch.nn as nn

from dcsched.bundle.saved_memory import SavedActivations
from dcsched.profile import checkpointing, saved_activations, zero3
from dcsched.graph.roles import is_aliasing
from dcsched.profile.meta_device import on_meta


def _mark_param_views_for_recompute(joint: torch.fx.Graph, param_positions: set[int]) -> None:
    """Tag views and narrowing casts of parameters (transitively) MUST_RECOMPUTE.

    The partitioner then recomputes them in the backward graph from the
    parameter, which ZeRO-3 re-gathers there, rather than saving a view of a
    gathered buffer that the forward frees.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    primals = [n for n in joint.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
    marked = {primals[i] for i in param_positions if i < len(primals)}
    for node in joint.nodes:
        # The min-cut partitioner wants every node in some checkpoint region.
        node.meta.setdefault("ac_graph_id", 1)
        if node.op != "call_function":
            continue
        if not (is_aliasing(node) or zero3.narrowing_cast_dtype(node) is not None):
            continue
        if any(isinstance(a, torch.fx.Node) and a in marked for a in node.args):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            # The partitioner saves a recomputed node that a later region's recomputed node reads: parameter
            # views get a region after all others, so none of them is saved (checkpointing.PARAM_VIEWS_REGION).
            node.meta["ac_graph_id"] = checkpointing.PARAM_VIEWS_REGION
            marked.add(node)


def _saved_for_backward(forward: torch.fx.GraphModule, unchecked: torch.fx.GraphModule | None, joint_inputs,
                        num_fwd_outputs: int, kwargs: dict) -> SavedActivations | None:
    """The bytes ``forward`` saves for the backward and, given ``unchecked`` (the joint graph without its
    checkpointed regions), the bytes its partitioning with no activation memory budget saves; None where that
    partitioning fails (a report figure is no reason to refuse a capture)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    saved = saved_activations.saved_bytes(forward.graph, num_fwd_outputs)
    if unchecked is None:
        return SavedActivations(saved)
    from torch._functorch import config as functorch_config
    try:
        with functorch_config.patch(activation_memory_budget=1.0):
            plain, _ = min_cut_rematerialization_partition(unchecked, joint_inputs,
                                                           num_fwd_outputs=num_fwd_outputs, **kwargs)
    except Exception:  # noqa: BLE001 (the partitioner raises what it likes; the capture goes on)
        return None
    return SavedActivations(saved, saved_activations.saved_bytes(plain.graph, num_fwd_outputs))


@dataclasses.dataclass
class _Graphs:
    """One compilation of a module: its inputs and, once compiled, its forward and backward graphs."""

    dynamo_inputs: list[Any]
    input_names: list[str]
    param_positions: dict[int, int]  # primal index -> ds_id
    num_fwd_outputs: int | None = None
    forward: torch.fx.GraphModule | None = None
    backward: torch.fx.GraphModule | None = None
    tangent_outputs: list[int] | None = None
    num_mutated: int = 0
    #: Forward input positions whose new values the forward returns (BatchNorm statistics), in output order.
    mutated_inputs: list[int] = dataclasses.field(default_factory=list)
    #: What the forward saves for the backward, and without its checkpointed regions (None: not known).
    saved: SavedActivations | None = None


@dataclasses.dataclass
class Recorded:
    """A compiled module and the first of its compilations that has a backward (a training step)."""

    name: str
    module: nn.Module
    n_params: int
    step: _Graphs | None = None
    forward_only: bool = False
    #: The trainable parameters as the graph sees them (default: the module's own).
    params: list[tuple[str, torch.Tensor]] | None = None

    def trainable(self) -> list[tuple[str, torch.Tensor]]:
        return self.params if self.params is not None else trainable_params(self.module)


def trainable_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


def _clean_input_name(name: str) -> str:
    """A readable name for a TorchDynamo placeholder.

    >>> _clean_input_name("L_self_modules_blocks_modules_0_buffers_cos_")
    'blocks.0.cos'
    >>> _clean_input_name("L_idx_")
    'idx'
    """
    name = name.removeprefix("L_").removeprefix("l_")
    name = name[:-1] if name.endswith("_") and len(name) > 1 else name
    if name.startswith("self_"):
        name = name.removeprefix("self_")
        for kind in ("modules", "buffers", "parameters"):
            name = name.replace(f"_{kind}_", ".")
            name = name.removeprefix(f"{kind}_")
    return name


class RecordingBackend:
    """A TorchDynamo backend: AOT autograd with recording compilers; the graphs still run (eagerly).

    Every compilation is traced; the first one whose backward gets compiled (a
    training step, not an evaluation under no_grad) is kept.
    """

    def __init__(self, record: Recorded, on_backward: Callable[[Recorded], None], eager_backward: bool = False,
                 trace_device: torch.device | None = None):
        self.record = record
        self.on_backward = on_backward
        #: Compile the backward right away instead of at its first run (capture without running a step).
        self.eager_backward = eager_backward
        #: profile --meta: the script's tensors are meta tensors claiming this device when traced
        #: (:func:`_meta_claims`); AOT autograd traces with it as the default device, and the compiled
        #: graphs run on the meta device (:func:`on_meta`).
        self.trace_device = trace_device

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        record = self.record
        ds_ids = {id(p): i for i, (_, p) in enumerate(record.trainable())}
        owned = {id(t): name for name, t in (*record.module.named_buffers(), *record.module.named_parameters(),
                                             *record.trainable())}
        placeholders = [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"]
        graphs = _Graphs(
            dynamo_inputs=list(example_inputs),
            input_names=[owned.get(id(x), _clean_input_name(name)) for x, name in zip(example_inputs, placeholders)],
            param_positions={i: ds_ids[id(x)] for i, x in enumerate(example_inputs)
                             if isinstance(x, torch.Tensor) and id(x) in ds_ids},
        )

        def partition(joint, joint_inputs, *, num_fwd_outputs, **kwargs):
            _mark_param_views_for_recompute(joint.graph, set(graphs.param_positions))
            checkpointing.save_random_ops(joint.graph)
            graphs.num_fwd_outputs = num_fwd_outputs
            unchecked = (saved_activations.without_checkpointing(joint)
                         if saved_activations.checkpoints(joint.graph) else None)
            fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                                         **kwargs)
            checkpointing.unwrap_rng_replays(fw, bw)
            graphs.saved = _saved_for_backward(fw, unchecked, joint_inputs, num_fwd_outputs, kwargs)
            return fw, bw

        def runnable(gm: torch.fx.GraphModule):
            """What runs the traced graph on the script's tensors (on the meta device, under --meta)."""
            return make_boxed_func((gm if self.trace_device is None else on_meta(gm)).forward)

        def forward_compiler(fw: torch.fx.GraphModule, _inputs):
            graphs.forward = fw
            graphs.mutated_inputs, graphs.tangent_outputs = _output_layout()
            graphs.num_mutated = len(graphs.mutated_inputs)
            return runnable(fw)

        def inference_compiler(fw: torch.fx.GraphModule, _inputs):
            record.forward_only = True
            return runnable(fw)

        def backward_compiler(bw: torch.fx.GraphModule, _inputs):
            kept = record.step is None
            if kept:
                graphs.backward = bw
                record.step = graphs
            run = runnable(bw)

            def run_then_maybe_stop(args):
                out = run(args)
                if kept:
                    self.on_backward(record)
                return out

            run_then_maybe_stop._boxed_call = True  # type: ignore[attr-defined]  # AOT's flag for boxed calls
            return run_then_maybe_stop

        from torch._functorch import config as functorch_config
        # Under --meta the inputs claim trace_device when made fake (_meta_claims), and so do the tensors
        # AOT autograd's decompositions make without naming a device.
        device = self.trace_device if self.trace_device is not None else contextlib.nullcontext()
        # The partitioner replays recomputed random ops through the CPU's generator-state ops, which
        # checkpointing.unwrap_rng_replays undoes where they draw nothing (CUDA's graph-safe form has no such undo).
        with functorch_config.patch(force_non_lazy_backward_lowering=self.eager_backward,
                                    graphsafe_rng_functionalization=False), device:
            return aot_module_simplified(gm, example_inputs, fw_compiler=forward_compiler,
                                         bw_compiler=backward_compiler, inference_compiler=inference_compiler,
                                         partition_fn=partition)


def _output_layout() -> tuple[list[int], list[int] | None]:
    """(the inputs whose new values the forward returns, which user outputs get tangents).

    AOT autograd's forward returns mutated inputs' new values first, then the
    module's outputs; read from its metadata (absent in some torch versions:
    then no mutations and tangents in output order are assumed).
    """
    try:
        from torch._guards import TracingContext
        meta = TracingContext.get().fw_metadata
        return ([int(i) for i in meta.mutated_inp_runtime_indices],
                [i for i, info in enumerate(meta.output_info) if info.requires_grad])
    except Exception:
        return [], None
