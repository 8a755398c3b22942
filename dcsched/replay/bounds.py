"""What a replay may cost, from the bundle's own figures, checked before anything is allocated or run.

A bundle says what each node outputs (``out``: shapes and dtypes; ``tensor_size``: bytes) and how long it
takes (``device_time``). Replay holds it to those figures:

* **Sizes.** :func:`check_step` propagates shapes through the replay's own modules with fake tensors
  (``FakeTensorMode``: no memory, no kernels) from the stored inputs' and parameters' shapes, and refuses
  a node whose real output disagrees with its recorded shapes, dtypes or bytes (a 3 GiB ``aten.full``
  recorded as 64 B). With every size verified, the simulator's peak on them bounds the step's memory;
  :func:`check_memory` compares it, times :data:`MEMORY_MARGIN`, with the memory the device has free.
* **Time.** A step may take :data:`TIME_FACTOR` times the bundle's recorded work (the sum of its nodes'
  ``device_time``), and never less than :data:`TIME_FLOOR_S` (:meth:`StepBounds.step_seconds`). A
  matrix product or convolution whose FLOPs at :data:`GENEROUS_FLOPS` take longer than its recorded time
  times the factor is refused before running; the rest is the watchdog's
  (:mod:`dcsched.replay.watchdog`), since one aten kernel cannot be interrupted.

>>> from dcsched import replay as rp
>>> from dcsched.runtime import ops
>>> bounds = check_step(rp.example_bundle(), "cpu", ops.Zero3Runtime())
>>> bounds.peak_bytes > 0, bounds.step_seconds() == TIME_FLOOR_S
(True, True)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import torch
import torch.fx

from dcsched.bundle.core import Bundle
from dcsched.errors import DcschedError, GraphError
from dcsched.graph.roles import Role, is_view_like, role_of
from dcsched.graph.specs import Spec, value_specs, nbytes, node_specs, shard_numel
from dcsched.replay.watchdog import Watchdog
from dcsched.runtime import ops
from dcsched.units import format_bytes, format_ms

#: A CPU step of a bundle whose figures were made for an H100 took 1,350-2,250 times the bundle's recorded
#: work on this project's 2-core CI machine (sample_graphs/*.pt, December 2026); 10,000 leaves 4x for a
#: busier machine. A bundle profiled on the device that replays it needs about 1.
TIME_FACTOR = 10_000
#: Seconds a step may always take (unprofiled bundles record no time; a tiny step's figures are microseconds).
TIME_FLOOR_S = 60.0
#: FLOP/s no CPU replay beats by much: about 40 times what this project's CI machine's two cores do (27 GFLOP/s
#: measured for float32 matrix products). A product whose FLOPs at this rate outlast its recorded time times
#: :data:`TIME_FACTOR` cannot be what the bundle says (its figures claim 10 PFLOP/s or more).
GENEROUS_FLOPS = 1e12
#: The step's memory may reach the simulated peak (of verified sizes) times this: the CPU's measured peak is
#: within 4% of the simulated one on the sample graphs; the rest is room for kernels' scratch memory and the
#: allocator's slack, which no figure records.
MEMORY_MARGIN = 1.5
#: What a replaying process may grow by beyond its tensors, which the watchdog's view of memory (the resident
#: set, on the CPU) also holds: modules imported on first use, the allocator's cached pages, the interpreter's.
MEMORY_SLACK = 512 * 2**20
#: Ops whose FLOPs are counted (by :class:`torch.utils.flop_counter.FlopCounterMode`, on fake tensors).
MATMUL_OPS = ("mm", "bmm", "addmm", "baddbmm", "convolution", "_convolution", "convolution_backward")


@dataclasses.dataclass(frozen=True)
class StepBounds:
    """One bundle's step as its verified figures bound it.

    ``peak_bytes``: the simulated peak on verified sizes (the largest memory the step holds);
    ``resident_bytes``: its parameters and inputs (held before the step starts); ``recorded_ms``: the sum
    of its nodes' ``device_time``; ``flops``: its matrix products' and convolutions' FLOPs.
    """

    peak_bytes: int
    resident_bytes: int
    recorded_ms: float
    flops: float

    def step_seconds(self, factor: float | None = None, floor: float | None = None) -> float:
        """Seconds one step may take: the recorded work times ``factor`` (default :data:`TIME_FACTOR`), at
        least ``floor`` (default :data:`TIME_FLOOR_S`).

        >>> StepBounds(0, 0, 8.0, 0.0).step_seconds()
        80.0
        """
        factor = TIME_FACTOR if factor is None else factor
        floor = TIME_FLOOR_S if floor is None else floor
        return max(floor, factor * self.recorded_ms / 1000.0)

    def memory_bytes(self, margin: float | None = None) -> int:
        """Bytes the step may hold: the simulated peak times ``margin`` (default :data:`MEMORY_MARGIN`)."""
        return int(math.ceil(self.peak_bytes * (MEMORY_MARGIN if margin is None else margin)))


class _Shapes(ops.Zero3Runtime):
    """A runtime for fake tensors: the real runtime's output shapes, none of its state or collectives."""

    def __init__(self, real: ops.Zero3Runtime) -> None:
        super().__init__()
        self.real = real

    def gathered_like(self, shard, graph_id, ds_id, dtype):
        return self.real.gathered_like(shard, graph_id, ds_id, dtype)

    def reduced_shard_like(self, grad, graph_id, ds_id):
        return self.real.reduced_shard_like(grad, graph_id, ds_id)


def _describe(specs: Sequence[Spec]) -> str:
    text = ", ".join(f"{str(dtype).removeprefix('torch.')}{list(shape)}" for shape, dtype in specs) or "nothing"
    return f"{text} ({format_bytes(sum(nbytes(s, d) for s, d in specs))})"


class _Checker:
    """Each node's fake output against its recorded figures; the step's FLOPs on the way."""

    def __init__(self, bundle: Bundle, runtime: ops.Zero3Runtime) -> None:
        self.world_size = runtime.world_size
        profiled = bundle.provenance.get("world_size")
        self.profiled = profiled if isinstance(profiled, int) and not isinstance(profiled, bool) and profiled > 0 \
            else 1
        self.flops = 0.0
        self.real_bytes: dict[str, dict[str, int]] = {}

    def __call__(self, graph_name: str, node: torch.fx.Node, call):
        target = node.target
        counted = isinstance(target, torch._ops.OpOverload) and target.namespace == "aten" and \
            target._opname in MATMUL_OPS
        try:
            if counted:
                from torch.utils.flop_counter import FlopCounterMode
                with FlopCounterMode(display=False) as counter:
                    value = call()
                self._check_time(graph_name, node, float(counter.get_total_flops()))
            else:
                value = call()
        except (torch._subclasses.fake_tensor.DynamicOutputShapeException,
                torch._subclasses.fake_tensor.DataDependentOutputException) as exc:
            raise GraphError(f"graph '{graph_name}': node {node.name} ({target}) outputs a size that depends on "
                             "the values it computes, so replay cannot check it against the bundle's figures "
                             f"before running it ({type(exc).__name__})") from None
        self._check_size(graph_name, node, value_specs(value))
        return value

    def _check_time(self, graph_name: str, node: torch.fx.Node, flops: float) -> None:
        self.flops += flops
        recorded = node.meta.get("device_time")
        if not isinstance(recorded, (int, float)) or isinstance(recorded, bool):
            return
        least_s = flops / GENEROUS_FLOPS
        allowed_s = TIME_FACTOR * float(recorded) / 1000.0
        if least_s > allowed_s:
            raise GraphError(f"graph '{graph_name}': node {node.name} computes {flops:.3g} FLOPs, at least "
                             f"{least_s:.3g} s at {GENEROUS_FLOPS:.0e} FLOP/s, but the bundle records "
                             f"{format_ms(float(recorded))} for it (at most {allowed_s:.3g} s allowed: "
                             f"{TIME_FACTOR} x its time); its figures do not describe it, refused before running")

    def _is_reduce(self, node: torch.fx.Node) -> bool:
        return role_of(node) is Role.REDUCE

    def _check_size(self, graph_name: str, node: torch.fx.Node, real: list[Spec]) -> None:
        where = f"graph '{graph_name}': node {node.name}"
        real_bytes = sum(nbytes(shape, dtype) for shape, dtype in real)
        self.real_bytes.setdefault(graph_name, {})[node.name] = real_bytes
        reduce = self._is_reduce(node)
        if node.meta.get("out") is not None or node.meta.get("val") is not None:
            recorded = node_specs(node)
            if reduce:  # a rank's reduced gradient: a flat shard of the recorded gradient, or all of it
                agrees = len(recorded) == len(real) and all(
                    d == rd and math.prod(rs) in (math.prod(s), shard_numel(math.prod(s), self.world_size))
                    for (s, d), (rs, rd) in zip(recorded, real))
            else:
                agrees = [(tuple(s), d) for s, d in recorded] == [(tuple(s), d) for s, d in real]
            if not agrees:
                raise GraphError(f"{where} outputs {_describe(real)} when run, but the bundle records "
                                 f"{_describe(recorded)}: its figures do not describe it, refused before running")
        size = node.meta.get("tensor_size")
        if isinstance(size, (int, float)) and not isinstance(size, bool):
            allowed = {real_bytes}
            if is_view_like(node):  # allocates nothing: a size of 0 is no lie about memory
                allowed.add(0)
            if reduce:  # recorded for the world size it was profiled at: a shard of the whole gradient
                whole = node_specs(node) if node.meta.get("out") is not None else real if self.world_size == 1 else []
                allowed.add(sum(shard_numel(math.prod(s), self.profiled) * d.itemsize for s, d in whole))
            if int(size) not in allowed:
                raise GraphError(f"{where} outputs {_describe(real)} when run, but the bundle records "
                                 f"tensor_size {format_bytes(int(size))}: its figures do not describe it, "
                                 "refused before running")


def _fake_args(bundle: Bundle, runtime: ops.Zero3Runtime, device: torch.device) -> list:
    """The forward's arguments as fake tensors of the shapes :func:`~dcsched.runtime.step.make_state` gives."""
    from dcsched.runtime.step import forward_arg
    shard = getattr(runtime, "shard", None) if runtime.world_size > 1 else None
    whole = runtime.plan.replicated if shard is not None else ()
    full = {p.ds_id: torch.empty(tuple(p.shape), dtype=p.dtype, device=device) for p in bundle.params}
    if shard is not None and whole:
        cut = shard
        full = {d: value.reshape(-1) if d in whole else cut(value) for d, value in full.items()}
        shard = None
    inputs = [torch.empty(tuple(i.shape), dtype=i.dtype, device=device) for i in bundle.inputs]
    return [forward_arg(k, entry, full, inputs, shard) for k, entry in enumerate(bundle.forward_placeholders)]


def _with_sizes(bundle: Bundle, sizes: Mapping[str, Mapping[str, int]]) -> Bundle:
    """A copy of ``bundle`` whose call nodes carry the verified ``tensor_size`` (for the simulator)."""
    from dcsched.graph.nxview import copy_graph
    graphs = {}
    for name, graph in bundle.graphs.items():
        copy = copy_graph(graph)
        for node in copy.nodes:
            if node.name in sizes.get(name, {}):
                node.meta["tensor_size"] = sizes[name][node.name]
        graphs[name] = copy
    result = bundle.with_graphs(**graphs)
    result.plans = dict(bundle.plans)
    return result


def recorded_ms(bundle: Bundle) -> float:
    """The sum of every node's recorded ``device_time`` in the step's graphs (ms; 0 for an unprofiled bundle)."""
    total = 0.0
    for graph in bundle.graphs.values():
        for node in graph.nodes:
            time = node.meta.get("device_time")
            if isinstance(time, (int, float)) and not isinstance(time, bool) and math.isfinite(time):
                total += float(time)
    return total


def check_step(bundle: Bundle, device: torch.device | str, runtime: ops.Zero3Runtime,
               placeholder_order: Mapping[str, list[str]] | None = None) -> StepBounds:
    """Verify every node's output against the bundle's figures without allocating, and bound the step.

    Runs the replay's own modules (:func:`~dcsched.runtime.step.build_step`) under ``FakeTensorMode``,
    with ``runtime``'s shapes for the ZeRO-3 ops, from the stored parameters' and inputs' shapes.

    Raises
    ------
    GraphError
        A node whose output (shapes, dtypes, bytes) disagrees with its recorded ``out`` or
        ``tensor_size``, whose FLOPs cannot fit its recorded time (:data:`GENEROUS_FLOPS`,
        :data:`TIME_FACTOR`), whose output size depends on data, or a graph that fails to run.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dcsched.sim.bundle_figures import simulated_figures
    from dcsched.runtime.step import build_step, installed, run_step

    device = torch.device(device)
    checker = _Checker(bundle, runtime)
    step = build_step(bundle, device, placeholder_order=placeholder_order)
    with FakeTensorMode(allow_non_fake_inputs=True), installed(_Shapes(runtime)):
        args = _fake_args(bundle, runtime, device)
        resident = sum(a.numel() * a.element_size() for a in args)
        from dcsched.runtime.step import StepState
        run_step(step, StepState(args, 0), on_node=checker)
    figures, _note = simulated_figures(_with_sizes(bundle, checker.real_bytes), runtime.world_size)
    if figures is not None:
        peak = int(figures["peak_bytes"])
    else:  # not simulated: every output alive at once
        peak = resident + sum(sum(sizes.values()) for sizes in checker.real_bytes.values())
    return StepBounds(max(peak, resident), resident, recorded_ms(bundle), checker.flops)


def check_memory(bounds: Sequence[StepBounds], device: torch.device, available: int | None = None,
                 margin: float | None = None) -> int:
    """Refuse (DcschedError) steps that cannot fit ``device``'s free memory together; returns the bytes needed.

    The orders run one at a time, each alive with the others' parameters and inputs (the timing rounds
    hold all of them): what the largest step holds, times ``margin``, plus the others' resident bytes.

    >>> try:
    ...     check_memory([StepBounds(2**30, 2**20, 1.0, 0.0)], torch.device("cpu"), available=2**30)
    ... except DcschedError as exc:
    ...     print(str(exc)[:60])
    the step needs up to 1.50 GiB (its simulated peak 1.00 GiB o
    """
    from dcsched.replay.device import free_bytes
    if not bounds:
        return 0
    margin = MEMORY_MARGIN if margin is None else margin
    largest = max(range(len(bounds)), key=lambda k: bounds[k].memory_bytes(margin))
    others = sum(b.resident_bytes for k, b in enumerate(bounds) if k != largest)
    need = bounds[largest].memory_bytes(margin) + others
    available = free_bytes(device) if available is None else available
    if available is not None and need > available:
        held = f" and the other order's parameters and inputs {format_bytes(others)}" if others else ""
        raise DcschedError(f"the step needs up to {format_bytes(need)} (its simulated peak "
                           f"{format_bytes(bounds[largest].peak_bytes)} on verified sizes x {margin:g}{held}) but "
                           f"only {format_bytes(available)} is free on {device}; nothing was allocated")
    return need


def watchdog_for(bounds: Sequence[StepBounds], need: int, device: torch.device,
                 timeout: float | None = None) -> Watchdog:
    """The watchdog of a bounded replay of steps ``bounds`` needing ``need`` bytes (:func:`check_memory`).

    Each phase within the slower step's :meth:`StepBounds.step_seconds`, or ``timeout`` seconds for
    everything; the process's memory within ``need``, plus each step's resident bytes again (the results
    kept: gradients as large as the parameters), plus :data:`MEMORY_SLACK`.
    """
    slowest = max(bounds, key=lambda b: b.step_seconds())
    if timeout is not None:
        how = f"--timeout {timeout:g}"
    else:
        how = (f"a step may take {TIME_FACTOR} x the bundle's {slowest.recorded_ms:.3g} ms of recorded device "
               f"time, at least {TIME_FLOOR_S:g} s; --timeout SECONDS sets another bound")
    limit = need + sum(b.resident_bytes for b in bounds) + MEMORY_SLACK
    return Watchdog(step_s=slowest.step_seconds(), total_s=timeout, memory_limit=limit, device=device, how=how)
