"""Capture one training step of a compiled module as forward and backward aten graphs.

Two entry points, one pipeline:

* :func:`capture` (Python): ``dcsched.capture(model, example_inputs, loss_fn=...)``
  compiles ``loss_fn(model(*example_inputs))`` and runs one forward and
  backward to capture it.
* :func:`capture_script`: runs a training script as ``__main__`` (:mod:`dcsched.profile.scripts`) with
  ``torch.compile`` intercepted and stops it after the first forward and
  backward of the compiled module (the largest one if it compiles several, or
  the one named by ``module``).

Either way the module is compiled full-graph (a graph break is an error naming
where it happened) by TorchDynamo and traced by AOT autograd into one forward
and one backward aten graph. Views and narrowing casts of parameters are marked
for recomputation before the joint graph is partitioned, so the backward
recomputes them from the (re-gathered) parameter instead of saving them, as
DeepCompile does. Then :mod:`dcsched.profile.zero3` inserts the ZeRO-3 ops and the
result is a :class:`~dcsched.bundle.core.Bundle` (not yet profiled: see
:mod:`dcsched.profile.measure`).

Parameters get ds_ids 0..P-1 in ``model.named_parameters()`` order (trainable
ones only; frozen parameters and buffers are step inputs).

>>> import torch
>>> model = torch.nn.Linear(4, 2)
>>> bundle = capture(model, (torch.randn(3, 4),), loss_fn=lambda out: out.sum())
>>> [p.name for p in bundle.params]
['weight', 'bias']
>>> bundle.forward_placeholders
[{'kind': 'param', 'ds_id': 0}, {'kind': 'param', 'ds_id': 1}, {'kind': 'input', 'index': 0}]
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx
import torch.nn as nn

from dcsched.profile import zero3
from dcsched.bundle.core import Bundle, InputInfo, ParamInfo
from dcsched.errors import DcschedError
from dcsched.graph.nxview import copy_graph
from dcsched.graph.roles import is_aliasing
from dcsched.runtime.step import on_device
from dcsched.profile.scripts import (ScriptError, StopScript, compile_interceptor, describe_exception, fresh_dynamo,
                                     run_script, unwrap_dynamo_error)

CPU = torch.device("cpu")
META = torch.device("meta")
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
# Compiling one module and recording its graphs
# ---------------------------------------------------------------------------


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
            marked.add(node)


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


@dataclasses.dataclass
class _Recorded:
    """A compiled module and the first of its compilations that has a backward (a training step)."""

    name: str
    module: nn.Module
    n_params: int
    step: _Graphs | None = None
    forward_only: bool = False
    #: The trainable parameters as the graph sees them (default: the module's own).
    params: list[tuple[str, torch.Tensor]] | None = None

    def trainable(self) -> list[tuple[str, torch.Tensor]]:
        return self.params if self.params is not None else _trainable(self.module)


def _trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
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


class _Backend:
    """A TorchDynamo backend: AOT autograd with recording compilers; the graphs still run (eagerly).

    Every compilation is traced; the first one whose backward gets compiled (a
    training step, not an evaluation under no_grad) is kept.
    """

    def __init__(self, record: _Recorded, on_backward: Callable[[_Recorded], None], eager_backward: bool = False,
                 trace_device: torch.device | None = None):
        self.record = record
        self.on_backward = on_backward
        #: Compile the backward right away instead of at its first run (capture without running a step).
        self.eager_backward = eager_backward
        #: profile --meta: the script's tensors are meta tensors claiming this device when traced
        #: (:func:`_meta_claims`); AOT autograd traces with it as the default device, and the compiled
        #: graphs run on the meta device (:func:`_on_meta`).
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
            graphs.num_fwd_outputs = num_fwd_outputs
            return min_cut_rematerialization_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                                       **kwargs)

        def runnable(gm: torch.fx.GraphModule):
            """What runs the traced graph on the script's tensors (on the meta device, under --meta)."""
            return make_boxed_func((gm if self.trace_device is None else _on_meta(gm)).forward)

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
        with functorch_config.patch(force_non_lazy_backward_lowering=self.eager_backward), device:
            return aot_module_simplified(gm, example_inputs, fw_compiler=forward_compiler,
                                         bw_compiler=backward_compiler, inference_compiler=inference_compiler,
                                         partition_fn=partition)


@contextlib.contextmanager
def _meta_claims(device: torch.device):
    """While open, a meta tensor made fake (TorchDynamo's and AOT autograd's tracing) claims ``device``.

    A fake tensor is a meta tensor that says which device it is on; TorchDynamo and AOT autograd trace
    with fake copies of the script's tensors, so with its meta tensors claiming ``device`` the graphs are
    those of a run on ``device``, from tensors that hold no data. Traced as meta tensors they were not:

    * the model's Python code tests the device before any tracing (Mixtral's auxiliary loss: ``histc`` in
      float32 on the CPU, int32 elsewhere; transformers' grouped-mm choice);
    * kernels choose by device: ``scaled_dot_product_attention`` takes the CPU's flash kernel on the CPU
      and the math path (the scores a tensor of the graph) on meta;
    * torch's Python dispatcher, on during AOT autograd's tracing, sends a composite op that has a Python
      meta kernel (``aten.nll_loss``: ``cross_entropy``) on a meta tensor to that kernel, below autograd, so
      the joint graph had no gradient of the loss (``nll_loss_backward``) and the partitioner saved other
      tensors for the backward.
    """
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConverter

    real_from_real_tensor = FakeTensorConverter.from_real_tensor

    class Claiming:
        def __init__(self, converter):
            self.converter = converter

        def __getattr__(self, name):
            return getattr(self.converter, name)

        def __call__(self, t, *args, callback, **kwargs):
            def claim(make_meta, **more):
                if torch.device(more.get("device", "meta")).type == "meta":
                    more["device"] = device
                return callback(make_meta, **more)
            return self.converter(t, *args, callback=claim, **kwargs)

    def from_real_tensor(self, fake_mode, t, *args, **kwargs):
        if isinstance(t, FakeTensor) or not (isinstance(t, torch.Tensor) and t.is_meta):
            return real_from_real_tensor(self, fake_mode, t, *args, **kwargs)
        converter = self.meta_converter
        self.meta_converter = Claiming(converter)
        try:
            return real_from_real_tensor(self, fake_mode, t, *args, **kwargs)
        finally:
            self.meta_converter = converter

    FakeTensorConverter.from_real_tensor = from_real_tensor
    try:
        yield
    finally:
        FakeTensorConverter.from_real_tensor = real_from_real_tensor


def _planning_device(traced_as: torch.device):
    """The script's default device under ``--meta``: meta when it runs, ``traced_as`` where TorchDynamo traces.

    A tensor the compiled code makes without naming a device (``torch.ones(n)``) is then made on the device
    the traced inputs claim (see :func:`_meta_claims`), as in a run there; the script itself, outside the
    compiled module, makes its model and inputs on the meta device.
    """
    from torch.utils._device import DeviceContext, _device_constructors

    class PlanningDevice(DeviceContext):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in _device_constructors() and kwargs.get("device") is None:
                kwargs["device"] = traced_as if torch.compiler.is_compiling() else self.device
            return func(*args, **kwargs)

    return PlanningDevice(META)


def _on_meta(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` that runs on meta tensors (the devices it names and its constants on meta)."""
    import copy

    from torch._subclasses.fake_tensor import unset_fake_temporarily
    graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:
        if node.op == "call_function":
            node.args, node.kwargs = on_device(node.args, META), on_device(node.kwargs, META)
    runnable = torch.fx.GraphModule(gm, graph)
    for node in graph.nodes:
        if node.op == "get_attr":
            owner, _, name = str(node.target).rpartition(".")
            module = runnable.get_submodule(owner) if owner else runnable
            value = getattr(module, name)
            if isinstance(value, torch.Tensor) and not value.is_meta:
                with unset_fake_temporarily():  # compiled while AOT autograd traces
                    setattr(module, name, value.to(META))
    return runnable


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


def _graph_break_message(exc: BaseException, module_name: str) -> str:
    where = None
    stack = getattr(exc, "real_stack", None)
    if stack:
        frame = stack[-1]
        where = f"{frame.filename}:{frame.lineno}"
    text = str(exc).strip().splitlines()
    reason = text[0] if text else type(exc).__name__
    if where is None:
        for line in text:
            line = line.strip()
            if line.startswith("File \"") and ", line " in line:
                where = line.split("File ", 1)[1].replace('"', "").replace(", line ", ":").split(",")[0]
    place = f" at {where}" if where else ""
    return (f"graph break in {module_name}{place}: {reason} (dcsched captures one full graph; "
            "make this code traceable by torch.compile(fullgraph=True))")


def _is_graph_break(exc: BaseException) -> bool:
    try:
        from torch._dynamo import exc as dynamo_exc
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, (dynamo_exc.Unsupported, dynamo_exc.UserError))


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


def _forward_inputs(record: _Recorded, fw_placeholders: list[torch.fx.Node], params: list[ParamInfo]):
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


def _backward_inputs(record: _Recorded, forward: torch.fx.Graph, backward: torch.fx.Graph, num_user: int) -> list[dict]:
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


def _build(record: _Recorded, forward_graph_id: int = 0, backward_graph_id: int = 1) -> Capture:
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
        provenance={"module": record.name, "torch": str(torch.__version__), "captured_by": "dcsched.capture"},
    )
    return Capture(bundle, param_tensors, input_tensors, record.name, list(step.mutated_inputs))


def capture_compiled(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], module: nn.Module,
                     params: Sequence[tuple[str, torch.Tensor]], name: str | None = None) -> Capture:
    """Capture a TorchDynamo graph of ``module`` as a ZeRO-3 bundle, from inside a TorchDynamo backend.

    ``params`` are the trainable parameters (name, tensor) as the graph takes
    them among ``example_inputs``; they get ds_ids in that order. Nothing
    runs: AOT autograd traces with fake tensors and the backward is compiled
    at once, so the parameters need no storage (see :mod:`dcsched.train`).
    """
    params = list(params)
    record = _Recorded(name=name or type(module).__name__, module=module,
                       n_params=sum(p.numel() for _, p in params), params=params)
    _Backend(record, on_backward=lambda _record: None, eager_backward=True)(gm, list(example_inputs))
    return _build(record)


# ---------------------------------------------------------------------------
# Python API
# ---------------------------------------------------------------------------


class _LossStep(nn.Module):
    def __init__(self, model: nn.Module, loss_fn: Callable | None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *inputs):
        out = self.model(*inputs)
        return self.loss_fn(out) if self.loss_fn is not None else out


def capture_step(model: nn.Module, example_inputs: Sequence[torch.Tensor], loss_fn: Callable | None = None) -> Capture:
    """Like :func:`capture`, also returning the real parameter and input tensors."""
    if not isinstance(model, nn.Module):
        raise CaptureError(f"capture() takes an nn.Module, not {type(model).__name__}")
    if not _trainable(model):
        raise CaptureError(f"{type(model).__name__} has no trainable parameters to shard")
    name = type(model).__name__
    record = _Recorded(name=name, module=model, n_params=sum(p.numel() for _, p in _trainable(model)))
    step = _LossStep(model, loss_fn)
    backend = _Backend(record, on_backward=lambda r: None)
    grads_before = {id(p): p.grad for _, p in _trainable(model)}
    buffers_before = [(b, b.detach().clone()) for b in model.buffers()]
    with fresh_dynamo():
        compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
        try:
            out = compiled(*example_inputs)
        except Exception as raised:
            exc = unwrap_dynamo_error(raised)
            if isinstance(exc, CaptureError):
                raise exc from None
            if _is_graph_break(exc):
                raise CaptureError(_graph_break_message(exc, name)) from None
            raise
        loss = out[0] if isinstance(out, (tuple, list)) else out
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise CaptureError(f"{name}: the step's first output must be a loss tensor that requires grad "
                               "(pass loss_fn=... to turn the model's output into one)")
        loss.backward(torch.ones_like(loss))
    # Leave the model as it was (.grad, BatchNorm statistics): capture is an observation, not a step.
    for _, p in _trainable(model):
        p.grad = grads_before[id(p)]
    with torch.no_grad():
        for buffer, value in buffers_before:
            buffer.copy_(value)
    if record.step is not None:
        arg_names = _forward_arg_names(model)
        record.step.input_names = [arg_names.get(name, name) for name in record.step.input_names]
    return _build(record)


def _forward_arg_names(model: nn.Module) -> dict[str, str]:
    """``{'inputs_0': 'idx', ...}``: the step's positional inputs named after ``model.forward``'s parameters."""
    import inspect
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return {}
    names = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return {f"inputs_{i}": name for i, name in enumerate(names)}


def capture(model: nn.Module, example_inputs: Sequence[torch.Tensor], loss_fn: Callable | None = None) -> Bundle:
    """Capture ``loss_fn(model(*example_inputs))``'s forward and backward as a ZeRO-3 bundle (unprofiled).

    Parameters
    ----------
    model : torch.nn.Module
        The module to capture; its trainable parameters become the bundle's
        sharded parameters (ZeRO-3 ops inserted where DeepCompile inserts them).
    example_inputs : sequence of torch.Tensor
        The inputs of one step, as ``model(*example_inputs)`` takes them.
    loss_fn : callable, optional
        Maps the model's output to a scalar loss; without it the model must
        return the loss itself (or a tuple with the loss first).

    Returns
    -------
    Bundle
        Forward and backward graphs without costs: profile the result with
        :func:`dcsched.profile_bundle`.

    Raises
    ------
    CaptureError
        The model does not compile into one graph (a graph break), has no
        trainable parameter, or its output gives no scalar loss.

    Examples
    --------
    >>> import torch, dcsched
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    >>> bundle = dcsched.capture(model, [torch.randn(2, 4)], loss_fn=lambda out: out.sum())
    >>> [p.name for p in bundle.params]
    ['0.weight', '0.bias', '2.weight', '2.bias']
    """
    return capture_step(model, example_inputs, loss_fn).bundle


# ---------------------------------------------------------------------------
# Scripts
# ---------------------------------------------------------------------------


class _ScriptCapture:
    """Stands in for ``torch.compile`` while a script runs."""

    def __init__(self, wanted: str | None, real_compile, meta: bool = False):
        self.wanted = wanted
        #: The script runs on the meta device: its step is traced as on the CPU (see _meta_claims).
        self.meta = meta
        self.real_compile = real_compile
        self.compiled: list[_Recorded] = []
        self.done: _Recorded | None = None
        self.compile = compile_interceptor(self.compile_module, CaptureError, "dcsched captures compiled modules")

    def target(self) -> _Recorded | None:
        if self.wanted is not None:
            return next((r for r in self.compiled if r.name == self.wanted), None)
        return max(self.compiled, key=lambda r: r.n_params, default=None)

    def on_backward(self, record: _Recorded) -> None:
        if self.target() is record:
            self.done = record
            raise StopScript()

    def compile_module(self, model, module: nn.Module, kwargs: dict):
        record = _Recorded(name=type(module).__name__, module=module,
                           n_params=sum(p.numel() for _, p in _trainable(module)))
        self.compiled.append(record)
        backend = _Backend(record, self.on_backward, trace_device=CPU if self.meta else None)
        return self.real_compile(model, backend=backend, fullgraph=True, dynamic=False)


def capture_script_step(path: str | os.PathLike, argv: Sequence[str] = (), module: str | None = None,
                        meta: bool = False) -> Capture:
    """Run ``path`` as ``__main__`` with ``argv`` until its compiled module's first forward and backward.

    ``meta``: the script runs with the meta device as the default device, so its model and inputs hold shapes
    and dtypes but no storage: a model of any size is captured in little memory, and nothing can be measured
    (see docs/profile.md, "Planning without the weights"). Its step is traced as the CPU's (its meta tensors
    claim the CPU when made fake, :func:`_meta_claims`), so the graphs are those of a capture without ``meta``.
    """
    path = Path(path)
    interceptor = _ScriptCapture(module, torch.compile, meta=meta)
    try:
        with _planning_device(CPU) if meta else contextlib.nullcontext(), \
                _meta_claims(CPU) if meta else contextlib.nullcontext():
            run = run_script(path, argv, interceptor.compile)
    except ScriptError as exc:
        raise CaptureError(str(exc)) from None
    except DcschedError:
        raise
    except Exception as exc:
        if _is_graph_break(exc):
            target = interceptor.compiled[-1].name if interceptor.compiled else "the compiled module"
            raise CaptureError(_graph_break_message(exc, target)) from None
        hint = (" (under `meta=True` tensors hold no values: the script may not read them, e.g. with .item(), nor move "
                "them to a device)" if meta and "meta" in str(exc).lower() else "")
        raise CaptureError(f"{path} failed before its step was captured: {describe_exception(exc)}{hint}") from None
    if run.exit_code != 0 and interceptor.done is None:
        raise CaptureError(f"{path} exited with status {run.exit_code} before its step was captured")
    finished = run.finished
    if not interceptor.compiled:
        raise CaptureError(f"{path} never calls torch.compile, so there is no compiled module to capture: wrap the "
                           "model, e.g. `model = torch.compile(model)`, before the training loop (dcsched intercepts "
                           "that call), or capture from Python with dcsched.capture(model, example_inputs, loss_fn)")
    record = interceptor.done
    if record is None:
        if module is not None and interceptor.target() is None:
            names = ", ".join(sorted({r.name for r in interceptor.compiled}))
            raise CaptureError(f"{path} compiles no module named {module!r} (it compiles: {names})")
        recorded = interceptor.target()
        assert recorded is not None  # a module was compiled (checked above)
        ran = "ended" if finished else "stopped"
        how = (" (it only ran under no_grad or inference mode)" if recorded.forward_only else "")
        raise CaptureError(f"{path} {ran} before {recorded.name} ran a forward and a backward pass{how}: call "
                           "loss.backward() on a loss computed from its output")
    return _build(record)  # under --meta, traced as on the CPU: the graphs name no meta device


def capture_script(path: str | os.PathLike, argv: Sequence[str] = (), module: str | None = None) -> Bundle:
    """Capture the compiled module's first training step of a script (see the module docstring).

    Parameters
    ----------
    path : str or os.PathLike
        The training script, run as ``__main__`` with ``torch.compile`` intercepted; it stops after the
        compiled module's first forward and backward.
    argv : Sequence[str]
        The script's arguments (its ``sys.argv[1:]``).
    module : str, optional
        Class name of the compiled module to capture where the script compiles several; by default the one
        with the most parameters.

    Returns
    -------
    Bundle
        The forward and backward aten graphs with the ZeRO-3 ops inserted, not yet profiled
        (:func:`dcsched.profile_bundle` adds the figures). :func:`capture_script_step` also returns the real
        parameters and inputs, and captures on the meta device with ``meta=True``.

    Raises
    ------
    ScriptError
        A script that cannot be run (missing, not Python).
    CaptureError
        A script that fails, exits or breaks its graph before its step is captured, or never calls
        ``torch.compile``.

    Examples
    --------
    >>> from pathlib import Path
    >>> import dcsched
    >>> gpt = Path(dcsched.__file__).parent.parent / "examples" / "gpt.py"
    >>> bundle = dcsched.capture_script(gpt, ["--layers", "1", "--d-model", "32", "--heads", "2", "--vocab", "64",
    ...                                       "--seq", "8", "--batch", "2", "--steps", "1"])  # doctest: +SKIP
    >>> sorted(bundle.graphs)  # doctest: +SKIP
    ['backward', 'forward']
    """
    return capture_script_step(path, argv, module).bundle
