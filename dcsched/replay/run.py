"""Replay one bundle: build, seed, run and measure its step under the ZeRO-3 runtime."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Mapping

import torch
import torch.fx

from dcsched.runtime import ops
from dcsched.runtime.commplan import comm_plan
from dcsched.bundle.core import Bundle
from dcsched.bundle.core import check_replayable
from dcsched.replay.bounds import check_memory as check_bounds, check_step
from dcsched.replay.device import check_fits, resolve_device
from dcsched.replay.watchdog import Unwatched
from dcsched.replay.measure import Measurement, synchronize, measure
from dcsched.runtime.step import DEFAULT_SEED, Step, StepState, build_step, installed, make_state, run_step


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
    whole = runtime.plan.replicated if shard is not None else ()  # replicated: every rank the whole weight
    return step, make_state(bundle, seed=seed, device=device, shard=shard, values=values, whole=whole)


def as_shards(bundle: Bundle, results: dict[str, torch.Tensor], runtime: ops.Zero3Runtime) -> dict[str, torch.Tensor]:
    """``results`` with each replicated parameter's (whole) gradient cut to this rank's shard.

    So that a run with replicated parameters compares, rank by rank, with one
    that shards them: the all-reduce averages each element as the
    reduce-scatter does, so the shards are equal bit for bit.
    """
    replicated = runtime.plan.replicated
    if runtime.world_size == 1 or not replicated:
        return results
    from dcsched.runtime.distributed import shard_of
    from dcsched.runtime.step import result_names
    names = {name: int(entry["ds_id"]) for name, entry in zip(result_names(bundle), bundle.forward_placeholders)
             if entry.get("kind") == "param"}
    return {name: shard_of(value, runtime.rank, runtime.world_size) if names.get(name) in replicated else value
            for name, value in results.items()}


def replay(bundle: Bundle, *, device: torch.device | str = "cpu", seed: int = DEFAULT_SEED, iters: int = 5,
           warmup: int = 1, runtime: ops.Zero3Runtime | None = None, check_memory: bool = True,
           values: Mapping[str, torch.Tensor] | None = None,
           placeholder_order: Mapping[str, list[str]] | None = None, memory: bool | None = None,
           watch=None) -> ReplayRun:
    """Run ``bundle``'s step: results of one step and, with ``iters`` > 0, measured figures.

    ``runtime`` defaults to a fresh single-process :class:`~dcsched.runtime.ops.Zero3Runtime`
    running the bundle's plan; pass a :class:`dcsched.runtime.distributed.DistributedZero3Runtime`
    to run sharded (it runs the plan it was given: :func:`dcsched.runtime.select.runtime_for`).
    ``values``: chosen parameter/input tensors by name (see :func:`make_state`).
    ``placeholder_order``: per graph, the placeholder names in the order the
    bundle's placeholder tables describe them (see :func:`build_step`).
    ``memory`` (default: ``iters > 0``) measures peak memory even when nothing is timed.
    ``check_memory``: before allocating anything, check every node's output against the bundle's figures
    and the step's memory against the device's (:func:`dcsched.replay.bounds.check_step`).
    ``watch``: a :class:`dcsched.replay.watchdog.Watchdog` bounding each phase (none by default).
    """
    check_replayable(bundle)
    device = resolve_device(device) if isinstance(device, str) else device
    if runtime is None:  # one process: only the plan's kept parameters change anything
        runtime = ops.Zero3Runtime()
        runtime.set_plan(comm_plan(bundle.plans, bundle.graph_ids))
    memory = iters > 0 if memory is None else memory
    if check_memory:
        check_fits(bundle, device, runtime.world_size)
        check_bounds([check_step(bundle, device, runtime, placeholder_order)], device)
    watch = watch or Unwatched()
    with installed(runtime), deterministic():
        with watch.phase("preparing the step"):
            step, state = prepare(bundle, device=device, seed=seed, runtime=runtime, values=values,
                                  placeholder_order=placeholder_order)
        with watch.phase("the first step"):
            results = {name: value.detach().to("cpu", copy=True)
                       for name, value in as_shards(bundle, run_step(step, state), runtime).items()}
            synchronize(device)
        measurement = None
        if memory or iters > 0:  # the results' step above was the first warm-up step
            measurement = measure(step, state, iters=iters, warmup=max(warmup - 1, 0), watch=watch)
            measurement = dataclasses.replace(measurement, warmup=max(warmup, 1))
    return ReplayRun(results, measurement, runtime.world_size, runtime.rank)
