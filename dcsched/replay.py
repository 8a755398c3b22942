"""Run a bundle's training step for real, measure it, and prove two orders compute the same.

The forward and backward graphs become ``torch.fx.GraphModule`` s over copies
of the bundle's graphs, node for node in the bundle's order (never re-traced,
so a scheduler's order is exactly what runs). Parameters and inputs of the
recorded shapes and dtypes are made from a seed; the step runs the forward,
then the backward fed with the saved tensors and the tangents (ones for the
loss, zeros for other user outputs). The ZeRO-3 ops run on
:data:`dcsched.ops.RUNTIME`: a single-process :class:`~dcsched.ops.Zero3Runtime`
by default, or a :class:`dcsched.distributed.DistributedZero3Runtime` under
torchrun.

The results of a step are named tensors, in this order: ``loss``, the other
user outputs (``output 1``, ...), then the backward's gradients: ``grad <param
name>`` (this rank's reduced shard) and ``grad input <input name>``.

>>> from dcsched import replay as rp
>>> bundle = rp.example_bundle()
>>> run = rp.replay(bundle, iters=2, warmup=1)
>>> list(run.results)
['loss', 'grad fc1.weight', 'grad fc1.bias', 'grad fc2.weight']
>>> run.measurement.peak_bytes >= run.measurement.resident_bytes > 0
True
>>> reordered = bundle.with_graphs(backward=rp.latest_first(bundle.backward))
>>> rp.compare(run.results, rp.replay(reordered, iters=0).results).exact
True

Python API: :func:`replay`, :func:`compare`, :func:`replay_orders` (both orders,
report), :func:`build_step`, :func:`make_state`, :func:`run_step`,
:func:`measure`, :func:`estimate_bytes`, :func:`check_fits`,
:func:`resolve_device`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import math
import os
import statistics
import time
from typing import Callable, Iterable, Mapping

import torch
import torch.fx

from . import ops
from .bundle import Bundle, InputInfo, ParamInfo
from .errors import DcschedError, GraphError, ResultMismatch
from .memtrack import LiveBytes
from .units import format_bytes

DEFAULT_SEED = 0

# ---------------------------------------------------------------------------
# Devices and memory estimates
# ---------------------------------------------------------------------------


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """``'auto'`` (CUDA when there is a GPU, else CPU), ``'cpu'``, ``'cuda'`` or ``'cuda:N'``.

    Raises :class:`DcschedError` for a device that is not there.

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    text = str(name).strip().lower()
    if text == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise DcschedError(f"unknown device '{name}' (use auto, cpu, cuda or cuda:N)") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise DcschedError(f"replay runs on cpu or cuda, not '{name}'")
    if not torch.cuda.is_available():
        why = "built without CUDA" if torch.version.cuda is None else "sees no GPU"
        raise DcschedError(f"device '{name}' is not there: this torch ({torch.__version__}) {why}; "
                           "use --device cpu")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise DcschedError(f"device '{name}' is not there: {torch.cuda.device_count()} GPU(s) visible")
    return device


def _spec_bytes(spec) -> int:
    if isinstance(spec, dict) and "shape" in spec:
        dtype = getattr(torch, str(spec.get("dtype", "float32")), torch.float32)
        return math.prod(int(s) for s in spec["shape"]) * dtype.itemsize
    if isinstance(spec, (list, tuple)):
        return sum(_spec_bytes(s) for s in spec)
    return 0


def _node_bytes(node: torch.fx.Node) -> int:
    size = node.meta.get("tensor_size")
    if isinstance(size, (int, float)):
        return int(size)
    return _spec_bytes(node.meta.get("out"))


def estimate_bytes(bundle: Bundle, world_size: int = 1) -> dict[str, int]:
    """A lower bound of the step's memory, from the bundle alone (bytes).

    ``param_shards`` (this rank's shards), ``largest_gathered`` (one parameter
    all-gathered), ``inputs``, ``saved`` (what the forward outputs, the tensors
    saved for the backward included) and their ``total``.
    """
    shards = sum(-(-p.numel // world_size) * p.dtype.itemsize for p in bundle.params)
    gathered = max((p.nbytes for p in bundle.params), default=0) if world_size > 1 else 0
    inputs = sum(math.prod(i.shape) * i.dtype.itemsize for i in bundle.inputs)
    saved = 0
    for node in bundle.forward.nodes:
        if node.op == "output":
            for value in _flat_nodes(node.args):
                if value.op != "placeholder":
                    saved += _node_bytes(value)
    total = shards + gathered + inputs + saved
    return {"param_shards": shards, "largest_gathered": gathered, "inputs": inputs, "saved": saved,
            "total": total}


def _flat_nodes(args) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(args, found.append)
    return found


def free_bytes(device: torch.device) -> int | None:
    """Bytes free for tensors on ``device`` (None when unknown)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(bundle: Bundle, device: torch.device, world_size: int = 1,
               available: int | None = None) -> dict[str, int]:
    """Raise :class:`DcschedError` before allocating anything if the step cannot fit on ``device``.

    ``available`` overrides the free memory the device reports (bytes).
    """
    estimate = estimate_bytes(bundle, world_size)
    available = free_bytes(device) if available is None else available
    if available is not None and estimate["total"] > available:
        parts = ", ".join(f"{key.replace('_', ' ')} {format_bytes(value)}"
                          for key, value in estimate.items() if key != "total" and value)
        raise DcschedError(f"the step needs at least {format_bytes(estimate['total'])} ({parts}) but only "
                           f"{format_bytes(available)} is free on {device}; nothing was allocated")
    return estimate


# ---------------------------------------------------------------------------
# Runnable modules
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# Parameters and inputs from a seed
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# One step
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Measured step figures: times in milliseconds (median and range over ``iters``), bytes."""

    device: str
    iters: int
    warmup: int
    step_ms: float | None
    step_ms_min: float | None
    step_ms_max: float | None
    forward_ms: float | None
    backward_ms: float | None
    peak_bytes: int
    resident_bytes: int
    timer: str
    memory_source: str

    @property
    def spread_percent(self) -> float | None:
        """(max - min) / median of the step time, in percent."""
        if not self.step_ms or self.step_ms_min is None or self.step_ms_max is None:
            return None
        return 100.0 * (self.step_ms_max - self.step_ms_min) / self.step_ms

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["spread_percent"] = self.spread_percent
        return data


class _CpuClock:
    name = "perf_counter_ns"

    def __init__(self) -> None:
        self.stamps: list[int] = []

    def __call__(self) -> None:
        self.stamps.append(time.perf_counter_ns())

    def split_ms(self) -> tuple[float, float]:
        a, b, c = self.stamps[-3:]
        return (b - a) / 1e6, (c - b) / 1e6


class _CudaClock:
    name = "cuda events"

    def __init__(self) -> None:
        self.events: list[torch.cuda.Event] = []

    def __call__(self) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)

    def split_ms(self) -> tuple[float, float]:
        a, b, c = self.events[-3:]
        c.synchronize()
        return a.elapsed_time(b), b.elapsed_time(c)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier() -> None:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def measure_memory(step: Step, state: StepState) -> tuple[int, int, str]:
    """(peak bytes, resident bytes before the step, how it was measured) for one step."""
    device = step.device
    if device.type == "cuda":
        _synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device)
        results = run_step(step, state)
        _synchronize(device)
        del results
        return torch.cuda.max_memory_allocated(device), resident, "torch.cuda.max_memory_allocated"
    with LiveBytes() as tracker:
        tracker.track([state.forward_args, list(step.constants.values())])
        resident = tracker.live
        tracker.reset_peak()
        results = run_step(step, state)
        del results
        peak = tracker.peak
    return peak, resident, "live tensor storages (dcsched.memtrack)"


def _clock_for(device: torch.device):
    return _CudaClock() if device.type == "cuda" else _CpuClock()


def time_step(step: Step, state: StepState, clock) -> tuple[float, float]:
    """(forward ms, backward ms) of one step, all ranks starting together."""
    _barrier()
    _synchronize(step.device)
    results = run_step(step, state, mark=clock)
    _synchronize(step.device)
    del results
    return clock.split_ms()


def summarize(device: torch.device, warmup: int, times: list[tuple[float, float]], peak: int, resident: int,
              timer: str, memory_source: str) -> Measurement:
    """A :class:`Measurement` from per-step (forward ms, backward ms) samples and the memory figures."""
    steps = [f + b for f, b in times]
    median = statistics.median
    return Measurement(
        device=str(device), iters=len(steps), warmup=warmup,
        step_ms=median(steps) if steps else None,
        step_ms_min=min(steps) if steps else None,
        step_ms_max=max(steps) if steps else None,
        forward_ms=median(f for f, _ in times) if steps else None,
        backward_ms=median(b for _, b in times) if steps else None,
        peak_bytes=int(peak), resident_bytes=int(resident), timer=timer, memory_source=memory_source)


def measure(step: Step, state: StepState, *, iters: int = 5, warmup: int = 1) -> Measurement:
    """Warm up, measure peak memory over one step, then time ``iters`` steps."""
    for _ in range(max(warmup, 0)):
        run_step(step, state)
    _synchronize(step.device)
    peak, resident, memory_source = measure_memory(step, state)
    clock = _clock_for(step.device)
    times = [time_step(step, state, clock) for _ in range(max(iters, 0))]
    return summarize(step.device, warmup, times, peak, resident, clock.name, memory_source)


# ---------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def deterministic():
    """Deterministic kernels while replaying (warn-only where an op has none)."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@contextlib.contextmanager
def installed(runtime: ops.Zero3Runtime):
    """``runtime`` behind the ZeRO-3 ops for the duration."""
    previous = ops.set_runtime(runtime)
    runtime.reset()
    try:
        yield runtime
    finally:
        runtime.reset()
        ops.set_runtime(previous)


@dataclasses.dataclass
class ReplayRun:
    """One bundle replayed: its results (on the CPU) and, when measured, its figures."""

    results: dict[str, torch.Tensor]
    measurement: Measurement | None
    world_size: int = 1
    rank: int = 0


def prepare(bundle: Bundle, *, device: torch.device, seed: int, runtime: ops.Zero3Runtime,
            values: Mapping[str, torch.Tensor] | None = None,
            placeholder_order: Mapping[str, list[str]] | None = None) -> tuple[Step, StepState]:
    """The runnable step and its parameters (this rank's shards under ``runtime``) and inputs."""
    step = build_step(bundle, device, placeholder_order=placeholder_order)
    shard = getattr(runtime, "shard", None) if runtime.world_size > 1 else None
    return step, make_state(bundle, seed=seed, device=device, shard=shard, values=values)


def replay(bundle: Bundle, *, device: torch.device | str = "cpu", seed: int = DEFAULT_SEED, iters: int = 5,
           warmup: int = 1, runtime: ops.Zero3Runtime | None = None, check_memory: bool = True,
           values: Mapping[str, torch.Tensor] | None = None,
           placeholder_order: Mapping[str, list[str]] | None = None, memory: bool | None = None) -> ReplayRun:
    """Run ``bundle``'s step: results of one step and, with ``iters`` > 0, measured figures.

    ``runtime`` defaults to a fresh single-process :class:`~dcsched.ops.Zero3Runtime`;
    pass a :class:`dcsched.distributed.DistributedZero3Runtime` to run sharded.
    ``values``: chosen parameter/input tensors by name (see :func:`make_state`).
    ``placeholder_order``: per graph, the placeholder names in the order the
    bundle's placeholder tables describe them (see :func:`build_step`).
    ``memory`` (default: ``iters > 0``) measures peak memory even when nothing is timed.
    """
    device = resolve_device(device) if isinstance(device, str) else device
    runtime = runtime if runtime is not None else ops.Zero3Runtime()
    memory = iters > 0 if memory is None else memory
    if check_memory:
        check_fits(bundle, device, runtime.world_size)
    with installed(runtime), deterministic():
        step, state = prepare(bundle, device=device, seed=seed, runtime=runtime, values=values,
                              placeholder_order=placeholder_order)
        results = {name: value.detach().to("cpu", copy=True) for name, value in run_step(step, state).items()}
        _synchronize(device)
        measurement = None
        if memory or iters > 0:  # the results' step above was the first warm-up step
            measurement = measure(step, state, iters=iters, warmup=max(warmup - 1, 0))
            measurement = dataclasses.replace(measurement, warmup=max(warmup, 1))
    return ReplayRun(results, measurement, runtime.world_size, runtime.rank)


# ---------------------------------------------------------------------------
# Comparing two runs
# ---------------------------------------------------------------------------

#: (rtol, atol) by dtype where bit-for-bit equality is not asked for.
TOLERANCES = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (2e-2, 1e-2),
}


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Two runs' results agree: how many outputs, how strictly, and the largest difference."""

    outputs: int
    exact: bool
    max_abs_error: float
    worst_output: str | None
    tolerance: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point or a.dtype.is_complex:
        a, b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    return torch.equal(a, b)


def _difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype == torch.bool:
        return (a != b).to(torch.float64)
    diff = (a.to(torch.float64) - b.to(torch.float64)).abs()
    both_nan = torch.isnan(a.to(torch.float64)) & torch.isnan(b.to(torch.float64))
    return diff.masked_fill(both_nan, 0.0).nan_to_num(nan=math.inf)


def compare(reference: Mapping[str, torch.Tensor], candidate: Mapping[str, torch.Tensor], *,
            exact: bool = True, rtol: float | None = None, atol: float | None = None,
            names: tuple[str, str] = ("baseline", "scheduled")) -> Comparison:
    """Check ``candidate`` computed what ``reference`` did; raise :class:`ResultMismatch` naming
    the first output that differs.

    ``exact``: bit for bit. Otherwise ``rtol``/``atol`` (default: :data:`TOLERANCES` by dtype).
    """
    ref_name, cand_name = names
    if list(reference) != list(candidate):
        only_ref = [k for k in reference if k not in candidate]
        only_cand = [k for k in candidate if k not in reference]
        raise ResultMismatch(f"the runs return different outputs (only in {ref_name}: {only_ref or 'none'}; "
                             f"only in {cand_name}: {only_cand or 'none'})")
    worst, worst_name = 0.0, None
    for name, a in reference.items():
        b = candidate[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ResultMismatch(f"{name}: {ref_name} is {a.dtype} {tuple(a.shape)}, "
                                 f"{cand_name} is {b.dtype} {tuple(b.shape)}")
        diff = _difference(a, b)
        largest = float(diff.max()) if diff.numel() else 0.0
        if exact:
            same = _bits_equal(a, b)
        else:
            r, t = TOLERANCES.get(a.dtype, (0.0, 0.0))
            r, t = (rtol if rtol is not None else r), (atol if atol is not None else t)
            same = bool(torch.isclose(a, b, rtol=r, atol=t, equal_nan=True).all()) if a.numel() else True
        if not same:
            count = int((diff != 0).sum())
            where = ""
            if diff.numel():
                flat = int(diff.reshape(-1).argmax())
                index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else ()
                where = (f" at index {index} ({ref_name} {a.reshape(-1)[flat].item():.9g}, "
                         f"{cand_name} {b.reshape(-1)[flat].item():.9g})")
            how = "bit for bit" if exact else "within tolerance"
            what = (f"{count} of {a.numel()} elements differ ({how})" if count else
                    "elements differ in their bits only (signed zeros or NaN payloads)")
            raise ResultMismatch(f"first differing output: {name}: {what}; largest error {largest:.3g}{where}")
        if largest > worst or worst_name is None:
            worst, worst_name = largest, name
    tolerance = "bit for bit" if exact else (
        f"rtol={rtol}, atol={atol}" if rtol is not None or atol is not None else
        "rtol/atol by dtype: " + ", ".join(f"{str(d).removeprefix('torch.')} {r:g}/{t:g}"
                                           for d, (r, t) in TOLERANCES.items()))
    return Comparison(len(reference), exact, worst, worst_name, tolerance)


# ---------------------------------------------------------------------------
# Simulated figures, for the report
# ---------------------------------------------------------------------------


def _meta_bytes(nodes: Iterable[torch.fx.Node]) -> int:
    return sum(_node_bytes(node) for node in nodes)


def simulated_figures(bundle: Bundle, world_size: int | None = None) -> tuple[dict | None, str]:
    """The simulator's step figures for ``bundle``'s own order, and a note on how they were made.

    With ``world_size`` given and different from the one the bundle was
    profiled for, parameter shards and reduced gradients are re-sized to it
    first, so the figures compare like for like with a replay at that size.

    Returns ``(None, why)`` when the simulator is not installed or the bundle
    lacks costs. The forward and backward are simulated separately;
    ``step_ms`` is their sum and ``peak_bytes`` the larger of the forward's peak
    and the backward's peak plus what the real step holds across it (the
    forward's inputs and user outputs that the backward does not take).
    """
    from .profile import resharded
    from .simulate import simulate

    profiled_for = bundle.provenance.get("world_size")
    resized = world_size is not None and isinstance(profiled_for, int) and profiled_for != world_size
    if resized:
        bundle = resharded(bundle, world_size)
    try:
        forward = simulate(bundle.forward, detail=False)
        backward = simulate(bundle.backward, detail=False) if bundle.backward is not None else None
    except DcschedError as exc:
        return None, f"not simulated: {exc}"
    peak = forward.peak_bytes
    held = 0
    if backward is not None:
        output = next(node for node in bundle.forward.nodes if node.op == "output")
        outputs = _flat_nodes(output.args)
        saved = {outputs[int(e["index"])] for e in bundle.backward_placeholders
                 if e.get("kind") == "saved" and 0 <= int(e["index"]) < len(outputs)}
        inputs = [node for node in bundle.forward.nodes if node.op in ("placeholder", "get_attr")]
        users = outputs[:bundle.num_user_outputs]
        held = _meta_bytes(n for n in dict.fromkeys(inputs + users) if n not in saved)
        peak = max(peak, backward.peak_bytes + held)
    figures = {
        "peak_bytes": int(peak),
        "step_ms": forward.step_ms + (backward.step_ms if backward else 0.0),
        "forward_ms": forward.step_ms,
        "backward_ms": backward.step_ms if backward else None,
        "forward_peak_bytes": forward.peak_bytes,
        "backward_peak_bytes": backward.peak_bytes if backward else None,
        "held_across_bytes": held,
    }
    source = bundle.provenance.get("time_source") or bundle.provenance.get("device") or "bundle costs"
    note = f"dcsched.simulate on the bundle's costs ({source})"
    if resized:
        note += f"; sizes re-sharded from the profiled world size {profiled_for} to this run's {world_size}"
    return figures, note


def percent_error(simulated: float | None, measured: float | None) -> float | None:
    """(simulated - measured) / measured in percent; None where either is missing or measured is 0.

    >>> percent_error(110, 100)
    10.0
    """
    if simulated is None or measured is None or not measured:
        return None
    return 100.0 * (simulated - measured) / measured


# ---------------------------------------------------------------------------
# Both orders: the report
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class OrderReport:
    """One order's measured and simulated figures."""

    label: str
    path: str | None
    measured: Measurement
    simulated: dict | None
    simulator_note: str

    def errors(self) -> dict[str, float | None]:
        sim = self.simulated or {}
        return {"peak_bytes": percent_error(sim.get("peak_bytes"), self.measured.peak_bytes),
                "step_ms": percent_error(sim.get("step_ms"), self.measured.step_ms)}

    def to_dict(self) -> dict:
        return {"label": self.label, "path": self.path, "measured": self.measured.to_dict(),
                "simulated": self.simulated, "simulator": self.simulator_note,
                "simulator_error_percent": self.errors()}


@dataclasses.dataclass
class ReplayReport:
    """What ``dcsched replay`` reports: each order's figures and whether the results match."""

    device: str
    world_size: int
    seed: int
    orders: list[OrderReport]
    comparison: Comparison | None

    def to_dict(self) -> dict:
        return {"device": self.device, "world_size": self.world_size, "seed": self.seed,
                "orders": [o.to_dict() for o in self.orders],
                "results": self.comparison.to_dict() if self.comparison else None}


def placeholder_names(bundle: Bundle) -> dict[str, list[str]]:
    return {name: _placeholders(graph) for name, graph in bundle.graphs.items()}


def check_same_step(candidate: Bundle, baseline: Bundle) -> None:
    """Raise :class:`DcschedError` unless both bundles hold the same step (parameters, inputs, graphs)."""
    if [(p.name, p.shape, p.dtype, p.ds_id) for p in candidate.params] != \
            [(p.name, p.shape, p.dtype, p.ds_id) for p in baseline.params]:
        raise DcschedError("the bundle and its baseline have different parameter tables: "
                           "they are not two orders of one step")
    if [(i.name, i.shape, i.dtype) for i in candidate.inputs] != [(i.name, i.shape, i.dtype) for i in baseline.inputs]:
        raise DcschedError("the bundle and its baseline have different inputs: they are not two orders of one step")
    for name, graph in baseline.graphs.items():
        other = candidate.graphs.get(name)
        if other is None or {n.name for n in other.nodes} != {n.name for n in graph.nodes}:
            raise DcschedError(f"the {name} graphs of the bundle and its baseline do not hold the same nodes: "
                               "they are not two orders of one step")
    if candidate.forward_placeholders != baseline.forward_placeholders or \
            candidate.backward_placeholders != baseline.backward_placeholders:
        raise DcschedError("the bundle and its baseline describe their placeholders differently")


def _world_size() -> int:
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _agree_across_ranks(error: str | None) -> str | None:
    """The first rank's mismatch message, on every rank (None when all matched)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return error
    messages: list = [None] * dist.get_world_size()
    dist.all_gather_object(messages, error)
    for rank, message in enumerate(messages):
        if message is not None:
            return f"rank {rank}: {message}"
    return None


def _slowest_rank(measurement: Measurement) -> Measurement:
    """Across ranks: the largest peak and the slowest median step (the step waits for every rank)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return measurement
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, measurement)
    slowest = max(everyone, key=lambda m: m.step_ms or 0.0)
    return dataclasses.replace(slowest, peak_bytes=max(m.peak_bytes for m in everyone),
                               resident_bytes=max(m.resident_bytes for m in everyone))


def _time_interleaved(bundles: list[Bundle], *, device: torch.device, seed: int, iters: int, warmup: int,
                      factory: Callable[[Bundle], ops.Zero3Runtime],
                      placeholder_order) -> list[list[tuple[float, float]]]:
    """Per bundle, ``iters`` (forward ms, backward ms) samples, timed in alternating rounds.

    Round r runs every order once (A B, then B A, ...), so load that comes and
    goes on the machine falls on both orders alike.
    """
    times: list[list[tuple[float, float]]] = [[] for _ in bundles]
    ready = []
    for bundle in bundles:
        runtime = factory(bundle)
        ready.append((runtime, *prepare(bundle, device=device, seed=seed, runtime=runtime,
                                        placeholder_order=placeholder_order)))
    clock = _clock_for(device)
    with deterministic():
        for round_ in range(max(warmup, 0) + iters):
            turn = range(len(ready)) if round_ % 2 == 0 else reversed(range(len(ready)))
            for k in turn:
                runtime, step, state = ready[k]
                with installed(runtime):
                    if round_ < warmup:
                        run_step(step, state)
                        _synchronize(device)
                    else:
                        times[k].append(time_step(step, state, clock))
    return times


def replay_orders(candidate: Bundle, baseline: Bundle | None = None, *, device: torch.device | str = "cpu",
                  seed: int = DEFAULT_SEED, iters: int = 5, warmup: int = 1,
                  runtime_factory: Callable[[Bundle], ops.Zero3Runtime] | None = None,
                  exact: bool | None = None, labels: tuple[str, str] = ("baseline", "scheduled"),
                  paths: tuple[str | None, str | None] = (None, None)) -> ReplayReport:
    """Replay ``baseline`` (when given) and ``candidate``, measure both, check they agree.

    Each order first runs alone for its results and peak memory; the results
    are compared; then both are timed in alternating rounds (``warmup`` untimed
    rounds, ``iters`` timed ones), so a busy machine slows both alike.
    ``exact`` (default: on the CPU) asks for bit-for-bit equality, else
    :data:`TOLERANCES`. Raises :class:`ResultMismatch` naming the first
    differing output. ``runtime_factory(bundle)`` makes each run's ZeRO-3
    runtime (default: single process).
    """
    device = resolve_device(device) if isinstance(device, str) else device
    factory = runtime_factory or (lambda _bundle: ops.Zero3Runtime())
    exact = (device.type == "cpu") if exact is None else exact
    order = None
    runs: list[tuple[str, str | None, Bundle, ReplayRun]] = []
    if baseline is not None:
        check_same_step(candidate, baseline)
        order = placeholder_names(baseline)
    check_fits(candidate, device, _world_size())
    jobs = ([(labels[0], paths[0], baseline)] if baseline is not None else []) + [(labels[1], paths[1], candidate)]
    for label, path, bundle in jobs:  # results and peak memory, one order at a time
        run = replay(bundle, device=device, seed=seed, iters=0, warmup=1, runtime=factory(bundle),
                     placeholder_order=order, check_memory=False, memory=True)
        runs.append((label, path, bundle, run))
    comparison = None
    if baseline is not None:
        error = None
        try:
            comparison = compare(runs[0][3].results, runs[1][3].results, exact=exact, names=labels)
        except ResultMismatch as exc:
            error = str(exc)
        error = _agree_across_ranks(error)
        if error is not None:
            raise ResultMismatch(error)
    # then the time, both orders in alternating rounds
    times = _time_interleaved([job[2] for job in jobs], device=device, seed=seed, iters=iters, warmup=warmup,
                              factory=factory, placeholder_order=order)
    for k, (label, path, bundle, run) in enumerate(runs):
        m = run.measurement
        run.measurement = summarize(device, warmup, times[k], m.peak_bytes, m.resident_bytes,
                                    _clock_for(device).name, m.memory_source)
    orders = []
    for label, path, bundle, run in runs:
        simulated, note = simulated_figures(bundle, run.world_size)
        orders.append(OrderReport(label, path, _slowest_rank(run.measurement), simulated, note))
    world_size = runs[-1][3].world_size
    return ReplayReport(str(device), world_size, seed, orders, comparison)


# ---------------------------------------------------------------------------
# Orders used by tests and examples
# ---------------------------------------------------------------------------


def latest_first(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A valid reordering of ``graph``: placeholders first as they were, then always the
    ready node that came latest in the original order (a "reverse-ish" topological order)."""
    from .nxview import to_fx, to_networkx

    view = to_networkx(graph)
    position = {name: data["position"] for name, data in view.nodes(data=True)}
    placeholders = [n for n in sorted(view.nodes, key=position.get) if view.nodes[n]["role"] == "placeholder"]
    waiting = {name: view.in_degree(name) for name in view.nodes}
    for name in placeholders:
        for succ in view.succ[name]:
            waiting[succ] -= 1
    ready = [(-position[n], n) for n in view.nodes if waiting[n] == 0 and n not in set(placeholders)]
    heapq.heapify(ready)
    order = list(placeholders)
    while ready:
        _, name = heapq.heappop(ready)
        order.append(name)
        for succ in view.succ[name]:
            waiting[succ] -= 1
            if waiting[succ] == 0:
                heapq.heappush(ready, (-position[succ], succ))
    return to_fx(graph, order)




# ---------------------------------------------------------------------------
# A hand-written bundle (docs, tests, smoke runs)
# ---------------------------------------------------------------------------


def _call(graph, op, args, name):
    return graph.create_node("call_function", op, tuple(args), name=name)


def _gather(graph, placeholder, graph_id, ds_id):
    gathered = _call(graph, ops.allgather_param, (placeholder, graph_id, ds_id),
                     f"allgather_ds_param_{placeholder.name}_{ds_id}")
    return _call(graph, ops.wait_allgather, (gathered, graph_id, ds_id),
                 f"wait_allgather_ds_param__{placeholder.name}_{ds_id}")


def _release(graph, value, placeholder, user, graph_id, ds_id, n_users=1):
    return _call(graph, ops.release_param, (value, graph_id, ds_id, n_users),
                 f"release_ds_param_{placeholder}_{user}_{ds_id}")


def example_bundle() -> Bundle:
    """A two-layer MLP training step written as ZeRO-3 graphs by hand (examples, tests, smoke runs).

    ``fc1`` (7x4 weight, 7 bias) and ``fc2`` (3x7 weight: 21 elements, so two
    ranks pad it), input ``x`` (5x4), loss = sum(fc2(relu(fc1(x)))^2). The
    ZeRO-3 ops sit where DeepCompile puts them, with its node names; node costs
    are nominal (``provenance['time_source']``).
    """
    aten = torch.ops.aten
    fwd = torch.fx.Graph()
    w1, b1, w2, x = (fwd.placeholder(n) for n in ("primals_1", "primals_2", "primals_3", "primals_4"))
    w1_full = _gather(fwd, w1, 0, 0)
    b1_full = _gather(fwd, b1, 0, 1)
    w2_full = _gather(fwd, w2, 0, 2)
    t = _call(fwd, aten.t.default, (w1_full,), "t")
    addmm = _call(fwd, aten.addmm.default, (b1_full, x, t), "addmm")
    rel_w1 = _release(fwd, addmm, "primals_1", "addmm", 0, 0)
    rel_b1 = _release(fwd, rel_w1, "primals_2", "addmm", 0, 1)
    relu = _call(fwd, aten.relu.default, (rel_b1,), "relu")
    t_1 = _call(fwd, aten.t.default, (w2_full,), "t_1")
    mm = _call(fwd, aten.mm.default, (relu, t_1), "mm")
    rel_w2 = _release(fwd, mm, "primals_3", "mm", 0, 2)
    pow_1 = _call(fwd, aten.pow.Tensor_Scalar, (rel_w2, 2), "pow_1")
    loss = _call(fwd, aten.sum.default, (pow_1,), "sum_1")
    fwd.output((loss, w2, x, relu, rel_w2))

    bwd = torch.fx.Graph()
    w2_s = bwd.placeholder("primals_3")
    w2_bwd = _gather(bwd, w2_s, 1, 2)
    x_s, relu_s, mm_s, tangent = (bwd.placeholder(n) for n in ("primals_4", "relu", "mm", "tangents_1"))
    expand = _call(bwd, aten.expand.default, (tangent, [5, 3]), "expand")
    twice = _call(bwd, aten.mul.Tensor, (mm_s, 2.0), "mul")
    d_mm = _call(bwd, aten.mul.Tensor, (expand, twice), "mul_1")
    t_2 = _call(bwd, aten.t.default, (d_mm,), "t_2")
    g_w2 = _call(bwd, aten.mm.default, (t_2, relu_s), "mm_1")
    red_w2 = _call(bwd, ops.reduce_grad, (g_w2, 1, 2), "reduce_ds_param_fc2_weight")
    mm_2 = _call(bwd, aten.mm.default, (d_mm, w2_bwd), "mm_2")
    rel_w2_b = _release(bwd, mm_2, "primals_3", "mm_2", 1, 2)
    d_relu = _call(bwd, aten.threshold_backward.default, (rel_w2_b, relu_s, 0), "threshold_backward")
    t_3 = _call(bwd, aten.t.default, (d_relu,), "t_3")
    g_w1 = _call(bwd, aten.mm.default, (t_3, x_s), "mm_3")
    red_w1 = _call(bwd, ops.reduce_grad, (g_w1, 1, 0), "reduce_ds_param_fc1_weight")
    g_b1 = _call(bwd, aten.sum.dim_IntList, (d_relu, [0]), "sum_2")
    red_b1 = _call(bwd, ops.reduce_grad, (g_b1, 1, 1), "reduce_ds_param_fc1_bias")
    bwd.output((red_w1, red_b1, red_w2, None))

    params = [ParamInfo("fc1.weight", (7, 4), torch.float32, 0), ParamInfo("fc1.bias", (7,), torch.float32, 1),
              ParamInfo("fc2.weight", (3, 7), torch.float32, 2)]
    bundle = Bundle(
        forward=fwd, backward=bwd, params=params,
        inputs=[InputInfo("x", (5, 4), torch.float32, low=-1.0, high=1.0)],
        forward_placeholders=[{"kind": "param", "ds_id": 0}, {"kind": "param", "ds_id": 1},
                              {"kind": "param", "ds_id": 2}, {"kind": "input", "index": 0}],
        backward_placeholders=[{"kind": "saved", "index": 1}, {"kind": "saved", "index": 2},
                               {"kind": "saved", "index": 3}, {"kind": "saved", "index": 4},
                               {"kind": "tangent", "index": 0}],
        num_user_outputs=1,
        provenance={"source": "dcsched.replay.example_bundle (hand-written)",
                    "time_source": "nominal: 0.01 ms per compute op, 0.005 ms per all-gather/reduce"},
    )
    _annotate(bundle)
    return bundle


def _annotate(bundle: Bundle) -> None:
    """Fill ``out``/``tensor_size`` (from one real step) and nominal ``device_time`` on every node."""
    from .roles import Role, role_of

    nominal = {Role.COMPUTE: 0.01, Role.ALLGATHER: 0.005, Role.REDUCE: 0.005}
    for graph in bundle.graphs.values():
        for node in graph.nodes:
            role = role_of(node)
            if role not in (Role.PLACEHOLDER, Role.OUTPUT):
                node.meta["device_time"] = nominal.get(role, 0.0)
                node.meta["time_source"] = "nominal"
    with installed(ops.Zero3Runtime()):
        step = build_step(bundle)
        state = make_state(bundle)
        seen: dict[str, torch.Tensor] = {}
        for name, module in (("forward", step.forward), ("backward", step.backward)):
            _record_outputs(module, seen, name)
        run_step(step, state)
    for name, graph in bundle.graphs.items():
        for node in graph.nodes:
            value = seen.get(f"{name}:{node.name}")
            if isinstance(value, torch.Tensor) and node.op not in ("output",):
                node.meta["out"] = {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
                node.meta["tensor_size"] = value.numel() * value.element_size()


def _record_outputs(module: torch.fx.GraphModule, seen: dict, graph_name: str) -> None:
    """Make ``module`` store each node's value's shape in ``seen`` as it runs (an Interpreter)."""

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            value = super().run_node(node)
            if isinstance(value, torch.Tensor):
                seen[f"{graph_name}:{node.name}"] = torch.empty(value.shape, dtype=value.dtype, device="meta")
            return value

    interpreter = Recorder(module)
    module.forward = lambda args: interpreter.run(*args)  # type: ignore[method-assign]
