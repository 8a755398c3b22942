"""Replay a reordered bundle beside its baseline: the same results, and both orders' time and memory."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch
import torch.fx

from dcsched.runtime import ops
from dcsched.runtime.select import runtime_for
from dcsched.bundle.core import Bundle
from dcsched.collective_issue import PROCESS_GROUP, SIMULATOR
from dcsched.runtime.consensus import check_same, plan_fingerprints
from dcsched.errors import DcschedError, ResultMismatch
from dcsched.replay.bounds import check_memory, check_step, watchdog_for
from dcsched.replay.compare import ResultComparison, compare
from dcsched.replay.device import check_fits, resolve_device
from dcsched.replay.measure import Measurement, clock_for, synchronize, time_step
from dcsched.bundle.core import check_replayable
from dcsched.replay.run import ReplayRun, deterministic, prepare, replay
from dcsched.sim.bundle_figures import percent_error, simulated_figures, timing_caveat
from dcsched.replay.watchdog import Unwatched
from dcsched.sim.plans import check_bundle_plans
from dcsched.runtime.step import DEFAULT_SEED, graph_placeholder_names, installed, run_step


@dataclasses.dataclass
class OrderReport:
    """One order's measured and simulated figures."""

    label: str
    path: str | None
    measured: Measurement
    simulated: dict | None
    simulator_note: str
    caveat: str | None = None  # why the simulated step time may be far off (CPU-measured costs), if it may

    def errors(self) -> dict[str, float | None]:
        sim = self.simulated or {}
        return {"peak_bytes": percent_error(sim.get("peak_bytes"), self.measured.peak_bytes),
                "step_ms": percent_error(sim.get("step_ms"), self.measured.step_ms)}

    def to_dict(self) -> dict:
        return {"label": self.label, "path": self.path, "measured": self.measured.to_dict(),
                "simulated": self.simulated, "simulator": self.simulator_note,
                "caveat": self.caveat,
                "simulator_error_percent": self.errors()}


@dataclasses.dataclass
class ReplayReport:
    """What ``dcsched replay`` reports: each order's figures and whether the results match."""

    device: str
    world_size: int
    seed: int
    orders: list[OrderReport]
    comparison: ResultComparison | None

    def to_dict(self) -> dict:
        return {"device": self.device, "world_size": self.world_size, "seed": self.seed,
                "orders": [o.to_dict() for o in self.orders],
                "results": self.comparison.to_dict() if self.comparison else None}


def placeholder_names(bundle: Bundle) -> dict[str, list[str]]:
    return {name: graph_placeholder_names(graph) for name, graph in bundle.graphs.items()}


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
                      placeholder_order, watch=None,
                      labels: tuple[str, ...] = ()) -> list[list[tuple[float, float]]]:
    """Per bundle, ``iters`` (forward ms, backward ms) samples, timed in alternating rounds.

    Round r runs every order once (A B, then B A, ...), so load that comes and
    goes on the machine falls on both orders alike.
    """
    times: list[list[tuple[float, float]]] = [[] for _ in bundles]
    watch = watch or Unwatched()
    names = list(labels) + [f"order {k + 1}" for k in range(len(labels), len(bundles))]
    ready = []
    for k, bundle in enumerate(bundles):
        runtime = factory(bundle)
        with watch.phase(f"preparing the {names[k]} step for timing"):
            ready.append((runtime, *prepare(bundle, device=device, seed=seed, runtime=runtime,
                                            placeholder_order=placeholder_order)))
    clock = clock_for(device)
    with deterministic():
        for round_ in range(max(warmup, 0) + iters):
            turn = range(len(ready)) if round_ % 2 == 0 else reversed(range(len(ready)))
            for k in turn:
                runtime, step, state = ready[k]
                with installed(runtime), watch.phase(f"round {round_ + 1} of the {names[k]} step"):
                    if round_ < warmup:
                        run_step(step, state)
                        synchronize(device)
                    else:
                        times[k].append(time_step(step, state, clock))
    return times


def replay_orders(candidate: Bundle, baseline: Bundle | None = None, *, device: torch.device | str = "cpu",
                  seed: int = DEFAULT_SEED, iters: int = 5, warmup: int = 1,
                  runtime_factory: Callable[[Bundle], ops.Zero3Runtime] | None = None,
                  exact: bool | None = None, labels: tuple[str, str] = ("baseline", "scheduled"),
                  paths: tuple[str | None, str | None] = (None, None), bounded: bool = False,
                  timeout: float | None = None) -> ReplayReport:
    """Replay ``baseline`` (when given) and ``candidate``, measure both, check they agree.

    Each order first runs alone for its results and peak memory; the results
    are compared; then both are timed in alternating rounds (``warmup`` untimed
    rounds, ``iters`` timed ones), so a busy machine slows both alike.

    Parameters
    ----------
    candidate, baseline : Bundle
        The reordered bundle and, optionally, the one it must compute the same as.
    device : torch.device or str
        Where to run (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
    seed : int
        Seeds the parameters and inputs both orders are given.
    iters, warmup : int
        Timed and untimed rounds.
    runtime_factory : callable, optional
        ``runtime_factory(bundle)`` makes each run's ZeRO-3 runtime (default:
        :func:`dcsched.runtime.select.runtime_for`'s pick: over the process
        group under ``torchrun``, else single process).
    exact : bool, optional
        Bit-for-bit equality (default on the CPU), else :data:`TOLERANCES`.
    labels, paths : tuple
        How the report names the two orders.
    bounded : bool
        Run under a :class:`~dcsched.replay.watchdog.Watchdog` that ends the process (one line, exit code
        2) when a phase outlasts its bound (:meth:`~dcsched.replay.bounds.StepBounds.step_seconds` of the
        slower order) or the process's memory passes the checked need; what ``dcsched replay`` does.
    timeout : float, optional
        With ``bounded``: seconds the whole replay may take instead of the per-phase bounds.

    Returns
    -------
    ReplayReport
        Each order's measured figures beside the simulator's, and the comparison.

    Raises
    ------
    ResultMismatch
        The orders computed different results (names the first differing output).
    DcschedError
        A bundle that cannot run here (planned without data, too big for the
        device, figures that do not describe its nodes, or ranks that loaded
        different bundles), or whose stored plan cannot be issued in its order
        (:func:`dcsched.sim.plans.check_stored_plans`, as ``schedule`` refuses it).

    Examples
    --------
    >>> import dcsched, torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    >>> bundle = dcsched.capture(model, [torch.randn(2, 4)], loss_fn=lambda out: out.sum())
    >>> bundle = dcsched.profile_bundle(bundle, dcsched.ProfileOptions(cost_model="analytic", gpu="h100"))
    >>> scheduled = bundle.with_graphs(forward=dcsched.schedule(bundle.forward, "fast-free"))
    >>> report = replay_orders(scheduled, bundle, iters=1)
    >>> report.comparison.exact, report.comparison.max_abs_error
    (True, 0.0)
    """
    for bundle in (candidate, baseline):
        if bundle is not None:
            check_replayable(bundle)
            check_bundle_plans(bundle)  # plans that cannot run as stored, refused as schedule refuses them
    device = resolve_device(device) if isinstance(device, str) else device
    factory = runtime_factory or (lambda bundle: runtime_for(bundle.params, flat_shards=False, plans=bundle.plans,
                                                             graph_ids=bundle.graph_ids))
    exact = (device.type == "cpu") if exact is None else exact
    order = None
    if baseline is not None:
        check_same_step(candidate, baseline)
        order = placeholder_names(baseline)
    check_fits(candidate, device, _world_size())
    jobs = ([(labels[0], paths[0], baseline)] if baseline is not None else []) + [(labels[1], paths[1], candidate)]
    # Every node's output against the figures, then the memory all orders need, before anything is allocated.
    bounds = [check_step(bundle, device, factory(bundle), order) for _label, _path, bundle in jobs]
    need = check_memory(bounds, device)
    # Under torchrun: every rank loaded the same bundles (in the same order) before any collective pairs up.
    loaded = {f"bundle's {k}": v for k, v in plan_fingerprints(candidate).items()}
    if baseline is not None:
        loaded.update({f"baseline's {k}": v for k, v in plan_fingerprints(baseline).items()})
    check_same(loaded, "loaded")
    watch = watchdog_for(bounds, need, device, timeout) if bounded else contextlib.nullcontext(Unwatched())
    with watch as watching:
        return _run_jobs(jobs, device=device, seed=seed, iters=iters, warmup=warmup, factory=factory, order=order,
                         exact=exact, labels=labels, watch=watching)


def _run_jobs(jobs, *, device: torch.device, seed: int, iters: int, warmup: int, factory, order, exact,
              labels: tuple[str, str], watch) -> ReplayReport:
    """Each order run alone (results and peak memory), compared, then both timed in alternating rounds."""
    runs: list[tuple[str, str | None, Bundle, ReplayRun]] = []
    for label, path, bundle in jobs:  # results and peak memory, one order at a time
        run = replay(bundle, device=device, seed=seed, iters=0, warmup=1, runtime=factory(bundle),
                     placeholder_order=order, check_memory=False, memory=True, watch=watch)
        runs.append((label, path, bundle, run))
    comparison = None
    if len(runs) > 1:  # a baseline and the candidate
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
                              factory=factory, placeholder_order=order, watch=watch,
                              labels=tuple(job[0] for job in jobs))
    for k, (_label, _path, _bundle, run) in enumerate(runs):
        m = run.measurement
        assert m is not None  # each order ran alone above, measured
        run.measurement = Measurement.from_samples(device, warmup, times[k], m.peak_bytes, m.resident_bytes,
                                    clock_for(device).name, m.memory_source)
    orders = []
    for label, path, bundle, run in runs:
        # under a process group the reduce-scatters run asynchronously, one in flight (runtime_for's default)
        issue = PROCESS_GROUP if (run.world_size or 1) > 1 else SIMULATOR
        simulated, note = simulated_figures(bundle, run.world_size, issue=issue)
        assert run.measurement is not None
        orders.append(OrderReport(label, path, _slowest_rank(run.measurement), simulated, note,
                                  timing_caveat(bundle.provenance)))
    world_size = runs[-1][3].world_size
    return ReplayReport(str(device), world_size, seed, orders, comparison)
