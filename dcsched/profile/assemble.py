"""From a recorded step to a bundle: parameters, inputs, placeholder tables, the ZeRO-3 ops inserted.

:func:`build_capture` takes what :mod:`dcsched.profile.recording` kept of a training
step (its forward and backward graphs and the inputs they ran with), names
each placeholder (a parameter by ds_id, a step input, a saved tensor, a
tangent), inserts the ZeRO-3 ops (:mod:`dcsched.profile.zero3`) and returns
the :class:`Capture`: the :class:`~dcsched.bundle.core.Bundle` and the real
tensors. :class:`CaptureError` says why a step cannot be captured.

Split from :mod:`dcsched.profile.capture` (the entry points), as the project
keeps a module to one job and about 600 lines.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from dcsched.profile import zero3
from dcsched.bundle.core import Bundle, InputInfo, ParamInfo
from dcsched.errors import DcschedError
from dcsched.graph.nxview import copy_graph
from dcsched.profile.recording import Recorded

#: Step inputs up to this many bytes are stored in the bundle as tensors.
KEEP_INPUT_BYTES = 64 * 1024


class CaptureError(DcschedError):
    """The script or model cannot be captured; the message says why and how to fix it."""


@dataclasses.dataclass
class Capture:
    """A captured step: the bundle plus the real tensors it ran with (for profiling and tests)."""

    bundle: Bundle
    #: ds_id -> the parameter tensor itself.
    params: dict[int, torch.Tensor]
    #: The step's inputs, in ``bundle.inputs`` order.
    inputs: list[torch.Tensor]
    module_name: str
    #: Forward placeholder positions whose new values are the last user outputs (in that order): the
    #: caller copies them back into those inputs after each forward (BatchNorm's running statistics).
    mutated_inputs: list[int] = dataclasses.field(default_factory=list)


# ---------------------------------------------------------------------------
# From recorded graphs to a bundle
# ---------------------------------------------------------------------------


def _input_info(name: str, value: torch.Tensor) -> InputInfo:
    value = value.detach()
    if value.is_meta:  # planned without data (profile --meta): the shape and dtype are all there is
        return InputInfo(name, tuple(value.shape), value.dtype, None, None, None)
    nbytes = value.numel() * value.element_size()
    low = high = None
    if value.numel():
        as_number = value.to(torch.float64) if not value.is_complex() else value.abs().to(torch.float64)
        low, high = float(as_number.min()), float(as_number.max())
    kept = value.to("cpu", copy=True) if nbytes <= KEEP_INPUT_BYTES else None
    return InputInfo(name, tuple(value.shape), value.dtype, kept, low, high)


def _forward_inputs(record: Recorded, fw_placeholders: list[torch.fx.Node], params: list[ParamInfo]):
    """What each forward placeholder is (a parameter by ds_id, or a step input), with the inputs' infos and values."""
    step = record.step
    assert step is not None  # a step was recorded before its inputs are read
    positions = step.param_positions or {}
    param_nodes: list[zero3.ParamNode] = []
    forward_placeholders: list[dict] = []
    inputs: list[InputInfo] = []
    input_tensors: list[torch.Tensor] = []
    for i, node in enumerate(fw_placeholders):
        if i in positions:
            ds_id = positions[i]
            forward_placeholders.append({"kind": "param", "ds_id": ds_id})
            param_nodes.append(zero3.ParamNode(node.name, ds_id, params[ds_id].dtype))
            continue
        value = step.dynamo_inputs[i]
        if not isinstance(value, torch.Tensor):
            raise CaptureError(f"{record.name}: step input {i} is a {type(value).__name__}, not a tensor "
                               "(dcsched captures static shapes; pass tensors)")
        forward_placeholders.append({"kind": "input", "index": len(inputs)})
        inputs.append(_input_info(step.input_names[i] if step.input_names else f"input_{i}", value))
        input_tensors.append(value)
    return forward_placeholders, param_nodes, inputs, input_tensors


def _backward_inputs(record: Recorded, forward: torch.fx.Graph, backward: torch.fx.Graph, num_user: int) -> list[dict]:
    """What each backward placeholder is: a tensor the forward saved (by output index) or a tangent.

    Puts the forward's outputs in the bundle's order on the way (user outputs, then mutated inputs' new
    values, then the saved tensors).
    """
    step = record.step
    assert step is not None  # a step was recorded before its graphs are read
    output_node = next(n for n in reversed(forward.nodes) if n.op == "output")
    if step.num_mutated:
        # User outputs first (the loss at 0), then mutated inputs' new values (e.g. BatchNorm's running
        # statistics), then the saved tensors; all but the saved ones count as user outputs.
        outs, n_mut = list(output_node.args[0]), step.num_mutated
        output_node.args = (tuple(outs[n_mut:num_user] + outs[:n_mut] + outs[num_user:]),)
    saved_index: dict[str, int] = {}
    for i, value in enumerate(output_node.args[0]):
        if isinstance(value, torch.fx.Node) and i >= num_user:
            saved_index.setdefault(value.name, i)
    tangents = step.tangent_outputs
    backward_placeholders = []
    n_tangent = 0
    for node in backward.nodes:
        if node.op != "placeholder":
            continue
        if node.name in saved_index:
            backward_placeholders.append({"kind": "saved", "index": saved_index[node.name]})
        elif node.name.startswith("tangents"):
            index = tangents[n_tangent] if tangents and n_tangent < len(tangents) else n_tangent
            backward_placeholders.append({"kind": "tangent", "index": index})
            n_tangent += 1
        else:
            raise CaptureError(f"{record.name}: backward input {node.name} is neither saved by the forward nor a "
                               "tangent (unsupported capture; please report)")
    return backward_placeholders


def build_capture(record: Recorded, forward_graph_id: int = 0, backward_graph_id: int = 1) -> Capture:
    step = record.step
    if step is None or step.forward is None or step.backward is None:
        why = ("it only ran without gradients (under no_grad or inference mode)" if record.forward_only
               else "it never ran a backward pass")
        raise CaptureError(f"{record.name} has no training step to capture: {why}; call loss.backward() on a loss "
                           "computed from its output, with the model's parameters requiring grad")
    fw_gm, bw_gm = step.forward, step.backward
    forward = copy_graph(fw_gm.graph)
    backward = copy_graph(bw_gm.graph)

    trainable = record.trainable()
    fw_placeholders = [n for n in forward.nodes if n.op == "placeholder"]
    positions = step.param_positions or {}
    if len(fw_placeholders) != len(step.dynamo_inputs):
        raise CaptureError(f"{record.name}: the forward graph has {len(fw_placeholders)} inputs but the step had "
                           f"{len(step.dynamo_inputs)} (unsupported capture; please report)")

    params: list[ParamInfo] = []
    param_tensors: dict[int, torch.Tensor] = {}
    for ds_id, (name, p) in enumerate(trainable):
        params.append(ParamInfo(name, tuple(p.shape), p.dtype, ds_id))
        param_tensors[ds_id] = p
    forward_placeholders, param_nodes, inputs, input_tensors = _forward_inputs(record, fw_placeholders, params)
    num_user = step.num_fwd_outputs if step.num_fwd_outputs is not None else 1
    backward_placeholders = _backward_inputs(record, forward, backward, num_user)

    bw_out = next(n for n in reversed(backward.nodes) if n.op == "output").args[0]
    if len(bw_out) != len(fw_placeholders):
        raise CaptureError(f"{record.name}: the backward returns {len(bw_out)} gradients for "
                           f"{len(fw_placeholders)} forward inputs (unsupported capture; please report)")
    grad_index = {p.name: i for i, p in zip([i for i in range(len(fw_placeholders)) if i in positions], param_nodes)}

    constants = {str(node.target): getattr(gm, str(node.target)).detach().cpu()
                 for gm, graph in ((fw_gm, forward), (bw_gm, backward))
                 for node in graph.nodes if node.op == "get_attr"}
    forward = zero3.insert_forward(forward, param_nodes, forward_graph_id)
    backward = zero3.insert_backward(backward, param_nodes, grad_index, backward_graph_id)
    bundle = Bundle(
        forward=forward,
        backward=backward,
        params=params,
        inputs=inputs,
        forward_placeholders=forward_placeholders,
        backward_placeholders=backward_placeholders,
        num_user_outputs=num_user,
        graph_ids={"forward": forward_graph_id, "backward": backward_graph_id},
        constants=constants,
        provenance={"module": record.name, "torch": str(torch.__version__), "captured_by": "dcsched.capture",
                    **(step.saved.provenance() if step.saved is not None else {})},
    )
    return Capture(bundle, param_tensors, input_tensors, record.name, list(step.mutated_inputs))
