"""``measured``: the step runs for real (:mod:`dcsched.runtime.step`) and every compute node is timed.

Each compute node runs ``warmup`` times untimed, then ``iters`` times timed;
the median is kept. On a GPU with CUDA events, on the CPU with
``time.perf_counter_ns``. Communication nodes run once (a release frees the
gathered buffer at its last call): modelled from their bytes in one process,
measured with real collectives of the same size when the run's topology has a
process group of more than one rank (:meth:`MeasuredCostModel.measures_collectives`).
"""

from __future__ import annotations

import math
import platform
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.fx

from dcsched.runtime import ops
from dcsched.bundle.core import Bundle
from dcsched.errors import DcschedError
from dcsched.graph.roles import COMM_ROLES, Role, role_of
from dcsched.graph.specs import node_specs, shard_numel
from dcsched.runtime.step import build_step, installed, make_state, run_step
from dcsched.costmodels.base import FREE_OPS, CostModel, ProfileRun, modelled_comm_time, progress_bar
from dcsched.costmodels.interconnects import kind_of_device
from dcsched.costmodels.registry import register
from dcsched.costmodels.topology import Topology

if TYPE_CHECKING:
    from dcsched.costmodels.options import ProfileOptions

#: The interconnect row for a CUDA GPU the table does not list (and no ``gpu`` named): the slowest GPU row, so
#: that communication is not made to look cheaper than it likely is.
UNLISTED_GPU_KIND = "a100"
#: The fewest timed runs of the collective that measures the latency under a process group.
LATENCY_ITERS = 20


def default_device() -> torch.device:
    """CUDA when there is a GPU, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def describe_device(device: torch.device) -> str:
    """``cuda:0 (NVIDIA H100 80GB HBM3)``, ``cpu (x86_64, 2 threads)``."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


class Timer:
    """Median milliseconds of a call: CUDA events on a GPU, ``perf_counter_ns`` on the CPU."""

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


def measure_collective(node: torch.fx.Node, world_size: int, device, timer: Timer, iters: int,
                       warmup: int) -> float:
    """Median ms of a real all-gather / reduce-scatter of ``node``'s size, the slowest rank's."""
    (shape, dtype), = node_specs(node)[:1]
    return _time_collective(role_of(node) is Role.ALLGATHER, shard_numel(math.prod(shape), world_size), dtype,
                            world_size, device, timer, iters, warmup)


def measure_latency(world_size: int, device, timer: Timer, iters: int, warmup: int) -> float:
    """Median ms of a real all-gather of one float per rank, the slowest rank's: the latency every collective
    pays once, whatever its bytes (what a bucket of collectives saves per member after its first)."""
    return _time_collective(True, 1, torch.float32, world_size, device, timer, iters, warmup)


def _time_collective(gather: bool, shard: int, dtype: torch.dtype, world_size: int, device, timer: Timer,
                     iters: int, warmup: int) -> float:
    """Median ms of an all-gather (``gather``) or reduce-scatter of ``shard`` elements a rank, the slowest
    rank's (every rank gets the same figure)."""
    import torch.distributed as dist

    from dcsched.runtime.distributed import all_gather_into_tensor, reduce_scatter_tensor
    full = torch.empty(shard * world_size, dtype=dtype, device=device)
    part = torch.empty(shard, dtype=dtype, device=device)
    if gather:
        def call():
            all_gather_into_tensor(full, part)
    else:
        def call():
            reduce_scatter_tensor(part, full)
    dist.barrier()
    _, ms = timer.time(call, iters, warmup)
    samples = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(samples, op=dist.ReduceOp.MAX)
    return float(samples.item())


@register
class MeasuredCostModel(CostModel):
    name = "measured"
    description = "run every node here and time it (median of iters runs after warmup runs)"

    def __init__(self, device: torch.device, iters: int, warmup: int) -> None:
        self.device, self.iters, self.warmup = device, iters, warmup
        self.timer = Timer(device)
        #: the latency measured under a process group (:meth:`annotate`), None before or in one process
        self.measured_latency_ms: float | None = None

    @classmethod
    def from_options(cls, options: ProfileOptions) -> MeasuredCostModel:
        device = torch.device(options.device) if options.device else default_device()
        return cls(device, options.iters, options.warmup)

    def interconnect_kind(self, options: ProfileOptions) -> str:
        """The named GPU's row, else the device's here (``cpu``, or the CUDA GPU's kind by its name)."""
        if options.gpu is not None:
            return options.gpu.lower()
        return kind_of_device(describe_device(self.device)) or UNLISTED_GPU_KIND

    def link_note(self, options: ProfileOptions) -> str:
        if options.gpu is None and kind_of_device(describe_device(self.device)) is None:
            return f"({describe_device(self.device)} is not in the table: taken as {UNLISTED_GPU_KIND})"
        return ""

    def measures_collectives(self, topology: Topology) -> bool:
        """Under a process group of more than one rank: the step runs here, so its collectives run for real."""
        return topology.process_group

    def _time_node(self, node: torch.fx.Node, call, run: ProfileRun):
        """Run one node, setting its figures; returns its value."""
        role = role_of(node)
        if role not in COMM_ROLES:
            out, ms = self.timer.time(call, self.iters, self.warmup)
            node.meta.update(device_time=ms, time_source="measured")
            return out
        measuring = self.measures_collectives(run.topology)
        if measuring and role in (Role.ALLGATHER, Role.REDUCE):
            ms = measure_collective(node, run.topology.world_size, self.device, self.timer, self.iters,
                                    self.warmup)
            node.meta.update(device_time=ms, time_source="measured")
        elif measuring:
            node.meta.update(device_time=0.0, time_source="measured")
        else:
            node.meta.update(device_time=modelled_comm_time(node, run.topology), time_source="modelled")
        return call()  # once: a release frees the gathered buffer at its last call

    def comm_latency_ms(self, run: ProfileRun) -> float | None:
        """Under a process group, the latency :meth:`annotate` measured (the collectives' figures are
        measured, latency included); in one process the modelled link's."""
        return self.measured_latency_ms if self.measures_collectives(run.topology) else super().comm_latency_ms(run)

    def annotate(self, bundle: Bundle, options: ProfileOptions, run: ProfileRun) -> str:
        description = describe_device(self.device)
        if self.measures_collectives(run.topology):  # a tiny collective's median is cheap: more runs, steadier
            self.measured_latency_ms = measure_latency(run.topology.world_size, self.device, self.timer,
                                                       max(self.iters, LATENCY_ITERS), max(self.warmup, 2))
        by_name = {name: {n.name: n for n in graph.nodes} for name, graph in bundle.graphs.items()}
        with progress_bar(options.progress) as progress:
            calls = sum(n.op == "call_function" for graph in bundle.graphs.values() for n in graph.nodes)
            task = progress.add_task(f"profiling on {description}", total=calls)

            def on_node(graph_name: str, copy: torch.fx.Node, call):
                out = self._time_node(by_name[graph_name][copy.name], call, run)  # the copy's by name
                progress.advance(task)
                return out

            try:
                with installed(ops.Zero3Runtime()), torch.no_grad():
                    state = make_state(bundle, device=self.device, params=run.params, inputs=run.inputs)
                    run_step(build_step(bundle, self.device), state, on_node=on_node)
            except DcschedError:
                raise
            except Exception as exc:  # a node that cannot run here: say which
                raise DcschedError(f"profiling failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}") \
                    from exc
        for graph in bundle.graphs.values():
            for node in graph.nodes:
                if node.op in FREE_OPS:
                    node.meta.update(device_time=0.0, time_source="none")
        if self.measured_latency_ms is not None:  # no collective pays more latency than it takes in all
            self.measured_latency_ms = min([self.measured_latency_ms] + [
                node.meta["device_time"] for graph in bundle.graphs.values() for node in graph.nodes
                if role_of(node) in (Role.ALLGATHER, Role.REDUCE) and node.meta["device_time"] > 0])
        return description

    def target_memory(self, options: ProfileOptions) -> int | None:
        """The named GPU's memory, else the GPU profiled on's, else unknown (a CPU profile)."""
        named = super().target_memory(options)
        if named is None and self.device.type == "cuda":
            return torch.cuda.get_device_properties(self.device).total_memory
        return named

    def provenance(self, options: ProfileOptions) -> dict[str, Any]:
        return {"device_time": f"measured: median of {self.iters} runs after {self.warmup} warm-up runs",
                "iters": self.iters, "warmup": self.warmup}
