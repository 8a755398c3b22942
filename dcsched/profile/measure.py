"""Profile a bundle: ``device_time`` (ms) and ``tensor_size`` (bytes) for every node, with provenance.

Compute times come from a cost model (:mod:`dcsched.costmodels`, one module
each, chosen by name):

* ``measured``: the graphs run for real through :mod:`dcsched.runtime.step` (forward,
  then backward on the forward's saved tensors with the step runner's tangents:
  ones for the loss, zeros for other outputs); each compute node is run
  ``warmup`` times, then timed ``iters`` times, and the median is kept. On a
  GPU with CUDA events, on the CPU with ``time.perf_counter_ns``.
* ``analytic``: nothing runs; a roofline estimate for a named GPU from each
  node's FLOPs and the bytes of its inputs and outputs, so a laptop can plan
  for a cluster.
* ``calibrated``: the analytic estimate times per-op-kind factors measured on a
  GPU (:class:`~dcsched.costmodels.options.ProfileOptions` ``(calibration="factors.json")``; with the analytic model a
  calibration file selects this one).

Communication nodes: in one process (no process group, or one of size 1) the
all-gather and the gradient reduce-scatter are modelled from their bytes with
``bytes*(W-1)/W / bandwidth + latency`` for the stated world size W, the
latency and bandwidth given in the options or else the interconnect table's
for the target GPU kind and W (:mod:`dcsched.costmodels.interconnects`); wait
and release cost 0. Under ``torchrun`` with a process group of size > 1 they are
measured with real collectives of the same size.

Under a process group every rank profiles, and the figures are then made the
same on every rank (:mod:`dcsched.runtime.consensus`): each node's ``device_time`` is
the maximum over the ranks, the target memory the smallest, after a check that
every rank holds the same step. A scheduler run on each rank then makes one
plan.

``tensor_size`` is the bytes of a node's outputs, from the recorded shapes,
with ZeRO-3 sharding over W ranks applied: a parameter placeholder holds its
shard (``ceil(numel/W) * itemsize``), an all-gather the gathered parameter
(full size), a reduce-grad this rank's gradient shard.

Every node also gets ``time_source`` (``measured``, ``modelled``, ``analytic``,
``calibrated`` or ``none`` for placeholders and outputs); ``bundle.provenance``
records how the figures were obtained.

>>> from dcsched import replay
>>> profiled = profile_bundle(replay.example_bundle(), ProfileOptions(cost_model="analytic", gpu="h100",
...                                                                  progress=False))
>>> profiled.provenance["device"], profiled.provenance["target_memory_bytes"] == 81559 * 2**20
('h100 (analytic, not run)', True)
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from dcsched.costmodels.base import CostModel, ProfileRun
from dcsched.costmodels.registry import build as build_cost_model

from dcsched.runtime import consensus
from dcsched.bundle.core import Bundle
from dcsched.costmodels.options import ProfileOptions
from dcsched.graph.nxview import copy_graph
from dcsched.bundle.resharding import tensor_sizes


#: ``provenance['data']`` of a bundle captured with ``meta=True``; ``provenance['planned']`` is True there.
PLANNED = "none: planned from shapes on the meta device, not measured (no weights, no input values)"


# ---------------------------------------------------------------------------
# The profiler
# ---------------------------------------------------------------------------

def _with_sizes(bundle: Bundle, world_size: int) -> Bundle:
    """A copy of ``bundle`` (graphs copied) whose nodes carry ``tensor_size`` for ``world_size`` ranks."""
    bundle = bundle.with_graphs(**{name: copy_graph(g) for name, g in bundle.graphs.items()})
    sizes = tensor_sizes(bundle, world_size)
    for name, graph in bundle.graphs.items():
        for node in graph.nodes:
            node.meta["tensor_size"] = sizes[name][node.name]
    return bundle


def _provenance(model: CostModel, options: ProfileOptions, run: ProfileRun,
                device: str) -> dict:
    target_gpu = model.target_gpu(options)
    how = model.provenance(options)
    # Measured collectives include no figure of the link: None; their latency is measured (the measured model's).
    link = None if run.distributed else model.comm_link(options)
    latency_ms = model.comm_latency_ms(options, run)
    return {
        "cost_model": model.name,
        "device_time": how["device_time"],
        "comm_time": ("measured with real collectives" if run.distributed
                      else "modelled: bytes*(W-1)/W / bandwidth + latency"),
        "tensor_size": "bytes of node outputs from recorded shapes; parameters and gradients as 1/W shards",
        "device": device,
        "gpu": target_gpu.name if target_gpu else None,
        "target_memory_bytes": model.target_memory(options),
        "torch": str(torch.__version__),
        "world_size": run.world_size,
        # The latency every collective's figure includes, what a bucket of them saves per extra member
        # (dcsched.sim.collectives): the modelled link's, or under a process group the measured model's own
        # measurement (an all-gather of one float a rank). Recorded once, in ms like every time of the bundle;
        # the older keys latency_us / bandwidth_GBps held the same figures and are no longer written.
        "comm_latency_ms": latency_ms,
        "comm_bandwidth_GBps": None if link is None else link.bandwidth_gbps,
        "comm_link": None if link is None else link.name,
        "iters": how["iters"],
        "warmup": how["warmup"],
    }


def profile_bundle(bundle: Bundle, options: ProfileOptions = ProfileOptions(), *,
                   params: Mapping[int, torch.Tensor] | None = None,
                   inputs: Sequence[torch.Tensor] | None = None) -> Bundle:
    """A copy of ``bundle`` whose nodes carry ``device_time``, ``tensor_size`` and ``time_source``.

    Parameters
    ----------
    bundle : Bundle
        The captured graphs (:func:`dcsched.capture`, :func:`dcsched.capture_script`); left unchanged.
    options : ProfileOptions
        The cost model and its settings (:class:`~dcsched.costmodels.options.ProfileOptions`).
    params : Mapping[int, torch.Tensor], optional
        ds_id -> full parameter, the real tensors to run a measured profile with; by default the step
        runner's seeded ones (:func:`dcsched.runtime.step.make_state`).
    inputs : Sequence[torch.Tensor], optional
        The step inputs in ``bundle.inputs`` order; by default seeded ones made from the bundle.

    Returns
    -------
    Bundle
        A copy with ``device_time`` (ms), ``tensor_size`` (bytes) and ``time_source`` on every node and
        ``provenance`` saying how the figures were obtained.

    Raises
    ------
    OptionError
        ``options`` no profile can use (:meth:`ProfileOptions.check <dcsched.costmodels.options.ProfileOptions.check>`).
    DcschedError
        Under a process group, ranks that captured different steps.

    Examples
    --------
    >>> from dcsched import replay
    >>> options = ProfileOptions(cost_model="analytic", gpu="a100", world_size=4, progress=False)
    >>> profile_bundle(replay.example_bundle(), options).provenance["world_size"]
    4
    """
    options.check()
    model = build_cost_model(options)
    world = consensus.group_size()
    distributed = world > 1
    run = ProfileRun(params, inputs, world if distributed else options.world_size, distributed)
    bundle = _with_sizes(bundle, run.world_size)
    # Under a process group: the same step on every rank before the profile's collectives pair up, and the
    # same figures after (each rank timed its own nodes), so every rank's scheduler makes the same plan.
    consensus.check_same(consensus.step_fingerprints(bundle), "compiled")
    device = model.annotate(bundle, options, run)
    bundle.provenance = {**bundle.provenance, **_provenance(model, options, run, device)}
    consensus.agree_figures(bundle)
    return bundle
