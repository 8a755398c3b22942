"""Measuring a step: peak memory, and time per iteration on the CPU or with CUDA events."""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.fx

from dcsched.replay.watchdog import Unwatched
from dcsched.runtime.memtrack import LiveBytes
from dcsched.runtime.step import Step, StepState, run_step


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

    @classmethod
    def from_samples(cls, device: torch.device, warmup: int, times: list[tuple[float, float]], peak: int,
                     resident: int, timer: str, memory_source: str) -> "Measurement":
        """From per-step (forward ms, backward ms) samples and the memory figures."""
        steps = [f + b for f, b in times]
        median = statistics.median
        return cls(
            device=str(device), iters=len(steps), warmup=warmup,
            step_ms=median(steps) if steps else None,
            step_ms_min=min(steps) if steps else None,
            step_ms_max=max(steps) if steps else None,
            forward_ms=median(f for f, _ in times) if steps else None,
            backward_ms=median(b for _, b in times) if steps else None,
            peak_bytes=int(peak), resident_bytes=int(resident), timer=timer, memory_source=memory_source)

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


def synchronize(device: torch.device) -> None:
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
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device)
        results = run_step(step, state)
        synchronize(device)
        del results
        return torch.cuda.max_memory_allocated(device), resident, "torch.cuda.max_memory_allocated"
    with LiveBytes() as tracker:
        tracker.track([state.forward_args, list(step.constants.values())])
        resident = tracker.live
        tracker.reset_peak()
        results = run_step(step, state)
        del results
        peak = tracker.peak
    return peak, resident, "live tensor storages (dcsched.runtime.memtrack)"


def clock_for(device: torch.device):
    return _CudaClock() if device.type == "cuda" else _CpuClock()


def time_step(step: Step, state: StepState, clock) -> tuple[float, float]:
    """(forward ms, backward ms) of one step, all ranks starting together."""
    _barrier()
    synchronize(step.device)
    results = run_step(step, state, mark=clock)
    synchronize(step.device)
    del results
    return clock.split_ms()


def measure(step: Step, state: StepState, *, iters: int = 5, warmup: int = 1, watch=None) -> Measurement:
    """Warm up, measure peak memory over one step, then time ``iters`` steps.

    ``watch``: a :class:`dcsched.replay.watchdog.Watchdog` bounding each step (none by default).
    """
    watch = watch or Unwatched()
    for k in range(max(warmup, 0)):
        with watch.phase(f"warm-up step {k + 1}"):
            run_step(step, state)
            synchronize(step.device)
    with watch.phase("the step measuring memory"):
        peak, resident, memory_source = measure_memory(step, state)
    clock = clock_for(step.device)
    times = []
    for k in range(max(iters, 0)):
        with watch.phase(f"timed step {k + 1}"):
            times.append(time_step(step, state, clock))
    return Measurement.from_samples(step.device, warmup, times, peak, resident, clock.name, memory_source)
