"""Profile a bundle: ``device_time`` (ms) and ``tensor_size`` (bytes) for every node, with provenance.

Two cost models for compute nodes:

* ``measured``: the graphs run for real through :mod:`dcsched.step` (forward,
  then backward on the forward's saved tensors with the step runner's tangents:
  ones for the loss, zeros for other outputs); each compute node is run
  ``warmup`` times, then timed ``iters`` times, and the median is kept. On a
  GPU with CUDA events, on the CPU with ``time.perf_counter_ns``.
* ``analytic``: nothing runs; a roofline estimate for a named GPU from each
  node's FLOPs and the bytes of its inputs and outputs
  (:mod:`dcsched.costmodel`), so a laptop can plan for a cluster.

Communication nodes: in one process (no process group, or one of size 1) the
all-gather and the gradient reduce-scatter are modelled from their bytes with
``bytes*(W-1)/W / bandwidth + latency`` for the stated world size W; wait and
release cost 0. Under ``torchrun`` with a process group of size > 1 they are
measured with real collectives of the same size.

``tensor_size`` is the bytes of a node's outputs, from the recorded shapes,
with ZeRO-3 sharding over W ranks applied: a parameter placeholder holds its
shard (``ceil(numel/W) * itemsize``), an all-gather the gathered parameter
(full size), a reduce-grad this rank's gradient shard.

Every node also gets ``time_source`` (``measured``, ``modelled``, ``analytic``
or ``none`` for placeholders and outputs); ``bundle.provenance`` records how the
figures were obtained.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable

import torch
import torch.fx

from . import costmodel, ops
from .bundle import Bundle, dtype_from_name
from .errors import DcschedError
from .nxview import copy_graph
from .roles import COMM_ROLES, Role, is_view_like, role_of
from .step import build_step, installed, make_state, run_step

COST_MODELS = ("measured", "analytic")


@dataclasses.dataclass(frozen=True)
class ProfileOptions:
    """How to profile. Times in ms, bandwidth in GB/s (10^9 bytes/s), latency in microseconds."""

    cost_model: str = "measured"
    iters: int = 5
    warmup: int = 2
    world_size: int = 8
    bandwidth_gbps: float = 100.0
    latency_us: float = 20.0
    #: Target GPU ('h100', 'a100', 'h200'): required by the analytic model; with
    #: a measured profile it only names the target device's memory.
    gpu: str | None = None
    #: Where a measured profile runs: default CUDA if available, else CPU.
    device: str | None = None
    progress: bool = True

    def check(self) -> None:
        if self.cost_model not in COST_MODELS:
            raise DcschedError(f"unknown cost model {self.cost_model!r} (choose from {', '.join(COST_MODELS)})")
        if self.cost_model == "analytic" and self.gpu is None:
            raise DcschedError("the analytic cost model needs a target GPU: pass --gpu h100|a100|h200")
        if self.gpu is not None and self.gpu.lower() not in costmodel.GPUS:
            raise DcschedError(f"unknown GPU {self.gpu!r} (choose from {', '.join(costmodel.GPUS)})")
        if self.iters < 1:
            raise DcschedError("--iters must be at least 1")
        if self.warmup < 0:
            raise DcschedError("--warmup must not be negative")
        if self.world_size < 1:
            raise DcschedError("--world-size must be at least 1")
        if not self.bandwidth_gbps > 0:
            raise DcschedError("--bandwidth must be positive (GB/s)")
        if self.latency_us < 0:
            raise DcschedError("--latency must not be negative (us)")


# ---------------------------------------------------------------------------
# Output specs and sizes
# ---------------------------------------------------------------------------

def _specs(value) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every tensor in a node's ``meta['val']`` or ``meta['out']``."""
    found: list[tuple[tuple[int, ...], torch.dtype]] = []

    def walk(v):
        if isinstance(v, torch.Tensor):
            found.append((tuple(int(s) for s in v.shape), v.dtype))
        elif isinstance(v, dict) and "shape" in v and "dtype" in v:
            dtype = v["dtype"] if isinstance(v["dtype"], torch.dtype) else dtype_from_name(v["dtype"])
            found.append((tuple(int(s) for s in v["shape"]), dtype))
        elif isinstance(v, (list, tuple)):
            for item in v:
                walk(item)

    walk(value)
    return found


def node_specs(node: torch.fx.Node) -> list[tuple[tuple[int, ...], torch.dtype]]:
    if "val" in node.meta and node.meta["val"] is not None:
        return _specs(node.meta["val"])
    return _specs(node.meta.get("out"))


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _node_bytes(node: torch.fx.Node) -> int:
    return sum(_nbytes(shape, dtype) for shape, dtype in node_specs(node))


def _sharded_bytes(node: torch.fx.Node, world_size: int) -> int:
    return sum(costmodel.shard_numel(math.prod(shape), world_size) * dtype.itemsize
               for shape, dtype in node_specs(node))


def tensor_sizes(bundle: Bundle, world_size: int) -> dict[str, dict[str, int]]:
    """``tensor_size`` (bytes) per node of each graph, ZeRO-3 sharding over ``world_size`` ranks applied."""
    param_placeholders = {"forward": _param_placeholder_names(bundle, "forward"),
                          "backward": _param_placeholder_names(bundle, "backward")}
    sizes: dict[str, dict[str, int]] = {}
    for name, graph in bundle.graphs.items():
        out = {}
        for node in graph.nodes:
            role = role_of(node)
            if role is Role.OUTPUT:
                out[node.name] = 0
            elif (role is Role.PLACEHOLDER and node.name in param_placeholders[name]) or role is Role.REDUCE:
                out[node.name] = _sharded_bytes(node, world_size)
            else:
                out[node.name] = _node_bytes(node)
        sizes[name] = out
    return sizes


def resharded(bundle: Bundle, world_size: int) -> Bundle:
    """A copy of ``bundle`` whose ``tensor_size`` figures are those of a run over ``world_size`` ranks.

    Times are kept; only shard-dependent sizes (parameter shards, reduced
    gradients) change, so a bundle profiled for 8 ranks can be compared with a
    single-process replay.
    """
    sizes = tensor_sizes(bundle, world_size)
    graphs = {}
    for name, graph in bundle.graphs.items():
        copy = copy_graph(graph)
        for node in copy.nodes:
            if "tensor_size" in node.meta:
                node.meta["tensor_size"] = sizes[name][node.name]
        graphs[name] = copy
    result = bundle.with_graphs(**graphs)
    result.provenance["world_size"] = world_size
    return result


def _param_placeholder_names(bundle: Bundle, graph_name: str) -> set[str]:
    """Placeholders holding a parameter shard: the forward's params, and the backward's saved copies of them.

    The backward reads a saved parameter under its forward placeholder name.
    """
    forward = [n for n in bundle.forward.nodes if n.op == "placeholder"]
    names = {node.name for node, kind in zip(forward, bundle.forward_placeholders) if kind.get("kind") == "param"}
    graph = bundle.graphs.get(graph_name)
    if graph_name == "forward" or graph is None:
        return names if graph is not None else set()
    return {n.name for n in graph.nodes if n.op == "placeholder" and n.name in names}


# ---------------------------------------------------------------------------
# Communication time
# ---------------------------------------------------------------------------

def _comm_bytes(node: torch.fx.Node) -> int:
    """Bytes a collective moves: the gathered parameter, or the full gradient being reduce-scattered."""
    return _node_bytes(node)


def _modelled_time(node: torch.fx.Node, options: ProfileOptions) -> float:
    role = role_of(node)
    if role in (Role.ALLGATHER, Role.REDUCE):
        return costmodel.comm_time_ms(_comm_bytes(node), world_size=options.world_size,
                                      bandwidth_gbps=options.bandwidth_gbps, latency_us=options.latency_us)
    return 0.0


# ---------------------------------------------------------------------------
# Analytic compute model
# ---------------------------------------------------------------------------

def _meta_tensor(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


def _as_meta(node_or_value, specs_of: Callable[[torch.fx.Node], list]):
    if isinstance(node_or_value, torch.fx.Node):
        specs = specs_of(node_or_value)
        if len(specs) == 1 and not isinstance(node_or_value.meta.get("val", node_or_value.meta.get("out")),
                                              (list, tuple)):
            return _meta_tensor(*specs[0])
        return tuple(_meta_tensor(*s) for s in specs)
    return node_or_value


def analytic_time(node: torch.fx.Node, device: costmodel.GPU) -> float:
    """Roofline time (ms) of a compute node from its recorded shapes; views and getitems cost 0."""
    if node.op != "call_function" or is_view_like(node):
        return 0.0
    args = torch.fx.node.map_arg(node.args, lambda n: _as_meta(n, node_specs))
    kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: _as_meta(n, node_specs))
    outs = node_specs(node)
    out_val = _as_meta(node, node_specs)
    flops = costmodel.node_flops(node.target, args, kwargs, out_val)
    read = sum(_node_bytes(n) for n in node.all_input_nodes)
    written = sum(_nbytes(shape, dtype) for shape, dtype in outs)
    dtypes = [dtype for _, dtype in outs if dtype.is_floating_point] or [
        dtype for n in node.all_input_nodes for _, dtype in node_specs(n) if dtype.is_floating_point]
    dtype = dtypes[0] if dtypes else torch.float32
    return costmodel.roofline_ms(flops, read + written, dtype, device)


# ---------------------------------------------------------------------------
# Measured profile: running the graphs
# ---------------------------------------------------------------------------

def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class _Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def time(self, call: Callable[[], Any], iters: int, warmup: int) -> tuple[Any, float]:
        """(last result, median milliseconds)."""
        out = None
        for _ in range(warmup):
            out = call()
            del out
        samples = []
        if self.cuda:
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
            for i in range(iters):
                starts[i].record()
                out = call()
                ends[i].record()
            torch.cuda.synchronize()
            samples = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        else:
            for _ in range(iters):
                begin = time.perf_counter_ns()
                out = call()
                samples.append((time.perf_counter_ns() - begin) / 1e6)
        return out, float(statistics.median(samples))


# ---------------------------------------------------------------------------
# Distributed (measured) collectives
# ---------------------------------------------------------------------------

def _process_group_size() -> int:
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _measure_collective(node: torch.fx.Node, world_size: int, device, timer: _Timer, options) -> float:
    import torch.distributed as dist
    (shape, dtype), = node_specs(node)[:1]
    shard = costmodel.shard_numel(math.prod(shape), world_size)
    full = torch.empty(shard * world_size, dtype=dtype, device=device)
    part = torch.empty(shard, dtype=dtype, device=device)
    if role_of(node) is Role.ALLGATHER:
        def call():
            dist.all_gather_into_tensor(full, part)
    else:
        def call():
            dist.reduce_scatter_tensor(part, full)
    dist.barrier()
    _, ms = timer.time(call, options.iters, options.warmup)
    samples = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(samples, op=dist.ReduceOp.MAX)
    return float(samples.item())


# ---------------------------------------------------------------------------
# The profiler
# ---------------------------------------------------------------------------

def _progress(enabled: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=Console(stderr=True), disable=not enabled, transient=True)
    return progress


def profile_bundle(bundle: Bundle, options: ProfileOptions = ProfileOptions(), *,
                   params: dict[int, torch.Tensor] | None = None,
                   inputs: list[torch.Tensor] | None = None) -> Bundle:
    """A copy of ``bundle`` whose nodes carry ``device_time``, ``tensor_size`` and ``time_source``.

    ``params`` (ds_id -> tensor) and ``inputs`` (``bundle.inputs`` order) are
    the real tensors to run a measured profile with; without them, parameters
    are random and inputs are the stored ones or made within their ranges.
    """
    options.check()
    bundle = bundle.with_graphs(**{name: copy_graph(g) for name, g in bundle.graphs.items()})
    group_size = _process_group_size()
    distributed = group_size > 1
    world_size = group_size if distributed else options.world_size
    target_gpu = costmodel.gpu(options.gpu) if options.gpu else None

    sizes = tensor_sizes(bundle, world_size)
    for name, graph in bundle.graphs.items():
        for node in graph.nodes:
            node.meta["tensor_size"] = sizes[name][node.name]

    total = sum(len(graph.nodes) for graph in bundle.graphs.values())
    device_desc: str
    if options.cost_model == "analytic":
        device_desc = f"{options.gpu.lower()} (analytic, not run)"
        with _progress(options.progress) as progress:
            task = progress.add_task("estimating", total=total)
            for graph in bundle.graphs.values():
                for node in graph.nodes:
                    _set_static_time(node, options, target_gpu)
                    progress.advance(task)
    else:
        device = torch.device(options.device) if options.device else _default_device()
        device_desc = _describe_device(device)
        timer = _Timer(device)
        with _progress(options.progress) as progress:
            calls = sum(n.op == "call_function" for graph in bundle.graphs.values() for n in graph.nodes)
            task = progress.add_task(f"profiling on {device_desc}", total=calls)

            by_name = {name: {n.name: n for n in graph.nodes} for name, graph in bundle.graphs.items()}

            def on_node(graph_name: str, copy: torch.fx.Node, call):
                node = by_name[graph_name][copy.name]  # the runnable copy's node is the bundle's by name
                role = role_of(node)
                if role in COMM_ROLES:
                    if distributed and role in (Role.ALLGATHER, Role.REDUCE):
                        node.meta["device_time"] = _measure_collective(node, world_size, device, timer, options)
                        node.meta["time_source"] = "measured"
                    else:
                        node.meta["device_time"] = _modelled_time(node, options) if not distributed else 0.0
                        node.meta["time_source"] = "modelled" if not distributed else "measured"
                    out = call()  # once: a release frees the gathered buffer at its last call
                else:
                    out, ms = timer.time(call, options.iters, options.warmup)
                    node.meta["device_time"] = ms
                    node.meta["time_source"] = "measured"
                progress.advance(task)
                return out

            try:
                with installed(ops.Zero3Runtime()), torch.no_grad():
                    step = build_step(bundle, device)
                    run_step(step, make_state(bundle, device=device, params=params, inputs=inputs), on_node=on_node)
            except DcschedError:
                raise
            except Exception as exc:  # a node that cannot run here: say which
                raise DcschedError(f"profiling failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}") \
                    from exc
            for graph in bundle.graphs.values():
                for node in graph.nodes:
                    if node.op in ("placeholder", "output", "get_attr"):
                        node.meta.update(device_time=0.0, time_source="none")

    if options.cost_model == "analytic":
        target_memory = target_gpu.memory_bytes
    elif target_gpu is not None:
        target_memory = target_gpu.memory_bytes
    elif options.cost_model == "measured" and (options.device or str(_default_device())).startswith("cuda"):
        target_memory = torch.cuda.get_device_properties(torch.device(options.device or "cuda")).total_memory
    else:
        target_memory = None

    bundle.provenance = {
        **bundle.provenance,
        "cost_model": options.cost_model,
        "device_time": ("analytic roofline max(flops/peak, bytes/memory bandwidth)"
                        if options.cost_model == "analytic"
                        else f"measured: median of {options.iters} runs after {options.warmup} warm-up runs"),
        "comm_time": ("measured with real collectives" if distributed
                      else "modelled: bytes*(W-1)/W / bandwidth + latency"),
        "tensor_size": "bytes of node outputs from recorded shapes; parameters and gradients as 1/W shards",
        "device": device_desc,
        "gpu": target_gpu.name if target_gpu else None,
        "target_memory_bytes": target_memory,
        "torch": str(torch.__version__),
        "world_size": world_size,
        "bandwidth_GBps": None if distributed else options.bandwidth_gbps,
        "latency_us": None if distributed else options.latency_us,
        "iters": options.iters if options.cost_model == "measured" else None,
        "warmup": options.warmup if options.cost_model == "measured" else None,
    }
    return bundle


def _set_static_time(node: torch.fx.Node, options: ProfileOptions, device: costmodel.GPU) -> None:
    role = role_of(node)
    if node.op in ("placeholder", "output", "get_attr"):
        node.meta.update(device_time=0.0, time_source="none")
    elif role in COMM_ROLES:
        node.meta.update(device_time=_modelled_time(node, options), time_source="modelled")
    else:
        node.meta.update(device_time=analytic_time(node, device), time_source="analytic")


def _describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    import platform
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"

