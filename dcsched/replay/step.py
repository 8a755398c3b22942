"""A bundle's graphs as runnable modules, parameters and inputs made from a seed, and one training step."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping

import torch
import torch.fx

from .. import ops
from ..bundle import Bundle, InputInfo, ParamInfo
from ..errors import DcschedError, GraphError


DEFAULT_SEED = 0


# Runnable modules

class _ListArgsCodeGen(torch.fx.graph.CodeGen):
    """``forward(self, args)`` takes one list of the placeholders' values and empties it.

    So the caller holds no reference to the inputs while the graph runs and
    each one is freed after its last use, as AOT autograd's boxed calling
    convention frees saved tensors during the backward.
    """

    def __init__(self, order: list[str] | None = None) -> None:
        super().__init__()
        self.order = order

    def gen_fn_def(self, free_vars, maybe_return_annotation, **_kwargs):
        names = [v.split(":")[0].split("=")[0].strip() for v in free_vars if v != "self"]
        if self.order is not None:
            names = list(self.order)
        head = f"def forward(self, dcsched_args){maybe_return_annotation}:"
        if not names:
            return head
        return (f"{head}\n    ({', '.join(names)},) = dcsched_args"
                "\n    dcsched_args.clear()")


def _module(graph: torch.fx.Graph, constants: Mapping[str, torch.Tensor],
            order: list[str] | None = None) -> torch.fx.GraphModule:
    if order is not None and sorted(order) != sorted(_placeholders(graph)):
        raise GraphError(f"the two orders have different placeholders ({_placeholders(graph)[:6]} vs {order[:6]})")
    copy = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:  # node for node, in the bundle's order
        env[node] = copy.node_copy(node, lambda n: env[n])
        if env[node].name != node.name:
            raise GraphError(f"node {node.name!r} could not keep its name in the runnable copy")
    copy.set_codegen(_ListArgsCodeGen(order))
    wanted = {node.target for node in copy.nodes if node.op == "get_attr"}
    missing = sorted(wanted - set(constants))
    if missing:
        raise GraphError(f"graph reads constant(s) {', '.join(missing)} that the bundle does not hold")
    return torch.fx.GraphModule({name: constants[name] for name in wanted}, copy)


@dataclasses.dataclass
class Step:
    """A bundle made runnable on one device."""

    bundle: Bundle
    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule | None
    device: torch.device
    constants: dict[str, torch.Tensor]


def _placeholders(graph: torch.fx.Graph) -> list[str]:
    return [node.name for node in graph.nodes if node.op == "placeholder"]


def build_step(bundle: Bundle, device: torch.device | str = "cpu",
               placeholder_order: Mapping[str, list[str]] | None = None) -> Step:
    """Runnable forward and backward modules for ``bundle``, its constants on ``device``.

    The modules take their placeholders' values in graph order, which is what
    the bundle's placeholder tables describe. A scheduler that moved
    placeholders among themselves breaks that link; ``placeholder_order``
    (graph name -> placeholder names, e.g. the original bundle's) restores it.
    """
    device = torch.device(device)
    placeholder_order = placeholder_order or {}
    n_forward = len(_placeholders(bundle.forward))
    if n_forward != len(bundle.forward_placeholders):
        raise GraphError(f"forward graph has {n_forward} placeholders but the bundle describes "
                         f"{len(bundle.forward_placeholders)}")
    if bundle.backward is not None:
        n_backward = len(_placeholders(bundle.backward))
        if n_backward != len(bundle.backward_placeholders):
            raise GraphError(f"backward graph has {n_backward} placeholders but the bundle describes "
                             f"{len(bundle.backward_placeholders)}")
    constants = {name: value.to(device) for name, value in bundle.constants.items()}
    forward = _module(bundle.forward, constants, placeholder_order.get("forward"))
    backward = (_module(bundle.backward, constants, placeholder_order.get("backward"))
                if bundle.backward is not None else None)
    return Step(bundle, forward, backward, device, constants)


# Parameters and inputs from a seed

@dataclasses.dataclass
class StepState:
    """What the forward graph takes, positionally (this rank's parameter shards and the inputs)."""

    forward_args: list[torch.Tensor]
    seed: int


def _random(shape, dtype: torch.dtype, generator: torch.Generator, low=None, high=None,
            scale: float | None = None) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if not dtype.is_floating_point and not dtype.is_complex:
        lo = int(low) if low is not None else 0
        hi = int(high) if high is not None else max(lo, 1)
        return torch.randint(lo, hi + 1, shape, generator=generator, dtype=torch.int64).to(dtype)
    if low is not None or high is not None:
        lo = float(low) if low is not None else float(high) - 1.0
        hi = float(high) if high is not None else lo + 1.0
        values = torch.rand(shape, generator=generator, dtype=torch.float64) * (hi - lo) + lo
        return values.clamp_(lo, hi).to(dtype)
    if scale is not None:
        return ((torch.rand(shape, generator=generator) * 2 - 1) * scale).to(dtype)
    return torch.randn(shape, generator=generator).to(dtype)


def make_param(info: ParamInfo, generator: torch.Generator) -> torch.Tensor:
    """A full parameter: uniform in [-1/sqrt(fan_in), 1/sqrt(fan_in)], as ``nn.Linear`` starts."""
    shape = tuple(info.shape)
    fan_in = math.prod(shape[1:]) if len(shape) >= 2 else (shape[0] if shape else 1)
    return _random(shape, info.dtype, generator, scale=1.0 / math.sqrt(max(fan_in, 1)))


def make_input(info: InputInfo, generator: torch.Generator) -> torch.Tensor:
    """The stored value, else values in [low, high] (integers for integer dtypes)."""
    if info.value is not None:
        return info.value.detach().clone().to(info.dtype)
    return _random(tuple(info.shape), info.dtype, generator, info.low, info.high)


def make_state(bundle: Bundle, *, seed: int = DEFAULT_SEED, device: torch.device | str = "cpu",
               shard: Callable[[torch.Tensor], torch.Tensor] | None = None,
               values: Mapping[str, torch.Tensor] | None = None) -> StepState:
    """Parameters and inputs from ``seed``, identical on every rank.

    ``shard`` cuts a full parameter to this rank's part (identity in one
    process). ``values`` gives chosen tensors by parameter or input name
    instead of random ones (e.g. a real model's weights).
    """
    device = torch.device(device)
    values = dict(values or {})
    generator = torch.Generator().manual_seed(seed)
    full_params = {p.ds_id: make_param(p, generator) for p in bundle.params}
    inputs = [make_input(i, generator) for i in bundle.inputs]
    for p in bundle.params:
        if p.name in values:
            full_params[p.ds_id] = _chosen(values.pop(p.name), p.name, p.shape, p.dtype)
    for k, info in enumerate(bundle.inputs):
        if info.name in values:
            inputs[k] = _chosen(values.pop(info.name), info.name, info.shape, info.dtype)
    if values:
        raise DcschedError(f"no parameter or input named {', '.join(sorted(values))} in the bundle")
    args = []
    for position, entry in enumerate(bundle.forward_placeholders):
        kind = entry.get("kind")
        if kind == "param":
            try:
                value = full_params[int(entry["ds_id"])]
            except KeyError:
                raise GraphError(f"forward placeholder {position} is parameter ds_id {entry.get('ds_id')}, "
                                 "which the parameter table does not list") from None
            value = shard(value) if shard is not None else value
        elif kind == "input":
            index = int(entry["index"])
            if not 0 <= index < len(inputs):
                raise GraphError(f"forward placeholder {position} is input {index}, but the bundle "
                                 f"holds {len(inputs)} inputs")
            value = inputs[index]
        else:
            raise GraphError(f"forward placeholder {position} has unknown kind {kind!r}")
        args.append(value.to(device))
    return StepState(args, seed)


def _chosen(value: torch.Tensor, name: str, shape, dtype) -> torch.Tensor:
    if tuple(value.shape) != tuple(shape):
        raise DcschedError(f"value for {name} has shape {tuple(value.shape)}, the bundle records {tuple(shape)}")
    return value.detach().to("cpu", dtype=dtype, copy=True)


# One step

def _names(bundle: Bundle) -> list[str]:
    by_ds_id = bundle.param_by_ds_id()
    names = []
    for entry in bundle.forward_placeholders:
        if entry.get("kind") == "param":
            param = by_ds_id.get(int(entry["ds_id"]))
            names.append(f"grad {param.name if param else 'ds_id ' + str(entry['ds_id'])}")
        else:
            index = int(entry.get("index", -1))
            name = bundle.inputs[index].name if 0 <= index < len(bundle.inputs) else str(index)
            names.append(f"grad input {name}")
    return names


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def run_step(step: Step, state: StepState, mark: Callable[[], None] | None = None) -> dict[str, torch.Tensor]:
    """Forward then backward; returns the named results (on the step's device).

    ``mark`` is called at the start, between forward and backward, and at the
    end (for timers).
    """
    bundle = step.bundle
    ops.RUNTIME.reset()
    torch.manual_seed(state.seed)  # graphs that draw random numbers draw the same ones
    if mark:
        mark()
    outputs = _as_list(step.forward(list(state.forward_args)))
    n_user = bundle.num_user_outputs
    if len(outputs) < n_user:
        raise GraphError(f"forward graph returns {len(outputs)} values, fewer than its "
                         f"{n_user} user outputs")
    user = outputs[:n_user]
    results: dict[str, torch.Tensor] = {}
    for k, value in enumerate(user):
        if isinstance(value, torch.Tensor):
            results["loss" if k == 0 else f"output {k}"] = value
    if mark:
        mark()
    if step.backward is not None:
        args = []
        for j, entry in enumerate(bundle.backward_placeholders):
            index = int(entry.get("index", -1))
            if entry.get("kind") == "saved" and 0 <= index < len(outputs):
                args.append(outputs[index])
            elif entry.get("kind") == "tangent" and 0 <= index < n_user:
                fill = torch.ones_like if index == 0 else torch.zeros_like
                args.append(fill(user[index]))
            else:
                raise GraphError(f"backward placeholder {j} ({entry}) refers to no forward output")
        del outputs  # the backward's argument list now holds the saved tensors alone
        grads = _as_list(step.backward(args))
        if len(grads) != len(bundle.forward_placeholders):
            raise GraphError(f"backward graph returns {len(grads)} values; the bundle's convention is one "
                             f"per forward placeholder ({len(bundle.forward_placeholders)})")
        for name, grad in zip(_names(bundle), grads):
            if isinstance(grad, torch.Tensor):
                results[name] = grad
    if mark:
        mark()
    return results
