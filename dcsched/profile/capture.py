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

This module holds the entry points; the pipeline's steps have modules of their
own (the project keeps a module to one job and about 600 lines):
:mod:`~dcsched.profile.recording` (the TorchDynamo backend that records the
graphs), :mod:`~dcsched.profile.assemble` (from the recorded graphs to a
bundle), :mod:`~dcsched.profile.meta_device` (capture on the meta device).

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
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx
import torch.nn as nn

from dcsched.bundle.core import Bundle
from dcsched.errors import DcschedError
from dcsched.profile.assemble import Capture, CaptureError, build_capture
from dcsched.profile.checkpointing import tracing_checkpoints
from dcsched.profile.meta_device import CPU, meta_claims, planning_device
from dcsched.profile.recording import RecordingBackend, Recorded, trainable_params
from dcsched.profile.scripts import (ScriptError, StopScript, compile_interceptor, describe_exception, fresh_dynamo,
                                     run_script, unwrap_dynamo_error)


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


def capture_compiled(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], module: nn.Module,
                     params: Sequence[tuple[str, torch.Tensor]], name: str | None = None) -> Capture:
    """Capture a TorchDynamo graph of ``module`` as a ZeRO-3 bundle, from inside a TorchDynamo backend.

    ``params`` are the trainable parameters (name, tensor) as the graph takes
    them among ``example_inputs``; they get ds_ids in that order. Nothing
    runs: AOT autograd traces with fake tensors and the backward is compiled
    at once, so the parameters need no storage (see :mod:`dcsched.train`).
    """
    params = list(params)
    record = Recorded(name=name or type(module).__name__, module=module,
                       n_params=sum(p.numel() for _, p in params), params=params)
    RecordingBackend(record, on_backward=lambda _record: None, eager_backward=True)(gm, list(example_inputs))
    return build_capture(record)


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
    if not trainable_params(model):
        raise CaptureError(f"{type(model).__name__} has no trainable parameters to shard")
    name = type(model).__name__
    record = Recorded(name=name, module=model, n_params=sum(p.numel() for _, p in trainable_params(model)))
    step = _LossStep(model, loss_fn)
    backend = RecordingBackend(record, on_backward=lambda r: None)
    grads_before = {id(p): p.grad for _, p in trainable_params(model)}
    buffers_before = [(b, b.detach().clone()) for b in model.buffers()]
    with fresh_dynamo(), tracing_checkpoints():
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
    for _, p in trainable_params(model):
        p.grad = grads_before[id(p)]
    with torch.no_grad():
        for buffer, value in buffers_before:
            buffer.copy_(value)
    if record.step is not None:
        arg_names = _forward_arg_names(model)
        record.step.input_names = [arg_names.get(name, name) for name in record.step.input_names]
    return build_capture(record)


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
        #: The script runs on the meta device: its step is traced as on the CPU (see meta_claims).
        self.meta = meta
        self.real_compile = real_compile
        self.compiled: list[Recorded] = []
        self.done: Recorded | None = None
        #: The optimizer the script built over the captured module's parameters (:func:`_script_optimizer`).
        self.optimizer: dict | None = None
        self.compile = compile_interceptor(self.compile_module, CaptureError, "dcsched captures compiled modules")

    def target(self) -> Recorded | None:
        if self.wanted is not None:
            return next((r for r in self.compiled if r.name == self.wanted), None)
        return max(self.compiled, key=lambda r: r.n_params, default=None)

    def on_backward(self, record: Recorded) -> None:
        if self.target() is record:
            self.done = record
            self.optimizer = _script_optimizer(record)  # while the script's frames (and its optimizer) live
            raise StopScript()

    def compile_module(self, model, module: nn.Module, kwargs: dict):
        record = Recorded(name=type(module).__name__, module=module,
                           n_params=sum(p.numel() for _, p in trainable_params(module)))
        self.compiled.append(record)
        backend = RecordingBackend(record, self.on_backward, trace_device=CPU if self.meta else None)
        return self.real_compile(model, backend=backend, fullgraph=True, dynamic=False)


def capture_script_step(path: str | os.PathLike, argv: Sequence[str] = (), module: str | None = None,
                        meta: bool = False) -> Capture:
    """Run ``path`` as ``__main__`` with ``argv`` until its compiled module's first forward and backward.

    ``meta``: the script runs with the meta device as the default device, so its model and inputs hold shapes
    and dtypes but no storage: a model of any size is captured in little memory, and nothing can be measured
    (see docs/profile.md, "Planning without the weights"). Its step is traced as the CPU's (its meta tensors
    claim the CPU when made fake, :func:`meta_claims`), so the graphs are those of a capture without ``meta``.
    """
    path = Path(path)
    interceptor = _ScriptCapture(module, torch.compile, meta=meta)
    try:
        with planning_device(CPU) if meta else contextlib.nullcontext(), \
                meta_claims(CPU) if meta else contextlib.nullcontext(), tracing_checkpoints():
            run = run_script(path, argv, interceptor.compile)
    except ScriptError as exc:
        raise CaptureError(str(exc)) from None
    except DcschedError:
        raise
    except Exception as exc:
        if _is_graph_break(exc):
            target = interceptor.compiled[-1].name if interceptor.compiled else "the compiled module"
            raise CaptureError(_graph_break_message(exc, target)) from None
        hint = (" (under `meta=True` tensors hold no values: the script may not read them, e.g. with .item(), nor "
                "copy them into real tensors)" if meta and "meta" in str(exc).lower() else "")
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
    captured = build_capture(record)  # under --meta, traced as on the CPU: the graphs name no meta device
    if interceptor.optimizer is not None:
        from dcsched.bundle.optimizer import OPTIMIZER_KEY
        captured.bundle.provenance[OPTIMIZER_KEY] = interceptor.optimizer
    return captured


def _script_optimizer(record: Recorded) -> dict | None:
    """The provenance record (:mod:`dcsched.bundle.optimizer`) of the ``torch.optim`` optimizer the script built
    over the captured module's parameters, found among the live objects; None where it built none (yet) or one
    dcsched does not model."""
    model = optimizer_over(p for _, p in record.trainable())
    return model.provenance() if model is not None else None


def optimizer_over(params) -> Any:
    """The :class:`~dcsched.bundle.optimizer.OptimizerModel` of a live ``torch.optim`` optimizer over any of
    ``params`` (found among the live objects), or None: none built (yet), or one dcsched does not model."""
    import gc
    import warnings

    from dcsched.bundle.optimizer import of_torch
    wanted = {id(p) for p in params}
    with warnings.catch_warnings():  # isinstance on deprecated module proxies (torch.distributed.reduce_op) warns
        warnings.simplefilter("ignore")
        found = [value for value in gc.get_objects() if _is_optimizer(value)]
    for value in found:
        if any(id(p) in wanted for group in value.param_groups for p in group.get("params", ())):
            return of_torch(value)
    return None


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


def _is_optimizer(value: Any) -> bool:
    """Whether ``value`` is a ``torch.optim.Optimizer`` (False for a dead weak proxy, which refuses the question)."""
    try:
        return isinstance(value, torch.optim.Optimizer)
    except ReferenceError:
        return False
