"""One training step of a bundle, run for real: the runner profile, replay and training share.

A bundle's forward and backward graphs become ``torch.fx.GraphModule`` s over
copies of its graphs, node for node in the bundle's order (never re-traced, so
a scheduler's order is exactly what runs), with every ``device=`` argument a
node carries (``arange(..., device=cpu)`` from a CPU capture) pointed at the
device the step runs on. The ZeRO-3 ops run on :data:`dcsched.runtime.ops.RUNTIME`;
:func:`installed` puts a runtime (single-process, or
:class:`dcsched.runtime.distributed.DistributedZero3Runtime` under torchrun) behind
them for a block.

The pieces, in the order a step uses them:

* :func:`build_step` -> :class:`Step` (the runnable modules on one device);
* :func:`make_state` -> :class:`StepState` (the forward's arguments: parameter
  shards and inputs, from a seed or from given tensors);
* :func:`run_forward` (all forward outputs: user outputs, then saved tensors),
  :func:`backward_args` (saved tensors and :func:`tangents`),
  :func:`run_backward` (one gradient per forward placeholder);
* :func:`run_step`: all of it, returning named results.

Either run can go node by node through a hook ``on_node(graph_name, node,
call)`` that must return ``call()``'s value (the profiler times each node
there).

**Tangents: ones for the loss (user output 0), zeros for other user outputs.**
That is what ``loss.backward()`` feeds AOT autograd's backward, so the
gradients are d(loss)/d(parameter), the figures training uses and eager
autograd computes; ones everywhere would add the other outputs' sums into the
gradients. Kernels and shapes do not depend on the values, so timing a node
with this convention measures what training runs.

>>> import dcsched
>>> from dcsched import replay
>>> from dcsched.runtime import ops
>>> bundle = replay.example_bundle()
>>> step = build_step(bundle, "cpu")
>>> state = make_state(bundle, seed=0)
>>> with installed(ops.Zero3Runtime()):
...     results = run_step(step, state)
>>> list(results)
['loss', 'grad fc1.weight', 'grad fc1.bias', 'grad fc2.weight']
>>> [float(t) for t in tangents(bundle, [results['loss']])]
[1.0]
"""

from __future__ import annotations

import contextlib
import dataclasses
import linecache
import math
import re
import traceback
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence

import torch
import torch.fx

from dcsched.runtime import ops
from dcsched.bundle.core import Bundle, InputInfo, ParamInfo
from dcsched.errors import DcschedError, GraphError, first_line


DEFAULT_SEED = 0

#: ``on_node(graph_name, node, call) -> value``: runs one call_function node (``call()`` computes it).
NodeHook = Callable[[str, torch.fx.Node, Callable[[], Any]], Any]


@contextlib.contextmanager
def installed(runtime: ops.Zero3Runtime) -> Iterator[ops.Zero3Runtime]:
    """``runtime`` behind the ZeRO-3 ops (the collectives) for the duration."""
    previous = ops.set_runtime(runtime)
    runtime.reset()
    try:
        yield runtime
    finally:
        runtime.reset()
        ops.set_runtime(previous)


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


def on_device(value, device: torch.device):
    """``value`` with every ``torch.device`` in it (through lists, tuples, dicts) replaced by ``device``."""
    if isinstance(value, torch.device):
        return device
    if isinstance(value, (list, tuple)):
        return type(value)(on_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: on_device(v, device) for k, v in value.items()}
    return value


def _module(graph: torch.fx.Graph, constants: Mapping[str, torch.Tensor], device: torch.device,
            order: list[str] | None = None) -> torch.fx.GraphModule:
    if order is not None and sorted(order) != sorted(graph_placeholder_names(graph)):
        raise GraphError(f"the two orders have different placeholders ({graph_placeholder_names(graph)[:6]} vs "
                         f"{order[:6]})")
    copy = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:  # node for node, in the bundle's order
        new = env[node] = copy.node_copy(node, lambda n: env[n])
        if new.name != node.name:
            raise GraphError(f"node {node.name!r} could not keep its name in the runnable copy")
        if new.op == "call_function":
            new.args, new.kwargs = on_device(new.args, device), on_device(new.kwargs, device)
    copy.set_codegen(_ListArgsCodeGen(order))
    wanted = {node.target for node in copy.nodes if node.op == "get_attr"}
    missing = sorted(wanted - set(constants))
    if missing:
        raise GraphError(f"graph reads constant(s) {', '.join(missing)} that the bundle does not hold")
    return torch.fx.GraphModule({name: constants[name] for name in wanted}, copy)


@dataclasses.dataclass(frozen=True)
class GraphInputs:
    """A graph's graph_id and which of its arguments its gathers read, for the runtime's :meth:`begin_graph`.

    ``gathers``: ``(argument position, ds_id, gather dtype)`` for each
    parameter gathered straight from a placeholder (a bucketed all-gather
    sends every member's shard at its first member, so the runtime needs them
    all at the graph's start); a gather of a computed value is not listed.

    >>> from dcsched import replay
    >>> bundle = replay.example_bundle()
    >>> inputs = graph_inputs(bundle.backward, None, 1)
    >>> inputs.graph_id, inputs.gathers
    (1, ((0, 2, None),))
    >>> inputs.bind(["shard", "x"])
    {2: ('shard', None)}
    """

    graph_id: int | None
    gathers: tuple[tuple[int, int, torch.dtype | None], ...] = ()

    def bind(self, args: Sequence) -> dict[int, tuple[Any, torch.dtype | None]]:
        """ds_id -> (its shard among ``args``, gather dtype)."""
        return {ds_id: (args[position], dtype) for position, ds_id, dtype in self.gathers}


def graph_inputs(graph: torch.fx.Graph, order: Sequence[str] | None, graph_id: int | None) -> GraphInputs:
    """:class:`GraphInputs` of ``graph`` called with its placeholders in ``order`` (None: graph order).

    ``graph_id`` is the bundle's for the graph; the ops' own is used where it is None.
    """
    from dcsched.graph.roles import Role, comm_ids, role_of
    position = {name: k for k, name in enumerate(order if order is not None else graph_placeholder_names(graph))}
    gathers: dict[int, tuple[int, int, torch.dtype | None]] = {}
    for node in graph.nodes:
        if role_of(node) is not Role.ALLGATHER:
            continue
        node_graph, ds_id = comm_ids(node)
        graph_id = node_graph if graph_id is None else graph_id
        source = node.args[0] if node.args else node.kwargs.get("a")
        if isinstance(source, torch.fx.Node) and source.op == "placeholder" and ds_id not in gathers:
            dtype = node.args[3] if len(node.args) > 3 else node.kwargs.get("dtype")
            gathers[ds_id] = (position[source.name], ds_id, dtype)
    return GraphInputs(graph_id, tuple(gathers.values()))


@dataclasses.dataclass
class Step:
    """A bundle made runnable on one device.

    ``orders``: per graph, the placeholder order its module takes its
    arguments in (None: the graph's own). ``inputs``: per graph, its
    :class:`GraphInputs` (given to the runtime at each run's start).
    """

    bundle: Bundle
    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule | None
    device: torch.device
    constants: dict[str, torch.Tensor]
    orders: dict[str, list[str] | None] = dataclasses.field(default_factory=dict)
    inputs: dict[str, GraphInputs] = dataclasses.field(default_factory=dict)


def graph_placeholder_names(graph: torch.fx.Graph) -> list[str]:
    """The names of ``graph``'s placeholders, in graph order."""
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
    n_forward = len(graph_placeholder_names(bundle.forward))
    if n_forward != len(bundle.forward_placeholders):
        raise GraphError(f"forward graph has {n_forward} placeholders but the bundle describes "
                         f"{len(bundle.forward_placeholders)}")
    if bundle.backward is not None:
        n_backward = len(graph_placeholder_names(bundle.backward))
        if n_backward != len(bundle.backward_placeholders):
            raise GraphError(f"backward graph has {n_backward} placeholders but the bundle describes "
                             f"{len(bundle.backward_placeholders)}")
    constants = {name: value.to(device) for name, value in bundle.constants.items()}
    orders = {name: placeholder_order.get(name) for name in bundle.graphs}
    forward = _module(bundle.forward, constants, device, orders["forward"])
    backward = (_module(bundle.backward, constants, device, orders.get("backward"))
                if bundle.backward is not None else None)
    inputs = {name: graph_inputs(graph, orders.get(name), bundle.graph_ids.get(name))
              for name, graph in bundle.graphs.items()}
    return Step(bundle, forward, backward, device, constants, orders, inputs)


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
        if low is not None:
            lo_f = float(low)
            hi_f = float(high) if high is not None else lo_f + 1.0
        else:
            hi_f = float(high)  # one of the two is set: the branch's test
            lo_f = hi_f - 1.0
        values = torch.rand(shape, generator=generator, dtype=torch.float64) * (hi_f - lo_f) + lo_f
        return values.clamp_(lo_f, hi_f).to(dtype)
    if scale is not None:
        return ((torch.rand(shape, generator=generator) * 2 - 1) * scale).to(dtype)
    return torch.randn(shape, generator=generator).to(dtype)


def make_param(info: ParamInfo, generator: torch.Generator) -> torch.Tensor:
    """A full parameter: uniform in [-1/sqrt(fan_in), 1/sqrt(fan_in)], as ``nn.Linear`` starts."""
    shape = tuple(info.shape)
    fan_in = math.prod(shape[1:]) if len(shape) >= 2 else (shape[0] if shape else 1)
    return _random(shape, info.dtype, generator, scale=1.0 / math.sqrt(max(fan_in, 1)))


def make_input(info: InputInfo, generator: torch.Generator) -> torch.Tensor:
    """The stored value, else values in [low, high] (integers for integer dtypes).

    >>> ids = make_input(InputInfo("ids", (4,), torch.int64, low=0, high=9), torch.Generator().manual_seed(0))
    >>> ids.dtype, bool(((0 <= ids) & (ids <= 9)).all())
    (torch.int64, True)
    """
    if info.value is not None:
        return info.value.detach().clone().to(info.dtype)
    return _random(tuple(info.shape), info.dtype, generator, info.low, info.high)


def make_state(bundle: Bundle, *, seed: int = DEFAULT_SEED, device: torch.device | str = "cpu",
               shard: Callable[[torch.Tensor], torch.Tensor] | None = None,
               values: Mapping[str, torch.Tensor] | None = None,
               params: Mapping[int, torch.Tensor] | None = None,
               inputs: Sequence[torch.Tensor] | None = None, whole: Collection[int] = ()) -> StepState:
    """Parameters and inputs from ``seed``, identical on every rank.

    ``shard`` cuts a full parameter to this rank's part (identity in one
    process); the parameters whose ds_id is in ``whole`` (a plan's replicated
    ones) are given flattened and whole instead. Chosen tensors instead of random ones (e.g. a real model's
    weights): ``values`` by parameter or input name, ``params`` by ds_id
    (full parameters), ``inputs`` all of them in ``bundle.inputs`` order.
    """
    device = torch.device(device)
    values = dict(values or {})
    generator = torch.Generator().manual_seed(seed)
    full_params = {p.ds_id: make_param(p, generator) for p in bundle.params}
    made_inputs = [make_input(i, generator) for i in bundle.inputs]
    for p in bundle.params:
        if p.name in values:
            full_params[p.ds_id] = _chosen(values.pop(p.name), p.name, p.shape, p.dtype)
        elif params is not None and p.ds_id in params:
            full_params[p.ds_id] = params[p.ds_id].detach()
    for k, info in enumerate(bundle.inputs):
        if info.name in values:
            made_inputs[k] = _chosen(values.pop(info.name), info.name, info.shape, info.dtype)
        elif inputs is not None:
            made_inputs[k] = inputs[k].detach()
    if values:
        raise DcschedError(f"no parameter or input named {', '.join(sorted(values))} in the bundle")
    if shard is not None and whole:
        cut = shard
        full_params = {d: value.reshape(-1) if d in whole else cut(value) for d, value in full_params.items()}
        shard = None
    args = [forward_arg(position, entry, full_params, made_inputs, shard)
            for position, entry in enumerate(bundle.forward_placeholders)]
    return StepState([value.to(device) for value in args], seed)


def forward_arg(position: int, entry: dict, full_params: dict[int, torch.Tensor], inputs: list[torch.Tensor],
                shard) -> torch.Tensor:
    """The value of forward placeholder ``position`` described by ``entry`` (a ``forward_placeholders`` item):
    its parameter from ``full_params`` (through ``shard`` when given), or its input."""
    kind = entry.get("kind")
    if kind == "param":
        try:
            value = full_params[int(entry["ds_id"])]
        except KeyError:
            raise GraphError(f"forward placeholder {position} is parameter ds_id {entry.get('ds_id')}, "
                             "which the parameter table does not list") from None
        return shard(value) if shard is not None else value
    if kind == "input":
        index = int(entry["index"])
        if not 0 <= index < len(inputs):
            raise GraphError(f"forward placeholder {position} is input {index}, but the bundle "
                             f"holds {len(inputs)} inputs")
        return inputs[index]
    raise GraphError(f"forward placeholder {position} has unknown kind {kind!r}")


def _chosen(value: torch.Tensor, name: str, shape, dtype) -> torch.Tensor:
    if tuple(value.shape) != tuple(shape):
        raise DcschedError(f"value for {name} has shape {tuple(value.shape)}, the bundle records {tuple(shape)}")
    return value.detach().to("cpu", dtype=dtype, copy=True)


# One step

def result_names(bundle: Bundle) -> list[str]:
    """Names of the backward's results, one per forward placeholder: ``grad <param>``, ``grad input <input>``."""
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


class _Hooked(torch.fx.Interpreter):
    """Runs a module node by node, handing each call_function node to ``on_node``."""

    def __init__(self, module: torch.fx.GraphModule, graph_name: str, on_node: NodeHook) -> None:
        super().__init__(module)
        self.graph_name, self.on_node = graph_name, on_node

    def run_node(self, node: torch.fx.Node):
        self.current = node.name
        if node.op != "call_function":
            return super().run_node(node)
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        return self.on_node(self.graph_name, node, lambda: node.target(*args, **kwargs))


#: An assignment in the code torch.fx generates for a graph: the node's name comes first.
_ASSIGNED = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=")


def failing_node(exc: BaseException) -> str | None:
    """The node whose line of a GraphModule's generated code raised ``exc`` (None if not found there).

    torch.fx keeps the generated source in :mod:`linecache` under an
    ``<eval_with_key>`` file name, one ``name = op(...)`` line per node.
    """
    found = None
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        if frame.f_code.co_filename.startswith("<eval_with_key>"):
            match = _ASSIGNED.match(linecache.getline(frame.f_code.co_filename, lineno))
            found = match.group(1) if match else found
    return found


def _graph_failed(graph_name: str, node: str | None, exc: Exception) -> GraphError:
    where = f"node {node}" if node else "a node"
    detail = first_line(exc)
    return GraphError(f"the {graph_name} graph failed to run at {where}: {type(exc).__name__}: {detail}")


def _run(step: Step, graph_name: str, args: list, on_node: NodeHook | None) -> list:
    """Run one graph, between the runtime's ``begin_graph`` (its parameter shards bound) and ``end_graph``.

    After an error the runtime is left as it stands; :func:`installed` resets it.
    """
    module = step.forward if graph_name == "forward" else step.backward
    if module is None:
        raise GraphError(f"the bundle has no {graph_name} graph to run")
    inputs = step.inputs.get(graph_name) or GraphInputs(step.bundle.graph_ids.get(graph_name))
    runtime = ops.RUNTIME
    runtime.begin_graph(inputs.graph_id, inputs.bind(args))
    outputs = _run_module(step, graph_name, module, args, on_node)
    runtime.end_graph(inputs.graph_id)  # not after an error: it may send what the other ranks never will
    return outputs


def _run_module(step: Step, graph_name: str, module, args: list, on_node: NodeHook | None) -> list:
    if on_node is None:
        try:
            return _as_list(module(args))
        except DcschedError:
            raise
        except Exception as exc:  # an edited op, out-of-range token ids: say where, not a traceback
            raise _graph_failed(graph_name, failing_node(exc), exc) from exc
    order = step.orders.get(graph_name)
    if order is not None:  # the interpreter takes the placeholders in graph order
        by_name = dict(zip(order, args))
        args = [by_name[name] for name in graph_placeholder_names(module.graph)]
    interpreter = _Hooked(module, graph_name, on_node)
    values = tuple(args)
    args.clear()  # as the compiled module does: the caller's list no longer holds the inputs
    try:
        return _as_list(interpreter.run(*values))
    except DcschedError:
        raise
    except Exception as exc:
        raise _graph_failed(graph_name, getattr(interpreter, "current", None), exc) from exc


def run_forward(step: Step, args: Sequence[torch.Tensor], on_node: NodeHook | None = None) -> list:
    """The forward graph's outputs (the user outputs, then the tensors saved for the backward)."""
    outputs = _run(step, "forward", list(args), on_node)
    n_user = step.bundle.num_user_outputs
    if len(outputs) < n_user:
        raise GraphError(f"forward graph returns {len(outputs)} values, fewer than its {n_user} user outputs")
    return outputs


def tangents(bundle: Bundle, user_outputs: Sequence) -> list:
    """The backward's tangent per user output: ones for the loss (output 0), zeros for the others.

    ``None`` for a user output that is not a tensor (it has no tangent).
    """
    return [(torch.ones_like if k == 0 else torch.zeros_like)(value) if isinstance(value, torch.Tensor) else None
            for k, value in enumerate(user_outputs[:bundle.num_user_outputs])]


def backward_args(bundle: Bundle, forward_outputs: Sequence, tangent_values: Sequence | None = None) -> list:
    """The backward graph's arguments: the saved forward outputs and the tangents (default :func:`tangents`)."""
    n_user = bundle.num_user_outputs
    if tangent_values is None:
        tangent_values = tangents(bundle, forward_outputs[:n_user])
    args = []
    for j, entry in enumerate(bundle.backward_placeholders):
        index = int(entry.get("index", -1))
        if entry.get("kind") == "saved" and 0 <= index < len(forward_outputs):
            args.append(forward_outputs[index])
        elif entry.get("kind") == "tangent" and 0 <= index < n_user and tangent_values[index] is not None:
            args.append(tangent_values[index])
        else:
            raise GraphError(f"backward placeholder {j} ({entry}) refers to no forward output")
    return args


def run_backward(step: Step, forward_outputs: list, tangent_values: Sequence | None = None,
                 on_node: NodeHook | None = None) -> list:
    """One gradient per forward placeholder (``None`` where there is none), reduce-scatters waited on.

    Empties ``forward_outputs``, so each saved tensor is freed after its last
    use in the backward, as in training; read the loss first.
    """
    if step.backward is None:
        raise GraphError("the bundle has no backward graph")
    args = backward_args(step.bundle, forward_outputs, tangent_values)
    forward_outputs.clear()  # the backward's argument list now holds the saved tensors alone
    grads = _run(step, "backward", args, on_node)
    ops.RUNTIME.finish()  # asynchronous reduce-scatters: the gradient shards are ready once waited on
    if len(grads) != len(step.bundle.forward_placeholders):
        raise GraphError(f"backward graph returns {len(grads)} values; the bundle's convention is one "
                         f"per forward placeholder ({len(step.bundle.forward_placeholders)})")
    return grads


def run_step(step: Step, state: StepState, mark: Callable[[], None] | None = None,
             on_node: NodeHook | None = None) -> dict[str, torch.Tensor]:
    """Forward then backward on the installed runtime; returns the named results (on the step's device).

    Results, in order: ``loss``, the other user outputs (``output 1``, ...),
    then the gradients (:func:`result_names`). ``mark`` is called at the
    start, between forward and backward, and at the end (for timers).
    """
    bundle = step.bundle
    ops.RUNTIME.reset()
    torch.manual_seed(state.seed)  # graphs that draw random numbers draw the same ones
    if mark:
        mark()
    outputs = run_forward(step, state.forward_args, on_node)
    results: dict[str, torch.Tensor] = {}
    for k, value in enumerate(outputs[:bundle.num_user_outputs]):
        if isinstance(value, torch.Tensor):
            results["loss" if k == 0 else f"output {k}"] = value
    if mark:
        mark()
    if step.backward is not None:
        grads = run_backward(step, outputs, on_node=on_node)
        for name, grad in zip(result_names(bundle), grads):
            if isinstance(grad, torch.Tensor):
                results[name] = grad
    if mark:
        mark()
    return results
