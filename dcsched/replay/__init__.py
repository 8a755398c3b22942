"""Run a bundle's training step for real, measure it, and prove two orders compute the same.

The forward and backward graphs become ``torch.fx.GraphModule`` s over copies
of the bundle's graphs, node for node in the bundle's order (never re-traced,
so a scheduler's order is exactly what runs). Parameters and inputs of the
recorded shapes and dtypes are made from a seed; the step runs the forward,
then the backward fed with the saved tensors and the tangents (ones for the
loss, zeros for other user outputs). The ZeRO-3 ops run on
:data:`dcsched.runtime.ops.RUNTIME`: a single-process :class:`~dcsched.runtime.ops.Zero3Runtime`
by default, or a :class:`dcsched.runtime.distributed.DistributedZero3Runtime` under
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

The step itself (runnable modules, seeded parameters and inputs, one step) is
:mod:`dcsched.runtime.step`, shared with the profiler and training; its API is
re-exported here. Modules, in the order a replay uses them: ``device`` (devices,
memory estimates, the fit check), ``bounds`` (every node's output and FLOPs checked
against the bundle's figures before anything runs; the step's memory and time
bounds), ``watchdog`` (stops a replay past them), ``measure`` (peak memory, timing), ``run`` (one bundle's
replay), ``compare`` (two runs' results), ``simulated`` (the simulator's
figures for the report), ``orders`` (a reordered bundle beside its baseline),
``transforms`` (orders for tests), ``example`` (a hand-written bundle).
"""

from __future__ import annotations

from dcsched.replay.device import resolve_device, estimate_bytes, free_bytes, check_fits
from dcsched.replay.bounds import StepBounds, check_step, check_memory
from dcsched.replay.watchdog import Watchdog
from dcsched.runtime.step import DEFAULT_SEED, Step, build_step, StepState, make_param, make_input, make_state, run_step
from dcsched.replay.measure import Measurement, measure_memory, time_step, measure
from dcsched.runtime.step import installed
from dcsched.replay.run import deterministic, ReplayRun, prepare, replay
from dcsched.replay.compare import TOLERANCES, ResultComparison, compare
from dcsched.sim.bundle_figures import simulated_figures, percent_error, timing_caveat
from dcsched.replay.orders import OrderReport, ReplayReport, placeholder_names, check_same_step, replay_orders
from dcsched.replay.transforms import latest_first
from dcsched.replay.example import example_bundle

__all__ = [
    "resolve_device",
    "estimate_bytes",
    "free_bytes",
    "check_fits",
    "StepBounds",
    "check_step",
    "check_memory",
    "Watchdog",
    "DEFAULT_SEED",
    "Step",
    "build_step",
    "StepState",
    "make_param",
    "make_input",
    "make_state",
    "run_step",
    "Measurement",
    "measure_memory",
    "time_step",
    "measure",
    "deterministic",
    "installed",
    "ReplayRun",
    "prepare",
    "replay",
    "TOLERANCES",
    "ResultComparison",
    "compare",
    "simulated_figures",
    "percent_error",
    "timing_caveat",
    "OrderReport",
    "ReplayReport",
    "placeholder_names",
    "check_same_step",
    "replay_orders",
    "latest_first",
    "example_bundle",
]
